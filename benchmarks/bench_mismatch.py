"""Mismatch corrections side by side on the main job, with a real train/inference mismatch: rollouts from
bfloat16 weights (`rollout.dtype=bfloat16`) against an fp32 trainer (`train.precision=fp32`, `model.dtype=float32`).

Owns nothing the library uses. One SFT model (`asyncflow sft` on the main job, or `--model PATH`, or `--model
preset:tiny-llama` for a smoke run from random weights), then a few GRPO steps of the main job from it with each
`algo.mismatch_correction` (`off` included, the uncorrected baseline), every run an `asyncflow` process as a user
runs it (one torch thread, this checkout's `src` first on PYTHONPATH), laid out as OUT/sft and OUT/CORRECTION.
A run already finished there is read, not run again.

Prints, per correction: the measured gap (mean over steps of `mismatch/abs_log_ratio`, |log pi_train - log
pi_rollout| per trained token, and of `..._same_version`, the engines' mismatch alone), the mean fractions it
truncated and masked (tokens, and the correction's own count: `mismatch/{count}_fraction`), and held-out accuracy
(greedy, the test prompts) at RL step 0 and at the end. One seed and a few steps show what each correction
touches under a real gap; they are not a learning comparison (that needs the main job's budget over seeds, as
`benchmarks/policy_loss_seeds.py` runs for the losses: `--variant NAME:algo.mismatch_correction=X,rollout.dtype=...`).
Stale data instead of (or with) the precision gap: `--set workflow.mode=async --set workflow.max_staleness=2
--set algo.stale_old_logprobs=policy --set runtime.kind=inline` (the ratio then also holds the policy's drift).

Run: .venv/bin/python benchmarks/bench_mismatch.py [--steps 20] [--seed 0] [--model PATH|preset:NAME]
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
    run_dir = out / correction
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
    parser.add_argument("--seed", type=int, default=0)
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
            asyncflow("sft", sft_dir, [], args.seed)
    with ThreadPoolExecutor(args.parallel) as pool:
        jobs = {c: pool.submit(rl_run, args.out, model, c, args.steps, args.seed, args.extra) for c in args.corrections}
        runs = {c: job.result() for c, job in jobs.items()}
    print(f"bf16 rollouts vs fp32 trainer, seed {args.seed}, {args.steps} steps from {model}")
    header = (f"{'correction':<20}{'|gap|':>10}{'|gap| same':>12}{'truncated':>11}{'masked tok':>12}"
              f"{'masked seq':>12}  {'own count':<56}{'held-out start -> end':>22}")
    print(header)
    for correction, rows in runs.items():
        trained = [r for r in rows if r.get("step", 0) > 0]
        names = [] if correction == "off" else correction.split("+")
        own = ", ".join(f"{OWN_COUNT[n]} {mean_of(trained, f'mismatch/{OWN_COUNT[n]}_fraction'):.4f}" for n in names)
        accuracy = [100 * r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
        held_out = f"{accuracy[0]:.1f} -> {accuracy[-1]:.1f}" if accuracy else "-"
        print(f"{correction:<20}{mean_of(trained, 'mismatch/abs_log_ratio'):>10.5f}"
              f"{mean_of(trained, 'mismatch/abs_log_ratio_same_version'):>12.5f}"
              f"{mean_of(trained, 'mismatch/truncated_tokens_fraction'):>11.4f}"
              f"{mean_of(trained, 'mismatch/masked_tokens_fraction'):>12.4f}"
              f"{mean_of(trained, 'mismatch/masked_sequences_fraction'):>12.4f}  {own:<56}{held_out:>22}")


if __name__ == "__main__":
    main()
