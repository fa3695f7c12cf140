"""Mismatch corrections side by side on the main job, with a real train/inference mismatch: rollouts from
bfloat16 weights (`rollout.dtype=bfloat16`) against an fp32 trainer (`train.precision=fp32`, `model.dtype=float32`).

Owns nothing the library uses. One SFT model (`asyncflow sft` on the main job with seed 0, or `--model PATH`, or
`--model preset:tiny-llama` for a smoke run from random weights), then a few GRPO steps of the main job from it with
each `algo.mismatch_correction` (`off` included, the uncorrected baseline) on each of `--seeds` (the RL run's
`run.seed`), every run an `asyncflow` process as a user runs it (one torch thread, this checkout's `src` first on
PYTHONPATH), laid out as OUT/sft and OUT/seedS/CORRECTION. A run already finished there is read, not run again.

Prints, per correction and as means over the seeds: the measured gap (mean over steps of `mismatch/abs_log_ratio`,
|log pi_train - log pi_rollout| per trained token, and of `..._same_version`, the engines' mismatch alone), the mean
fractions it truncated and masked (tokens, and the correction's own count: `mismatch/{count}_fraction`), and
held-out accuracy (greedy, the test prompts) at RL step 0 and at the end, then the end accuracy of each seed. A few
steps show what each correction touches under a real gap; they are not a learning comparison (that needs the main
job's budget, as `benchmarks/policy_loss_seeds.py` runs for the losses: `--variant
NAME:algo.mismatch_correction=X,rollout.dtype=...`).
Stale data instead of (or with) the precision gap: `--set workflow.mode=async --set workflow.max_staleness=2
--set algo.stale_old_logprobs=policy --set runtime.kind=inline` (the ratio then also holds the policy's drift).

Run: .venv/bin/python benchmarks/bench_mismatch.py [--steps 20] [--seeds 0 1 2] [--model PATH|preset:NAME]
        [--out runs/mismatch] [--corrections off token_tis icepop ...] [--parallel 1] [--set KEY=VALUE ...]
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

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/arithmetic_grpo.yaml"
CORRECTIONS = ["off", "token_tis", "icepop", "seq_tis", "seq_mask", "geo_mis", "m2po", "token_tis+seq_mask"]
MISMATCH = ["rollout.dtype=bfloat16", "train.precision=fp32", "model.dtype=float32"]  # bf16 engine, fp32 trainer
OWN_COUNT = {"token_tis": "truncated_tokens", "geo_mis": "masked_sequences", "icepop": "icepop_masked_tokens",
             "seq_tis": "seq_tis_truncated_sequences", "seq_mask": "seq_mask_masked_sequences",
             "m2po": "m2po_masked_tokens"}


def asyncflow(command: str, run_dir: Path, overrides: list[str], seed: int) -> None:
    cmd = [sys.executable, "-m", "asyncflow.cli", command, EXAMPLE, "--threads", "1", "run.progress=false",
           f"run.seed={seed}", "--output", str(run_dir), *(["--overwrite"] if command == "train" else []), *overrides]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=6 * 3600)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_dir.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.open()] if path.is_file() else []


def rl_run(out: Path, model: str, correction: str, steps: int, seed: int, extra: list[str]) -> list[dict]:
    run_dir = out / f"seed{seed}" / correction
    if not any(row.get("step") == steps for row in metrics(run_dir)):
        asyncflow("train", run_dir, ["sft.before_rl=false", f"model.path={model}", f"train.steps={steps}",
                                     f"eval.every={steps}", "checkpoint.every=0", *MISMATCH,
                                     f"algo.mismatch_correction={correction}", *extra], seed)
    return metrics(run_dir)


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]  # NaN != NaN
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps per correction")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="the RL runs' seeds (one SFT model)")
    parser.add_argument("--model", default=None, help="start every run from this model (default: SFT it here)")
    parser.add_argument("--corrections", nargs="+", default=CORRECTIONS)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "mismatch")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="KEY=VALUE for every RL run")
    args = parser.parse_args()
    model = args.model
    if model is None:
        sft_dir = args.out / "sft"
        model = str(sft_dir / "sft")
        if not (Path(model) / "sft_summary.json").is_file():
            asyncflow("sft", sft_dir, [], 0)
    with ThreadPoolExecutor(args.parallel) as pool:
        jobs = {(c, seed): pool.submit(rl_run, args.out, model, c, args.steps, seed, args.extra)
                for seed in args.seeds for c in args.corrections}
        runs = {key: job.result() for key, job in jobs.items()}
    print(f"bf16 rollouts vs fp32 trainer{' with ' + ' '.join(args.extra) if args.extra else ''}, seeds "
          f"{' '.join(map(str, args.seeds))}, {args.steps} steps from {model}; means over the seeds")
    header = (f"{'correction':<20}{'|gap|':>10}{'|gap| same':>12}{'truncated':>11}{'masked tok':>12}"
              f"{'masked seq':>12}  {'own count':<48}{'held-out start -> end':>22}  end per seed")
    print(header)
    for correction in args.corrections:
        seeds = [runs[correction, seed] for seed in args.seeds]
        trained = [[r for r in rows if r.get("step", 0) > 0] for rows in seeds]

        def seed_mean(key: str) -> float:
            return statistics.mean(mean_of(rows, key) for rows in trained)

        names = [] if correction == "off" else correction.split("+")
        own = ", ".join(f"{OWN_COUNT[n]} {seed_mean(f'mismatch/{OWN_COUNT[n]}_fraction'):.4f}" for n in names)
        accuracy = [[100 * r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None] for rows in seeds]
        held_out = (f"{statistics.mean(a[0] for a in accuracy):.1f} -> {statistics.mean(a[-1] for a in accuracy):.1f}"
                    if all(accuracy) else "-")
        ends = " ".join(f"{a[-1]:.1f}" if a else "-" for a in accuracy)
        print(f"{correction:<20}{seed_mean('mismatch/abs_log_ratio'):>10.5f}"
              f"{seed_mean('mismatch/abs_log_ratio_same_version'):>12.5f}"
              f"{seed_mean('mismatch/truncated_tokens_fraction'):>11.4f}"
              f"{seed_mean('mismatch/masked_tokens_fraction'):>12.4f}"
              f"{seed_mean('mismatch/masked_sequences_fraction'):>12.4f}  {own:<48}{held_out:>22}  {ends}")


if __name__ == "__main__":
    main()
