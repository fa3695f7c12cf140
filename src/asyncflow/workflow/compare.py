"""`asyncflow bench`: one config trained in several workflow modes, side by side, with throughput ratios.

Owns: the mode names (`sync`, `stream`, `async:K`), running one mode as its own `asyncflow train`
process (so modes share no process state and each starts its own Ray cluster), the throughput of a
finished run over a steady-state window, and the comparison table.

Invariants:
- Modes run interleaved (sync, stream, async:1, sync, ...) so that drift of a shared machine hits
  each mode alike; each repeat's ratio is taken against the `sync` run of the same repeat.
- The window leaves out the first `warmup` steps (start-up), the last step (the final evaluation)
  and, for `async:K`, the K steps before it (its replicas have finished and the trainer has the
  machine to itself).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def mode_overrides(mode: str) -> list[str]:
    """Config overrides of a mode name: `sync`, `stream` or `async:K` (K = max staleness >= 1)."""
    if mode in ("sync", "stream"):
        return [f"workflow.mode={mode}"]
    name, _, k = mode.partition(":")
    if name == "async" and k.isdigit() and int(k) >= 1:
        return ["workflow.mode=async", f"workflow.max_staleness={k}"]
    raise ValueError(f"unknown workflow mode {mode!r}: use sync, stream or async:K with K >= 1 (e.g. async:1)")


def train_run(args: list[str], out: Path, *, threads: int = 0, timeout_s: float = 3600) -> list[dict]:
    """Run `asyncflow train ARGS --output OUT` in a new process; returns its training rows of metrics.jsonl."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", *args, "--output", str(out)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/samples" in r]


def throughput(rows: list[dict], warmup: int, staleness: int) -> tuple[float, float]:
    """(samples/s, tokens/s) over training steps warmup+1 .. last-1-staleness (see the module docstring)."""
    window = rows[warmup : len(rows) - 1 - staleness]
    if warmup < 1 or not window:
        raise ValueError(f"{len(rows)} steps leave no window after {warmup} warm-up steps: train more steps")
    seconds = window[-1]["wall_s"] - rows[warmup - 1]["wall_s"]
    return sum(r["rollout/samples"] for r in window) / seconds, sum(r["rollout/tokens"] for r in window) / seconds


def compare(
    base_args: list[str], modes: list[str], *, steps: int, warmup: int = 2, repeats: int = 1, threads: int = 0,
    sft_first: bool = False,
) -> dict[str, dict]:
    """Train `base_args` (a config file and overrides) for `steps` steps in each mode; print and return
    per-mode samples/s (median over repeats) and the ratio to `sync` of the same repeat. With `sft_first`
    the SFT warm-up runs once and every mode starts from its model (response lengths, hence the
    workload, depend on it)."""
    overrides = {mode: mode_overrides(mode) for mode in modes}
    if "sync" not in modes:
        raise ValueError("the comparison needs `sync` among the modes: ratios are taken against it")
    if steps < warmup + 2:
        raise ValueError(f"--steps {steps} is too few for --warmup {warmup}: need at least {warmup + 2}")
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="asyncflow-bench-") as tmp:
        if sft_first:
            sft_dir = Path(tmp) / "sft"
            subprocess.run([sys.executable, "-m", "asyncflow.cli", "sft", *base_args, "run.progress=false",
                            f"sft.output={sft_dir}"], check=True, capture_output=True, timeout=3600)
            base_args = [*base_args, f"model.path={sft_dir}"]
        for rep in range(repeats):
            for mode in modes:
                rows = train_run(
                    [*base_args, *overrides[mode], f"train.steps={steps}", "run.progress=false",
                     "eval.every=0", "checkpoint.every=0", "sft.before_rl=false"],
                    Path(tmp) / f"{mode.replace(':', '')}_{rep}", threads=threads,
                )  # fmt: skip
                k = int(mode.partition(":")[2] or 0)
                samples[mode].append(throughput(rows, warmup, k)[0])
                print(f"[{rep}] {mode:10s} {samples[mode][-1]:8.1f} samples/s", flush=True)
    result = {}
    print(f"\n{'mode':10s} {'samples/s':>10s} {'vs sync':>8s}   per repeat")
    for mode, values in samples.items():
        paired = [v / s for v, s in zip(values, samples["sync"])]
        result[mode] = {"samples_per_s": statistics.median(values), "vs_sync": statistics.median(paired)}
        print(f"{mode:10s} {result[mode]['samples_per_s']:10.1f} {result[mode]['vs_sync']:7.2f}x   "
              f"{', '.join(f'{r:.2f}x' for r in paired)}")  # fmt: skip
    return result
