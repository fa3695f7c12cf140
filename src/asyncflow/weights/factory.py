"""`make_weight_sync`: a publisher of the named transport (each imported only when asked for, so
`ray` is imported only by a run that uses the `ray` transport)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from asyncflow.weights.base import WeightPublisher
from asyncflow.weights.buckets import DEFAULT_BUCKET_BYTES

TransportKind = Literal["inprocess", "shared_memory", "ray", "torch_distributed"]


def make_weight_sync(
    kind: TransportKind, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, delta: bool = False,
    delta_max_fraction: float = 0.5, dtype: torch.dtype | None = None, **options: Any
) -> WeightPublisher:
    """A publisher of the given transport; receivers: `publisher.receiver_spec.open()` (for
    `torch_distributed`, `receiver_spec.for_rank(r).open()` with r in 1..num_receivers).

    `dtype`: the receiving engine's; the remote transports (`ray`, `torch_distributed`) stage and send floating
    tensors wider than it in it (a bf16 engine receives bf16), the local ones send the trainer's own.

    `delta`: lossless delta updates (`asyncflow.weights.delta`), versions cast to `dtype` (the engine's) first:
    a `DeltaPublisher` over two publishers of `kind` (a full channel and a delta channel), or for `torch_distributed`,
    whose every publish is a broadcast every receiver takes, over one (each version once, as a delta or in full);
    a delta larger than `delta_max_fraction` of the full bytes goes in full.

    options: inprocess: `device`; shared_memory: `path`; ray: `store_name`, `namespace`, `timeout_s`;
    torch_distributed: `num_receivers` (required), `host`, `port`, `backend`, `device`, `timeout_s`.
    """
    if delta:
        from asyncflow.weights.delta import DeltaPublisher

        if kind == "torch_distributed":  # one channel: every receiver takes every send
            collective = make_weight_sync(kind, bucket_bytes=bucket_bytes, dtype=dtype, **options)
            return DeltaPublisher(collective, None, dtype=dtype, bucket_bytes=bucket_bytes,
                                  max_fraction=delta_max_fraction, timeout_s=options.get("timeout_s", 60.0))
        channels = []
        for channel in ("full", "delta"):
            named = dict(options)
            for key in ("path", "store_name"):  # two channels, two names
                if named.get(key) is not None and channel == "delta":
                    named[key] = f"{named[key]}-delta"
            channels.append(make_weight_sync(kind, bucket_bytes=bucket_bytes, **named))
        return DeltaPublisher(channels[0], channels[1], dtype=dtype, bucket_bytes=bucket_bytes,
                              max_fraction=delta_max_fraction, fixed_capacity=kind == "shared_memory",
                              timeout_s=options.get("timeout_s", 60.0))
    if kind == "inprocess":
        from asyncflow.weights.inprocess import InProcessPublisher

        return InProcessPublisher(bucket_bytes, **options)
    if kind == "shared_memory":
        from asyncflow.weights.shared_memory import SharedMemoryPublisher

        return SharedMemoryPublisher(bucket_bytes, **options)
    if kind == "ray":
        from asyncflow.weights.ray_transport import RayWeightPublisher

        return RayWeightPublisher(bucket_bytes, dtype=dtype, **options)
    if kind == "torch_distributed":
        from asyncflow.weights.torch_distributed import TorchDistributedPublisher

        return TorchDistributedPublisher(bucket_bytes=bucket_bytes, dtype=dtype, **options)
    raise ValueError(f"unknown weight-sync transport {kind!r}: inprocess, shared_memory, ray or torch_distributed")
