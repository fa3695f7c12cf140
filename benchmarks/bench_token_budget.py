"""Benchmark: peak memory of a training step on a long-tailed batch, micro-batched by rows vs by a token budget
(`train.max_tokens_per_micro_batch`), side by side.

Owns nothing the library uses. The batch is GRPO groups whose response lengths are exponential (mean `--mean`)
capped at `--max-response`, with one row at the cap (the long tail). Each mode trains the same rows through
`PolicyTrainer` (the run's micro-batching) with the torch engine, in its own process: `rows:N` is N rows per
micro-batch, `budget:B` at most B padded tokens per micro-batch; a mode that runs out of memory is reported as
such. Peak memory as in `bench_precision.py` (CUDA:
`max_memory_allocated` above the level before the step; CPU: peak resident set above it).

Run: .venv/bin/python benchmarks/bench_token_budget.py [--device cpu|cuda] [--preset small-llama]
     [--modes rows:64,rows:8,budget:4096,budget:2048]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_precision import CPUPeak, CUDAPeak

from asyncflow.config import AlgoConfig
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.workers.rollout import Rollout
from asyncflow.workers.trainer import PolicyTrainer, assign_advantages


def long_tailed(groups: int, group_size: int, mean: int, cap: int, vocab: int) -> list[Rollout]:
    rng = random.Random(0)
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(32)]
        for k in range(group_size):
            length = cap if (g, k) == (0, 0) else min(cap, int(rng.expovariate(1 / mean)) + 1)
            response = [rng.randrange(3, vocab) for _ in range(length)]
            reward = float(rng.random() < 0.5)
            rows.append(Rollout(g, k, prompt, response, [-2.0] * length, "stop", 0, "", reward=reward))
    assign_advantages([rows[i : i + group_size] for i in range(0, len(rows), group_size)], AlgoConfig(), cap)
    return rows


def one_mode(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = load_model(resolve_model_path(f"preset:{args.preset}"), device=args.device)
    rows = long_tailed(args.groups, args.group_size, args.mean, args.max_response, model.config.vocab_size)
    kind, _, value = args.one.partition(":")
    engine = TorchTrainEngine(model, lr=1e-5, packing=args.packing)
    padded: list[int] = []
    backward = engine.backward_micro_batch

    def recording(samples, loss_fn, **kw):
        padded.append(len(samples) * max(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        return backward(samples, loss_fn, **kw)

    engine.backward_micro_batch = recording
    trainer = PolicyTrainer(engine, AlgoConfig(), micro_batch_size=int(value) if kind == "rows" else len(rows),
                            temperature=1.0, max_tokens_per_micro_batch=int(value) if kind == "budget" else None)
    trainer.accumulate(rows)
    trainer.finish_step()  # warm-up: AdamW state, allocator
    meter = CUDAPeak() if args.device.startswith("cuda") else CPUPeak()
    meter.reset()
    padded.clear()
    t0 = time.perf_counter()
    trainer.accumulate(rows)
    metrics = trainer.finish_step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"mode": args.one, "peak_bytes": meter.peak(), "step_s": time.perf_counter() - t0,
            "micro_batches": len(padded), "max_padded": max(padded), "grad_norm": metrics["grad_norm"],
            "tokens": sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--mean", type=int, default=48)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--packing", default="off", choices=["auto", "on", "off"])
    parser.add_argument("--modes", default="rows:64,rows:8,budget:4096,budget:2048")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_mode(args)))
        return
    results = []
    for mode in args.modes.split(","):
        child = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("modes", "one")]
        proc = subprocess.run([sys.executable, __file__, *child, "--one", mode], capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0 and "OutOfMemoryError" in proc.stderr:
            results.append({"mode": mode, "out_of_memory": True})
            continue
        if proc.returncode != 0:
            raise SystemExit(f"mode {mode} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    tokens = next((r["tokens"] for r in results if "tokens" in r), "?")
    print(f"device={args.device} preset={args.preset} {args.groups}x{args.group_size} rows, responses exponential "
          f"(mean {args.mean}) capped at {args.max_response}, {tokens} tokens, packing={args.packing}")
    print(f"{'mode':<13} {'micro-batches':>13} {'max padded tok':>15} {'peak MB':>9} {'step s':>8} {'grad norm':>10}")
    for r in results:
        if r.get("out_of_memory"):
            print(f"{r['mode']:<13} {'out of memory':>13}")
            continue
        print(f"{r['mode']:<13} {r['micro_batches']:13d} {r['max_padded']:15d} {r['peak_bytes'] / 2**20:9.1f} "
              f"{r['step_s']:8.3f} {r['grad_norm']:10.6f}")


if __name__ == "__main__":
    main()
