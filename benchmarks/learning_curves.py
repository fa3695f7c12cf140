"""Learning is not worse: `sync`, `stream` and `async` k=1 on the arithmetic task, from one SFT model.

Owns nothing the library uses. Runs SFT once (the main example's settings), then GRPO in each mode
from that model with the same seed and the same number of samples, each an `asyncflow train`
process (`sync` inline with every core; `stream` and `async` separated on a local Ray cluster, one
core for the rollout replica and one for the trainer, as in `bench_workflows.py`). Prints held-out
accuracy (greedy, 256 prompts) per mode and writes one PNG with accuracy against samples and
against wall time.

Run: .venv/bin/python benchmarks/learning_curves.py [--steps 200] [--out runs/learning_curves]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from bench_workflows import MODES as BENCH_MODES  # noqa: E402 - same placement as the speed benchmark

ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 2
EXAMPLE = "examples/arithmetic_grpo.yaml"
MODES = {mode: BENCH_MODES[mode] for mode in ("sync", "stream", "async k=1")}

def asyncflow(args: list[str], threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "asyncflow.cli", *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default="runs/learning_curves")
    parser.add_argument("--rerun", default=",".join(MODES), help="modes to train again; the others are read from --out")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    sft = out / "sft"
    if not (sft / "config.json").exists():
        asyncflow(["sft", EXAMPLE, "run.progress=false", "--output", str(out)], CORES)  # writes out/sft
    curves = {}
    for mode, (overrides, threads) in MODES.items():
        run_dir = out / mode.replace(" ", "_").replace("=", "")
        if mode in args.rerun.split(","):
            asyncflow(["train", EXAMPLE, "sft.before_rl=false", f"model.path={sft}", f"train.steps={args.steps}",
                       f"eval.every={args.eval_every}", "checkpoint.every=0", "run.progress=false", *overrides,
                       "--output", str(run_dir), "--overwrite"], threads)  # fmt: skip
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        curves[mode] = [(r["samples"], r["wall_s"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        print(f"{mode:10s} accuracy {curves[mode][0][2]:.3f} -> {curves[mode][-1][2]:.3f} after "
              f"{curves[mode][-1][0]:.0f} samples, {curves[mode][-1][1]:.0f} s", flush=True)
    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, points in curves.items():
        samples, wall, accuracy = zip(*points)
        by_samples.plot(samples, accuracy, marker="o", label=mode)
        by_time.plot(wall, accuracy, marker="o", label=mode)
    by_samples.set(xlabel="training samples", ylabel="held-out accuracy (greedy)", title="accuracy vs samples")
    by_time.set(xlabel="wall time (s)", title="accuracy vs wall time")
    for axis in (by_samples, by_time):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=110)
    print(f"wrote {out / 'learning_curves.png'}")


if __name__ == "__main__":
    main()
