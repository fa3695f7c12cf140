"""Benchmark: the built-in torch inference engine vs transformers `model.generate`, sampling on this machine.

Owns nothing the library imports. Two workloads, each engine timed interleaved with the other in
one process (so machine noise hits both alike), best of `--reps` runs (the least disturbed):

- equal lengths: a batch of B prompts of one length, exactly `--new-tokens` sampled tokens each
  (no stop tokens for either engine), T = 1, no top-k/top-p. Plain throughput, tokens/s.
- long tail: `--tail-requests` prompts of mixed lengths, stop tokens that end a sample with probability of
  roughly 2-3% per token (lengths spread from a few to `--tail-max` tokens). `generate` runs
  static batches of B = 16 (left-padded; a batch lasts as long as its longest sample), the engine
  keeps B slots busy (continuous batching). Useful tokens (up to and including the stop) per second.

    PYTHONPATH=src python benchmarks/bench_generate.py            # full (a few minutes on 2 cores)
    PYTHONPATH=src python benchmarks/bench_generate.py --quick    # < 60 s
    PYTHONPATH=src python benchmarks/bench_generate.py --clock cpu --reps 5   # steadier on a busy machine
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from transformers import GenerationConfig

from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model, resolve_model_path

STOP_TOKENS = (2, 40, 41)  # eos and two characters: a sample ends after ~1/35 of its tokens on these random models


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.choice(lengths) - 1)] for _ in range(n)]


def hf_generate(model, prompts: list[list[int]], batch_size: int, max_new: int, stop: tuple[int, ...]) -> int:
    """Static batches through `model.generate` (left padding); returns the useful tokens generated."""
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=0,
        eos_token_id=list(stop) or None,
    )
    useful = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
        for row in out:
            ends = [i for i, t in enumerate(row) if t in stop]
            useful += ends[0] + 1 if ends else len(row)
    return useful


def ours_generate(engine, prompts: list[list[int]], max_new: int, stop: tuple[int, ...]) -> int:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=stop)
    requests = (GenerationRequest(i, p) for i, p in enumerate(prompts))
    return sum(len(c.response_ids) for c in engine.generate(requests, params))


CLOCK = time.perf_counter


def timed(fn) -> tuple[float, int]:
    t0 = CLOCK()
    tokens = fn()
    return CLOCK() - t0, tokens


def compare(label: str, hf_fn, ours_fn, max_new: int, reps: int) -> None:
    """Time `fn(max_new)` of both engines interleaved; print best-of-`reps` tokens/s (best = least disturbed)."""
    hf_fn(2), ours_fn(2)  # warm-up: thread pool, allocator, first-call dispatch
    hf_runs, ours_runs = [], []
    for _ in range(reps):
        hf_runs.append(timed(lambda: hf_fn(max_new)))
        ours_runs.append(timed(lambda: ours_fn(max_new)))
    (hf_s, hf_tok), (ours_s, ours_tok) = min(hf_runs), min(ours_runs)
    hf_tps, ours_tps = hf_tok / hf_s, ours_tok / ours_s
    print(
        f"{label:<34} {hf_tok:>7} {hf_tps:>9.0f} {ours_tok:>7} {ours_tps:>9.0f} {ours_tps / hf_tps:>6.2f}x", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (< 60 s)")
    parser.add_argument("--presets", default="tiny-llama,small-llama")
    parser.add_argument("--batch-sizes", default="8,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tail-max", type=int, default=256)
    parser.add_argument("--tail-requests", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0 = torch default). 1 keeps numbers stable on a shared machine, where a "
        "preempted OpenMP worker stalls every op; these tiny models gain little from more.",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or this process's CPU time (steadier on a busy shared machine; with --threads 1 it "
        "leaves out the time the process waited for a core)",
    )
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.quick:
        args.new_tokens, args.tail_max, args.tail_requests, args.reps = 48, 128, 32, 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; "
        f"sampling T=1, prompt {args.prompt_len}"
    )
    print(f"{'workload':<34} {'hf tok':>7} {'hf tok/s':>9} {'our tok':>7} {'our tok/s':>9} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as cache_dir:
        for preset in args.presets.split(","):
            model = load_model(resolve_model_path(f"preset:{preset}", cache_dir=cache_dir)).eval()
            model.generation_config.eos_token_id = None  # equal lengths: nothing may stop a sample early
            vocab = model.config.vocab_size
            for batch_size in map(int, args.batch_sizes.split(",")):
                engine = TorchInferenceEngine(model, max_batch_size=batch_size)
                prompts = random_prompts(batch_size, [args.prompt_len], vocab, seed=batch_size)
                compare(
                    f"{preset} B={batch_size} equal {args.new_tokens} new",
                    lambda n: hf_generate(model, prompts, batch_size, n, ()),
                    lambda n: ours_generate(engine, prompts, n, ()),
                    args.new_tokens,
                    args.reps,
                )
            if preset == args.presets.split(",")[0]:
                batch_size = 16
                engine = TorchInferenceEngine(model, max_batch_size=batch_size)
                prompts = random_prompts(args.tail_requests, [8, 16, 32, 64], vocab, seed=1)
                compare(
                    f"{preset} B={batch_size} long tail <={args.tail_max}",
                    lambda n: hf_generate(model, prompts, batch_size, n, STOP_TOKENS),
                    lambda n: ours_generate(engine, prompts, n, STOP_TOKENS),
                    args.tail_max,
                    args.reps,
                )


if __name__ == "__main__":
    main()
