"""Benchmark: `async` with and without partial rollouts on a long-tailed workload, side by side.

Owns nothing the library uses. Both variants train the same model on the same prompts with the built-in
torch engine, `async` with `max_staleness` k on a local Ray cluster (one core for the rollout replica, one
for the trainer, as `bench_workflows.py` separates them):

- `finish`: at a weight update, the samples in flight complete on the weights they started with
  (`rollout.on_weight_update=finish`, the default).
- `resume`: partial rollouts (`rollout.on_weight_update=resume`): the replica takes new weights at its next
  decode step, recomputes the in-flight samples' KV cache and goes on under the new version.

The workload is long-tailed: most responses are short (they end at EOS or one of 20 stop tokens, about a
quarter of the random tiny model's next-token mass, so ~4 tokens on average) and one request in `LONG_EVERY`
ignores the stop tokens and runs to `max_new_tokens` (default 128): a partition's generation lasts as long as
those. `LongTailEngine` is the torch engine with that one change to when a sample stops. The trainer packs
each group's responses without padding (`train.packing=on`) and takes 2 groups per micro-batch, so training
costs about the tokens generated, not rows x the longest. Runs are interleaved (finish, resume, finish, ...),
each a separate `asyncflow train` process; throughput counts the samples trained in steps `warmup+1 ..
steps-1-k` over their wall time (`asyncflow.workflow.compare.throughput`). Staleness is the mean over that
window of each step's `staleness/mean` (rows, by their oldest token) and `staleness/token_mean` (tokens), with
the fraction of rows spanning versions.

Run: PYTHONPATH=src .venv/bin/python benchmarks/bench_partial_rollouts.py [--steps 10] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.workflow.compare import throughput, train_run

CORES = os.cpu_count() or 2
STOP_IDS = list(range(36, 56))  # 20 characters of the built-in tokenizer: ~23% stop chance per token
LONG_EVERY = 16
WORKLOAD = [
    "model.path=preset:tiny-llama", "sft.before_rl=false", "data.task=arithmetic", "data.test_size=8",
    "rollout.engine=bench_partial_rollouts:long_tail_engine",
    "rollout.group_size=8", "rollout.temperature=1.0", f"rollout.stop_token_ids={STOP_IDS}",
    "rollout.max_batch_size=128", "train.micro_batch_size=16", "train.packing=on", "eval.every=0", "checkpoint.every=0",
    "run.progress=false", "runtime.call_timeout_s=300", "workflow.mode=async", "runtime.kind=ray",
    f"runtime.num_cpus={CORES}", f"runtime.rollout_cpus={CORES // 2}", f"runtime.trainer_cpus={CORES - CORES // 2}",
]  # fmt: skip


class LongTailEngine(TorchInferenceEngine):
    """The torch engine, except that a queue row whose index is a multiple of `LONG_EVERY` ignores the stop
    tokens (evaluation requests, named by (group, sample), stop as usual)."""

    def _append(self, slots, logits):
        super()._append(slots, logits)
        for s in slots:
            long = isinstance(s.request.request_id, int) and s.request.request_id % LONG_EVERY == 0  # a queue row
            if s.finish_reason == "stop" and long:
                s.finish_reason = "length" if len(s.response_ids) >= s.params.max_new_tokens else None


def long_tail_engine(*, model, **kwargs) -> LongTailEngine:
    return LongTailEngine(model, **kwargs)


VARIANTS = {"finish": ["rollout.on_weight_update=finish"], "resume": ["rollout.on_weight_update=resume"]}


def run_once(args: list[str], out: Path, threads: int) -> list[dict]:
    """`train_run`, tried again once when the local Ray cluster did not start (a loaded machine)."""
    try:
        return train_run(args, out, threads=threads, timeout_s=1800)
    except RuntimeError as err:
        if "timed out during startup" not in str(err):
            raise
        print("Ray did not start; trying again", flush=True)
        return train_run(args, out.with_name(out.name + "_again"), threads=threads, timeout_s=1800)


def window_mean(rows: list[dict], key: str, warmup: int, k: int) -> float:
    return statistics.mean(r[key] for r in rows[warmup : len(rows) - 1 - k])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x 8 samples)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=1, help="workflow.max_staleness")
    parser.add_argument("--quick", action="store_true", help="6 steps, 1 repeat, 8 prompts")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats, args.prompts = 6, 2, 1, 8
    workload = [*WORKLOAD, f"rollout.prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.max_new_tokens}",
                f"workflow.max_staleness={args.k}", f"train.steps={args.steps}"]  # fmt: skip
    threads = CORES - CORES // 2
    here = str(Path(__file__).resolve().parent)  # the engine factory's module, for the runs and their Ray workers
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="asyncflow-partial-") as tmp:
        for rep in range(args.repeats):
            for name, overrides in VARIANTS.items():
                t0 = time.time()
                rows = run_once([*workload, *overrides], Path(tmp) / f"{name}_{rep}", threads)
                samples, tokens = throughput(rows, args.warmup, args.k)
                window = rows[args.warmup : len(rows) - 1 - args.k]
                results[name].append({
                    "samples/s": samples, "tokens/s": tokens,
                    "step s": statistics.median(r["time/step_s"] for r in window),
                    "stale rows": window_mean(rows, "staleness/mean", args.warmup, args.k),
                    "stale tokens": window_mean(rows, "staleness/token_mean", args.warmup, args.k),
                    "spanning": window_mean(rows, "staleness/rows_spanning_versions", args.warmup, args.k),
                    "max len": max(r["response_length/max"] for r in window),
                    "mean len": statistics.mean(r["response_length/mean"] for r in window),
                })  # fmt: skip
                print(f"[{rep}] {name:7s} {samples:7.1f} samples/s  ({time.time() - t0:.0f} s)", flush=True)
    print(
        f"\nworkload: tiny-llama, async k={args.k} on Ray ({CORES} cores), {args.prompts} prompts x 8 samples per "
        f"step, 1 in {LONG_EVERY} runs to {args.max_new_tokens} new tokens, mean response "
        f"{statistics.mean(r['mean len'] for v in results.values() for r in v):.1f} tokens, longest per step "
        f"{statistics.median(r['max len'] for v in results.values() for r in v):.0f} (median); {args.steps} steps, "
        f"{args.repeats} repeats; medians over repeats"
    )
    keys = ["samples/s", "tokens/s", "step s", "stale rows", "stale tokens", "spanning"]
    print(f"{'variant':8s} " + " ".join(f"{k:>12s}" for k in keys))
    for name, values in results.items():
        print(f"{name:8s} " + " ".join(f"{statistics.median(v[k] for v in values):12.3f}" for k in keys))
    paired = [r["samples/s"] / f["samples/s"] for r, f in zip(results["resume"], results["finish"])]
    print(f"resume / finish samples/s per repeat: {', '.join(f'{p:.2f}x' for p in paired)} "
          f"(median {statistics.median(paired):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
