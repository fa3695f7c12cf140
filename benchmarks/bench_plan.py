"""Predicted (asyncflow.plan) vs measured step time of sync, stream and async k=1, side by side in one run.

    PYTHONPATH=src flock /tmp/asyncflow-bench.lock .venv/bin/python benchmarks/bench_plan.py --steps 12 --invocations 3

1. `asyncflow profile` in a process of its own measures this machine's costs for the tiny Llama (one thread),
   once as `sync` runs (in-process queue) and once as `stream` / `async` run (`SEPARATED`: the queue's calls
   through Ray actors on the same two cores).
2. For each workload (the main job `examples/arithmetic_grpo.yaml` without its SFT warm-up, at most 8 new
   tokens; and a long-tailed one: 64 new tokens, ~7% stop chance per token), each mode trains `--steps` steps in
   a process of its own with one torch thread: `sync` inline (the stages one after another on one core),
   `stream` / `async` separated as `benchmarks/bench_workflows.py` runs them (a Ray rollout replica on one core,
   the trainer on the other; on threads of one process instead, the GIL made async k=1 on the long tail 2x
   slower than sync in a first invocation, which the simulator does not model).
3. The simulator predicts each mode's step time from the profile and the workload's length statistics only (the
   measured run's mean response length per step, geometric, capped at max_new_tokens): no measured timing of
   the run enters the prediction.

Step time: mean wall seconds per step over steps `warmup+1 .. steps-1-k` (async's last k steps, where rollout has
finished, left out), for both. With `--invocations N` all of it is done N times and the last table gives each
step time's mean over the invocations (the ratios are those of the means).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

from asyncflow.plan.costs import Costs, Profile
from asyncflow.plan.sim import SimSpec, simulate
from asyncflow.plan.workload import Lengths, Workload
from asyncflow.workflow.compare import train_run

ROOT = Path(__file__).resolve().parents[1]
STOP_IDS = [36, 37, 38, 39, 40, 41]  # 'A'..'F' of the built-in character tokenizer
COMMON = ["sft.before_rl=false", "eval.every=0", "checkpoint.every=0", "run.progress=false", "export.at_end=false",
          "runtime.call_timeout_s=300", "data.test_size=8"]  # fmt: skip
SEPARATED = ["runtime.kind=ray", "runtime.num_cpus=2", "runtime.rollout_cpus=1", "runtime.trainer_cpus=1"]
WORKLOADS = {
    "main job (<= 8 tokens)": ["rollout.max_batch_size=128"],
    "long tail (<= 64 tokens)": ["rollout.max_new_tokens=64", f"rollout.stop_token_ids={STOP_IDS}",
                                 "rollout.max_batch_size=128", "train.micro_batch_size=64"],
}
MODES = {"sync": (["workflow.mode=sync", "runtime.kind=inline"], 0),
         "stream": (["workflow.mode=stream", *SEPARATED], 0),
         "async k=1": (["workflow.mode=async", "workflow.max_staleness=1", *SEPARATED], 1)}
PROMPT_TOKENS = 7  # "37+58=" and the BOS of the character tokenizer


def window_step_s(ends: list[float], warmup: int, k: int) -> float:
    last = len(ends) - 1 - k
    return (ends[last] - ends[warmup - 1]) / (last - warmup + 1)


def predict(profile: Profile, rows: list[dict], mode: str, k: int, *, steps: int, warmup: int, group_size: int,
            prompts: int, max_new: int, slots: int, micro_batch: int) -> float:
    mean = float(np.mean([r["response_length/mean"] for r in rows]))
    workload = Workload(prompts_per_step=prompts, group_size=group_size, prompt=Lengths(mean=PROMPT_TOKENS),
                        response=Lengths.truncated_geometric(mean, max_new))
    P, L = workload.sample(steps)
    costs = Costs.from_profile(profile)
    spec = SimSpec(mode=mode.split()[0], prompt_lengths=P, response_lengths=L, group_size=group_size, costs=costs,
                   max_staleness=max(k, 1), replicas=1, slots=slots, micro_batch_groups=micro_batch // group_size,
                   sync_micro_batch_rows=micro_batch)  # fmt: skip
    return window_step_s(simulate(spec).step_end_s.tolist(), warmup, k)


def invocation(args, tmp: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """Profiles taken, then each workload x mode trained and predicted: {(workload, mode): (predicted, measured)}."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    profiles = {}
    for placement, overrides in {"inline": [], "ray": SEPARATED}.items():
        path = tmp / f"profile_{placement}.yaml"
        subprocess.run([sys.executable, "-m", "asyncflow.cli", "profile", args.config, *overrides, "--threads",
                        "1", "--out", str(path)], check=True, env=env, capture_output=True)
        profiles[placement] = Profile.load(path)
        print(f"profile ({placement}):", json.dumps(profiles[placement].model_dump(exclude={"notes", "hardware"})))
    results = {}
    for name, overrides in WORKLOADS.items():
        for mode, (mode_overrides, k) in MODES.items():
            out = tmp / f"{len(results)}_{name[:4]}"
            run_args = [args.config, *COMMON, *overrides, *mode_overrides, f"train.steps={args.steps}"]
            rows = train_run(run_args, out, threads=1, timeout_s=1800)
            measured = window_step_s([r["wall_s"] for r in rows], args.warmup, k)
            config = yaml.safe_load((out / "config.yaml").read_text())
            ro, tr = config["rollout"], config["train"]
            profile = profiles["inline" if mode == "sync" else "ray"]
            results[name, mode] = (predict(profile, rows, mode, k, steps=args.steps, warmup=args.warmup,
                                           group_size=ro["group_size"], prompts=ro["prompts_per_step"],
                                           max_new=ro["max_new_tokens"], slots=ro["max_batch_size"],
                                           micro_batch=tr["micro_batch_size"]), measured)  # fmt: skip
    return results


def print_table(results: dict[tuple[str, str], tuple[float, float]]) -> None:
    print("| workload | mode | predicted s/step | measured s/step | error | predicted vs sync | measured vs sync |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, mode), (predicted, measured) in results.items():
        ps, ms = results[name, "sync"]
        print(f"| {name} | {mode} | {predicted:.3f} | {measured:.3f} | {100 * (predicted / measured - 1):+.0f}% "
              f"| {ps / predicted:.2f}x | {ms / measured:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--invocations", type=int, default=1,
                        help="profiles and runs taken this many times, one after another; the last table is the mean "
                             "of each column over them (one invocation's noise here is about +-20%%)")
    parser.add_argument("--config", default=str(ROOT / "examples" / "arithmetic_grpo.yaml"))
    args = parser.parse_args()
    invocations = []
    for i in range(args.invocations):
        with tempfile.TemporaryDirectory() as tmp:
            invocations.append(invocation(args, Path(tmp)))
        print(f"invocation {i + 1} of {args.invocations}:")
        print_table(invocations[-1])
    if args.invocations > 1:
        print(f"mean over {args.invocations} invocations:")
        print_table({key: tuple(float(np.mean([inv[key][j] for inv in invocations])) for j in (0, 1))
                     for key in invocations[0]})


if __name__ == "__main__":
    main()
