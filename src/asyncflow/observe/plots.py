"""PNG plots of logged metrics: one run's curves (`plot_metrics`) and several runs compared on one
axis (`plot_curves`, e.g. sync vs stream vs async reward against samples or wall time).

Owns: `plot_metrics`, `plot_curves`, `save_png` (also the timeline's).
Invariants:
- matplotlib is imported on first plot, not at import time (it costs about a second).
- Figures are built with `matplotlib.figure.Figure` and rendered by Agg: no pyplot global state,
  no display needed, safe to call from any thread, and the caller's backend is left alone.
- A row lacking a key, or holding NaN for it, contributes no point; it never breaks a line's
  x order (points are sorted by x).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.observe.metrics import read_metrics

DEFAULT_KEYS = ("reward/mean", "eval/accuracy")
METRICS_PNG = "metrics.png"

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_metrics(
    source: str | Path | Sequence[Mapping[str, Any]],
    keys: Sequence[str] = DEFAULT_KEYS,
    out_png: str | Path | None = None,
) -> Path | None:
    """Line plots of `keys` against step, one panel per key present in the rows. `source` is a run
    directory (out_png defaults to RUN_DIR/metrics.png) or a list of metric rows. Returns the PNG
    path, or None (nothing written) when none of the keys has a value."""
    rows: Sequence[Mapping[str, Any]]
    if isinstance(source, (str, Path)):
        rows = read_metrics(source)
        out_png = Path(source) / METRICS_PNG if out_png is None else out_png
    else:
        rows = list(source)
    if out_png is None:
        raise ValueError("plot_metrics: out_png is required when plotting rows rather than a run directory")
    series = {key: _points(rows, "step", key) for key in keys}
    series = {key: points for key, points in series.items() if points}
    if not series:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 2.6 * len(series)), layout="constrained")
    axes = figure.subplots(len(series), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (key, points) in zip(axes, series.items()):
        ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return save_png(figure, out_png)


def plot_curves(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    x_key: str,
    y_key: str,
    out_png: str | Path,
    title: str | None = None,
) -> Path:
    """One line per run label: `y_key` against `x_key` (e.g. "samples" or "time/wall_s"). Runs
    without any (x, y) pair are left out; raises ValueError if no run has one."""
    curves = {label: _points(rows, x_key, y_key) for label, rows in runs.items()}
    curves = {label: points for label, points in curves.items() if points}
    if not curves:
        seen = sorted({key for rows in runs.values() for row in rows for key in row})
        raise ValueError(f"plot_curves: no run has both {x_key!r} and {y_key!r}; keys present: {seen}")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = figure.subplots()
    for label, points in curves.items():
        ax.plot(*zip(*points), label=label)
    ax.set_xlabel(x_key)
    ax.set_ylabel(y_key)
    ax.set_title(title or f"{y_key} vs {x_key}")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_png(figure, out_png)


def _points(rows: Sequence[Mapping[str, Any]], x_key: str, y_key: str) -> list[tuple[float, float]]:
    points = []
    for row in rows:
        x, y = row.get(x_key), row.get(y_key)
        if x is None or y is None or math.isnan(float(x)) or math.isnan(float(y)):
            continue
        points.append((float(x), float(y)))
    return sorted(points)


def save_png(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
