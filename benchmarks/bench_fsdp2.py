"""Benchmark: the FSDP2 training engine against the built-in one, side by side in one invocation.

Owns nothing the library uses. Two measurements, each over interleaved repeats (median), printed with
ratios to the built-in `torch` engine measured in the same invocation:

1. Step time on a fixed global batch (GRPO groups, a policy-loss step: forward + backward in micro-batches,
   one AdamW step): `torch` (one process) vs `fsdp2` with 1 and 2 ranks (one thread per rank).
2. Per weight version: the full state dict gathered to the driver (`state_dict()` after a step; `fsdp2`:
   all-gather to rank 0, packed into buckets, handed over in shared memory) and its `publish` through the
   shared-memory weight transport, for a Llama of >= 20M parameters.

Run: PYTHONPATH=src python benchmarks/bench_fsdp2.py [--repeats 5] [--quick] [--parts steps,publish]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from asyncflow.config import AlgoConfig
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.weights import make_weight_sync
from asyncflow.workers.trainer import PolicyLoss

HP = dict(lr=1e-5, grad_clip=1.0)


def batch(groups: int, group_size: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(6, 12))]
        for _ in range(group_size):
            samples.append(TrainSample(prompt, [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))], g))
    return samples


def loss_of(samples: list[TrainSample]) -> PolicyLoss:
    lengths = [len(s.response_ids) for s in samples]
    width = max(lengths)
    g = torch.Generator().manual_seed(0)
    return PolicyLoss(torch.randn(len(samples), width, generator=g), torch.full((len(samples), width), -2.0),
                      None, torch.ones(len(samples), width, dtype=torch.bool), lengths, AlgoConfig())


def train_step(engine, samples: list[TrainSample], micro_batch: int) -> None:
    for start in range(0, len(samples), micro_batch):
        rows = samples[start : start + micro_batch]
        engine.backward_micro_batch(rows, loss_of(rows))
    engine.optimizer_step(1.0 / sum(len(s.response_ids) for s in samples))


def engines(path: Path) -> dict[str, object]:
    return {
        "torch": TorchTrainEngine(load_model(path), **HP),
        "fsdp2 x1": FSDP2TrainEngine(load_model(path), model_path=path, world_size=1, threads_per_rank=1,
                                     launcher=ProcessRanks, **HP),
        "fsdp2 x2": FSDP2TrainEngine(load_model(path), model_path=path, world_size=2, threads_per_rank=1,
                                     launcher=ProcessRanks, **HP),
    }


def report(title: str, times: dict[str, list[float]]) -> None:
    base = statistics.median(times["torch"])
    print(title)
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:9s} median {median:7.3f} s  (min {min(values):.3f})  ratio to torch {median / base:5.2f}")
    if "fsdp2 x1" in times:
        ratio = statistics.median(times["fsdp2 x2"]) / statistics.median(times["fsdp2 x1"])
        print(f"  fsdp2 2 ranks / 1 rank: {ratio:.2f}")


def bench_steps(args) -> None:
    path = resolve_model_path(args.step_model)
    n_params = sum(p.numel() for p in load_model(path).parameters())
    samples = batch(args.groups, args.group_size, vocab=90)
    print(f"step: {args.step_model} ({n_params / 1e6:.1f}M params), global batch {len(samples)} rows "
          f"({sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)} tokens), micro-batch "
          f"{args.micro_batch}, 1 thread per process")
    built = engines(path)
    times: dict[str, list[float]] = {name: [] for name in built}
    try:
        for repeat in range(args.repeats + 1):  # the first repeat warms up
            for name, engine in built.items():
                t0 = time.perf_counter()
                train_step(engine, samples, args.micro_batch)
                if repeat:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for engine in built.values():
            getattr(engine, "close", lambda: None)()
    report("step time per optimizer step:", times)


def large_model(folder: Path) -> Path:
    """A Llama of ~27M parameters (hidden 512, 8 layers), random init, saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def bench_publish(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = large_model(Path(tmp) / "model")
        n_params = sum(p.numel() for p in load_model(path).parameters())
        print(f"weight sync: Llama {n_params / 1e6:.1f}M params ({n_params * 4 / 2**20:.0f} MiB fp32), "
              "state_dict() after a step, then publish through shared_memory")
        samples = batch(2, 2, vocab=1000)
        built = engines(path)
        gather: dict[str, list[float]] = {name: [] for name in built}
        publish: dict[str, list[float]] = {name: [] for name in built}
        publishers = {name: make_weight_sync("shared_memory") for name in built}
        try:
            for version in range(args.repeats + 1):
                for name, engine in built.items():
                    train_step(engine, samples, len(samples))  # a new version: the cached weights are gone
                    t0 = time.perf_counter()
                    weights = engine.state_dict()
                    t1 = time.perf_counter()
                    publishers[name].publish(weights, version)
                    t2 = time.perf_counter()
                    if version:
                        gather[name].append(t1 - t0)
                        publish[name].append(t2 - t1)
        finally:
            for name, engine in built.items():
                getattr(engine, "close", lambda: None)()
                publishers[name].close()
        report("full state dict to the driver (gather), per version:", gather)
        report("publish (shared_memory snapshot), per version:", publish)
        report("gather + publish, per version:", {k: [a + b for a, b in zip(gather[k], publish[k])] for k in gather})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-model", default="preset:small-llama")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="2 repeats, a 4 x 4 batch")
    parser.add_argument("--parts", default="steps,publish", help="which measurements: steps, publish or both")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.groups, args.group_size = 2, 4, 4
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    if "steps" in parts:
        bench_steps(args)
    if "publish" in parts:
        bench_publish(args)


if __name__ == "__main__":
    main()
