"""Benchmark: full vs lossless delta weight updates (`weights.delta`), side by side on the same model in one run.

Owns nothing the library uses. A random-initialised Llama (`--presets`: 30m, 120m) trains with AdamW at each
`--lrs` on a language-model loss over random tokens (real gradients, a real optimizer: how far each step moves the
weights is what decides a delta's size). After every step each mode publishes the new version through the
transport, a receiver in this process takes it and loads it into its own built-in engine (bf16 by default), and
the engines are checked bit for bit against each other. Per mode it reports the median over the steps of: bytes
that reached the receiver, `publish` (what the trainer waits for), `transfer` (the receiver taking the version:
its copy out of the transport, and for a delta rebuilding it on its base), `apply` (`update_weights`; a
`torch_distributed` version is received bucket by bucket here, as a run's rollout loop receives it) and `total`
(from `publish` until the publisher has sent the version whole). `torch_distributed` runs its receiver (rank 1) in
this process, over gloo on the loopback: its bytes cross a TCP socket.

Modes are entries of `MODES`: a name, how to build its publisher and how its engine takes a received version. A
third kind of update (adapter-only LoRA) is one more entry.

`--encodings` also measures two lossless encodings on the same versions: what `asyncflow.weights.delta` sends
(values with, per bucket, positions or a bitmask) and XOR of the bit patterns, zlib-compressed (level 1): bytes and
seconds to encode.

Run: PYTHONPATH=src python benchmarks/bench_weight_updates.py [--presets 30m,120m] [--lrs 1e-6,1e-5]
     [--steps 4] [--transport shared_memory] [--engine-dtype bfloat16] [--encodings]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

from asyncflow.engines.torch_inference import TorchInferenceEngine  # noqa: E402
from asyncflow.weights import make_weight_sync  # noqa: E402
from asyncflow.weights.buckets import Weights, materialize  # noqa: E402
from asyncflow.weights.delta import encode_delta, engine_weights  # noqa: E402

# name -> (hidden, layers, heads, kv heads, intermediate, vocab); tied embeddings
SHAPES = {
    "30m": (512, 6, 8, 4, 1536, 32000),
    "120m": (768, 14, 12, 4, 2048, 32000),
}
TIMEOUT_S = 120.0
TIMED = ("bytes", "publish", "transfer", "apply", "total")  # medians over the steps
TRANSPORTS = ["inprocess", "shared_memory", "ray", "torch_distributed"]


def build_model(preset: str, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[preset]
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=512, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 64))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class Mode:
    """One kind of update: `publisher(transport, dtype)` builds its weight channel; `apply(engine, version,
    weights)` loads a received version into the engine."""

    name: str
    publisher: Callable[[str, torch.dtype], object]
    apply: Callable[[TorchInferenceEngine, int, dict], None]


def _load(engine: TorchInferenceEngine, version: int, weights: Weights) -> None:
    engine.update_weights(materialize(weights), version)  # as the rollout loop does: a stream is received here


MODES = [
    # as a run builds it: `ray` stages and sends the engine's dtype, the local transports the trainer's own
    Mode("full", lambda transport, dtype: make_weight_sync(transport, dtype=dtype, **_options(transport)), _load),
    Mode("delta", lambda transport, dtype: make_weight_sync(transport, delta=True, dtype=dtype,
                                                            **_options(transport)), _load),
]


def _options(transport: str) -> dict:
    if transport == "torch_distributed":  # one receiver (rank 1) in this process, over gloo on the loopback
        return {"timeout_s": TIMEOUT_S, "num_receivers": 1}
    return {"timeout_s": TIMEOUT_S} if transport == "ray" else {}


def _open_receiver(publisher):
    spec = publisher.receiver_spec
    return spec.for_rank(1).open() if hasattr(spec, "for_rank") else spec.open()


def encodings(base, new) -> dict[str, float]:
    """Bytes and encode seconds of the delta as sent ("sparse": values with positions or a bitmask) and of
    zlib(XOR) for one version."""
    t0 = time.perf_counter()
    sparse = encode_delta(base, new, max_bytes=1 << 62)
    t1 = time.perf_counter()
    xor_bytes = 0
    for old, fresh in zip(base.buckets, new.buckets, strict=True):
        bits = {2: torch.int16, 4: torch.int32}[fresh.element_size()]
        xor = torch.bitwise_xor(old.view(bits), fresh.view(bits))
        xor_bytes += len(zlib.compress(xor.numpy().tobytes(), 1))
    t2 = time.perf_counter()
    return {"sparse_bytes": float(sparse.numel()), "sparse_s": t1 - t0, "xor_bytes": float(xor_bytes),
            "xor_s": t2 - t1, "full_bytes": float(new.nbytes)}


def bench(preset: str, lr: float, args) -> list[dict]:
    dtype = getattr(torch, args.engine_dtype)
    model = build_model(preset)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engines, publishers, receivers = {}, {}, {}
    for mode in MODES:
        engines[mode.name] = TorchInferenceEngine(build_model(preset).to(dtype).eval().requires_grad_(False))
        publishers[mode.name] = mode.publisher(args.transport, dtype)
        receivers[mode.name] = _open_receiver(publishers[mode.name])
    samples: dict[str, list[dict]] = {mode.name: [] for mode in MODES}
    previous = None
    encoded: list[dict] = []
    try:
        for version in range(args.steps + 1):  # version 0: the initial weights, a full update for every mode
            if version:
                train_step(model, optimizer, vocab)
            weights = {k: v.detach() for k, v in model.state_dict().items()}
            if args.encodings:
                packed = engine_weights(weights, version, dtype)
                if previous is not None:
                    encoded.append(encodings(previous, packed))
                previous = packed
            for mode in MODES:
                publisher, receiver, engine = publishers[mode.name], receivers[mode.name], engines[mode.name]
                t0 = time.perf_counter()
                publisher.publish(weights, version)
                t1 = time.perf_counter()
                got = receiver.wait_for(version, TIMEOUT_S)
                t2 = time.perf_counter()
                mode.apply(engine, got[0], got[1])
                t3 = time.perf_counter()
                del got  # a consumer lets the version go once loaded (the rollout loop does)
                publisher.wait_published(TIMEOUT_S)  # a collective send ends once the receiver has taken it all
                t4 = time.perf_counter()
                if version:
                    samples[mode.name].append({"bytes": receiver.received_bytes, "kind": receiver.received_kind,
                                               "publish": t1 - t0, "transfer": t2 - t1, "apply": t3 - t2,
                                               "total": t4 - t0})
            reference = engines[MODES[0].name].model.state_dict()
            for mode in MODES[1:]:
                state = engines[mode.name].model.state_dict()
                if not all(torch.equal(reference[k], state[k]) for k in reference):
                    raise AssertionError(f"{mode.name} engine differs from {MODES[0].name} at version {version}")
    finally:
        for name in publishers:
            receivers[name].close()
            publishers[name].close()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for mode in MODES:
        s = samples[mode.name]
        deltas = sum(x["kind"] == "delta" for x in s)
        # a mode whose versions came both ways gets a row per way as well: medians of a mix describe neither
        splits = [(mode.name, s)] + ([(f"{mode.name} ({kind}s)", [x for x in s if x["kind"] == kind])
                                      for kind in ("delta", "full")] if 0 < deltas < len(s) else [])
        for name, part in splits:
            rows.append({
                "preset": preset, "params": params, "lr": lr, "mode": name,
                "deltas": sum(x["kind"] == "delta" for x in part), "steps": len(part),
                **{key: statistics.median(x[key] for x in part) for key in TIMED},
            })
    if encoded:
        rows.append({"preset": preset, "params": params, "lr": lr, "mode": "encodings",
                     **{k: statistics.median(e[k] for e in encoded) for k in encoded[0]}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="30m,120m")
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--transport", default="shared_memory", choices=TRANSPORTS)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--encodings", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.transport == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    print(f"transport {args.transport}, engine {args.engine_dtype}, {args.steps} AdamW steps per row, "
          f"torch threads {torch.get_num_threads()}")
    print("| model | lr | mode | deltas | MB per update | vs full | publish s | transfer s | apply s | total s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    extra = []
    for preset in args.presets.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            rows = bench(preset, lr, args)
            full = next(r for r in rows if r["mode"] == "full")
            for r in rows:
                if r["mode"] == "encodings":
                    extra.append(r)
                    continue
                print(f"| {preset} ({r['params'] / 1e6:.0f}M) | {lr:g} | {r['mode']} | {r['deltas']}/{r['steps']} | "
                      f"{r['bytes'] / 2**20:.1f} | {r['bytes'] / full['bytes']:.3f} | {r['publish']:.3f} | "
                      f"{r['transfer']:.3f} | {r['apply']:.3f} | {r['total']:.3f} |", flush=True)
    if extra:
        print("\n| model | lr | engine-dtype MB | delta MB | delta encode s | zlib(XOR) MB | zlib(XOR) encode s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for e in extra:
            print(f"| {e['preset']} | {e['lr']:g} | {e['full_bytes'] / 2**20:.1f} | {e['sparse_bytes'] / 2**20:.2f} | "
                  f"{e['sparse_s']:.3f} | {e['xor_bytes'] / 2**20:.2f} | {e['xor_s']:.3f} |")


if __name__ == "__main__":
    main()
