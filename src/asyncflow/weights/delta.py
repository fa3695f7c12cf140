"""Lossless delta weight updates (`weights.delta: true`): a replica holding version `b` receives only the
elements whose bits changed, in the engine's dtype, between `b` and the new version.

Owns: `engine_manifest` / `engine_weights` (the trainer's weights cast to the engine's dtype, packed: what a
full update loads, and the base a delta is taken against), `encode_delta` / `patch` / `apply_delta` (the
encoding), `DeltaPublisher` with `DeltaReceiver` (two channels of one transport: full versions and deltas) or
`CollectiveDeltaReceiver` (one `torch_distributed` channel carrying both), and `HeldVersion` (a receiver's
version and buffers).

Encoding: one blob per version; per bucket of the version's `Manifest` the new values of the elements whose bit
pattern differs from the base (in the bucket's dtype), then where they are, whichever of two ways is smaller:
`SPARSE`, their int32 positions (int64 for a bucket of 2**31 elements or more), or `BITMASK`, one bit per element
(k(4 + s) against n/8 + ks bytes for s-byte values: a bf16 bucket with more than 1/32 of its elements changed
goes as a bitmask, so a delta stays under half of a bf16 version up to about 44% changed, not 33%). Both are
compared and applied chunk by chunk on integer views (a compare, `packbits`, a `flatnonzero` and a `take` to
encode; `unpackbits` and an `np.put` to apply): no model- or bucket-sized temporary. Measured against XOR encoding
(the new bits XOR the base bits, zlib-compressed) on the weights of real training steps
(`benchmarks/bench_weight_updates.py --encodings`, table in BENCHMARKS.md): zlib(XOR) moves fewer bytes but
encodes several times slower, on a path the trainer's next version waits for, so it is not used.

Blob layout (uint8, every section 64-byte aligned): an int64 header `[MAGIC, base version, version, buckets,
count_0 .. count_{B-1}, encoding_0 .. encoding_{B-1}]`, then per bucket its values and its positions or bitmask.

Where the time goes (`benchmarks/bench_weight_updates.py`): the trainer's thread only casts the version into a
staging payload; compare and encode run on the publisher's sender thread, which writes the blob straight into the
channel's buffer where it has one layout (`shared_memory`: only the blob's bytes are copied); the staged version
then becomes its base, and the old base's buffers go back to the sender to stage the next version into. No full
version is copied per delta: the full channel gets one only when no delta is sent, or when a receiver asks. A
receiver hands out the version it holds without a copy and patches it in place once released (`HeldVersion`), so
in the steady state no full-size buffer is allocated or copied on either side (fresh multi-hundred-MB buffers cost
more in page faults than a copy into them).

Two channels (`inprocess`, `shared_memory`, `ray`): `DeltaPublisher` publishes each version's delta against
the version before (when it is at most `max_fraction` of the full bytes) on one publisher, or else the full
version on the other. A `DeltaReceiver` takes a delta only when its base is the version it holds. When it holds
no base (its first version, after a restart or a resume: a new publisher starts with a full version) or missed
a delta, it takes the full channel's version and asks for a full one (`request_full`, a counter on the full
channel), which the publisher's sender thread sends from its base at the next send or within
`DeltaPublisher.REQUEST_POLL_S` while idle. One collective channel (`torch_distributed`): every receiver takes
every send in order, so each version goes once, as a delta or in full, and the next is encoded only after that
send reached every receiver.

Invariants:
- A delta is applied only to the version it was taken against: `patch` checks the base version and the
  layout and raises `WeightSyncError` naming both otherwise; the receivers never call it on another base.
- Applying a delta gives, bit for bit, the full version it was taken from (indices and values are exact copies
  of the engine-dtype tensors, compared by bit pattern so -0.0 / +0.0 and NaN payloads travel too).
- The publisher's base is the last version it sent; a receiver's is the last it applied; the full channel holds
  the publisher's base or an older version, never a newer one than a delta already sent.
- Tensors `poll` handed out are never written while anything outside the receiver references them (the package
  invariant on received tensors): `in_use` counts the references to their memory, and while any remain the
  next delta is applied to a copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncflow.weights.background import BackgroundSender
from asyncflow.weights.base import PollingReceiver, Received, WeightSyncError
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
    materialize,
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
    """One version in the engine's dtype: its layout and a payload viewed as buckets."""

    version: int
    manifest: Manifest
    buckets: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.manifest.payload_bytes

    def copy(self, into: Packed | None = None) -> Packed:
        """A copy of this version: into `into`'s payload where its layout is the same, else into a fresh one."""
        if into is None or into.manifest != self.manifest:
            into = Packed(self.version, self.manifest, bucket_views(self.manifest, allocate_payload(self.manifest)))
        for mine, theirs in zip(into.buckets, self.buckets, strict=True):
            mine.copy_(theirs)
        into.version = self.version
        return into


def engine_manifest(weights: Weights, dtype: torch.dtype | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """The layout of `weights` with every floating tensor in `dtype` (None: as they are)."""
    if isinstance(weights, BucketStream):
        tensors = {e.name: (e.shape, e.dtype) for e in weights.manifest.tensors}
    else:
        tensors = {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}

    def target(t: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point else t

    return plan_buckets({name: torch.empty(shape, dtype=target(t), device="meta")
                         for name, (shape, t) in tensors.items()}, bucket_bytes)


def engine_weights(weights: Weights, version: int, dtype: torch.dtype | None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Packed:
    """`weights` cast to `dtype` (None: as they are), packed into a fresh payload. The cast is the one a full
    update's `copy_` into the engine does (round to nearest even), so the result is bit for bit what the engine
    holds after loading `weights`."""
    manifest = engine_manifest(weights, dtype, bucket_bytes)
    buckets = bucket_views(manifest, allocate_payload(manifest))
    write_weights(materialize(weights), manifest, buckets)
    return Packed(version, manifest, buckets)


SPARSE, BITMASK = 0, 1  # a bucket's encoding in the blob's header
_CHUNK = 1 << 22  # elements compared (or unpacked) at a time: temporaries of a few MB, never bucket-sized


def _bits(bucket: torch.Tensor) -> np.ndarray:
    """The bucket's bit patterns as a numpy integer view (numpy has no bfloat16; bits compare -0.0 / NaN exactly)."""
    return bucket.view(_BITS[bucket.element_size()]).numpy()


def _index_dtype(bucket: torch.Tensor) -> torch.dtype:
    return torch.int32 if bucket.numel() < 2**31 else torch.int64


def mask_bytes(n: int) -> int:
    """Bytes of a bitmask over `n` elements (1 bit each)."""
    return -(-n // 8)


def _encode_bucket(old: torch.Tensor, new: torch.Tensor, raw: np.ndarray, room: int) -> tuple[int, int, int] | None:
    """One bucket's section of a blob, written at the start of `raw`: the changed elements' values [k] (the
    bucket's dtype), then their positions [k] (int32/int64, `SPARSE`) or a bitmask [ceil(n/8)] (uint8, bit i of
    byte j for element 8j+i, `BITMASK`), whichever is smaller. (k, encoding, bytes written), or None where the
    section would exceed `room` bytes.

    Compares chunk by chunk on integer views, taking each chunk's values straight into the blob: the temporaries
    are one chunk's mask and positions, the bitmask [ceil(n/8)], and the positions kept while sparse can still
    be the smaller (their 4 or 8 bytes each stay under the bitmask's n/8)."""
    a, b = _bits(old), _bits(new)
    n, itemsize = a.size, b.itemsize
    index_size = _index_dtype(new).itemsize
    bitmask = np.empty(mask_bytes(n), dtype=np.uint8)
    positions: list[np.ndarray] | None = []
    k = 0
    for start in range(0, n, _CHUNK):
        changed = a[start : start + _CHUNK] != b[start : start + _CHUNK]
        bitmask[start // 8 : start // 8 + mask_bytes(changed.size)] = np.packbits(changed, bitorder="little")
        index = np.flatnonzero(changed)
        if align((k + index.size) * itemsize) + min(align((k + index.size) * index_size), align(bitmask.size)) > room:
            return None
        np.take(b[start:], index, out=raw[k * itemsize : (k + index.size) * itemsize].view(b.dtype))
        k += index.size
        if positions is not None and k * index_size < bitmask.size:
            positions.append(np.add(index, start, out=index))
        else:
            positions = None  # the bitmask is smaller
    offset = align(k * itemsize)
    if positions is not None:
        section = raw[offset : offset + k * index_size].view(np.int32 if index_size == 4 else np.int64)
        if positions:
            np.concatenate(positions, out=section, casting="unsafe")
        return k, SPARSE, offset + align(section.nbytes)
    raw[offset : offset + bitmask.size] = bitmask
    return k, BITMASK, offset + align(bitmask.size)


def blob_bound(manifest: Manifest) -> int:
    """The most bytes a delta blob of `manifest`'s layout can take (every element changed)."""
    header = align(8 * (_HEADER + 2 * len(manifest.buckets)))
    return header + sum(align(b.nbytes) + align(mask_bytes(b.nbytes // b.dtype.itemsize)) for b in manifest.buckets)


def encode_delta(base: Packed, new: Packed, max_bytes: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The blob taking `base` to `new` (same manifest), or None where it would exceed `max_bytes` or the layouts
    differ. Shapes: each bucket [n_i] -> values [k_i] of the bucket's dtype, then indices [k_i] int32/int64 or a
    bitmask [ceil(n_i / 8)] uint8, per bucket whichever is smaller (`_encode_bucket`; bytes k(4 + s) against
    n/8 + ks for s-byte values: bf16 buckets switch to the bitmask above 1/32 of their elements changed).
    `out`: a uint8 buffer of at least `max_bytes` the blob is written into (it is then a view of its prefix), so a
    channel of one fixed layout is written once, not through a blob copied into it."""
    if base.manifest != new.manifest:
        return None
    header_bytes = align(8 * (_HEADER + 2 * len(new.buckets)))
    if out is not None and out.numel() < min(max_bytes, blob_bound(new.manifest)):
        raise ValueError(f"delta: the output buffer holds {out.numel()} bytes, the blob may need {max_bytes}")
    # a fresh blob is allocated at its bound: pages never written are never touched
    blob = torch.empty(min(max_bytes, blob_bound(new.manifest)), dtype=torch.uint8) if out is None else out
    raw = blob.numpy()
    offset, counts, encodings = header_bytes, [], []
    for old, fresh in zip(base.buckets, new.buckets, strict=True):
        section = _encode_bucket(old, fresh, raw[offset:], max_bytes - offset)
        if section is None:
            return None
        counts.append(section[0])
        encodings.append(section[1])
        offset += section[2]
    header = blob[: 8 * (_HEADER + 2 * len(counts))].view(torch.int64)
    header[:] = torch.tensor([MAGIC, base.version, new.version, len(counts), *counts, *encodings])
    return blob[:offset]


def delta_versions(blob: torch.Tensor) -> tuple[int, int]:
    """(base version, version) of a delta blob."""
    header = blob[: 8 * _HEADER].view(torch.int64).tolist()
    if header[0] != MAGIC:
        raise WeightSyncError("delta: the blob is not a weight delta (bad magic)")
    return header[1], header[2]


def delta_sections(blob: torch.Tensor) -> list[tuple[int, int]]:
    """Per bucket of a delta blob: (changed elements, encoding: `SPARSE` or `BITMASK`)."""
    buckets = int(blob[8 * 3 : 8 * 4].view(torch.int64).item())
    words = blob[8 * _HEADER : 8 * (_HEADER + 2 * buckets)].view(torch.int64).tolist()
    return list(zip(words[:buckets], words[buckets:], strict=True))


def _patch_bucket(target: np.ndarray, values: np.ndarray, section: np.ndarray, encoding: int,
                  index_dtype: type) -> None:
    """Write one bucket's changed `values` into `target` (its bit patterns, in place), at the positions the
    section after them names: `np.put` per section (`SPARSE`) or per chunk of the unpacked bitmask (`BITMASK`),
    faster than a boolean-mask assign or torch's `index_put_` on a CPU."""
    if encoding == SPARSE:
        np.put(target, section[: values.size * np.dtype(index_dtype).itemsize].view(index_dtype), values)
        return
    done = 0
    for start in range(0, target.size, _CHUNK):
        chunk = target[start : start + _CHUNK]
        bits = np.unpackbits(section[start // 8 : start // 8 + mask_bytes(chunk.size)], count=chunk.size,
                             bitorder="little")
        index = np.flatnonzero(bits.view(bool))  # 10x faster than over the uint8 0/1 values
        np.put(chunk, index, values[done : done + index.size])
        done += index.size
    if done != values.size:
        raise WeightSyncError(f"delta: a bitmask marks {done} changed elements, its section holds {values.size}")


def patch(blob: torch.Tensor, held: Packed) -> None:
    """Turn `held` into the version `blob` encodes, in place (`_patch_bucket` per bucket). `WeightSyncError` when
    `held` is not the version (or layout) the delta was taken against; `held` is then unchanged."""
    base_version, version = delta_versions(blob)
    buckets = int(blob[8 * 3 : 8 * 4].view(torch.int64).item())
    if base_version != held.version or buckets != len(held.buckets):
        raise WeightSyncError(
            f"delta: version {version} was taken against version {base_version} ({buckets} buckets), but this "
            f"replica holds version {held.version} ({len(held.buckets)} buckets): it needs a full update"
        )
    raw = blob.numpy()
    offset = align(8 * (_HEADER + 2 * buckets))
    for bucket, (count, encoding) in zip(held.buckets, delta_sections(blob), strict=True):
        target = _bits(bucket)
        values = raw[offset : offset + count * target.itemsize].view(target.dtype)
        offset += align(values.nbytes)
        index_dtype = np.int32 if _index_dtype(bucket) == torch.int32 else np.int64
        _patch_bucket(target, values, raw[offset:], encoding, index_dtype)
        section = count * np.dtype(index_dtype).itemsize if encoding == SPARSE else mask_bytes(target.size)
        offset += align(section)
    held.version = version


def apply_delta(blob: torch.Tensor, base: Packed) -> Packed:
    """A fresh `Packed` of the version `blob` encodes, from `base` (left unchanged). `WeightSyncError` when
    `base` is not the version (or layout) the delta was taken against."""
    delta_versions(blob)  # a bad blob fails before the copy
    fresh = base.copy()
    patch(blob, fresh)
    return fresh


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
    `fixed_capacity`: the delta channel keeps one layout (`shared_memory`): every blob is encoded into a buffer of
    `max_fraction` of the full bytes, and published with `used_bytes`, so only the blob is copied either way.

    `delta=None`: one collective channel (`torch_distributed`), whose every send every receiver takes in order:
    each version goes on it once, as a delta when it pays, else in full, and the next is encoded only after that
    send completed (`wait_published`), so every receiver holds the base of each delta it receives. Blob sizes are
    rounded up to 1/64 of the capacity: a channel that announces each new layout sees at most 64 of them.

    `publish` casts the version into a staging payload in the engine's dtype on the caller's thread (the
    snapshot) and returns; a `BackgroundSender` thread encodes it against the base, publishes both channels
    and keeps it as the next base (the old base's buffers are staged into next), so the trainer steps while the
    delta is encoded. The base is the last version sent (a superseded one never is), and only that thread touches
    it. `timeout_s` bounds `close`.

    Two channels: the full channel gets a version only when no delta is sent (the first version, a delta over
    `max_fraction`) or when a receiver asked for one (`request_full`: it holds no base, or missed a delta); the
    sender thread then publishes its base, at the next send or within `REQUEST_POLL_S` while idle."""

    REQUEST_POLL_S = 0.05

    def __init__(self, full: Any, delta: Any | None, *, dtype: torch.dtype | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_fraction: float = 0.5, fixed_capacity: bool = False,
                 timeout_s: float = 60.0):
        if not 0 < max_fraction <= 1:
            raise ValueError(f"delta: max_fraction must be in (0, 1], got {max_fraction}")
        self.full, self.delta = full, delta
        self.transport = full.transport
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.max_fraction, self.fixed_capacity, self.timeout_s = max_fraction, fixed_capacity, timeout_s
        self.receiver_spec: DeltaSpec | CollectiveDeltaSpec = \
            CollectiveDeltaSpec(full.receiver_spec) if delta is None \
            else DeltaSpec(full.receiver_spec, delta.receiver_spec, bucket_bytes)
        self._base: Packed | None = None
        self._out: torch.Tensor | None = None  # what blobs are encoded into (`fixed_capacity`, one channel)
        self.last_kind = "full"  # of the last version sent: "full" or "delta"
        self.last_delta_bytes = 0
        self.full_version: int | None = None  # the newest version on the full channel (two channels)
        self._requests_seen = 0  # the full channel's `full_requests` at the last look
        self._sender = BackgroundSender(f"{self.transport} (delta)", self._send, bucket_bytes=bucket_bytes,
                                        layout=lambda weights: engine_manifest(weights, dtype, bucket_bytes),
                                        idle=None if delta is None else self._serve_requests,
                                        idle_s=self.REQUEST_POLL_S)

    def publish(self, state_dict: Weights, version: int) -> None:
        self._sender.publish(materialize(state_dict), version)

    def _send(self, version: int, manifest: Manifest, buckets: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """On the sender thread: the delta (when it pays), then the full version (one of them on one collective
        channel), then the base moves on: the staged version becomes the base, and the old base's buffers go back
        to the sender to stage into (no copy)."""
        new = Packed(version, manifest, buckets)
        capacity = align(int(self.max_fraction * new.nbytes))
        out = None
        if self.fixed_capacity or self.delta is None:  # one layout: blobs are encoded into one reused buffer
            if self._out is None or self._out.numel() != capacity:
                self._out = torch.zeros(capacity, dtype=torch.uint8)
            out = self._out
        blob = None if self._base is None else encode_delta(self._base, new, capacity, out=out)
        if self.delta is None:
            if blob is not None and out is not None:
                granule = align(max(1, capacity // 64))
                self.full.publish({DELTA_KEY: out[: min(capacity, -(-blob.numel() // granule) * granule)]}, version)
            else:
                self.full.publish(unpack(manifest, buckets), version)
            self.full.wait_published(self.timeout_s)  # every receiver took it: the next delta's base
        elif blob is not None:
            if out is not None:
                self.delta.publish({DELTA_KEY: out}, version, used_bytes=blob.numel())
            else:
                self.delta.publish({DELTA_KEY: blob}, version)
        else:
            self._publish_full(new)
        given_back = None
        if self._base is None or self._base.manifest != manifest:  # the first version (or a new layout)
            self._base = new.copy()  # the staged buffers stay the sender's
        else:
            given_back, self._base = self._base.buckets, new
        self.last_kind, self.last_delta_bytes = ("delta", blob.numel()) if blob is not None else ("full", 0)
        if self.delta is not None:
            self._serve_requests()
        return given_back

    def _publish_full(self, version: Packed) -> None:
        """`version` on the full channel, after the delta channel's send (ray sends in the background: a receiver
        must not see a full version before the delta that preceded it)."""
        if self.delta is not None:
            self.delta.wait_published(self.timeout_s)
        self.full.publish(unpack(version.manifest, version.buckets), version.version)
        self.full_version = version.version

    def _serve_requests(self) -> None:
        """On the sender thread (after each send, and every `REQUEST_POLL_S` while idle): the base in full when a
        receiver asked for a full version since the last look, and the full channel does not hold it yet."""
        if self._base is None or self.full_version == self._base.version:
            return
        requests = self.full.full_requests()
        if requests != self._requests_seen:
            self._requests_seen = requests
            self._publish_full(self._base)

    def wait_published(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._sender.wait_published(timeout)
        for channel in (self.delta, self.full):
            if channel is not None:
                channel.wait_published(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        try:
            self._sender.close(self.timeout_s)
            if self.delta is not None:
                self.delta.close()
        finally:
            self.full.close()


def in_use(packed: Packed) -> bool:
    """Whether a tensor other than `packed`'s own bucket views still shares its memory (a version `poll` handed out
    whose consumer still holds it), by torch's count of the references to the payload's storage. True where that
    count is not available: the caller then copies instead of writing."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or not packed.buckets:
        return count is None
    storage = packed.buckets[0].untyped_storage()
    return bool(count(storage._cdata) > len(packed.buckets) + 1)  # the bucket views and `storage` itself


class HeldVersion:
    """The version a delta receiver holds, and how it is handed out without a copy.

    The held version is handed out as it is. The next delta patches it in place once no tensor outside the
    receiver shares its memory (`in_use`: the consumer loaded it and let it go); while one does, the held version
    is copied into the spare buffer (the one handed out before, once released), so a handed-out version is never
    written and, in the steady state, no buffer is allocated. `taken_bytes` / `took_full`: what reached the
    receiver since the last version handed out."""

    def __init__(self) -> None:
        self.packed: Packed | None = None
        self.handed_out = False  # `packed`'s tensors were handed out: written only once `in_use` is False
        self.spare: Packed | None = None  # a buffer handed out before: reused once released
        self.taken_bytes, self.took_full = 0, False

    @property
    def version(self) -> int | None:
        return None if self.packed is None else self.packed.version

    def _free(self, manifest: Manifest) -> Packed | None:
        """A buffer of `manifest`'s layout that nothing outside the receiver reads (its contents may be lost)."""
        for candidate, handed_out in ((self.packed, self.handed_out), (self.spare, True)):
            if candidate is not None and candidate.manifest == manifest and not (handed_out and in_use(candidate)):
                return candidate
        return None

    def apply(self, blob: torch.Tensor, nbytes: int) -> None:
        """Patch the held version with a delta blob (`WeightSyncError` if it is not the delta's base)."""
        held = self.packed
        if held is None:
            raise WeightSyncError("delta: a delta arrived before any full version")
        delta_versions(blob)  # a bad blob fails before a copy
        if self.handed_out and in_use(held):
            spare = self.spare if self.spare is not None and not in_use(self.spare) else None
            held, self.spare = held.copy(into=spare), held
            self.packed = held
        self.handed_out = False
        patch(blob, held)
        self.taken_bytes += nbytes

    def take_full(self, version: int, weights: Weights, manifest: Manifest, nbytes: int) -> None:
        """Hold a full version (laid out by `manifest`), copied into a free buffer: the channel's are not ours."""
        into = self._free(manifest)
        if into is None:
            into = Packed(version, manifest, bucket_views(manifest, allocate_payload(manifest)))
        if into is not self.packed:  # the spare or a fresh buffer: the held version is the spare now, if handed out
            self.spare = self.packed if self.handed_out else None
        write_weights(weights, manifest, into.buckets)
        into.version = version
        self.packed, self.handed_out = into, False
        self.taken_bytes += nbytes
        self.took_full = True

    def hand_out(self, receiver: PollingReceiver, have_version: int) -> Received | None:
        """The held version if newer than `have_version`, its bytes and kind recorded on `receiver`."""
        held = self.packed
        if held is None or held.version <= have_version:
            return None
        receiver.received_bytes, receiver.received_kind = self.taken_bytes, "full" if self.took_full else "delta"
        self.taken_bytes, self.took_full = 0, False
        self.handed_out = True
        return held.version, unpack(held.manifest, held.buckets)


class DeltaReceiver(PollingReceiver):
    """Follows the delta channel on a thread (every `FOLLOW_S`), applying each delta whose base is the version it
    holds, so a replica that takes versions only now and then (between partitions) still has the base of the
    next delta; `poll` returns the newest version held (`HeldVersion`: no copy), or takes the full one when the
    deltas do not reach it. `received_bytes` counts every byte taken since the previous version `poll` returned;
    `received_kind` is "delta" when no full version was among them."""

    collective = False
    FOLLOW_S = 0.05

    def __init__(self, full: Any, delta: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.full, self.delta, self.bucket_bytes = full, delta, bucket_bytes
        self.transport = full.transport
        self._held = HeldVersion()
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
        held = self._held.version
        if held is None:
            return
        delta = self.delta.poll(held)
        if delta is not None:
            if delta_versions(delta[1][DELTA_KEY])[0] == held:
                self._held.apply(delta[1][DELTA_KEY], self.delta.received_bytes)
            else:  # a delta was missed: the deltas no longer reach the version held
                self.full.request_full()

    def poll(self, have_version: int) -> Received | None:
        with self._lock:
            if self._error is not None:
                raise WeightSyncError(f"delta: following the delta channel failed: {self._error!r}") from self._error
            self._take_delta()
            held = self._held.version
            # with no base yet, take the version there even if the engine has it (it started from those weights)
            newest = self.full.poll(-1 if held is None else max(have_version, held))
            if newest is not None:
                version, state_dict = newest
                self._held.take_full(version, state_dict, manifest_of(state_dict, self.bucket_bytes),
                                     self.full.received_bytes)
            elif held is None:
                self.full.request_full()
            return self._held.hand_out(self, have_version)

    def close(self) -> None:
        self._stop.set()
        self._follower.join(10 * self.FOLLOW_S)
        with self._lock:
            try:
                self.delta.close()
            finally:
                self.full.close()


# ------------------------------------------------------------------- one collective channel (torch_distributed)
@dataclass(frozen=True)
class CollectiveDeltaSpec:
    """A `torch_distributed` channel carrying both kinds: every receiver takes every send, in order."""

    channel: Any  # TorchDistributedSpec

    def for_rank(self, rank: int) -> CollectiveDeltaSpec:
        return CollectiveDeltaSpec(self.channel.for_rank(rank))

    def open(self) -> CollectiveDeltaReceiver:
        return CollectiveDeltaReceiver(self.channel.open())


class CollectiveDeltaReceiver(PollingReceiver):
    """Takes every send of a collective channel in order (`TorchDistributedReceiver.sends`): a delta patches the
    version held (every receiver took the version before, which is the one the sender encoded against), a full
    version replaces it; `poll` hands out the newest (`HeldVersion`: no copy)."""

    collective = True

    def __init__(self, channel: Any):
        self.channel = channel
        self.transport = channel.transport
        self._held = HeldVersion()

    def poll(self, have_version: int) -> Received | None:
        for version, stream in self.channel.sends():
            if is_delta(stream.manifest):
                self._held.apply(materialize(stream)[DELTA_KEY], stream.manifest.payload_bytes)
            else:
                self._held.take_full(version, stream, stream.manifest, stream.manifest.payload_bytes)
        received = self._held.hand_out(self, have_version)
        if received is None and self.channel.closed():
            raise WeightSyncError("torch_distributed: publisher closed")
        return received

    def close(self) -> None:
        self.channel.close()


def is_delta(manifest: Manifest) -> bool:
    """Whether a version's layout is a delta blob's (one uint8 tensor named `DELTA_KEY`, maybe split over buckets)."""
    return {e.name for e in manifest.tensors} == {DELTA_KEY}


def state_dict_bytes(state_dict: Mapping[str, torch.Tensor] | StateDict) -> int:
    """Bytes of a state dict's tensors."""
    return sum(t.numel() * t.element_size() for t in state_dict.values())
