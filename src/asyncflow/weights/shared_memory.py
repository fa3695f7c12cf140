"""The `shared_memory` transport: processes on one host, through a 2-slot file in /dev/shm.

Owns: `SharedMemoryPublisher` (packs into the idle slot, then flips the active one) and
`SharedMemoryReceiver` (a seqlock reader that copies the active slot out).

Invariants:
- A reader never returns a torn version: it keeps a copy only if the slot's sequence number was even
  and unchanged across the copy.
- The file is named after its owner (`asyncflow.weights.segments`) and unlinked by its publisher's
  `close` or finalizer; one left by a killed publisher is removed when the next one is created.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import weakref
from dataclasses import dataclass

import torch

from asyncflow.weights.base import PollingReceiver, Received, WeightSyncError, check_increasing
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    Manifest,
    Weights,
    align,
    allocate_payload,
    bucket_views,
    manifest_of,
    materialize,
    unpack,
    write_weights,
)
from asyncflow.weights.segments import segment_path

# File layout (all integers little-endian int64):
#   [0, 64)               control: magic, active slot, closed, manifest bytes, slot stride (the publisher's), then
#                         full-version requests (written by receivers only: `request_full`)
#   [64, 64 + m)          pickled Manifest, written once before the file becomes visible
#   slot i at data_start + i * stride: [seq, version, used] (64-byte header) then the payload, of which the
#   first `used` bytes are meaningful (all of it, but for a delta blob: `publish(..., used_bytes=)`)
# Seqlock: the writer makes the idle slot's seq odd, writes payload and version, makes seq even,
# then points `active` at it. A reader copies the active slot and keeps the copy only if seq was
# even and unchanged across the copy (else it re-reads `active` and retries). Store/load order
# across processes comes from x86-64 TSO; on weakly ordered CPUs from the barriers of the GIL
# hand-off around each torch copy.
_MAGIC = 0x57534E43_41464C57
_CONTROL = struct.Struct("<5q")
_REQUESTS = struct.Struct("<q")  # at byte _CONTROL.size
_MANIFEST_AT = 64
_SLOT = struct.Struct("<3q")
_SLOT_HEADER = 64
_TORN_READ_RETRIES = 100


@dataclass(frozen=True)
class SharedMemorySpec:
    path: str

    def open(self) -> SharedMemoryReceiver:
        return SharedMemoryReceiver(self.path)


def _unlink_quietly(path: str) -> None:
    for p in (path, path + ".tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class SharedMemoryPublisher:
    """Two payload slots in one memory-mapped file; the layout is fixed by the first publish."""

    transport = "shared_memory"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, path: str | None = None):
        self.bucket_bytes = bucket_bytes
        self.path = path or segment_path("weights")
        self.receiver_spec = SharedMemorySpec(self.path)
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._manifest: Manifest | None = None
        self._active = 1  # so the first publish writes slot 0
        self._last_version: int | None = None
        self._data_start = self._stride = 0
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path)

    def _create(self, manifest: Manifest) -> None:
        manifest_bytes = pickle.dumps(manifest)
        self._data_start = align(_MANIFEST_AT + len(manifest_bytes))
        self._stride = align(_SLOT_HEADER + manifest.payload_bytes)
        size = self._data_start + 2 * self._stride
        fd = os.open(self.path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:  # reserve the pages now: a full tmpfs must fail here, not SIGBUS on a later write
                os.posix_fallocate(fd, 0, size)
            except AttributeError:
                os.ftruncate(fd, size)
            except OSError as err:
                raise WeightSyncError(f"shared_memory: cannot reserve {size} bytes in {self.path}: {err}") from err
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._mm[_MANIFEST_AT : _MANIFEST_AT + len(manifest_bytes)] = manifest_bytes
        _CONTROL.pack_into(self._mm, 0, _MAGIC, -1, 0, len(manifest_bytes), self._stride)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._manifest = manifest

    def publish(self, state_dict: Weights, version: int, *, used_bytes: int | None = None) -> None:
        """`used_bytes`: only this prefix of the payload matters (a delta blob padded to the fixed layout, the state
        dict's one uint8 tensor): only it is copied in, and receivers copy only it out."""
        check_increasing(self.transport, self._last_version, version)
        manifest = manifest_of(state_dict, self.bucket_bytes)
        first = self._mm is None
        if first:
            self._create(manifest)
        elif self._bytes is None:
            raise WeightSyncError("shared_memory: publish after close")
        elif manifest != self._manifest:
            raise ValueError(
                "shared_memory: the state dict layout differs from the first publish (fixed per publisher)"
            )
        mm, data = self._mm, self._bytes
        if mm is None or data is None:  # not reached: _create sets both, and close is caught above
            raise WeightSyncError("shared_memory: publish after close")
        slot = 1 - self._active
        start = self._data_start + slot * self._stride
        seq, _, _ = _SLOT.unpack_from(mm, start)
        seq |= 1  # odd: being written (already odd if an earlier publish into this slot raised)
        used = manifest.payload_bytes if used_bytes is None else min(used_bytes, manifest.payload_bytes)
        _SLOT.pack_into(mm, start, seq, version, used)
        payload = data[start + _SLOT_HEADER : start + _SLOT_HEADER + manifest.payload_bytes]
        if used_bytes is None:
            write_weights(state_dict, manifest, bucket_views(manifest, payload))
        else:  # one uint8 tensor (a padded blob): its meaningful prefix only
            (blob,) = materialize(state_dict).values()
            payload[:used].copy_(blob.reshape(-1).view(torch.uint8)[:used])
        del payload
        _SLOT.pack_into(mm, start, seq + 1, version, used)
        magic, _, closed, manifest_len, stride = _CONTROL.unpack_from(mm, 0)
        _CONTROL.pack_into(mm, 0, magic, slot, closed, manifest_len, stride)
        self._active, self._last_version = slot, version
        if first:
            os.rename(self.path + ".tmp", self.path)

    def wait_published(self, timeout: float) -> None:
        """A publish is visible when it returns."""

    def full_requests(self) -> int:
        """How many times receivers asked for a full version (`asyncflow.weights.delta`); 0 before the first publish."""
        return 0 if self._mm is None or self._bytes is None else _REQUESTS.unpack_from(self._mm, _CONTROL.size)[0]

    def close(self) -> None:
        if self._mm is not None and self._bytes is not None:
            values = list(_CONTROL.unpack_from(self._mm, 0))
            values[2] = 1
            _CONTROL.pack_into(self._mm, 0, *values)
            self._bytes = None  # before closing the map: a live tensor view of it blocks the close
            self._mm.close()
        self._unlink()


class SharedMemoryReceiver(PollingReceiver):
    transport = "shared_memory"

    def __init__(self, path: str):
        self.path = path
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._manifest: Manifest | None = None
        self._data_start = self._stride = 0

    def _attach(self) -> bool:
        try:
            # read-write: torch.frombuffer wants a writable buffer, and `request_full` writes its counter
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            self._mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        magic, _, _, manifest_len, self._stride = _CONTROL.unpack_from(self._mm, 0)
        if magic != _MAGIC:
            raise WeightSyncError(f"shared_memory: {self.path} is not a weight-sync file")
        self._manifest = pickle.loads(self._mm[_MANIFEST_AT : _MANIFEST_AT + manifest_len])
        self._data_start = align(_MANIFEST_AT + manifest_len)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        return True

    def poll(self, have_version: int) -> Received | None:
        if self._mm is None and not self._attach():
            return None
        if self._mm is None or self._bytes is None or self._manifest is None:  # _attach set _mm; close cleared the rest
            raise WeightSyncError("shared_memory: receiver used after close")
        manifest = self._manifest
        for _ in range(_TORN_READ_RETRIES):
            _, slot, closed, _, _ = _CONTROL.unpack_from(self._mm, 0)
            start = self._data_start + slot * self._stride
            seq_before, version, used = _SLOT.unpack_from(self._mm, start)
            if seq_before % 2:
                continue
            if version <= have_version:
                if closed:
                    raise WeightSyncError(f"shared_memory: publisher of {self.path} closed")
                return None
            payload = allocate_payload(manifest)
            payload[:used].copy_(self._bytes[start + _SLOT_HEADER : start + _SLOT_HEADER + used])
            seq_after, _, _ = _SLOT.unpack_from(self._mm, start)
            if seq_after == seq_before:
                self.received_bytes = used
                return version, unpack(manifest, bucket_views(manifest, payload))
        return None  # the writer kept overwriting what we read; wait_for retries until its deadline

    def request_full(self) -> None:
        """Ask the publisher for a full version (a counter receivers bump; an increment lost to a race with another
        receiver's still changes it, and a receiver asks again until it is served)."""
        if self._mm is None and not self._attach():
            return  # nothing published yet: the first version is a full one
        if self._mm is not None:
            (requests,) = _REQUESTS.unpack_from(self._mm, _CONTROL.size)
            _REQUESTS.pack_into(self._mm, _CONTROL.size, requests + 1)

    def close(self) -> None:
        self._bytes = self._manifest = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
