"""The `torch_distributed` transport: rank 0 publishes, ranks 1..N receive, over gloo or NCCL.

Owns: `TorchDistributedPublisher` (broadcasts buckets over a private TCPStore and process group that never
touches the default process group: a version staged whole and sent from a background thread, or, with
`forward_streams`, a `BucketStream` forwarded bucket by bucket from the caller's thread) and its receiver.

Invariants: a staged version is one copy in the engine's dtype and `publish` returns at once (the trainer steps on
while the replicas poll). A forwarded `BucketStream` (a multi-rank trainer's weights, `weights.stage_on_driver:
false`) is held one bucket at a time, never whole; its `publish` returns once every receiver has taken the version
(a broadcast is collective), so the trainer waits for the replicas to poll instead of keeping a copy.

A receiver holds one bucket at a time. `poll` hands the newest version out as a `BucketStream`
whose buckets are received as its consumer asks for them (an engine that streams weights loads each as it
arrives; `asyncflow.weights.materialize` builds a state dict for one that does not), and receives every
superseded version bucket by bucket without keeping it.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from asyncflow.weights.background import BackgroundPublisher, BackgroundSender
from asyncflow.weights.base import PollingReceiver, Received, WeightSyncError, WeightSyncTimeout
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketStream,
    Manifest,
    Weights,
    cast_manifest,
    filled_buckets,
)


# ------------------------------------------------------------------------- torch.distributed
# Protocol:
#   join:      each receiver bumps store key "joined"; rank 0 builds the group once all N joined.
#   announce:  for its k-th send rank 0 sets "announce/k" = (version, manifest id) (and
#              "manifest/<id>" when the layout changes), then broadcasts every bucket from rank 0.
#   receive:   a receiver that has taken k-1 sends sees "announce/k" and joins exactly those
#              broadcasts, in order; `poll` drains every announced send and returns the newest.
# Broadcasts are collective: a send completes only when every receiver has polled. Each
# broadcast waits at most `timeout_s`; after a timeout the group is out of step and the
# transport is broken (WeightSyncError on every later call): close it and build a new one.
def make_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"torch_distributed: unknown backend {backend!r} (gloo or nccl)")


RESTART_REFUSAL = ("runtime.weight_sync=torch_distributed cannot take a restarted replica back into its process group: "
                   "use shared_memory (one machine) or ray to survive restarts")


def _store_set(store: Any, key: str, value: bytes) -> None:
    """`store.set(key, value)` with bytes: the C++ store takes str or bytes; torch's stub says str only."""
    store.set(key, value)


def _broadcast(group: Any, buckets: Iterable[torch.Tensor], timeout_s: float, version: int, count: int, first: int = 0
               ) -> None:
    """Broadcast every bucket from rank 0, in order; each waits at most `timeout_s`. Errors name bucket
    `first + i + 1` of `count`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    number = first
    for bucket in buckets:  # not enumerate: its cached tuple would keep a bucket alive while the next is built
        number += 1
        what = f"broadcast of bucket {number}/{count}"
        try:
            group.broadcast(bucket, 0, timeout).wait(timeout)
        except RuntimeError as err:
            if "timed out" in str(err).lower() or "timeout" in str(err).lower():
                raise WeightSyncTimeout(
                    "torch_distributed", version, f"{what} (every receiver must poll)", timeout_s
                ) from err
            if "closed by peer" in str(err) or "reset by peer" in str(err):
                raise WeightSyncError(f"torch_distributed: a receiver left during {what} of version {version} (a "
                                      f"replica died?): {RESTART_REFUSAL}") from err
            raise WeightSyncError(f"torch_distributed: {what} of version {version} failed: {err}") from err
        del bucket  # a forwarded bucket is freed before the next one is built


@dataclass(frozen=True)
class TorchDistributedSpec:
    host: str
    port: int
    world_size: int
    backend: str
    device: str
    timeout_s: float
    rank: int | None = None

    def for_rank(self, rank: int) -> TorchDistributedSpec:
        return replace(self, rank=rank)

    def open(self) -> TorchDistributedReceiver:
        """Join the group; blocks (at most `timeout_s`) until the publisher is there too."""
        return TorchDistributedReceiver(self)


class TorchDistributedPublisher(BackgroundPublisher):
    transport = "torch_distributed"

    def __init__(
        self,
        num_receivers: int,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: Literal["gloo", "nccl"] = "gloo",
        device: str = "cpu",
        timeout_s: float = 60.0,
        dtype: torch.dtype | None = None,
        forward_streams: bool = False,
    ):
        import torch.distributed as dist

        if num_receivers < 1:
            raise ValueError("torch_distributed needs at least one receiver")
        if backend == "nccl" and not device.startswith("cuda"):
            raise ValueError(f"torch_distributed: nccl moves CUDA tensors; got device {device!r}")
        self.num_receivers, self.timeout_s, self.backend = num_receivers, timeout_s, backend
        self._store = dist.TCPStore(
            host, port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.receiver_spec = TorchDistributedSpec(host, self._store.port, num_receivers + 1, backend, device, timeout_s)
        self._group: Any = None
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._broken: WeightSyncError | None = None  # a forwarded version failed part-way: the group is out of step
        self._sends = 0
        self._manifests: dict[Manifest, int] = {}
        self._sender = BackgroundSender(
            self.transport, self._send, bucket_bytes=bucket_bytes, staging_device=device, connect=self._connect,
            dtype=dtype,
        )
        self._device, self.forward_streams = device, forward_streams

    def _connect(self) -> None:
        import torch.distributed as dist

        deadline = time.monotonic() + self.timeout_s
        while self._store.add("joined", 0) < self.num_receivers:
            if self._closed.is_set():
                return
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(
                    self.transport,
                    None,
                    f"{self.num_receivers} receivers to join port {self._store.port}",
                    self.timeout_s,
                )
            time.sleep(0.01)
        self._group = make_group(
            dist.PrefixStore("group", self._store), 0, self.num_receivers + 1, self.backend, self.timeout_s
        )
        self._connected.set()

    def _announce(self, version: int, manifest: Manifest) -> None:
        manifest_id = self._manifests.get(manifest)
        if manifest_id is None:
            manifest_id = self._manifests[manifest] = len(self._manifests)
            _store_set(self._store, f"manifest/{manifest_id}", pickle.dumps(manifest))
        self._sends += 1
        _store_set(self._store, f"announce/{self._sends}", pickle.dumps((version, manifest_id)))

    def _send(self, version: int, manifest: Manifest, buckets: list[torch.Tensor]) -> None:
        self._announce(version, manifest)
        _broadcast(self._group, buckets, self.timeout_s, version, len(buckets))

    def publish(self, state_dict: Weights, version: int) -> None:
        """Staged in the engine's dtype and sent in the background (returns at once); with `forward_streams`, a
        `BucketStream` is forwarded bucket by bucket instead, each cast into a buffer of its own and broadcast before
        the next is read, so this returns once every receiver has taken the version (each broadcast waits at most
        `timeout_s`)."""
        if self._broken is not None:
            raise self._broken
        if not (self.forward_streams and isinstance(state_dict, BucketStream)):
            self._sender.publish(state_dict, version)
            return
        self._sender.wait_published(self.timeout_s)  # a staged version still being sent goes first
        if not self._connected.wait(self.timeout_s):
            raise WeightSyncTimeout(self.transport, version, f"{self.num_receivers} receivers to join",
                                    self.timeout_s)
        self._sender.sent_directly(version)
        manifest = cast_manifest(state_dict.manifest, self._sender.dtype)
        self._announce(version, manifest)
        try:
            _broadcast(self._group, filled_buckets(state_dict, manifest, self._device), self.timeout_s, version,
                       len(manifest.buckets))
        except WeightSyncError as err:
            self._broken = err
            raise

    def close(self) -> None:
        self._closed.set()
        if not self._sender.close(self.timeout_s):
            return  # a broadcast is still stuck; it ends with its own timeout
        _store_set(self._store, "closed", b"1")
        if self._group is not None:
            self._group.shutdown()
            self._group = None


class TorchDistributedReceiver(PollingReceiver):
    transport = "torch_distributed"
    collective = True

    def __init__(self, spec: TorchDistributedSpec):
        import torch.distributed as dist

        if spec.rank is None or not 1 <= spec.rank < spec.world_size:
            raise ValueError(f"torch_distributed: receiver rank must be in 1..{spec.world_size - 1} (spec.for_rank)")
        self._spec = spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            self._store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
            self._store.add("joined", 1)
            self._group = make_group(
                dist.PrefixStore("group", self._store), spec.rank, spec.world_size, spec.backend, spec.timeout_s
            )
        except RuntimeError as err:  # DistStoreError and gloo's connect errors are RuntimeErrors
            raise WeightSyncTimeout(
                self.transport, None, f"the group at {spec.host}:{spec.port} to form ({err})", spec.timeout_s
            ) from err
        self._taken = 0
        self._manifests: dict[int, Manifest] = {}
        self._taking: Iterator[list[torch.Tensor]] | None = None  # the version handed out last, being received

    def _announced(self, send: int) -> bool:
        return bool(self._store.check([f"announce/{send}"]))

    def _announcement(self, send: int) -> tuple[int, Manifest]:
        version, manifest_id = pickle.loads(self._store.get(f"announce/{send}"))
        manifest = self._manifests.get(manifest_id)
        if manifest is None:
            manifest = self._manifests[manifest_id] = pickle.loads(self._store.get(f"manifest/{manifest_id}"))
        return version, manifest

    def _members(self, manifest: Manifest, version: int) -> Iterator[list[torch.Tensor]]:
        """Each bucket's tensors (views of a fresh buffer; a split tensor's slice as its rows), its broadcast received
        when it is asked for."""
        count = len(manifest.buckets)
        for index, bucket in enumerate(manifest.buckets):
            buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=self._spec.device)
            _broadcast(self._group, [buffer], self._spec.timeout_s, version, count, first=index)
            yield [buffer[e.offset : e.offset + e.numel].view(e.piece_shape) for e in manifest.tensors
                   if e.bucket == index]
            del buffer

    def _taken_by(self) -> Iterator[list[torch.Tensor]]:
        """The buckets of the version handed out last (`BucketStream.buckets`: one pass)."""
        if self._taking is None:
            raise WeightSyncError("torch_distributed: a received weight stream is read once, before the next poll")
        return self._taking

    def _finish_taking(self) -> None:
        """Receive (and drop) what is left of the version handed out last: the sender broadcasts every bucket."""
        taking, self._taking = self._taking, None
        if taking is not None:
            for _ in taking:
                pass

    def sends(self) -> Iterator[tuple[int, BucketStream]]:
        """Every announced send not taken yet, in order, as (version, a `BucketStream` received as it is read): read
        each before asking for the next, or what is left of it is received and dropped (`asyncflow.weights.delta`
        takes every send: a delta needs the one before)."""
        self._finish_taking()
        while self._store_call(lambda: self._announced(self._taken + 1)):
            version, manifest = self._store_call(lambda: self._announcement(self._taken + 1))
            self._taken += 1
            self._taking = self._members(manifest, version)
            self.received_bytes = manifest.payload_bytes
            yield version, BucketStream(manifest, self._taken_by)
            self._finish_taking()

    def closed(self) -> bool:
        """Whether the publisher closed (its last send may still be announced)."""
        return bool(self._store_call(lambda: self._store.check(["closed"])))

    def _store_call(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except WeightSyncError:
            raise
        except RuntimeError as err:
            raise self._store_failed(err) from err

    def _store_failed(self, err: RuntimeError) -> WeightSyncError:
        return WeightSyncError(f"torch_distributed: store at {self._spec.host}:{self._spec.port} failed: {err}")

    def poll(self, have_version: int) -> Received | None:
        """The newest announced version, if newer than `have_version`, as a `BucketStream` whose buckets are received
        as its consumer asks for them (consume it before the next call, or that call receives the rest); every
        older announced version is received and dropped one bucket at a time (`sends`)."""
        for version, stream in self.sends():
            if version > have_version and not self._store_call(lambda: self._announced(self._taken + 1)):
                return version, stream  # the generator stops here: the stream stays readable until the next call
        if self.closed():
            raise WeightSyncError("torch_distributed: publisher closed")
        return None

    def close(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None
