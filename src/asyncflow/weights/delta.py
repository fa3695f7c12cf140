"""Lossless delta weight updates (`weights.delta: true`): a replica holding version `b` receives only the
elements whose bits changed, in the engine's dtype, between `b` and the new version.

Owns: `engine_weights` (the trainer's weights cast to the engine's dtype, packed: what a full update loads,
and the base a delta is taken against), `encode_delta` / `apply_delta` (the encoding), and `DeltaPublisher` /
`DeltaReceiver`, which carry full versions and deltas over two channels of one transport.

Encoding: sparse indices + values, one blob per version. For each bucket of the version's `Manifest` the
int32 positions (int64 for a bucket of 2**31 elements or more) of the elements whose bit pattern differs from
the base, then their new values, in the bucket's dtype. Measured against XOR encoding (the new bits XOR the base
bits, zlib-compressed) on the weights of real training steps (`benchmarks/bench_weight_updates.py
--encodings`, table in BENCHMARKS.md): sparse moves fewer or comparable bytes at the 1-3% changed fraction of
an RL step and encodes and applies an order of magnitude faster (a compare, a `nonzero` and an indexed copy
instead of a compressor over every byte), so sparse is kept.

Blob layout (uint8, every section 64-byte aligned): an int64 header `[MAGIC, base version, version, buckets,
count_0 .. count_{B-1}]`, then per bucket its indices and its values.

Two channels: `DeltaPublisher` publishes each version's delta against the version before (when it is at most
`max_fraction` of the full bytes) on one publisher, then the full version on another. A `DeltaReceiver` takes
the delta only when its base is the version it holds, and the full version otherwise (its first version, one
after a skipped delta, after a restart or a resume: a new publisher starts with a full version). Bytes reach a
replica only when it reads them, so a full version costs the replica nothing while deltas apply.

Invariants:
- A delta is applied only to the version it was taken against: `apply_delta` checks the base version and the
  layout and raises `WeightSyncError` naming both otherwise; the receiver never calls it on another base.
- Applying a delta gives, bit for bit, the full version it was taken from (indices and values are exact copies
  of the engine-dtype tensors, compared by bit pattern so -0.0 / +0.0 and NaN payloads travel too).
- A received version is a fresh payload: the base is cloned, then patched, so tensors handed out earlier are
  never written (the package invariant on received tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncflow.weights.base import PollingReceiver, Received, WeightPublisher, WeightSyncError
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketStream,
    Manifest,
    StateDict,
    Weights,
    align,
    allocate_payload,
    bucket_views,
    manifest_of,
    plan_buckets,
    unpack,
    write_weights,
)

DELTA_KEY = "__delta__"
MAGIC = 0x41464C57_44454C54
_HEADER = 4  # int64 words before the per-bucket counts
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Packed:
    """One version in the engine's dtype: its layout and a fresh payload viewed as buckets."""

    version: int
    manifest: Manifest
    buckets: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.manifest.payload_bytes


def engine_weights(weights: Weights, version: int, dtype: torch.dtype | None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Packed:
    """`weights` with every floating tensor cast to `dtype` (None: as they are), packed into a fresh payload.
    The cast is the one a full update's `copy_` into the engine does (round to nearest even), so the result is
    bit for bit what the engine holds after loading `weights`."""
    if isinstance(weights, BucketStream):  # a multi-rank trainer's stream: taken in full first
        payload = allocate_payload(weights.manifest)
        weights = unpack(weights.manifest, bucket_views(weights.manifest, payload))
    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # planned on meta tensors, then each tensor cast straight into its place: one pass over the weights
    manifest = plan_buckets({name: torch.empty(t.shape, dtype=target(t), device="meta")
                             for name, t in weights.items()}, bucket_bytes)
    buckets = bucket_views(manifest, allocate_payload(manifest))
    for entry in manifest.tensors:
        place = buckets[entry.bucket][entry.offset : entry.offset + entry.numel]
        place.view(entry.shape).copy_(weights[entry.name].detach())
    return Packed(version, manifest, buckets)


def _bits(bucket: torch.Tensor) -> torch.Tensor:
    return bucket.view(_BITS[bucket.element_size()])


def encode_delta(base: Packed, new: Packed, max_bytes: int) -> torch.Tensor | None:
    """The blob taking `base` to `new` (same manifest), or None where it would exceed `max_bytes` or the layouts
    differ. Shapes: each bucket [n_i] -> indices [k_i] int32/int64 and values [k_i] of the bucket's dtype."""
    if base.manifest != new.manifest:
        return None
    sections: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = align(8 * (_HEADER + len(new.buckets)))
    for old, fresh in zip(base.buckets, new.buckets, strict=True):
        # numpy's flatnonzero: about twice as fast as torch's nonzero on a CPU
        index = torch.from_numpy(np.flatnonzero(_bits(old).numpy() != _bits(fresh).numpy()))
        if fresh.numel() < 2**31:
            index = index.to(torch.int32)
        values = fresh[index]
        total += align(index.nbytes) + align(values.nbytes)
        if total > max_bytes:
            return None
        sections.append((index, values))
    blob = torch.zeros(total, dtype=torch.uint8)
    header = blob[: 8 * (_HEADER + len(sections))].view(torch.int64)
    header[:_HEADER] = torch.tensor([MAGIC, base.version, new.version, len(sections)])
    header[_HEADER:] = torch.tensor([len(index) for index, _ in sections], dtype=torch.int64)
    offset = align(header.nbytes)
    for index, values in sections:
        for part in (index, values):
            blob[offset : offset + part.nbytes].copy_(part.view(torch.uint8))
            offset += align(part.nbytes)
    return blob


def delta_versions(blob: torch.Tensor) -> tuple[int, int]:
    """(base version, version) of a delta blob."""
    header = blob[: 8 * _HEADER].view(torch.int64).tolist()
    if header[0] != MAGIC:
        raise WeightSyncError("delta: the blob is not a weight delta (bad magic)")
    return header[1], header[2]


def apply_delta(blob: torch.Tensor, base: Packed) -> Packed:
    """A fresh `Packed` of the version `blob` encodes, from `base` (left unchanged). `WeightSyncError` when
    `base` is not the version (or layout) the delta was taken against."""
    base_version, version = delta_versions(blob)
    buckets = int(blob[8 * 3 : 8 * 4].view(torch.int64).item())
    if base_version != base.version or buckets != len(base.buckets):
        raise WeightSyncError(
            f"delta: version {version} was taken against version {base_version} ({buckets} buckets), but this "
            f"replica holds version {base.version} ({len(base.buckets)} buckets): it needs a full update"
        )
    counts = blob[8 * _HEADER : 8 * (_HEADER + buckets)].view(torch.int64).tolist()
    payload = allocate_payload(base.manifest)
    out = bucket_views(base.manifest, payload)
    offset = align(8 * (_HEADER + buckets))
    for old, fresh, count in zip(base.buckets, out, counts, strict=True):
        index_dtype = torch.int32 if old.numel() < 2**31 else torch.int64
        index = blob[offset : offset + count * index_dtype.itemsize].view(index_dtype)
        offset += align(index.nbytes)
        values = blob[offset : offset + count * old.element_size()].view(old.dtype)
        offset += align(values.nbytes)
        fresh.copy_(old)
        fresh[index.long()] = values
    return Packed(version, base.manifest, out)


# ------------------------------------------------------------------------- the two channels
@dataclass(frozen=True)
class DeltaSpec:
    full: Any  # the full channel's ReceiverSpec
    delta: Any  # the delta channel's ReceiverSpec
    bucket_bytes: int  # the publisher's: a receiver lays a full version out as the publisher does

    def open(self) -> DeltaReceiver:
        return DeltaReceiver(self.full.open(), self.delta.open(), self.bucket_bytes)


class DeltaPublisher:
    """Publishes each version on `full` and, when small enough, its delta against the previous one on `delta`
    (first: a receiver that sees the full version of v has the delta of v already, or never will).
    `fixed_capacity`: the delta channel keeps one layout (`shared_memory`): every blob is padded to
    `max_fraction` of the full bytes, and published with `used_bytes`, so receivers copy only the blob."""

    def __init__(self, full: WeightPublisher, delta: Any, *, dtype: torch.dtype | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_fraction: float = 0.5, fixed_capacity: bool = False):
        if not 0 < max_fraction <= 1:
            raise ValueError(f"delta: max_fraction must be in (0, 1], got {max_fraction}")
        self.full, self.delta = full, delta
        self.transport = full.transport
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.max_fraction, self.fixed_capacity = max_fraction, fixed_capacity
        self.receiver_spec = DeltaSpec(full.receiver_spec, delta.receiver_spec, bucket_bytes)
        self._base: Packed | None = None
        self.last_kind = "full"  # of the last publish: "full" or "delta"
        self.last_delta_bytes = 0

    def publish(self, state_dict: Weights, version: int) -> None:
        new = engine_weights(state_dict, version, self.dtype, self.bucket_bytes)
        capacity = align(int(self.max_fraction * new.nbytes))
        blob = None if self._base is None else encode_delta(self._base, new, capacity)
        if blob is not None:
            if self.fixed_capacity:  # one layout: padded, and only the blob's own bytes are read
                used = blob.numel()
                self.delta.publish({DELTA_KEY: torch.cat([blob, blob.new_zeros(capacity - used)])}, version,
                                   used_bytes=used)
            else:
                self.delta.publish({DELTA_KEY: blob}, version)
        self.last_kind, self.last_delta_bytes = ("delta", blob.numel()) if blob is not None else ("full", 0)
        self.full.publish(unpack(new.manifest, new.buckets), version)
        self._base = new

    def wait_published(self, timeout: float) -> None:
        self.delta.wait_published(timeout)
        self.full.wait_published(timeout)

    def close(self) -> None:
        try:
            self.delta.close()
        finally:
            self.full.close()


class DeltaReceiver(PollingReceiver):
    """Follows the delta channel on a thread (every `FOLLOW_S`), applying each delta whose base is the version it
    holds, so a replica that takes versions only now and then (between partitions) still has the base of the
    next delta; `poll` returns the newest version held, or takes the full one when the deltas do not reach it.
    `received_bytes` counts every byte taken since the previous version `poll` returned; `received_kind` is
    "delta" when no full version was among them."""

    collective = False
    FOLLOW_S = 0.05

    def __init__(self, full: Any, delta: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.full, self.delta, self.bucket_bytes = full, delta, bucket_bytes
        self.transport = full.transport
        self._held: Packed | None = None
        self._taken_bytes, self._took_full = 0, False  # since the last version `poll` returned
        self._lock = threading.Lock()  # the follower, the rollout thread and an in-flight watcher
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="weights-delta-follower", daemon=True)
        self._follower.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.FOLLOW_S):
            try:
                with self._lock:
                    self._take_delta()
            except BaseException as err:  # noqa: BLE001 - raised by the next poll
                self._error = err
                return

    def _take_delta(self) -> None:
        held = self._held
        if held is None:
            return
        delta = self.delta.poll(held.version)
        if delta is not None and delta_versions(delta[1][DELTA_KEY])[0] == held.version:
            self._held = apply_delta(delta[1][DELTA_KEY], held)
            self._taken_bytes += self.delta.received_bytes

    def poll(self, have_version: int) -> Received | None:
        with self._lock:
            if self._error is not None:
                raise WeightSyncError(f"delta: following the delta channel failed: {self._error!r}") from self._error
            self._take_delta()
            held = self._held
            # with no base yet, take the version there even if the engine has it (it started from those weights)
            newest = self.full.poll(-1 if held is None else max(have_version, held.version))
            if newest is not None:
                held = self._held = self._pack(newest)
                self._taken_bytes += self.full.received_bytes
                self._took_full = True
            if held is None or held.version <= have_version:
                return None
            self.received_bytes, self.received_kind = self._taken_bytes, "full" if self._took_full else "delta"
            self._taken_bytes, self._took_full = 0, False
            return held.version, unpack(held.manifest, held.buckets)

    def _pack(self, received: Received) -> Packed:
        version, state_dict = received
        manifest = manifest_of(state_dict, self.bucket_bytes)
        buckets = bucket_views(manifest, allocate_payload(manifest))
        write_weights(state_dict, manifest, buckets)
        return Packed(version, manifest, buckets)

    def close(self) -> None:
        self._stop.set()
        self._follower.join(10 * self.FOLLOW_S)
        with self._lock:
            try:
                self.delta.close()
            finally:
                self.full.close()


def state_dict_bytes(state_dict: Mapping[str, torch.Tensor] | StateDict) -> int:
    """Bytes of a state dict's tensors."""
    return sum(t.numel() * t.element_size() for t in state_dict.values())
