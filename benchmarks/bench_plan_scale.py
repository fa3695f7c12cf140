"""How fast the simulator runs: 10,000 devices x 1,000 steps of `async` k=1.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_plan_scale.py

Qwen2.5-7B on 10,000 H100s (spec-derived profile): 6,000 rollout replicas (tensor parallel 1) and a trainer on
4,000 devices; 4,096 prompts x 16 samples per step (65,536 rows), prompts of 512 tokens, responses lognormal
(mean 2,000, cut at 16,384). Prints the wall time of sampling the lengths and of the simulation.
"""

from __future__ import annotations

import argparse
import time

from asyncflow.plan.costs import Costs, Profile, qwen_like
from asyncflow.plan.sim import SimSpec, simulate
from asyncflow.plan.workload import Lengths, Workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=10_000)
    args = parser.parse_args()
    rollout = args.devices * 6 // 10
    workload = Workload(prompts_per_step=4096, group_size=16, prompt=Lengths(mean=512),
                        response=Lengths(kind="lognormal", mean=2000, max=16384))
    t0 = time.perf_counter()
    P, L = workload.sample(args.steps)
    t1 = time.perf_counter()
    costs = Costs.from_profile(Profile.load("h100"), qwen_like("7B"), train_devices=args.devices - rollout)
    result = simulate(SimSpec(mode="async", prompt_lengths=P, response_lengths=L, group_size=16, costs=costs,
                              max_staleness=1, replicas=rollout, micro_batch_groups=256))
    t2 = time.perf_counter()
    print(f"{args.devices} devices ({rollout} rollout replicas), {args.steps} steps, {workload.rows} rows per step: "
          f"sampling {t1 - t0:.1f} s, simulation {t2 - t1:.1f} s, total {t2 - t0:.1f} s; simulated "
          f"{result.total_s / 3600:.1f} h, {result.step_time():.1f} s per step, busy {result.busy()}")


if __name__ == "__main__":
    main()
