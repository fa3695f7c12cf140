"""An example over several seeds: SFT, then GRPO, each seed a whole `asyncflow train EXAMPLE` run (as a user runs
it); by default the built-in multi-turn task (`examples/tool_calculator_grpo.yaml`: SFT on tool-use
demonstrations), or any example with `--example` (`examples/reasoning_gym_grpo.yaml`).

Owns nothing the library uses. Prints per seed where SFT stopped, the held-out accuracy before and after GRPO
(greedy, the test split), the gain at the end and at the last evaluation within `--minutes` of RL wall time, and
wall and CPU time of SFT, RL and the whole run; writes one PNG with every seed's
held-out accuracy and sampled reward against the RL step (the figure in docs/multiturn.md).

`--parallel 2` runs two seeds at once with one torch thread each (two cores busy, as a 2-core laptop would be
with one run using both); `--parallel 1` runs them one after another with `--threads` threads.

Run: .venv/bin/python benchmarks/example_seeds.py [--seeds 0 1 2] [--parallel 2] [--out runs/tool_seeds]
        [--example examples/tool_calculator_grpo.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/tool_calculator_grpo.yaml"


def train(example: str, seed: int, out: Path, threads: int, overrides: list[str]) -> dict:
    """One whole run (SFT + GRPO) of the example for `seed`; returns its run folder and wall time."""
    run_dir = out / f"seed_{seed}"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "asyncflow.cli", "train", example, f"run.seed={seed}", "run.progress=false",
           "--threads", str(threads), "--output", str(run_dir), "--overwrite", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    (out / f"seed_{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return {"seed": seed, "run_dir": run_dir, "wall_s": wall}


def summarize(result: dict, minutes: float) -> dict:
    run_dir = result["run_dir"]
    sft = json.loads((run_dir / "sft" / "sft_summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    in_budget = [r["eval/accuracy"] for r in rows
                 if r.get("eval/accuracy") is not None and r.get("wall_s", 0.0) <= 60 * minutes]
    rewards = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    start, final = evals[0][1], evals[-1][1]
    return {**result, "sft_steps": sft["steps"], "sft_val": sft["val_accuracy"], "sft_wall_s": sft["wall_s"],
            "test_start": start, "test_final": final, "test_best": max(a for _, a in evals), "gain": final - start,
            "gain_in_budget": in_budget[-1] - start, "rl_wall_s": rows[-1].get("wall_s", 0.0),
            "evals": evals, "rewards": rewards}


def plot(results: list[dict], path: Path, example: str) -> None:
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps, acc = zip(*r["evals"])
        line, = ax_acc.plot(steps, [100 * a for a in acc], marker="o", label=f"seed {r['seed']}")
        if r["rewards"]:
            rsteps, rew = zip(*r["rewards"])
            smooth = [sum(rew[max(0, i - 4):i + 1]) / len(rew[max(0, i - 4):i + 1]) for i in range(len(rew))]
            ax_rew.plot(rsteps, smooth, color=line.get_color(), label=f"seed {r['seed']}")
    ax_acc.set(xlabel="RL step", ylabel="held-out accuracy, greedy (%)", title="after SFT (step 0) and during GRPO")
    temperature = yaml.safe_load((results[0]["run_dir"] / "config.yaml").read_text())["rollout"]["temperature"]
    ax_rew.set(xlabel="RL step", ylabel="mean reward, 5-step mean",
               title=f"sampled reward (temperature {temperature})")
    for ax in (ax_acc, ax_rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(example).name}: SFT, then GRPO, per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=2, help="seeds run at once (each with one torch thread)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run with --parallel 1 (0: all)")
    parser.add_argument("--out", default="runs/tool_seeds")
    parser.add_argument("--example", default=EXAMPLE)
    parser.add_argument("--minutes", type=float, default=15.0,
                        help="also report the gain at the last evaluation within this much RL wall time")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    threads = 1 if args.parallel > 1 else args.threads
    start = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda s: train(args.example, s, out, threads, args.overrides), args.seeds))
    total_wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    results = [summarize(r, args.minutes) for r in results]
    budget = f"gain {args.minutes:g} min"
    print(f"{'seed':>4} {'SFT stop':>8} {'SFT val':>7} {'SFT min':>7} {'test: start':>11} {'final':>6} {'best':>6} "
          f"{'gain':>6} {budget:>13} {'RL min':>6} {'wall SFT+RL':>11}")
    for r in results:
        print(f"{r['seed']:>4} {r['sft_steps']:>8} {100 * r['sft_val']:>6.1f}% {r['sft_wall_s'] / 60:>7.1f} "
              f"{100 * r['test_start']:>10.1f}% {100 * r['test_final']:>5.1f}% {100 * r['test_best']:>5.1f}% "
              f"{100 * r['gain']:>+6.1f} {100 * r['gain_in_budget']:>+13.1f} {r['rl_wall_s'] / 60:>6.1f} "
              f"{r['wall_s'] / 60:>9.1f} min")
    gains = sorted(100 * r["gain"] for r in results)
    print(f"gain (points): min {gains[0]:+.1f}, median {gains[len(gains) // 2]:+.1f}, max {gains[-1]:+.1f}; "
          f"{len(results)} runs, {args.parallel} at a time, {total_wall / 60:.1f} min wall in all, "
          f"{(usage.ru_utime + usage.ru_stime) / 60:.1f} CPU-min in all (load average now {os.getloadavg()[0]:.1f})")
    png = out / f"{Path(args.example).stem}_seeds.png"
    plot(results, png, args.example)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
