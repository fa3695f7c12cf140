"""A run seen while it runs: a Prometheus `/metrics` endpoint and a watchdog that names a stall.

Owns: `LiveMetrics` (the endpoint, opt-in by `observe.metrics_port`), `Watchdog` (`observe.stall_s`),
`prometheus_name`, `thread_stacks`.

Invariants:
- The endpoint serves its own registry (never `prometheus_client`'s global one) from a daemon thread; a
  scrape reads the last logged step row and calls the probes, each under its own try (a failing probe
  drops its series from that scrape, with one warning, and never fails the run or the scrape).
- Names: `asyncflow_` + the metric name with every character outside `[a-zA-Z0-9_]` as `_`
  (`throughput/tokens_per_s` -> `asyncflow_throughput_tokens_per_s`). Probes give labelled series:
  `{name: {labels tuple: value}}`, e.g. `{"queue_rows": {(("column", "reward"),): 12.0}}`.
- The watchdog samples a progress fingerprint (e.g. the step and the queue's produced and consumed
  counters) every `stall_s / 4` s. When it has not changed for `stall_s`, it logs once per stall what
  `explain()` says (which stage waits on which) and the stack of every thread of this process; with
  `on_stall` given, it then calls it with that message (the run's `StopSignals.fail`, which ends the run).
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
Probe = Callable[[], Mapping[str, Mapping[Labels, float]]]


def prometheus_name(metric: str) -> str:
    """`reward/errors_total` -> `asyncflow_reward_errors_total`."""
    return "asyncflow_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class _RunCollector(Collector):
    def __init__(self, probes: Mapping[str, Probe]) -> None:
        self.row: dict[str, float] = {}
        self.probes = dict(probes)
        self._warned: set[str] = set()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for metric, value in sorted(self.row.items()):
            family = GaugeMetricFamily(prometheus_name(metric), f"{metric} of the last logged step")
            family.add_metric([], value if math.isfinite(value) else math.nan)
            yield family
        for probe_name, probe in self.probes.items():
            try:
                series = probe()
            except Exception as err:  # noqa: BLE001 - a scrape never fails the run
                if probe_name not in self._warned:
                    self._warned.add(probe_name)
                    log.warning("live metrics: probe %r failed (%r); its series are left out", probe_name, err)
                continue
            for name, by_labels in series.items():
                keys = sorted({key for labels in by_labels for key, _ in labels})
                family = GaugeMetricFamily(prometheus_name(name), f"{name} (now)", labels=keys)
                for labels, value in by_labels.items():
                    given = dict(labels)
                    family.add_metric([given.get(key, "") for key in keys], float(value))
                yield family


class LiveMetrics:
    """`/metrics` on `port` (0: a free one, see `.port`) of `host`; `record(row)` after each logged step."""

    def __init__(self, port: int, probes: Mapping[str, Probe] | None = None, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _RunCollector(probes or {})
        self.registry.register(self._collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        log.info("live metrics on http://%s:%d/metrics", host, self.port)

    def record(self, row: Mapping[str, Any]) -> None:
        self._collector.row = {k: float(v) for k, v in row.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def thread_stacks() -> str:
    """The current stack of every thread of this process, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'thread "{names.get(ident, ident)}":\n{stack}')
    return "\n".join(parts)


class Watchdog:
    """Names a stall: see the module invariants. `progress()` returns anything comparable that changes
    whenever the run moves; `explain()` says who waits on whom; `on_stall(message)` (optional) ends the run."""

    def __init__(self, stall_s: float, progress: Callable[[], object], explain: Callable[[], str],
                 on_stall: Callable[[str], None] | None = None) -> None:
        if not stall_s > 0:
            raise ValueError(f"observe.stall_s must be > 0, got {stall_s}")
        self.stall_s = stall_s
        self.progress, self.explain, self.on_stall = progress, explain, on_stall
        self.stalls = 0  # stalls reported so far
        self.last_message = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def _sample(self) -> object:
        try:
            return self.progress()
        except Exception as err:  # noqa: BLE001 - an unreadable fingerprint is itself no progress
            return ("unreadable", repr(err))

    def _watch(self) -> None:
        seen, since, reported = self._sample(), time.monotonic(), False
        while not self._stop.wait(self.stall_s / 4):
            now = self._sample()
            if now != seen:
                seen, since, reported = now, time.monotonic(), False
            elif not reported and time.monotonic() - since >= self.stall_s:
                reported = True
                self._report(time.monotonic() - since)

    def _report(self, still_s: float) -> None:
        try:
            why = self.explain()
        except Exception as err:  # noqa: BLE001 - the stall is reported either way
            why = f"(the stages could not be read: {err!r})"
        self.stalls += 1
        self.last_message = f"no progress for {still_s:.0f} s (observe.stall_s={self.stall_s:g}): {why}"
        log.error("%s\nthreads of the driver:\n%s", self.last_message, thread_stacks())
        if self.on_stall is not None:
            self.on_stall(self.last_message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
