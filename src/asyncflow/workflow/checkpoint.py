"""Checkpoints: `RUN_DIR/checkpoints/step_N/` with everything needed to resume exactly.

Owns: writing and reading a checkpoint folder:
- `model.safetensors`: policy weights;
- `training_state.pt`: optimizer and LR schedule state;
- `rng.pt`: python, numpy and torch RNG states (and the inference engine's generator);
- `state.json`: step, data position, weight version, counters.

Invariants: a checkpoint folder is written under a temporary name and renamed when complete, so
`latest_checkpoint` never returns a half-written one; only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_PREFIX = "step_"


def save_checkpoint(
    run_dir: Path, step: int, weights: dict[str, torch.Tensor], training_state: dict, state: dict,
    generator_state: torch.Tensor | None = None, keep: int = 2,
) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp_{STEP_PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Tied embeddings share storage; safetensors refuses shared tensors, so save contiguous clones.
    save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    torch.save(training_state, tmp / "training_state.pt")
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator_state,
    }
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    path = Path(checkpoint) / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} has no model.safetensors")
    return load_file(str(path))


def load_checkpoint(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    """-> (weights, training_state, state, rng); restores the global RNGs as a side effect."""
    checkpoint = Path(checkpoint)
    weights = load_weights(checkpoint)
    training_state = torch.load(checkpoint / "training_state.pt", weights_only=False)
    state = json.loads((checkpoint / "state.json").read_text())
    rng = torch.load(checkpoint / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return weights, training_state, state, rng
