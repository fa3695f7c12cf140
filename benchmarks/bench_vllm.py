"""Benchmark: the vLLM adapter vs vLLM's own offline `LLM.generate` vs the built-in torch engine, and weight
updates into a running vLLM engine. Run with the vLLM environment (`bash scripts/setup_vllm.sh`).

Owns nothing the library imports. In one process:

- throughput: one batch of `--prompts` random prompts of `--prompt-len` tokens, exactly `--new-tokens`
  sampled tokens each (no stop token), T = 1, no top-k/top-p, the sampled token's log-prob requested from
  every engine. The three engines are alive at once (the vLLM ones with the same engine settings) and are
  timed interleaved, `--reps` rounds; reported: the best round of each (the least disturbed) and the ratio
  of the adapter to raw vLLM and to the torch engine.
- weight update: a Llama of `--update-hidden` x `--update-layers` (>= 20M parameters by default), its fresh
  weights pushed `--update-reps` times through `VLLMInferenceEngine.update_weights` by each path into the same
  running engine, interleaved: `file` (safetensors file in /dev/shm + the worker's `reload_weights`) and
  `collective` (buckets broadcast over gloo into `reload_weights`). Reported per path: the whole call, the time
  generation was paused, GB/s, and the ratio to one in-memory copy of the state dict into a preallocated buffer
  (the floor of any path that hands the engine its own copy); the file write alone is timed too.

    flock /tmp/asyncflow-bench.lock env PYTHONPATH=src .venv-vllm/bin/python benchmarks/bench_vllm.py
    ... benchmarks/bench_vllm.py --quick    # small batch, fewer rounds
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from asyncflow.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from asyncflow.engines.torch_inference import TorchInferenceEngine  # noqa: E402
from asyncflow.engines.vllm_engine import VLLMInferenceEngine, distinct_tensors  # noqa: E402
from asyncflow.models.loading import load_model, resolve_model_path  # noqa: E402
from asyncflow.weights.segments import segment_path  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def throughput(args) -> None:
    folder = resolve_model_path(f"preset:{args.model}")
    prompts = random_prompts(args.prompts, args.prompt_len, vocab=98)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    requests = [GenerationRequest(i, p) for i, p in enumerate(prompts)]
    adapter = VLLMInferenceEngine(folder, max_batch_size=args.prompts, seed=0)
    from vllm import LLM

    raw = LLM(
        model=str(folder), dtype="float32", seed=0, max_num_seqs=args.prompts, enable_prefix_caching=True,
        skip_tokenizer_init=True, logprobs_mode="processed_logprobs", enforce_eager=True, disable_log_stats=True,
    )
    raw_params = adapter.vllm_sampling_params(params)
    torch.set_num_threads(args.torch_threads)
    ours = TorchInferenceEngine(load_model(folder).eval(), max_batch_size=args.prompts, seed=0)
    runs = {
        "adapter": lambda: sum(len(c.response_ids) for c in adapter.generate(requests, params)),
        "raw LLM.generate": lambda: sum(
            len(o.outputs[0].token_ids)
            for o in raw.generate([{"prompt_token_ids": p} for p in prompts], raw_params, use_tqdm=False)  # noqa: F821
        ),
        "torch engine": lambda: sum(len(c.response_ids) for c in ours.generate(requests, params)),
    }
    for fn in runs.values():  # warm-up
        fn()
    best: dict[str, float] = {}
    for rep in range(args.reps):
        for name, fn in runs.items():
            seconds, tokens = timed(fn)
            assert tokens == args.prompts * args.new_tokens, (name, tokens)
            best[name] = max(best.get(name, 0.0), tokens / seconds)
            print(f"round {rep}: {name:17s} {tokens / seconds:8.0f} tok/s", flush=True)
    print(f"\n{args.model}, {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new, T=1, "
          f"best of {args.reps} (torch engine on {args.torch_threads} thread(s))")
    print("| engine | tok/s | adapter / this |\n|---|---:|---:|")
    for name, rate in best.items():
        print(f"| {name} | {rate:.0f} | {best['adapter'] / rate:.2f} |")
    adapter.shutdown()
    del raw


def weight_update(args) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tempfile.mkdtemp(prefix="bench-vllm-update-")
    config = LlamaConfig(
        vocab_size=1024, hidden_size=args.update_hidden, intermediate_size=3 * args.update_hidden,
        num_hidden_layers=args.update_layers, num_attention_heads=args.update_hidden // 64,
        num_key_value_heads=args.update_hidden // 64, max_position_embeddings=512, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    engine = VLLMInferenceEngine(folder, max_batch_size=8, seed=0, owned_dir=folder, bucket_bytes=args.bucket_mb << 20)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    from safetensors.torch import save_file

    calls: dict[str, list[float]] = {"file": [], "collective": []}
    pauses: dict[str, list[float]] = {"file": [], "collective": []}
    writes, memcopies = [], []
    version = 0
    for _ in range(args.update_reps):
        for transfer in calls:
            version += 1
            for v in state.values():
                v.add_(1e-3)
            engine.weight_transfer = transfer
            seconds, _ = timed(lambda: engine.update_weights(state, version))
            calls[transfer].append(seconds)
            pauses[transfer].append(engine.last_pause_s)
        path = segment_path("benchwrite")
        seconds, _ = timed(lambda: save_file(distinct_tensors(state), path))
        os.unlink(path)
        writes.append(seconds)
        seconds, _ = timed(lambda: [copies[k].copy_(v) for k, v in state.items()])
        memcopies.append(seconds)
    engine.shutdown()

    def best_median(xs: list[float]) -> tuple[float, float]:
        return min(xs), sorted(xs)[len(xs) // 2]

    copy_s = best_median(memcopies)[0]
    print(f"\nweight update: Llama {params / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB fp32, "
          f"{args.update_reps} updates per path (interleaved), {engine.bucket_bytes >> 20} MB buckets")
    print("| what | best s | median s | GB/s (best) | / one in-memory copy |\n|---|---:|---:|---:|---:|")
    rows = [(f"update_weights, {t}" + (" (write + reload)" if t == "file" else " (pack + broadcast + reload)"),
             calls[t]) for t in calls]
    rows += [(f"of which generation paused, {t}", pauses[t]) for t in calls]
    rows += [("safetensors file to /dev/shm (write alone)", writes)]
    rows += [("one in-memory copy of the state dict", memcopies)]
    for name, xs in rows:
        best, median = best_median(xs)
        print(f"| {name} | {best:.3f} | {median:.3f} | {nbytes / best / 1e9:.2f} | {best / copy_s:.1f}x |")
    speedup = best_median(calls["file"])[0] / best_median(calls["collective"])[0]
    print(f"collective / file speed (best update_weights): {speedup:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--update-hidden", type=int, default=512)
    parser.add_argument("--update-layers", type=int, default=8)
    parser.add_argument("--update-reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size of the collective path (MB)")
    parser.add_argument("--quick", action="store_true", help="16 prompts, 64 new tokens, 2 rounds, 3 updates")
    parser.add_argument("--skip", choices=["throughput", "update"], default=None)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.reps, args.update_reps = 16, 64, 2, 3
    if args.skip != "throughput":
        throughput(args)
    if args.skip != "update":
        weight_update(args)


if __name__ == "__main__":
    main()
