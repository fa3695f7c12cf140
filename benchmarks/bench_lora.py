"""Benchmark: LoRA vs full fine-tuning on the built-in training engine, step time and peak memory.

Owns nothing the library uses. A ~31M-parameter Llama (hidden 512, 8 layers, vocab 8000, tied
embeddings, random init) trains with `TorchTrainEngine` on one micro-batch of fixed token ids, once
with every weight trained (AdamW over all parameters) and once with LoRA adapters (`--rank`, on
q/k/v/o or `--targets`). Each configuration runs in a fresh spawned process, alternating, so its peak
memory is its own: on CPU the growth of peak RSS (`ru_maxrss`) over the RSS right after the model is
built (gradients, optimizer state, activations); on CUDA `torch.cuda.max_memory_allocated` over the
model's own allocation. Also timed: `state_dict()` (what each weight sync sends: under LoRA the merge).
Every figure is the median over `--repeats` processes; the ratios come from this one invocation.

Run: PYTHONPATH=src python benchmarks/bench_lora.py [--quick] [--device cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=1536, vocab_size=8000, max_position_embeddings=512, tie_word_embeddings=True)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _run_one(kind: str, args, results) -> None:
    """Child process: build the model, train `args.steps` timed steps (after one warm-up), report figures."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from asyncflow.engines.torch_train import TorchTrainEngine
    from asyncflow.models.logprobs import TrainSample

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), dtype=torch.float32).to(args.device)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base_mem = _rss_mib()
    lora = None
    if kind == "lora":
        from asyncflow.engines.peft_lora import LoRASettings

        lora = LoRASettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=tuple(args.targets.split(",")))
    engine = TorchTrainEngine(model, lr=1e-4, packing="off", lora=lora)
    generator = torch.Generator().manual_seed(1)
    samples = [
        TrainSample(torch.randint(3, 8000, (args.prompt,), generator=generator).tolist(),
                    torch.randint(3, 8000, (args.response,), generator=generator).tolist(), i)
        for i in range(args.batch)
    ]  # fmt: skip

    def loss_fn(out):
        return -(out.policy.logprobs * out.policy.mask).sum() / out.policy.mask.sum(), {}

    def step() -> None:
        engine.backward_micro_batch(samples, loss_fn)
        engine.optimizer_step()
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: allocates the optimizer state
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.state_dict()
    if cuda:
        torch.cuda.synchronize()
    sync_s = time.perf_counter() - t0
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_mem
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.model.parameters())
    results.put({"kind": kind, "step_s": statistics.median(times), "peak_mib": peak, "sync_s": sync_s,
                 "trainable": trainable, "total": total})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (one micro-batch)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration (alternating)")
    parser.add_argument("--quick", action="store_true", help="--steps 3 --repeats 2")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 2
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    for _ in range(args.repeats):
        for kind in runs:
            results = ctx.Queue()
            proc = ctx.Process(target=_run_one, args=(kind, args, results))
            proc.start()
            runs[kind].append(results.get(timeout=1800))
            proc.join(timeout=60)
    rows = {}
    for kind, found in runs.items():
        rows[kind] = {key: statistics.median(r[key] for r in found) for key in ("step_s", "peak_mib", "sync_s")}
        rows[kind] |= {"trainable": found[0]["trainable"], "total": found[0]["total"]}
    memory = "peak CUDA MiB over the model" if args.device.startswith("cuda") else "peak RSS MiB over the model"
    print(f"device {args.device}, threads {args.threads}, {rows['full']['total'] / 1e6:.1f}M parameters, "
          f"batch {args.batch} x ({args.prompt} + {args.response}) tokens, rank {args.rank} on {args.targets}, "
          f"median of {args.repeats} processes x {args.steps} steps")
    print(f"| | trainable parameters | step s | {memory} | state_dict (weight sync) ms |")
    print("|---|---:|---:|---:|---:|")
    for kind, row in rows.items():
        print(f"| {kind} | {row['trainable'] / 1e6:.2f}M | {row['step_s']:.3f} | {row['peak_mib']:.0f} | "
              f"{row['sync_s'] * 1e3:.1f} |")
    full, lora = rows["full"], rows["lora"]
    print(f"LoRA / full: step time {lora['step_s'] / full['step_s']:.2f}x, "
          f"peak memory {lora['peak_mib'] / full['peak_mib']:.2f}x, "
          f"trainable parameters {lora['trainable'] / full['trainable']:.4f}x")


if __name__ == "__main__":
    main()
