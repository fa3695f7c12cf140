"""Background sending for the remote transports (`ray`, `torch_distributed`): `BackgroundSender`, so that
`publish` costs one local copy and never waits for receivers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncflow.weights.base import WeightSyncError, WeightSyncTimeout, check_increasing
from asyncflow.weights.buckets import (
    Manifest,
    Weights,
    allocate_payload,
    bucket_views,
    cast_manifest,
    manifest_of,
    write_weights,
)

Layout = Callable[[Weights], Manifest]
# (version, manifest, buckets) -> None, or buckets of the same layout the sender keeps no longer: staged into next
# instead of the ones just sent, which the sender then keeps
Send = Callable[[int, Manifest, list[torch.Tensor]], "list[torch.Tensor] | None"]


@dataclass
class _Staged:
    manifest: Manifest
    buckets: list[torch.Tensor]  # views of one payload
    version: int = -1


class BackgroundSender:
    """Double-buffered staging plus one sender thread.

    `idle`: called on the sender thread every `idle_s` while nothing is to be sent (a delta publisher serves
    receivers' requests for a full version there).

    `publish` packs into a free staging payload and queues it; the thread sends it with
    `send(version, manifest, buckets)`. Two payloads circulate: one being sent, the other pending
    or free (a `send` that keeps the buckets it sent, a delta publisher's base, returns other buckets of the same
    layout, which circulate in their place). A publish while one is pending supersedes it (reuses its payload;
    that version is never sent); the version already being sent completes. The first failure is sticky: every
    later call raises it. `dtype`: floating tensors wider than it are staged and sent in it (the receiving
    engine's dtype: a bf16 engine gets half the bytes of fp32); None keeps each tensor's own. `layout` (default:
    `manifest_of` cast to `dtype`) lays the staging payload out instead; `write_weights` copies into it, casting
    where the layout's dtypes differ from the weights' (`asyncflow.weights.delta` stages in the engine's dtype).
    """

    def __init__(
        self,
        transport: str,
        send: Send,
        *,
        bucket_bytes: int,
        staging_device: torch.device | str = "cpu",
        connect: Callable[[], None] | None = None,
        dtype: torch.dtype | None = None,
        layout: Layout | None = None,
        idle: Callable[[], None] | None = None,
        idle_s: float = 0.05,
    ):
        self.transport, self.bucket_bytes, self.dtype = transport, bucket_bytes, dtype
        self.staging_device = torch.device(staging_device)
        self._send, self._connect, self._idle, self._idle_s = send, connect, idle, idle_s
        self._layout: Layout = layout or (lambda weights: cast_manifest(manifest_of(weights, bucket_bytes), dtype))
        self._cond = threading.Condition()
        self._free: list[_Staged] = []
        self._pending: _Staged | None = None
        self._sending = False
        self._failure: BaseException | None = None
        self._closing = False
        self.last_version: int | None = None
        self.superseded = 0
        self._thread = threading.Thread(target=self._run, name=f"weight-sync-{transport}", daemon=True)
        self._thread.start()

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            if isinstance(self._failure, WeightSyncError):
                raise self._failure
            raise WeightSyncError(f"{self.transport}: background send failed: {self._failure!r}") from self._failure
        if self._closing:
            raise WeightSyncError(f"{self.transport}: publisher closed")

    def publish(self, state_dict: Weights, version: int) -> None:
        manifest = self._layout(state_dict)
        with self._cond:
            self._raise_if_unusable()
            check_increasing(self.transport, self.last_version, version)
            staged: _Staged | None
            if self._pending is not None:
                staged, self._pending = self._pending, None
                self.superseded += 1
            else:
                staged = self._free.pop() if self._free else None
        if staged is None or staged.manifest != manifest:
            staged = _Staged(manifest, bucket_views(manifest, allocate_payload(manifest, self.staging_device)))
        write_weights(state_dict, manifest, staged.buckets)
        if staged.buckets and staged.buckets[0].is_cuda:  # the sender thread must not read it before the copy lands
            torch.cuda.current_stream(staged.buckets[0].device).synchronize()
        staged.version = version
        with self._cond:
            self._pending = staged
            self.last_version = version
            self._cond.notify_all()

    def sent_directly(self, version: int) -> None:
        """Record `version` as published by the caller itself, after `wait_published` (a version forwarded bucket by
        bucket, never staged): later publishes must be newer."""
        with self._cond:
            self._raise_if_unusable()
            check_increasing(self.transport, self.last_version, version)
            self.last_version = version

    def wait_published(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._failure is None and (self._pending is not None or self._sending):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncTimeout(
                        self.transport, self.last_version, "the background send to reach receivers", timeout
                    )
                self._cond.wait(left)
            self._raise_if_unusable()

    def _run(self) -> None:
        try:
            if self._connect is not None:
                self._connect()
            while True:
                with self._cond:
                    if self._pending is None and not self._closing:
                        self._cond.wait(None if self._idle is None else self._idle_s)
                    if self._closing:
                        return
                    staged, self._pending = self._pending, None
                    self._sending = staged is not None
                if staged is None:  # woken with nothing to send
                    if self._idle is not None:
                        self._idle()
                    continue
                kept = self._send(staged.version, staged.manifest, staged.buckets)
                if kept is not None:  # the sender keeps what it sent and gives these back
                    staged = _Staged(staged.manifest, kept)
                with self._cond:
                    self._sending = False
                    if len(self._free) < 2:
                        self._free.append(staged)
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer thread on its next call
            with self._cond:
                self._failure, self._sending = err, False
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Stop after the send in flight (a pending, unsent version is dropped); False if that
        send is still running after `timeout` (it ends with its own transport timeout)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class BackgroundPublisher:
    """The `WeightPublisher` calls of a transport that sends through `self._sender` (a `BackgroundSender`)."""

    _sender: BackgroundSender

    def publish(self, state_dict: Weights, version: int) -> None:
        self._sender.publish(state_dict, version)

    def wait_published(self, timeout: float) -> None:
        self._sender.wait_published(timeout)
