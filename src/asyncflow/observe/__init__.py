"""Observability: per-step metrics (JSONL + TensorBoard, optionally Weights & Biases), worker timelines
(Chrome trace, Gantt, utilization, idle fractions), metric plots and a progress bar. Imports nothing
of asyncflow; matplotlib loads only when a plot is drawn, wandb only when a W&B run is asked for."""

from asyncflow.observe.metrics import MetricsLogger, read_metrics
from asyncflow.observe.plots import plot_curves, plot_metrics
from asyncflow.observe.progress import TrainProgress, format_metrics
from asyncflow.observe.timeline import Timeline

__all__ = [
    "MetricsLogger", "Timeline", "TrainProgress", "format_metrics", "plot_curves", "plot_metrics", "read_metrics",
]
