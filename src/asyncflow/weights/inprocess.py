"""The `inprocess` transport: publisher and receivers in one process (the inline runtime).

Owns: `InProcessPublisher` (packs into a fresh payload per version and swaps a reference under a
lock) and its receiver. Its spec holds that reference, so it only works inside the publishing process.
"""

from __future__ import annotations

import threading

import torch

from asyncflow.weights.base import PollingReceiver, Received, WeightSyncError, check_increasing
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    Manifest,
    Weights,
    allocate_payload,
    bucket_views,
    manifest_of,
    unpack,
    write_weights,
)


class InProcessSpec:
    """The newest (version, manifest, buckets), shared by the publisher and its receivers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latest: tuple[int, Manifest, list[torch.Tensor]] | None = None
        self.closed = False
        self.full_requests = 0  # receivers' asks for a full version (`asyncflow.weights.delta`)

    def open(self) -> InProcessReceiver:
        return InProcessReceiver(self)


class InProcessPublisher:
    transport = "inprocess"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str = "cpu"):
        self.bucket_bytes, self.device = bucket_bytes, device
        self._slot = self.receiver_spec = InProcessSpec()

    def publish(self, state_dict: Weights, version: int) -> None:
        manifest = manifest_of(state_dict, self.bucket_bytes)
        payload = allocate_payload(manifest, self.device)
        buckets = bucket_views(manifest, payload)
        write_weights(state_dict, manifest, buckets)
        with self._slot.lock:
            if self._slot.closed:
                raise WeightSyncError("inprocess: publish after close")
            latest = self._slot.latest
            check_increasing(self.transport, None if latest is None else latest[0], version)
            self._slot.latest = (version, manifest, buckets)

    def wait_published(self, timeout: float) -> None:
        """A publish is visible when it returns."""

    def full_requests(self) -> int:
        return self._slot.full_requests

    def close(self) -> None:
        with self._slot.lock:
            self._slot.closed = True


class InProcessReceiver(PollingReceiver):
    transport = "inprocess"

    def __init__(self, slot: InProcessSpec):
        self._slot = slot

    def poll(self, have_version: int) -> Received | None:
        with self._slot.lock:
            latest, closed = self._slot.latest, self._slot.closed
        if latest is not None and latest[0] > have_version:
            self.received_bytes = latest[1].payload_bytes
            return latest[0], unpack(latest[1], latest[2])
        if closed:
            raise WeightSyncError("inprocess: publisher closed")
        return None

    def request_full(self) -> None:
        with self._slot.lock:
            self._slot.full_requests += 1

    def close(self) -> None:
        """Nothing to release."""
