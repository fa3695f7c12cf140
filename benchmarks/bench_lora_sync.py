"""Benchmark: a LoRA weight version as the adapter alone (`train.lora.sync: adapter`) against the merged full weights
(`merged`), per rollout engine: bytes per update and the engine's time to apply it.

Owns nothing the library uses. For each size a random-initialised fp32 Llama (vocab 1024, intermediate 3 x hidden,
untied: the shapes of `bench_vllm.py`'s weight update, 28.3M and 111.2M parameters) and a random rank-`--rank`
adapter on every linear layer but the head (q/k/v/o/gate/up/down, alpha = 2 x rank). Bytes: the tensors one update
carries (fp32). Engine time: `update_weights` with the merged weights on an engine holding full weights, against
`update_weights` with the adapter on an engine under adapter sync, interleaved, `--reps` each (median and best);
"+ first token" adds one greedy 1-token request right after, so vLLM's activation of a new adapter (it copies the
adapter into its LoRA slots at the first batch that uses it) is counted. The vLLM engines use the `file` transfer
(the default). `--engine torch` runs in the main environment (peft), `--engine vllm` in .venv-vllm. `--bytes-of`
only counts the bytes of one update for the published shapes (`asyncflow.models.bpe`, on the meta device).

Run: PYTHONPATH=src python benchmarks/bench_lora_sync.py --engine torch [--sizes 512x8,1024x8] [--rank 16]
     PYTHONPATH=src .venv-vllm/bin/python benchmarks/bench_lora_sync.py --engine vllm [--sizes qwen2.5-0.5b]
     PYTHONPATH=src python benchmarks/bench_lora_sync.py --bytes-of qwen2.5-0.5b,llama-3.2-1b
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

from asyncflow.engines.base import GenerationRequest, LoRASettings, SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(hidden: int, layers: int, folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def adapter_and_merged(model: torch.nn.Module, lora: LoRASettings, seed: int):
    """A random adapter on `TARGETS` (peft's naming) and the merged weights it gives (`W + alpha/r * B @ A`)."""
    g = torch.Generator().manual_seed(seed)
    adapter, merged = {}, {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            a = 0.01 * torch.randn(lora.rank, module.in_features, generator=g)
            b = 0.01 * torch.randn(module.out_features, lora.rank, generator=g)
            adapter |= {f"base_model.model.{name}.lora_A.weight": a, f"base_model.model.{name}.lora_B.weight": b}
            merged[f"{name}.weight"] += lora.alpha / lora.rank * b @ a
    return adapter, merged


def make_engine(kind: str, folder: str, model: torch.nn.Module, adapter: LoRASettings | None):
    if kind == "torch":
        from asyncflow.engines.torch_inference import TorchInferenceEngine
        from asyncflow.models.loading import load_model

        return TorchInferenceEngine(load_model(folder).eval(), max_batch_size=4, adapter=adapter)
    from asyncflow.engines.vllm_engine import VLLMInferenceEngine

    return VLLMInferenceEngine(folder, max_batch_size=4, seed=0, adapter=adapter, adapter_slots=2)


def timed_update(engine, weights, version: int) -> tuple[float, float]:
    """Seconds of `update_weights`, and of it plus one greedy 1-token request."""
    t0 = time.perf_counter()
    engine.update_weights(weights, version)
    t1 = time.perf_counter()
    list(engine.generate([GenerationRequest(0, [1, 5, 7])], SamplingParams(temperature=0.0, max_new_tokens=1)))
    return t1 - t0, time.perf_counter() - t0


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def one_size(args, size: str) -> None:
    """`size`: `HIDDENxLAYERS` (a Llama built here) or the name of a preset (`qwen2.5-0.5b`: its real shape, tied
    embeddings, loaded from the folder `asyncflow.models` builds)."""
    folder = tempfile.mkdtemp(prefix="bench-lora-sync-")
    try:
        if "x" in size:
            hidden, layers = (int(x) for x in size.split("x"))
            model = build_model(hidden, layers, folder)
            shape = f"Llama (hidden {hidden}, {layers} layers)"
        else:
            from asyncflow.models.loading import load_model, resolve_model_path

            shutil.rmtree(folder)
            shutil.copytree(resolve_model_path(f"preset:{size}"), folder)  # the engines load it as a user's folder
            model = load_model(folder, dtype="float32").eval()
            shape = size
        params = sum(p.numel() for p in model.parameters())  # a tied embedding once
        lora = LoRASettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=TARGETS)
        full = make_engine(args.engine, folder, model, None)
        adapted = make_engine(args.engine, folder, model, lora)
        times: dict[str, list[tuple[float, float]]] = {"merged": [], "adapter": []}
        for version in range(1, args.reps + 2):
            adapter, merged = adapter_and_merged(model, lora, version % 2)  # one version held at a time (0.5B: 2 GB)
            merged_s = timed_update(full, merged, version)
            del merged
            adapter_s = timed_update(adapted, adapter, version)
            if version > 1:  # the first update of each engine is a warm-up
                times["merged"].append(merged_s)
                times["adapter"].append(adapter_s)
        for engine in (full, adapted):
            engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # one version's distinct tensors: a tied embedding travels once (`weight_stream(distinct=True)`)
    full_bytes, adapter_bytes = params * model.dtype.itemsize, nbytes(adapter)
    med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in times.items()}
    best = {k: [min(x[i] for x in v) for i in (0, 1)] for k, v in times.items()}
    print(f"\n{args.engine} engine, {shape} {params / 1e6:.1f}M, LoRA r={args.rank} "
          f"on {len(TARGETS)} linear kinds, {args.reps} updates each (interleaved)")
    print("| sync | bytes per update | update_weights s (median / best) | + first token s (median / best) |")
    print("|---|---:|---:|---:|")
    for name, size in (("merged", full_bytes), ("adapter", adapter_bytes)):
        print(f"| {name} | {size / 1e6:.2f} MB | {med[name][0]:.4f} / {best[name][0]:.4f} | "
              f"{med[name][1]:.4f} / {best[name][1]:.4f} |")
    ratio = [med["adapter"][i] / med["merged"][i] for i in (0, 1)]
    print(f"adapter / merged: bytes {adapter_bytes / full_bytes:.4f}, update_weights {ratio[0]:.3f}, "
          f"+ first token {ratio[1]:.3f} (medians)")


def bytes_of(names: list[str], rank: int) -> None:
    """Bytes of one update, merged and adapter (rank `rank` on `TARGETS`), for the published shapes, in their dtype."""
    from transformers import AutoModelForCausalLM

    from asyncflow.models.bpe import bpe_preset_config

    print(f"\n| shape | parameters | merged MB | adapter r={rank} MB | adapter / merged |\n|---|---:|---:|---:|---:|")
    for name in names:
        config = bpe_preset_config(name, 1, 0, 0)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        element = model.dtype.itemsize
        full = sum(p.numel() for p in model.parameters()) * element  # tied embeddings counted once
        adapter = sum(rank * (m.in_features + m.out_features) * element for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS)
        params = full / element / 1e6
        print(f"| {name} | {params:.1f}M | {full / 1e6:.0f} | {adapter / 1e6:.1f} | {adapter / full:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--sizes", default="512x8,1024x8",
                        help="HIDDENxLAYERS or a preset name (qwen2.5-0.5b), comma-separated")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bytes-of", default=None, help="published shapes to count bytes of, comma-separated")
    args = parser.parse_args()
    if args.bytes_of:
        bytes_of(args.bytes_of.split(","), args.rank)
        return
    torch.set_num_threads(args.threads)
    for size in args.sizes.split(","):
        one_size(args, size)


if __name__ == "__main__":
    main()
