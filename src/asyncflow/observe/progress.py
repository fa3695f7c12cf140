"""Training progress for humans: a live `rich` bar with the latest metrics and step rate on a
terminal, a plain `logging` line every N steps elsewhere (CI, files, Ray workers).

Owns: `TrainProgress`, `format_metrics`.
Invariants:
- The bar is drawn only when enabled and the console is a terminal; otherwise nothing is drawn and
  log lines go to the "asyncflow.progress" logger (every `log_every` steps and at the last step).
- Metrics shown are the latest value seen for each name, so a metric logged only on some steps
  (e.g. eval accuracy) stays visible in between.
- The bar writes to stderr, keeping stdout clean for the program's own output.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

logger = logging.getLogger("asyncflow.progress")


def format_metrics(metrics: Mapping[str, Any], show: Mapping[str, str] | None = None) -> str:
    """"reward 0.42  acc 0.31": `show` maps a display label to a metric name (labels whose metric
    is absent are skipped); None shows every metric under its own name, sorted."""
    pairs = show.items() if show is not None else ((name, name) for name in sorted(metrics))
    return "  ".join(f"{label} {_number(metrics[name])}" for label, name in pairs if name in metrics)


class TrainProgress:
    """`with TrainProgress(total_steps, initial=start_step) as bar: bar.update(step, metrics)`."""

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        *,
        enabled: bool = True,
        log_every: int = 10,
        show: Mapping[str, str] | None = None,
        description: str = "train",
        console: Console | None = None,
    ) -> None:
        if total_steps < 0 or not 0 <= initial <= total_steps:
            raise ValueError(f"need 0 <= initial <= total_steps, got initial={initial}, total_steps={total_steps}")
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.total_steps, self.initial, self.log_every = total_steps, initial, log_every
        self.show, self.description = show, description
        console = console or Console(stderr=True)
        self.live = enabled and console.is_terminal
        self.latest: dict[str, Any] = {}
        self._last_logged_step = initial
        self._start_time = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            disable=not self.live,
        )
        self._task = self._progress.add_task(description, total=total_steps, completed=initial, metrics="")

    def __enter__(self) -> TrainProgress:
        self._start_time = time.perf_counter()
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that `step` steps are done (absolute, not an increment), with this step's metrics."""
        self.latest.update(metrics or {})
        elapsed = time.perf_counter() - self._start_time
        rate = (step - self.initial) / elapsed if elapsed > 0 else 0.0
        text = "  ".join(part for part in (format_metrics(self.latest, self.show), f"step/s {rate:.2f}") if part)
        if self.live:
            self._progress.update(self._task, completed=step, metrics=text)
        elif step > self._last_logged_step and (step - self._last_logged_step >= self.log_every
                                                or step >= self.total_steps):
            self._last_logged_step = step
            logger.info("%s step %d/%d  %s", self.description, step, self.total_steps, text)


def _number(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(number):
        return "nan"
    return f"{number:.3g}" if abs(number) < 1e4 else f"{number:.4g}"
