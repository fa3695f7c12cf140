"""Per-step scalar metrics: `RUN_DIR/metrics.jsonl` (the contract users script against),
TensorBoard event files under `RUN_DIR/tensorboard` and, optionally, a Weights & Biases run
(`asyncflow.observe.wandb_logger`), all with the same metric names and steps.

Owns: `MetricsLogger`, `read_metrics`, `METRICS_FILE`.
Invariants:
- One JSON object per `log` call, one per line, flushed at once: `{"step": N, ...}` with `step`
  first and the metric names sorted after it; values are floats, non-finite values (NaN, inf)
  are written as null (JSON has no NaN) and read back by `read_metrics` as NaN.
- Resuming with `resume_from_step=S` drops every row with step > S from metrics.jsonl (rewritten
  atomically) and tells TensorBoard to discard its events with step > S, so a resumed run never
  shows a step twice. A cut-off last line (a full disk, a power loss) is dropped there with a
  warning instead of blocking the resume; damage anywhere else sets the file aside as
  `damaged_metrics.jsonl` with a warning naming the lines, and the intact rows go on; a missing
  file is a warning that the earlier rows are gone. `read_metrics` itself stays strict.
- `log` is thread-safe. Only the `tensorboard` package is needed for event files (torch is not);
  wandb is imported only when a W&B run is asked for.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLogger:
    """Append-only metrics log for one run directory; use as a context manager or call `close()`."""

    def __init__(
        self, run_dir: str | Path, tensorboard: bool = True, resume_from_step: int | None = None,
        wandb: Mapping[str, Any] | None = None,
    ) -> None:
        """`wandb`: keyword arguments of `asyncflow.observe.wandb_logger.WandbWriter` (project, entity,
        name, mode, config) to also log every metric to a W&B run; None (the default) = no W&B."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_from_step is not None:
            _check_step(resume_from_step)
            if self.path.exists():
                rows = _intact_rows(self.path)
                kept = [row for row in rows if row["step"] <= resume_from_step]
                tmp = self.path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(_encode(int(row["step"]), row) for row in kept), encoding="utf-8")
                os.replace(tmp, self.path)
            elif resume_from_step > 0:
                log.warning("%s is missing: the rows of steps 0..%d are gone; the resumed run logs from step %d on",
                            self.path, resume_from_step, resume_from_step + 1)
        self._writers: list[Any] = []  # each with write(step, values) and close()
        if wandb is not None:
            from asyncflow.observe.wandb_logger import WandbWriter

            self._writers.append(WandbWriter(self.run_dir, resume_from_step=resume_from_step, **wandb))
        if tensorboard:
            self._writers.append(_TensorBoardWriter(self.run_dir / TENSORBOARD_DIR, resume_from_step))
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number: int, float, numpy scalar, 0-d tensor) for `step`."""
        _check_step(step)
        values = {name: _to_float(name, value) for name, value in metrics.items()}
        line = _encode(step, values)
        with self._lock:
            if self._file.closed:
                raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
            self._file.write(line)
            self._file.flush()
            for writer in self._writers:
                writer.write(step, values)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
            for writer in self._writers:
                writer.close()
            self._writers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path, *, drop_cut_off_last_line: bool = False) -> list[dict[str, float]]:
    """Rows of RUN_DIR/metrics.jsonl in file order (`step` an int, nulls as NaN); [] if absent.
    `drop_cut_off_last_line`: a last line that is not valid JSON is left out with a warning."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                if drop_cut_off_last_line and not any(rest.strip() for rest in lines):
                    log.warning("%s:%d: cut-off last line dropped (%s)", path, line_number, err.msg)
                    break
                raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict) or type(row.get("step")) is not int:
                found = line.strip()[:80]
                raise ValueError(f"{path}:{line_number}: expected an object with an integer 'step', got {found!r}")
            rows.append({key: math.nan if value is None else value for key, value in row.items()})
    return rows


def _intact_rows(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics file being resumed: a cut-off last line is dropped with a warning; damage anywhere
    else sets the file aside as `damaged_metrics.jsonl` (as the run folder names what it sets aside) with a
    warning naming the lines, and the intact rows are kept."""
    try:
        return read_metrics(path.parent, drop_cut_off_last_line=True)
    except (ValueError, UnicodeDecodeError) as err:
        first_damage = str(err)
    rows, damaged = [], []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or type(row.get("step")) is not int:
                damaged.append(line_number)
                continue
            rows.append({key: math.nan if value is None else value for key, value in row.items()})
    aside = path.with_name(f"damaged_{path.name}")
    shutil.copyfile(path, aside)
    log.warning("%s is damaged (%s; %d damaged line(s): %s): set aside as %s, the %d intact rows are kept",
                path, first_damage, len(damaged), ", ".join(map(str, damaged[:10])), aside, len(rows))
    return rows


def _check_step(step: object) -> None:
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def _to_float(name: object, value: Any) -> float:
    if not isinstance(name, str) or not name or name == "step":
        raise ValueError(f"metric name must be a non-empty string other than 'step', got {name!r}")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__} {value!r}") from None


def _encode(step: int, values: Mapping[str, float]) -> str:
    row: dict[str, Any] = {"step": step}
    for name in sorted(key for key in values if key != "step"):
        value = values[name]
        row[name] = value if math.isfinite(value) else None
    return json.dumps(row, allow_nan=False) + "\n"


class _TensorBoardWriter:
    """Scalars straight into a TensorBoard event file, through the tensorboard package alone."""

    def __init__(self, logdir: Path, resume_from_step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir))
        if resume_from_step is not None:
            # TensorBoard drops earlier events with step >= a START session log's step
            # (this is what torch's SummaryWriter(purge_step=...) writes).
            start = SessionLog(status=SessionLog.START)
            self._writer.add_event(Event(wall_time=time.time(), step=resume_from_step + 1, session_log=start))

    def write(self, step: int, values: Mapping[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=name, simple_value=v) for name, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
