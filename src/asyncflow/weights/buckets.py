"""Buckets: how a state dict travels as a few large contiguous buffers plus a `Manifest`.

Owns: `plan_buckets` (same-dtype tensors flattened into buffers of at most `bucket_bytes`; a larger
tensor gets a bucket of its own), `allocate_payload` / `bucket_views` (one aligned byte buffer per
version, viewed as typed buckets), `pack` (copy a state dict in) and `unpack` (views back out), and
`BucketStream`: a version whose tensors are produced one bucket at a time (a multi-rank trainer gathers
them so), which `write_weights` copies in bucket by bucket wherever a state dict could go.

Invariants:
- `unpack(manifest, buckets)` after `pack(sd, manifest, buckets)` gives tensors equal to `sd` (names,
  shapes, dtypes, values), as views of the buckets: no copy on the way out.
- `write_weights` of a `BucketStream` writes the same bytes as `pack` of the state dict it streams, and
  holds no more than the bucket it is copying (plus what the stream's producer holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 64 << 20
ALIGN = 64  # byte alignment of buckets inside a payload, so any dtype view of them is legal

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int  # in elements, inside its bucket

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    byte_offset: int  # inside the flat payload; a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """How a state dict lies in a flat byte payload: buckets, and each tensor's place in them."""

    tensors: tuple[TensorEntry, ...]
    buckets: tuple[Bucket, ...]
    payload_bytes: int


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """Group same-dtype tensors, in state-dict order, into buckets of at most `bucket_bytes`."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket_numels: list[int] = []
    bucket_dtypes: list[torch.dtype] = []
    open_bucket: dict[torch.dtype, int] = {}
    entries = []
    for name, tensor in state_dict.items():
        dtype, numel = tensor.dtype, tensor.numel()
        index = open_bucket.get(dtype)
        if index is None or (
            bucket_numels[index] > 0 and (bucket_numels[index] + numel) * dtype.itemsize > bucket_bytes
        ):
            index = open_bucket[dtype] = len(bucket_numels)
            bucket_numels.append(0)
            bucket_dtypes.append(dtype)
        entries.append(TensorEntry(name, tuple(tensor.shape), dtype, index, bucket_numels[index]))
        bucket_numels[index] += numel
    buckets, offset = [], 0
    for dtype, numel in zip(bucket_dtypes, bucket_numels, strict=True):
        buckets.append(Bucket(dtype, numel, offset))
        offset = align(offset + numel * dtype.itemsize)
    return Manifest(tuple(entries), tuple(buckets), offset)


def allocate_payload(manifest: Manifest, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(manifest.payload_bytes, dtype=torch.uint8, device=device)


def bucket_views(manifest: Manifest, payload: torch.Tensor) -> list[torch.Tensor]:
    """Typed 1-D views of each bucket inside a uint8 `payload` of `manifest.payload_bytes`."""
    return [payload[b.byte_offset : b.byte_offset + b.nbytes].view(b.dtype) for b in manifest.buckets]


def pack(state_dict: Mapping[str, torch.Tensor], manifest: Manifest, buckets: list[torch.Tensor]) -> None:
    """Copy every tensor into its bucket: one concatenation per bucket."""
    members: list[list[torch.Tensor]] = [[] for _ in buckets]
    for entry in manifest.tensors:
        members[entry.bucket].append(state_dict[entry.name].detach().reshape(-1))
    for bucket, sources in zip(buckets, members, strict=True):
        if all(s.device == bucket.device for s in sources):
            torch.cat(sources, out=bucket)
        else:
            bucket.copy_(torch.cat(sources))


def unpack(manifest: Manifest, buckets: list[torch.Tensor]) -> StateDict:
    """The state dict as views into `buckets` (no copy)."""
    return {e.name: buckets[e.bucket][e.offset : e.offset + e.numel].view(e.shape) for e in manifest.tensors}


@dataclass(frozen=True)
class BucketStream:
    """A version's weights as their `manifest` and `buckets()`: an iterator that yields, for each bucket of the
    manifest in order, the tensors of that bucket's entries in manifest order (each may be freed once copied).
    One pass: `buckets()` is called once per use."""

    manifest: Manifest
    buckets: Callable[[], Iterator[Sequence[torch.Tensor]]]


Weights = Mapping[str, torch.Tensor] | BucketStream
"""What a publisher takes: a whole state dict, or one streamed bucket by bucket."""


def manifest_of(weights: Weights, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """The layout `weights` travel in: a stream's own, or `plan_buckets` of a state dict."""
    return weights.manifest if isinstance(weights, BucketStream) else plan_buckets(weights, bucket_bytes)


def write_weights(weights: Weights, manifest: Manifest, buckets: list[torch.Tensor]) -> None:
    """Copy `weights` into `buckets` (typed views laid out by `manifest`): `pack` for a state dict; for a stream,
    each bucket's tensors as they arrive."""
    if not isinstance(weights, BucketStream):
        pack(weights, manifest, buckets)
        return
    if weights.manifest != manifest:
        raise ValueError("a weight stream's manifest differs from the layout it is written into")
    written = 0
    for index, members in enumerate(weights.buckets()):
        sources = [t.detach().reshape(-1) for t in members]
        bucket = buckets[index]
        if sum(s.numel() for s in sources) != bucket.numel():
            raise ValueError(f"bucket {index} of a weight stream has {sum(s.numel() for s in sources)} elements, "
                             f"its manifest {bucket.numel()}")
        if all(s.device == bucket.device and s.dtype == bucket.dtype for s in sources):
            torch.cat(sources, out=bucket)
        else:
            offset = 0
            for s in sources:
                bucket[offset : offset + s.numel()].copy_(s)
                offset += s.numel()
        del sources, members
        written += 1
    if written != len(buckets):
        raise ValueError(f"a weight stream ended after {written} of {len(buckets)} buckets")
