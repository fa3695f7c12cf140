"""Who was busy when: busy spans per worker, exported as a Chrome/Perfetto trace and a Gantt PNG,
and summarised as idle fractions.

Owns: `Timeline`.
An event is a plain dict, so a remote worker can return its events (pickle or JSON) and the driver
`merge`s them:
    {"kind": "span" | "instant", "worker": str, "name": str, "start_s": float, "end_s": float, "args": dict}
Times are wall-clock seconds (`time.time()`), the only clock shared by processes on one machine;
a span measured here takes its duration from `time.perf_counter()`, so it is never negative.
Invariants:
- Recording is thread-safe; `events` returns a copy.
- Every stored event has end_s >= start_s (instants: end_s == start_s).
- Spans whose name starts with "wait" mean "idle, waiting": they are drawn, but count as idle in
  `idle_fractions`. Busy time is the union of a worker's other spans, so overlapping spans (one
  worker, several threads) are not counted twice.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REQUIRED_KEYS = ("kind", "worker", "name", "start_s", "end_s")
_IDLE_PREFIX = "wait"


class Timeline:
    def __init__(self, events: Iterable[Mapping[str, Any]] = ()) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self.merge(events)

    @contextmanager
    def span(self, worker: str, name: str, **args: Any) -> Iterator[None]:
        """Record the time spent inside the `with` block as a span of `worker` (also on error)."""
        start_s, start_perf = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self._append(_event("span", worker, name, start_s, start_s + time.perf_counter() - start_perf, args))

    def instant(self, worker: str, name: str, **args: Any) -> None:
        """Record a point event (e.g. "weights v3 loaded") at the current time."""
        now = time.time()
        self._append(_event("instant", worker, name, now, now, args))

    def add_span(self, worker: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record a span measured elsewhere, with wall-clock (`time.time()`) start and end."""
        self._append(_event("span", worker, name, start_s, end_s, args))

    def merge(self, other_events: Timeline | Iterable[Mapping[str, Any]]) -> None:
        """Add events from another Timeline or an events list (e.g. shipped back by a remote worker)."""
        source = other_events.events if isinstance(other_events, Timeline) else other_events
        checked = []
        for index, raw in enumerate(source):
            missing = [key for key in _REQUIRED_KEYS if key not in raw] if isinstance(raw, Mapping) else None
            if missing is None or missing:
                raise ValueError(f"timeline event {index} must be a dict with keys {_REQUIRED_KEYS}; got {raw!r}")
            try:
                checked.append(_event(raw["kind"], raw["worker"], raw["name"], raw["start_s"], raw["end_s"],
                                      raw.get("args", {})))
            except (TypeError, ValueError) as err:
                raise ValueError(f"timeline event {index}: {err}") from None
        with self._lock:
            self._events.extend(checked)

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of all events, in recording order."""
        with self._lock:
            return [dict(event, args=dict(event["args"])) for event in self._events]

    def workers(self) -> list[str]:
        """Worker names in order of first appearance."""
        return list(dict.fromkeys(event["worker"] for event in self.events))

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing): one
        process/thread row per worker, named after it; `ts`/`dur` in microseconds since the earliest
        event, whose wall-clock time is kept in `otherData.origin_unix_s`."""
        events = self.events
        origin = min((event["start_s"] for event in events), default=0.0)
        rows = {worker: row for row, worker in enumerate(dict.fromkeys(event["worker"] for event in events), start=1)}
        trace: list[dict[str, Any]] = []
        for worker, row in rows.items():
            trace.append({"ph": "M", "name": "process_name", "pid": row, "tid": row, "args": {"name": worker}})
            trace.append({"ph": "M", "name": "process_sort_index", "pid": row, "tid": row, "args": {"sort_index": row}})
            trace.append({"ph": "M", "name": "thread_name", "pid": row, "tid": row, "args": {"name": worker}})
        for event in events:
            row = rows[event["worker"]]
            entry = {"name": event["name"], "cat": event["worker"], "pid": row, "tid": row,
                     "ts": (event["start_s"] - origin) * 1e6, "args": event["args"]}
            if event["kind"] == "span":
                entry.update(ph="X", dur=(event["end_s"] - event["start_s"]) * 1e6)
            else:
                entry.update(ph="i", s="t")
            trace.append(entry)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}
        path.write_text(json.dumps(document, default=repr), encoding="utf-8")
        return path

    def gantt_png(self, path: str | Path, title: str = "worker timeline") -> Path:
        """One row per worker, one colour per span name (legend), seconds since the earliest event."""
        from matplotlib.figure import Figure  # imported here so workers that only record spans skip it

        spans = [event for event in self.events if event["kind"] == "span"]
        workers = list(dict.fromkeys(span["worker"] for span in spans))
        names = list(dict.fromkeys(span["name"] for span in spans))
        origin = min((span["start_s"] for span in spans), default=0.0)
        figure = Figure(figsize=(10, 1.0 + 0.5 * max(len(workers), 1)), layout="constrained")
        ax = figure.subplots()
        palette = [f"C{index % 10}" for index in range(len(names))]
        for name, colour in zip(names, palette):
            idle = name.startswith(_IDLE_PREFIX)
            legend_label = name
            for row, worker in enumerate(workers):
                bars = [(span["start_s"] - origin, span["end_s"] - span["start_s"])
                        for span in spans if span["worker"] == worker and span["name"] == name]
                if bars:
                    # wait spans are hatched and faint: visible, but plainly not work
                    ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, alpha=0.35 if idle else 0.9,
                                   hatch="//" if idle else None, label=legend_label)
                    legend_label = "_nolegend_"  # one legend entry per span name
        ax.set_yticks(range(len(workers)), labels=workers)
        ax.set_ylim(-0.6, max(len(workers), 1) - 0.4)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(title if spans else f"{title} (no spans recorded)")
        if names:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
        return path

    def idle_fractions(self, window: tuple[float, float] | None = None) -> dict[str, float]:
        """Per worker with spans: 1 - (union of its non-wait spans inside the window) / window length.
        `window` is (start_s, end_s) in wall-clock seconds; default: earliest start to latest end."""
        spans = [event for event in self.events if event["kind"] == "span"]
        if not spans:
            return {}
        if window is None:
            window = (min(span["start_s"] for span in spans), max(span["end_s"] for span in spans))
        window_start, window_end = window
        if not window_end > window_start:
            raise ValueError(f"idle_fractions: window {window} has no length (end must be after start)")
        fractions = {}
        for worker in dict.fromkeys(span["worker"] for span in spans):
            intervals = sorted(
                (max(span["start_s"], window_start), min(span["end_s"], window_end))
                for span in spans
                if span["worker"] == worker and not span["name"].startswith(_IDLE_PREFIX)
            )
            busy, covered_until = 0.0, window_start
            for start, end in intervals:
                start = max(start, covered_until)
                if end > start:
                    busy += end - start
                    covered_until = end
            fractions[worker] = 1.0 - busy / (window_end - window_start)
        return fractions

    def _append(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)


def _event(kind: str, worker: str, name: str, start_s: float, end_s: float, args: Mapping[str, Any]) -> dict[str, Any]:
    if kind not in ("span", "instant"):
        raise ValueError(f"kind must be 'span' or 'instant', got {kind!r}")
    for label, text in (("worker", worker), ("name", name)):
        if not isinstance(text, str) or not text:
            raise ValueError(f"{label} must be a non-empty string, got {text!r}")
    start_s, end_s = float(start_s), float(end_s)
    if end_s < start_s:
        raise ValueError(f"span {worker}/{name} ends ({end_s}) before it starts ({start_s})")
    return {"kind": kind, "worker": worker, "name": name, "start_s": start_s, "end_s": end_s, "args": dict(args)}
