"""Benchmark: publish a ~20M-parameter fp32 state dict and receive it in another process, per transport.

Owns nothing the library uses. For each transport it reports: the trainer-blocking time of
`publish` (the snapshot copy), the time until a receiver in another process (a spawn child, a Ray
actor, a gloo rank) holds the complete state dict, the number of buckets and the number of calls
the publisher makes per version. The first version is a warm-up and is not timed.

Run: PYTHONPATH=src python benchmarks/bench_weight_sync.py [--quick] [--transports shared_memory,ray]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

from asyncflow.weights import DEFAULT_BUCKET_BYTES, make_weight_sync, plan_buckets  # noqa: E402

TIMEOUT_S = 120.0


def model_state_dict(version: int) -> dict[str, torch.Tensor]:
    """A transformer-shaped fp32 state dict of ~20M parameters, filled with `version`."""
    d, vocab, layers = 384, 8000, 8
    shapes = {"embed.weight": (vocab, d)}
    for i in range(layers):
        shapes |= {
            f"layers.{i}.attn.qkv.weight": (3 * d, d),
            f"layers.{i}.attn.o.weight": (d, d),
            f"layers.{i}.mlp.up.weight": (4 * d, d),
            f"layers.{i}.mlp.down.weight": (d, 4 * d),
            f"layers.{i}.norm1.weight": (d,),
            f"layers.{i}.norm2.weight": (d,),
        }
    shapes["lm_head.weight"] = (vocab, d)
    return {name: torch.full(shape, float(version)) for name, shape in shapes.items()}


def _receive_loop(spec, rank, versions, results):
    """Child process: receive each version, report (version, wall time of receipt)."""
    receiver = spec.for_rank(rank).open() if rank else spec.open()
    for version in versions:
        got, state = receiver.wait_for(version, TIMEOUT_S)
        results.put((got, time.time(), float(state["lm_head.weight"][0, 0])))
    receiver.close()


def _calls_per_version(kind: str, buckets: int) -> str:
    return {
        "inprocess": "0 (reference swap)",
        "shared_memory": "0 (memcpy into idle slot)",
        "ray": f"{buckets} ray.put + 1 actor call",
        "torch_distributed": f"{buckets} broadcasts + 1 store set",
    }[kind]


def bench(kind: str, reps: int) -> dict:
    versions = list(range(1, reps + 2))
    states = {v: model_state_dict(v) for v in (1, 2)}  # alternate two prebuilt dicts: no allocation in the timing
    ctx = mp.get_context("spawn")
    results = ctx.Queue() if kind in ("shared_memory", "torch_distributed") else None
    options = {"num_receivers": 1, "timeout_s": TIMEOUT_S} if kind == "torch_distributed" else {}
    if kind == "ray":
        options = {"timeout_s": TIMEOUT_S}
    publisher = make_weight_sync(kind, **options)
    receiver = child = actor = None
    if kind == "inprocess":
        receiver = publisher.receiver_spec.open()
    elif kind == "ray":
        import ray

        actor = ray.remote(num_cpus=0)(_RayReceiver).remote(publisher.receiver_spec)
    else:
        rank = 1 if kind == "torch_distributed" else 0
        child = ctx.Process(target=_receive_loop, args=(publisher.receiver_spec, rank, versions, results))
        child.start()
    publish_s, visible_s = [], []
    try:
        for version in versions:
            state = states[1 + version % 2]
            start = time.time()
            publisher.publish(state, version)
            published = time.time()
            if receiver is not None:
                got, received = receiver.wait_for(version, TIMEOUT_S)
                received_at, value = time.time(), float(received["lm_head.weight"][0, 0])
            elif actor is not None:
                import ray

                got, received_at, value = ray.get(actor.wait_for.remote(version), timeout=TIMEOUT_S)
            else:
                got, received_at, value = results.get(timeout=TIMEOUT_S)
            assert got == version and value == 1 + version % 2, (kind, got, version, value)
            if version > 1:
                publish_s.append(published - start)
                visible_s.append(received_at - start)
        publisher.wait_published(TIMEOUT_S)
    finally:
        publisher.close()
        if child is not None:
            child.join(30)
        if actor is not None:
            import ray

            ray.kill(actor)
    buckets = len(plan_buckets(states[1], DEFAULT_BUCKET_BYTES).buckets)
    return {
        "kind": kind,
        "publish_ms": 1e3 * statistics.median(publish_s),
        "visible_ms": 1e3 * statistics.median(visible_s),
        "buckets": buckets,
        "calls": _calls_per_version(kind, buckets),
    }


class _RayReceiver:
    def __init__(self, spec):
        self.receiver = spec.open()

    def wait_for(self, version):
        got, state = self.receiver.wait_for(version, TIMEOUT_S)
        return got, time.time(), float(state["lm_head.weight"][0, 0])


def memcpy_baseline_ms(state: dict[str, torch.Tensor], reps: int) -> float:
    """This machine's floor for any transport: one copy of every tensor into a flat buffer."""
    flat = torch.empty(sum(t.numel() for t in state.values()))
    times = []
    for _ in range(reps + 1):
        start = time.time()
        torch.cat([t.reshape(-1) for t in state.values()], out=flat)
        times.append(time.time() - start)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed versions per transport (< 60 s)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--transports", default="inprocess,shared_memory,torch_distributed,ray")
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    kinds = args.transports.split(",")
    state = model_state_dict(0)
    params = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(
        f"state dict: {params / 1e6:.1f}M fp32 params, {len(state)} tensors, {nbytes / 2**20:.0f} MiB; "
        f"bucket_bytes={DEFAULT_BUCKET_BYTES >> 20} MiB; median of {reps} versions; "
        f"torch threads={torch.get_num_threads()}"
    )
    if "ray" in kinds:
        import ray

        ray.init(
            include_dashboard=False, num_cpus=2, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": SRC}}
        )
    try:
        rows = [bench(kind, reps) for kind in kinds]
    finally:
        if "ray" in kinds:
            ray.shutdown()
    print(f"{'transport':<18} {'publish ms':>10} {'visible ms':>10} {'GB/s':>6} {'buckets':>7}  calls per version")
    copy_ms = memcpy_baseline_ms(state, reps)
    print(
        f"{'(one memcpy)':<18} {copy_ms:>10.1f} {copy_ms:>10.1f} {nbytes / (copy_ms / 1e3) / 1e9:>6.2f} {'-':>7}  "
        "reference: copying the state dict once into a preallocated buffer"
    )
    for row in rows:
        gbps = nbytes / (row["visible_ms"] / 1e3) / 1e9
        timings = f"{row['publish_ms']:>10.1f} {row['visible_ms']:>10.1f} {gbps:>6.2f}"
        print(f"{row['kind']:<18} {timings} {row['buckets']:>7}  {row['calls']}")


if __name__ == "__main__":
    main()
