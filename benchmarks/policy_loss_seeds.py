"""Policy losses side by side on the main job: one SFT model per seed, then the main job's GRPO budget with each
variant (`ppo`, `gspo`, `cispo`, a mode ...) from that same model.

Owns nothing the library uses. Each run is an `asyncflow` process as a user runs it (one torch thread), laid out
as OUT/seedS/sft and OUT/seedS/VARIANT; a run already finished there (its `metrics.jsonl` reaches `train.steps`)
is read, not run again, so the table can be rebuilt from existing runs. Prints, per variant and seed, the
held-out accuracy (greedy, 256 test prompts) at RL step 0 and at the end and the gain, with the spread over
seeds; writes a PNG of the held-out accuracy against the RL step, one panel per variant.

Run: .venv/bin/python benchmarks/policy_loss_seeds.py [--seeds 0 1 2] [--parallel 2] [--out runs/policy_losses] \
        [--variant NAME:OVERRIDE,OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/arithmetic_grpo.yaml"
ASYNC = "workflow.mode=async,workflow.max_staleness=1,runtime.kind=inline"
VARIANTS = [f"ppo_async:algo.loss=ppo,{ASYNC}", "gspo_sync:algo.loss=gspo", f"gspo_async:algo.loss=gspo,{ASYNC}",
            f"cispo_async:algo.loss=cispo,{ASYNC}"]


def asyncflow(command: str, run_dir: Path, overrides: list[str], seed: int) -> None:
    cmd = [sys.executable, "-m", "asyncflow.cli", command, EXAMPLE, "--threads", "1", "run.progress=false",
           f"run.seed={seed}", "--output", str(run_dir), *(["--overwrite"] if command == "train" else []), *overrides]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=6 * 3600)
    run_dir.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def finished(run_dir: Path, steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and any(json.loads(line).get("step") == steps for line in metrics.open())


def sft_model(out: Path, seed: int) -> Path:
    """The SFT model of a seed: `asyncflow sft --output OUT/seedS/sft` writes it to that run's `sft/`."""
    return out / f"seed{seed}" / "sft" / "sft"


def rl_run(out: Path, seed: int, variant: str, steps: int) -> Path:
    name, _, overrides = variant.partition(":")
    run_dir = out / f"seed{seed}" / name
    if not finished(run_dir, steps):
        asyncflow("train", run_dir, ["sft.before_rl=false", f"model.path={sft_model(out, seed)}",
                                     f"train.steps={steps}", "checkpoint.every=0", *overrides.split(",")], seed)
    return run_dir


def held_out(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [(r["step"], 100 * r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", help="NAME:comma-separated overrides (repeatable)")
    parser.add_argument("--steps", type=int, default=1000, help="RL steps (the main job's budget)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "policy_losses")
    args = parser.parse_args()
    variants = args.variant or VARIANTS
    with ThreadPoolExecutor(args.parallel) as pool:  # SFT first: every variant of a seed starts from its model
        jobs = [pool.submit(asyncflow, "sft", sft_model(args.out, seed).parent, [], seed) for seed in args.seeds
                if not (sft_model(args.out, seed) / "sft_summary.json").is_file()]
        for job in jobs:
            job.result()
    with ThreadPoolExecutor(args.parallel) as pool:
        jobs = {(v, s): pool.submit(rl_run, args.out, s, v, args.steps) for v in variants for s in args.seeds}
        curves = {key: held_out(job.result()) for key, job in jobs.items()}
    fig, axes = plt.subplots(1, len(variants), figsize=(4 * len(variants), 3.6), sharey=True, squeeze=False)
    print(f"{'variant':<14}" + "".join(f"{'seed ' + str(s):>24}" for s in args.seeds) + "   gain: mean [min, max]")
    for variant, ax in zip(variants, axes[0]):
        name = variant.partition(":")[0]
        gains, cells = [], []
        for seed in args.seeds:
            curve = curves[variant, seed]
            start, end = curve[0][1], curve[-1][1]
            gains.append(end - start)
            cells.append(f"{start:.1f} -> {end:.1f} ({end - start:+.1f})")
            ax.plot(*zip(*curve), label=f"seed {seed}")
        print(f"{name:<14}" + "".join(f"{c:>24}" for c in cells) +
              f"   {statistics.mean(gains):+.1f} [{min(gains):+.1f}, {max(gains):+.1f}]")
        ax.set(title=name, xlabel="RL step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy, greedy (%)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(args.out / "policy_losses.png", dpi=110)
    print(f"plot: {args.out / 'policy_losses.png'}")


if __name__ == "__main__":
    main()
