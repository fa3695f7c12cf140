"""Benchmark: the same RL workload in `sync`, `stream`, `async` k=1 and `async` k=2, side by side.

Owns nothing the library uses. Every mode trains the same model on the same prompts with the same
group size and sampling; responses end at EOS or one of a few extra stop tokens, so (the tiny
model's next-token distribution being near uniform) their lengths are geometric with a long tail
up to `max_new_tokens`. Runs are interleaved (sync, stream, async1, async2, sync, ...), each a
separate `asyncflow train` process:

- `sync`: colocated, inline, every core to each stage in turn (torch threads = all cores).
- `stream`, `async`: separated on a local Ray cluster, one core for the rollout replica (which
  scores its own responses) and one for the trainer; the trainer borrows the replica's core while
  the replica waits for weights (`runtime.lend_idle_cores`; the `no-lending` modes turn it off).

Throughput counts the samples trained in steps `warmup+1 .. steps-1-k` over their wall time (the
first steps include process start-up, the last one the final evaluation; `async` k's rollout
replica has generated every partition k steps before the end, and from then on the trainer has the
whole machine, so those k steps are left out too; k = 0 for `sync` and `stream`). The perfect-overlap
bound is the throughput if generation and training overlapped completely, each on its share of
the machine: samples per step / max(generation + reward alone, training alone), both measured by
a `sync` run restricted to one thread (the separated modes score rewards inside the rollout replica).

Medians over the repeats, and each repeat's ratio to the `sync` run just before it (the machine
drifts between repeats; neighbouring runs see about the same conditions).

Run: .venv/bin/python benchmarks/bench_workflows.py [--steps 12] [--repeats 2] [--quick] [--prompts 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from asyncflow.workflow.compare import throughput, train_run

ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 2
STOP_IDS = [36, 37, 38, 39, 40, 41]  # 'A'..'F' of the built-in character tokenizer: ~7% stop chance per token

WORKLOAD = [
    "model.path=preset:tiny-llama", "sft.before_rl=false", "data.task=arithmetic", "data.test_size=8",
    "rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_new_tokens=64", "rollout.temperature=1.0",
    f"rollout.stop_token_ids={STOP_IDS}", "rollout.max_batch_size=128", "train.micro_batch_size=64",
    "eval.every=0", "checkpoint.every=0", "run.progress=false", "runtime.call_timeout_s=300",
]  # fmt: skip
SEPARATED = ["runtime.kind=ray", f"runtime.num_cpus={CORES}", f"runtime.rollout_cpus={CORES // 2}",
             f"runtime.trainer_cpus={CORES - CORES // 2}"]  # fmt: skip
MODES = {
    "sync": (["workflow.mode=sync"], CORES),
    "stream": (["workflow.mode=stream", *SEPARATED], CORES - CORES // 2),
    "async k=1": (["workflow.mode=async", "workflow.max_staleness=1", *SEPARATED], CORES - CORES // 2),
    "async k=2": (["workflow.mode=async", "workflow.max_staleness=2", *SEPARATED], CORES - CORES // 2),
    # not in the default set: the same separation on threads of one process (no Ray hops, one GIL)
    "async k=1 inline": (["workflow.mode=async", "workflow.max_staleness=1"], CORES - CORES // 2),
    # two rollout replicas time-sharing the rollout core(s) with the trainer (decode steps of small
    # models gain from a second process, not from a second thread)
    "stream 2 replicas": (["workflow.mode=stream", *SEPARATED, "rollout.replicas=2"], CORES - CORES // 2),
    # each separated worker strictly on its own core, without borrowing the idle one's
    "stream no-lending": (["workflow.mode=stream", *SEPARATED, "runtime.lend_idle_cores=false"], CORES - CORES // 2),
    "async k=1 no-lending": (["workflow.mode=async", "workflow.max_staleness=1", *SEPARATED,
                              "runtime.lend_idle_cores=false"], CORES - CORES // 2),
}
DEFAULT_MODES = ["sync", "stream", "async k=1", "async k=2"]
BOUND_RUN = (["workflow.mode=sync"], CORES // 2)  # each stage alone on its share of the machine


def train(overrides: list[str], threads: int, out: Path, steps: int) -> list[dict]:
    return train_run([*WORKLOAD, f"train.steps={steps}", *overrides], out, threads=threads, timeout_s=1800)


def max_staleness(overrides: list[str]) -> int:
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("workflow.max_staleness=")), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="6 steps, 1 repeat")
    parser.add_argument(
        "--prompts", type=int, default=32, help="prompts per step (x 8 samples; the engine has 128 slots)"
    )
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {list(MODES)}")
    args = parser.parse_args()
    modes = {name: MODES[name] for name in args.modes.split(",")}
    if args.quick:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    workload = [f"rollout.prompts_per_step={args.prompts}"]
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    stage_times: list[tuple[float, float]] = []
    lengths: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode, (overrides, threads) in modes.items():
                t0 = time.time()
                rows = train(workload + overrides, threads, Path(tmp) / f"{mode.replace(' ', '_')}_{rep}", args.steps)
                results[mode].append(throughput(rows, args.warmup, max_staleness(overrides)))
                lengths += [r["response_length/mean"] for r in rows]
                print(
                    f"[{rep}] {mode:10s} {results[mode][-1][0]:7.1f} samples/s  ({time.time() - t0:.0f} s)", flush=True
                )
            rows = train(workload + BOUND_RUN[0], BOUND_RUN[1], Path(tmp) / f"bound_{rep}", args.steps)
            stage_times += [
                (r["time/generate_s"] + r["time/reward_s"], r["time/train_s"]) for r in rows[args.warmup : -1]
            ]
            print(f"[{rep}] stages on {BOUND_RUN[1]} core(s) measured", flush=True)
    samples_per_step = rows[0]["rollout/samples"]
    generate_s = statistics.median(g for g, _ in stage_times)
    train_s = statistics.median(t for _, t in stage_times)
    bound = samples_per_step / max(generate_s, train_s)
    base = statistics.median(s for s, _ in results["sync"])
    print(
        f"\nworkload: tiny-llama, {args.prompts} prompts x 8 samples per step, max 64 new tokens, mean response "
        f"{statistics.mean(lengths):.1f} tokens; {CORES} cores; {args.steps} steps, {args.repeats} repeats"
    )
    print(
        f"{'mode':12s} {'samples/s':>10s} {'tokens/s':>10s} {'vs sync':>8s} {'vs bound':>9s}   "
        "per repeat vs that repeat's sync"
    )
    for mode, values in results.items():
        samples = statistics.median(s for s, _ in values)
        tokens = statistics.median(t for _, t in values)
        paired = [s / sync for (s, _), (sync, _) in zip(values, results["sync"])]
        print(
            f"{mode:12s} {samples:10.1f} {tokens:10.0f} {samples / base:7.2f}x {samples / bound:8.2f}   "
            f"{', '.join(f'{r:.2f}x' for r in paired)} (median {statistics.median(paired):.2f}x)"
        )
    print(
        f"{'bound':12s} {bound:10.1f} {'':>10s} {bound / base:7.2f}x   (generation+reward {generate_s:.2f} s, "
        f"training {train_s:.2f} s per step, each on {BOUND_RUN[1]} core(s))"
    )


if __name__ == "__main__":
    main()
