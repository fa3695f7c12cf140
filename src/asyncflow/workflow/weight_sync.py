"""Weight synchronisation: the trainer publishes versioned state dicts, inference engines receive them.

Owns: bucketing (`plan_buckets`, `pack`, `unpack`), the `WeightPublisher` / `WeightReceiver`
protocols, their transports and the `make_weight_sync` factory:

| kind                | reaches               | publish                                  |
|---------------------|-----------------------|------------------------------------------|
| `inprocess`         | the same process      | packs into a fresh buffer, swaps a reference |
| `shared_memory`     | processes, one host   | packs into the idle slot of a 2-slot file in /dev/shm, flips |
| `ray`               | a Ray cluster         | packs, then `ray.put`s buckets on a background thread |
| `torch_distributed` | a process group       | packs, then broadcasts buckets (gloo / NCCL) on a background thread |

Receivers are built in any process from `publisher.receiver_spec` (a small picklable dataclass;
`spec.open()`), except `inprocess`, whose spec only works inside the publishing process.

Invariants:
- A receiver returns whole versions only: every tensor of one published version, never a mix.
- Weights travel as a few large buckets: same-dtype tensors flattened into contiguous buffers of
  at most `bucket_bytes` (a larger tensor gets a bucket of its own), plus a `Manifest` (names,
  shapes, dtypes, offsets) that rebuilds the state dict. No transport makes a call per tensor.
- `publish` never waits for receivers. It costs one local copy of the weights (the snapshot: the
  trainer may step as soon as it returns); the remote part (`ray`, `torch_distributed`) runs on a
  background thread. A publish while an earlier version is still waiting to be sent **supersedes**
  it: that version is never sent and receivers skip it; the version already being sent completes.
  Receivers therefore converge to the newest version but may skip intermediate ones.
- Versions published by one publisher strictly increase.
- Every blocking call takes a timeout and ends in `WeightSyncTimeout` (transport, version, what was
  awaited); a closed or broken transport raises `WeightSyncError`. Nothing hangs silently.
- Received tensors are read-only snapshots: the transport never writes them again; callers copy
  them into their model (`load_state_dict`) and must not modify them in place.
- `publish` and `wait_published` are called from one thread (the trainer's).
"""

from __future__ import annotations

import datetime
import math
import mmap
import os
import pickle
import struct
import tempfile
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

DEFAULT_BUCKET_BYTES = 64 << 20
_ALIGN = 64  # byte alignment of buckets inside a payload, so any dtype view of them is legal

StateDict = dict[str, torch.Tensor]
Received = tuple[int, StateDict]


class WeightSyncError(RuntimeError):
    """The transport is closed or broken (publisher gone, a failed send, a dead peer)."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A blocking weight-sync call ran out of time."""

    def __init__(self, transport: str, version: int | None, waited_for: str, timeout_s: float):
        self.transport, self.version, self.waited_for, self.timeout_s = transport, version, waited_for, timeout_s
        of_version = "" if version is None else f" (version {version})"
        super().__init__(
            f"{transport} weight sync timed out after {timeout_s:.3g}s waiting for {waited_for}{of_version}"
        )


# ----------------------------------------------------------------------------------- buckets
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
    byte_offset: int  # inside the flat payload; a multiple of _ALIGN

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """How a state dict lies in a flat byte payload: buckets, and each tensor's place in them."""

    tensors: tuple[TensorEntry, ...]
    buckets: tuple[Bucket, ...]
    payload_bytes: int


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


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
        offset = _align(offset + numel * dtype.itemsize)
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


# --------------------------------------------------------------------------------- protocols
class WeightReceiver(Protocol):
    def poll(self, have_version: int) -> Received | None:
        """The newest complete version if it is newer than `have_version`, else None; never waits
        for a version to appear."""
        ...

    def wait_for(self, min_version: int, timeout: float) -> Received:
        """The newest complete version once it is >= `min_version`; `WeightSyncTimeout` otherwise."""
        ...

    def close(self) -> None: ...


class ReceiverSpec(Protocol):
    def open(self) -> WeightReceiver: ...


class WeightPublisher(Protocol):
    transport: str
    receiver_spec: ReceiverSpec

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Snapshot `state_dict` as `version` and make it visible to receivers, without waiting for them."""
        ...

    def wait_published(self, timeout: float) -> None:
        """Block until the last published version is visible to receivers."""
        ...

    def close(self) -> None: ...


class _PollingReceiver(ABC):
    """`wait_for` on top of `poll`: polls with a short, growing sleep until the deadline."""

    transport = ""

    @abstractmethod
    def poll(self, have_version: int) -> Received | None: ...

    def wait_for(self, min_version: int, timeout: float) -> Received:
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            received = self.poll(min_version - 1)
            if received is not None:
                return received
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(self.transport, min_version, f"a published version >= {min_version}", timeout)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.01)


def _check_increasing(transport: str, last: int | None, version: int) -> None:
    if last is not None and version <= last:
        raise ValueError(f"{transport}: version {version} is not newer than the last published {last}")


# --------------------------------------------------------------------------------- inprocess
class _InProcessSlot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latest: tuple[int, Manifest, list[torch.Tensor]] | None = None
        self.closed = False


@dataclass(frozen=True)
class InProcessSpec:
    slot: _InProcessSlot

    def open(self) -> InProcessReceiver:
        return InProcessReceiver(self.slot)


class InProcessPublisher:
    """Packs into a fresh payload per version and swaps the reference under a lock."""

    transport = "inprocess"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str = "cpu"):
        self.bucket_bytes, self.device = bucket_bytes, device
        self._slot = _InProcessSlot()
        self.receiver_spec = InProcessSpec(self._slot)

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        manifest = plan_buckets(state_dict, self.bucket_bytes)
        payload = allocate_payload(manifest, self.device)
        buckets = bucket_views(manifest, payload)
        pack(state_dict, manifest, buckets)
        with self._slot.lock:
            if self._slot.closed:
                raise WeightSyncError("inprocess: publish after close")
            latest = self._slot.latest
            _check_increasing(self.transport, None if latest is None else latest[0], version)
            self._slot.latest = (version, manifest, buckets)

    def wait_published(self, timeout: float) -> None:
        """A publish is visible when it returns."""

    def close(self) -> None:
        with self._slot.lock:
            self._slot.closed = True


class InProcessReceiver(_PollingReceiver):
    transport = "inprocess"

    def __init__(self, slot: _InProcessSlot):
        self._slot = slot

    def poll(self, have_version: int) -> Received | None:
        with self._slot.lock:
            latest, closed = self._slot.latest, self._slot.closed
        if latest is not None and latest[0] > have_version:
            return latest[0], unpack(latest[1], latest[2])
        if closed:
            raise WeightSyncError("inprocess: publisher closed")
        return None

    def close(self) -> None:
        """Nothing to release."""


# ----------------------------------------------------------------------------- shared memory
# File layout (all integers little-endian int64):
#   [0, 64)               control: magic, active slot, closed, manifest bytes, slot stride
#   [64, 64 + m)          pickled Manifest, written once before the file becomes visible
#   slot i at data_start + i * stride: [seq, version] (64-byte header) then the payload
# Seqlock: the writer makes the idle slot's seq odd, writes payload and version, makes seq even,
# then points `active` at it. A reader copies the active slot and keeps the copy only if seq was
# even and unchanged across the copy (else it re-reads `active` and retries). Store/load order
# across processes comes from x86-64 TSO; on weakly ordered CPUs from the barriers of the GIL
# hand-off around each torch copy.
_MAGIC = 0x57534E43_41464C57
_CONTROL = struct.Struct("<5q")
_SLOT = struct.Struct("<2q")
_SLOT_HEADER = 64
_TORN_READ_RETRIES = 100


def _shared_memory_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


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
        self.path = path or os.path.join(
            _shared_memory_dir(), f"asyncflow-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        )
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
        self._data_start = _align(_CONTROL.size + len(manifest_bytes))
        self._stride = _align(_SLOT_HEADER + manifest.payload_bytes)
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
        self._mm[_CONTROL.size : _CONTROL.size + len(manifest_bytes)] = manifest_bytes
        _CONTROL.pack_into(self._mm, 0, _MAGIC, -1, 0, len(manifest_bytes), self._stride)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._manifest = manifest

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        _check_increasing(self.transport, self._last_version, version)
        manifest = plan_buckets(state_dict, self.bucket_bytes)
        first = self._mm is None
        if first:
            self._create(manifest)
        elif self._bytes is None:
            raise WeightSyncError("shared_memory: publish after close")
        elif manifest != self._manifest:
            raise ValueError(
                "shared_memory: the state dict layout differs from the first publish (fixed per publisher)"
            )
        slot = 1 - self._active
        start = self._data_start + slot * self._stride
        seq, _ = _SLOT.unpack_from(self._mm, start)
        seq |= 1  # odd: being written (already odd if an earlier publish into this slot raised)
        _SLOT.pack_into(self._mm, start, seq, version)
        payload = self._bytes[start + _SLOT_HEADER : start + _SLOT_HEADER + manifest.payload_bytes]
        pack(state_dict, manifest, bucket_views(manifest, payload))
        del payload
        _SLOT.pack_into(self._mm, start, seq + 1, version)
        magic, _, closed, manifest_len, stride = _CONTROL.unpack_from(self._mm, 0)
        _CONTROL.pack_into(self._mm, 0, magic, slot, closed, manifest_len, stride)
        self._active, self._last_version = slot, version
        if first:
            os.rename(self.path + ".tmp", self.path)

    def wait_published(self, timeout: float) -> None:
        """A publish is visible when it returns."""

    def close(self) -> None:
        if self._mm is not None and self._bytes is not None:
            values = list(_CONTROL.unpack_from(self._mm, 0))
            values[2] = 1
            _CONTROL.pack_into(self._mm, 0, *values)
            self._bytes = None
            self._mm.close()
        self._bytes = None
        self._unlink()


class SharedMemoryReceiver(_PollingReceiver):
    transport = "shared_memory"

    def __init__(self, path: str):
        self.path = path
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._manifest: Manifest | None = None
        self._data_start = self._stride = 0

    def _attach(self) -> bool:
        try:
            # read-write only because torch.frombuffer wants a writable buffer; receivers never write
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
        self._manifest = pickle.loads(self._mm[_CONTROL.size : _CONTROL.size + manifest_len])
        self._data_start = _align(_CONTROL.size + manifest_len)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        return True

    def poll(self, have_version: int) -> Received | None:
        if self._mm is None and not self._attach():
            return None
        if self._bytes is None or self._manifest is None:
            raise WeightSyncError("shared_memory: receiver used after close")
        manifest = self._manifest
        for _ in range(_TORN_READ_RETRIES):
            _, slot, closed, _, _ = _CONTROL.unpack_from(self._mm, 0)
            start = self._data_start + slot * self._stride
            seq_before, version = _SLOT.unpack_from(self._mm, start)
            if seq_before % 2:
                continue
            if version <= have_version:
                if closed:
                    raise WeightSyncError(f"shared_memory: publisher of {self.path} closed")
                return None
            payload = allocate_payload(manifest)
            payload.copy_(self._bytes[start + _SLOT_HEADER : start + _SLOT_HEADER + manifest.payload_bytes])
            seq_after, _ = _SLOT.unpack_from(self._mm, start)
            if seq_after == seq_before:
                return version, unpack(manifest, bucket_views(manifest, payload))
        return None  # the writer kept overwriting what we read; wait_for retries until its deadline

    def close(self) -> None:
        self._bytes = self._manifest = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


# ---------------------------------------------------------------- background sending (ray, dist)
@dataclass
class _Staged:
    manifest: Manifest
    payload: torch.Tensor
    buckets: list[torch.Tensor] = field(default_factory=list)
    version: int = -1


class _BackgroundSender:
    """Double-buffered staging plus one sender thread.

    `publish` packs into a free staging payload and queues it; the thread sends it with
    `send(version, manifest, buckets)`. Two payloads circulate: one being sent, the other pending
    or free. A publish while one is pending supersedes it (reuses its payload; that version is
    never sent). The first failure is sticky: every later call raises it.
    """

    def __init__(
        self,
        transport: str,
        send: Callable[[int, Manifest, list[torch.Tensor]], None],
        *,
        bucket_bytes: int,
        staging_device: torch.device | str = "cpu",
        connect: Callable[[], None] | None = None,
    ):
        self.transport, self.bucket_bytes = transport, bucket_bytes
        self.staging_device = torch.device(staging_device)
        self._send, self._connect = send, connect
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

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        manifest = plan_buckets(state_dict, self.bucket_bytes)
        with self._cond:
            self._raise_if_unusable()
            _check_increasing(self.transport, self.last_version, version)
            if self._pending is not None:
                staged, self._pending = self._pending, None
                self.superseded += 1
            else:
                staged = self._free.pop() if self._free else None
        if staged is None or staged.manifest != manifest:
            payload = allocate_payload(manifest, self.staging_device)
            staged = _Staged(manifest, payload, bucket_views(manifest, payload))
        pack(state_dict, manifest, staged.buckets)
        if staged.payload.is_cuda:  # the sender thread must not read the payload before the copy lands
            torch.cuda.current_stream(staged.payload.device).synchronize()
        staged.version = version
        with self._cond:
            self._pending = staged
            self.last_version = version
            self._cond.notify_all()

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
                    while self._pending is None and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                    staged, self._pending, self._sending = self._pending, None, True
                self._send(staged.version, staged.manifest, staged.buckets)
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


# --------------------------------------------------------------------------------------- ray
@dataclass(frozen=True)
class RaySpec:
    store_name: str
    namespace: str | None
    timeout_s: float

    def open(self) -> RayWeightReceiver:
        return RayWeightReceiver(self)


class RayWeightPublisher:
    """`ray.put`s each bucket, then records the refs in a named weight-store actor.

    Ray must be initialised. Receivers ask the store for refs newer than theirs and `ray.get` them.
    The store holds the latest version only; older objects are freed once no receiver holds them.
    """

    transport = "ray"

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        store_name: str | None = None,
        namespace: str | None = None,
        timeout_s: float = 60.0,
    ):
        from asyncflow.runtime import ray_weight_sync as adapter

        self._adapter, self.timeout_s = adapter, timeout_s
        name = store_name or f"asyncflow-weight-store-{uuid.uuid4().hex[:12]}"
        self._store = adapter.create_weight_store(name, namespace)
        self.receiver_spec = RaySpec(name, namespace, timeout_s)
        self._sender = _BackgroundSender(self.transport, self._send, bucket_bytes=bucket_bytes)

    def _send(self, version: int, manifest: Manifest, buckets: list[torch.Tensor]) -> None:
        arrays = [b.view(torch.uint8).numpy() for b in buckets]
        try:
            self._adapter.store_version(self._store, version, pickle.dumps(manifest), arrays, self.timeout_s)
        except TimeoutError as err:
            raise WeightSyncTimeout(
                self.transport, version, f"the weight store to record it ({err})", self.timeout_s
            ) from err
        except ConnectionError as err:
            raise WeightSyncError(f"ray: storing version {version} failed: {err}") from err

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._sender.publish(state_dict, version)

    def wait_published(self, timeout: float) -> None:
        self._sender.wait_published(timeout)

    @property
    def superseded(self) -> int:
        return self._sender.superseded

    def close(self) -> None:
        self._sender.close(self.timeout_s)
        self._adapter.kill_weight_store(self._store)


class RayWeightReceiver(_PollingReceiver):
    transport = "ray"

    def __init__(self, spec: RaySpec):
        from asyncflow.runtime import ray_weight_sync as adapter

        self._adapter, self._spec = adapter, spec
        try:
            self._store = adapter.find_weight_store(spec.store_name, spec.namespace, spec.timeout_s)
        except TimeoutError as err:
            raise WeightSyncTimeout(self.transport, None, f"weight store {spec.store_name!r}", spec.timeout_s) from err

    def poll(self, have_version: int) -> Received | None:
        try:
            latest = self._adapter.fetch_newer(self._store, have_version, self._spec.timeout_s)
        except TimeoutError as err:
            raise WeightSyncTimeout(
                self.transport, have_version + 1, f"weights from the store ({err})", self._spec.timeout_s
            ) from err
        except ConnectionError as err:
            raise WeightSyncError(
                f"ray: weight store {self._spec.store_name!r} unreachable (publisher closed?): {err}"
            ) from err
        if latest is None:
            return None
        version, manifest_bytes, arrays = latest
        manifest: Manifest = pickle.loads(manifest_bytes)
        payload = allocate_payload(manifest)
        buckets = bucket_views(manifest, payload)
        for bucket, array in zip(buckets, arrays, strict=True):
            bucket.view(torch.uint8).numpy()[:] = array  # out of the read-only object-store mapping
        return version, unpack(manifest, buckets)

    def close(self) -> None:
        """Holds no objects between polls."""


# ------------------------------------------------------------------------- torch.distributed
# Protocol (rank 0 publishes, ranks 1..N receive), over a private TCPStore + process group that
# never touches the default process group:
#   join:      each receiver bumps store key "joined"; rank 0 builds the group once all N joined.
#   announce:  for its k-th send rank 0 sets "announce/k" = (version, manifest id) (and
#              "manifest/<id>" when the layout changes), then broadcasts every bucket from rank 0.
#   receive:   a receiver that has taken k-1 sends sees "announce/k" and joins exactly those
#              broadcasts, in order; `poll` drains every announced send and returns the newest.
# Broadcasts are collective: a send completes only when every receiver has polled. Each
# broadcast waits at most `timeout_s`; after a timeout the group is out of step and the
# transport is broken (WeightSyncError on every later call): close it and build a new one.
def _make_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"torch_distributed: unknown backend {backend!r} (gloo or nccl)")


def _broadcast(group: Any, tensor: torch.Tensor, timeout_s: float, version: int, what: str) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        group.broadcast(tensor, 0, timeout).wait(timeout)
    except RuntimeError as err:
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            raise WeightSyncTimeout(
                "torch_distributed", version, f"{what} (every receiver must poll)", timeout_s
            ) from err
        raise WeightSyncError(f"torch_distributed: {what} of version {version} failed: {err}") from err


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


class TorchDistributedPublisher:
    """Rank 0 of a private process group; broadcasts buckets on a background thread."""

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
        self._sends = 0
        self._manifests: dict[Manifest, int] = {}
        self._sender = _BackgroundSender(
            self.transport, self._send, bucket_bytes=bucket_bytes, staging_device=device, connect=self._connect
        )

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
        self._group = _make_group(
            dist.PrefixStore("group", self._store), 0, self.num_receivers + 1, self.backend, self.timeout_s
        )

    def _send(self, version: int, manifest: Manifest, buckets: list[torch.Tensor]) -> None:
        manifest_id = self._manifests.get(manifest)
        if manifest_id is None:
            manifest_id = self._manifests[manifest] = len(self._manifests)
            self._store.set(f"manifest/{manifest_id}", pickle.dumps(manifest))
        self._sends += 1
        self._store.set(f"announce/{self._sends}", pickle.dumps((version, manifest_id)))
        for i, bucket in enumerate(buckets):
            _broadcast(self._group, bucket, self.timeout_s, version, f"broadcast of bucket {i + 1}/{len(buckets)}")

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._sender.publish(state_dict, version)

    def wait_published(self, timeout: float) -> None:
        self._sender.wait_published(timeout)

    @property
    def superseded(self) -> int:
        return self._sender.superseded

    def close(self) -> None:
        self._closed.set()
        if not self._sender.close(self.timeout_s):
            return  # a broadcast is still stuck; it ends with its own timeout
        self._store.set("closed", b"1")
        if self._group is not None:
            self._group.shutdown()
            self._group = None


class TorchDistributedReceiver(_PollingReceiver):
    transport = "torch_distributed"

    def __init__(self, spec: TorchDistributedSpec):
        import torch.distributed as dist

        if spec.rank is None or not 1 <= spec.rank < spec.world_size:
            raise ValueError(f"torch_distributed: receiver rank must be in 1..{spec.world_size - 1} (spec.for_rank)")
        self._spec = spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            self._store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
            self._store.add("joined", 1)
            self._group = _make_group(
                dist.PrefixStore("group", self._store), spec.rank, spec.world_size, spec.backend, spec.timeout_s
            )
        except RuntimeError as err:  # DistStoreError and gloo's connect errors are RuntimeErrors
            raise WeightSyncTimeout(
                self.transport, None, f"the group at {spec.host}:{spec.port} to form ({err})", spec.timeout_s
            ) from err
        self._taken = 0
        self._manifests: dict[int, Manifest] = {}

    def _receive(self, key: str) -> tuple[int, Manifest, list[torch.Tensor]]:
        version, manifest_id = pickle.loads(self._store.get(key))
        manifest = self._manifests.get(manifest_id)
        if manifest is None:
            manifest = self._manifests[manifest_id] = pickle.loads(self._store.get(f"manifest/{manifest_id}"))
        buckets = bucket_views(manifest, allocate_payload(manifest, self._spec.device))
        for i, bucket in enumerate(buckets):
            _broadcast(
                self._group, bucket, self._spec.timeout_s, version, f"broadcast of bucket {i + 1}/{len(buckets)}"
            )
        return version, manifest, buckets

    def poll(self, have_version: int) -> Received | None:
        newest = None
        try:
            while self._store.check([f"announce/{self._taken + 1}"]):
                newest = self._receive(f"announce/{self._taken + 1}")
                self._taken += 1
            closed = newest is None and self._store.check(["closed"])
        except RuntimeError as err:
            if isinstance(err, WeightSyncError):
                raise
            raise WeightSyncError(
                f"torch_distributed: store at {self._spec.host}:{self._spec.port} failed: {err}"
            ) from err
        if newest is not None and newest[0] > have_version:
            return newest[0], unpack(newest[1], newest[2])
        if closed:
            raise WeightSyncError("torch_distributed: publisher closed")
        return None

    def close(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None


# ------------------------------------------------------------------------------------ factory
TransportKind = Literal["inprocess", "shared_memory", "ray", "torch_distributed"]


def make_weight_sync(
    kind: TransportKind, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> WeightPublisher:
    """A publisher of the given transport; receivers: `publisher.receiver_spec.open()` (for
    `torch_distributed`, `receiver_spec.for_rank(r).open()` with r in 1..num_receivers).

    options: inprocess: `device`; shared_memory: `path`; ray: `store_name`, `namespace`, `timeout_s`;
    torch_distributed: `num_receivers` (required), `host`, `port`, `backend`, `device`, `timeout_s`.
    """
    if kind == "inprocess":
        return InProcessPublisher(bucket_bytes, **options)
    if kind == "shared_memory":
        return SharedMemoryPublisher(bucket_bytes, **options)
    if kind == "ray":
        return RayWeightPublisher(bucket_bytes, **options)
    if kind == "torch_distributed":
        return TorchDistributedPublisher(bucket_bytes=bucket_bytes, **options)
    raise ValueError(f"unknown weight-sync transport {kind!r}: inprocess, shared_memory, ray or torch_distributed")
