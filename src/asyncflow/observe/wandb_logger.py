"""Experiment logging to Weights & Biases, next to metrics.jsonl and TensorBoard (`observe.wandb`).

Owns: `WandbWriter` (one W&B run fed by `MetricsLogger`), `require_wandb`, `WANDB_EXTRA`.
Invariants:
- The only asyncflow module that imports `wandb`, and only when a writer is built: a run with
  `observe.wandb: false` never loads it, and the package is an optional extra (`WANDB_EXTRA`).
- Metric names and steps are exactly those of metrics.jsonl (`run.log(values, step=step)`); NaN and
  inf are passed on as they are, as TensorBoard gets them.
- The W&B run folder is `RUN_DIR/wandb/` unless `WANDB_DIR` is set; `WANDB_MODE` in the environment
  takes precedence over the configured mode (W&B's own convention). `offline` needs no account or
  network; `wandb sync RUN_DIR/wandb/offline-run-*` uploads such a run later. W&B's own process
  writes the run file: `close()` can return a moment (about 0.1 s, wandb 0.31) before its last
  records are on disk.
- A resumed run (`resume_from_step`) is a new W&B run with `resumed_from_step` in its config: W&B
  cannot rewind the steps of an existing run, so steps after the checkpoint are never shown twice
  within one W&B run.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WANDB_EXTRA = "pip install 'asyncflow-rl[wandb]'"


def require_wandb() -> None:
    """Raise ModuleNotFoundError naming the extra to install when the wandb package is missing. Cheap:
    finds the package without importing it (importing wandb takes seconds)."""
    if importlib.util.find_spec("wandb") is None:
        raise ModuleNotFoundError(f"the wandb package is not installed: {WANDB_EXTRA}", name="wandb")


class WandbWriter:
    """Scalars of one asyncflow run into one W&B run; `write` per step, `close` at the end."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str,
        entity: str | None = None,
        name: str | None = None,
        mode: str = "offline",
        config: Mapping[str, Any] | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        require_wandb()
        import wandb

        run_config = dict(config or {})
        if resume_from_step is not None:
            run_config["resumed_from_step"] = resume_from_step
        options: dict[str, Any] = {"project": project, "entity": entity, "name": name, "config": run_config}
        if not os.environ.get("WANDB_MODE"):
            options["mode"] = mode
        if not os.environ.get("WANDB_DIR"):
            options["dir"] = str(run_dir)
        self._run = wandb.init(**options)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()
