"""Collective weight groups: one sender (rank 0, the process holding the state dict) broadcasts a version's
buckets to N receivers (ranks 1..N, e.g. vLLM's workers), over gloo (CPU tensors) or NCCL (CUDA tensors).

Owns: `backend_for` (the backend a device needs), `host_store` / `join_group` (a private TCPStore and process
group that never touch the default process group), and `CollectiveGroup`, whose `send` / `receive` move one
version's buckets (`asyncflow.weights.buckets`) as one broadcast per bucket.

Protocol: the sender makes the store (`host_store`), the receivers are told its address by other means (the
vLLM adapter passes it through `collective_rpc`), and every rank calls `join_group`, which returns once all
`world_size` ranks are in. For each version the receivers learn the `Manifest` out of band, then every rank
walks the buckets in order: rank 0 broadcasts bucket i, ranks 1..N receive it. Nothing else travels.

Invariants:
- Every blocking call (join, each broadcast) waits at most the group's `timeout_s` and then raises
  `WeightSyncTimeout` whose message names the side that did not show up: the sender's names the receivers,
  a receiver's names rank 0 (the sender). Any other failure raises `WeightSyncError` naming this side's rank.
- After a failure the group is out of step (`broken`): it is never used again; callers make a new one.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from asyncflow.weights.base import WeightSyncError, WeightSyncTimeout
from asyncflow.weights.buckets import Manifest, TensorEntry
from asyncflow.weights.torch_distributed import make_group

TRANSPORT = "collective"


def backend_for(device: torch.device | str) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors: the same code path on both."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"collective weight transfer: no backend for device {str(device)!r} (cpu: gloo, cuda: nccl)")


def host_store(host: str, timeout_s: float) -> Any:
    """The sender's TCPStore on a free port of `host` (`store.port`); receivers connect to it in `join_group`."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, 0, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _side(rank: int) -> str:
    return "rank 0 (the sender)" if rank == 0 else f"receiver rank {rank}"


@dataclass
class CollectiveGroup:
    """This process's membership of a weight group: `rank` 0 sends, the others receive."""

    group: Any
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    side: str  # how errors name this process ("the trainer side", "vLLM worker 0", ...)
    broken: bool = False

    def _start(self, tensor: torch.Tensor, version: int, what: str) -> tuple[Any, int, str]:
        """Post the broadcast of `tensor` (it runs on the backend's threads); `_wait` for it."""
        if self.broken:
            raise WeightSyncError(f"{TRANSPORT}: {self.side} ({_side(self.rank)}): the group broke in an earlier call")
        try:
            return self.group.broadcast(tensor, 0, datetime.timedelta(seconds=self.timeout_s)), version, what
        except RuntimeError as err:
            self._failed(err, version, what)

    def _wait(self, posted: tuple[Any, int, str]) -> None:
        work, version, what = posted
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            self._failed(err, version, what)

    def _failed(self, err: RuntimeError, version: int, what: str) -> NoReturn:
        self.broken = True
        awaited = f"every receiver (ranks 1..{self.world_size - 1}) to take {what}" if self.rank == 0 \
            else f"rank 0 (the sender) to send {what}"
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            raise WeightSyncTimeout(
                TRANSPORT, version, f"{awaited}, on {self.side} ({_side(self.rank)})", self.timeout_s
            ) from err
        raise WeightSyncError(
            f"{TRANSPORT}: {self.side} ({_side(self.rank)}) failed waiting for {awaited} of version {version}: {err}"
        ) from err

    def send(self, buckets: Iterable[torch.Tensor], version: int, count: int | None = None) -> None:
        """Rank 0: broadcast every bucket, in order, each waited for at most `timeout_s`. A list is posted at once;
        any other iterable (`count` buckets, e.g. a stream's as they arrive) one bucket at a time, each sent before
        the next is taken, so this side holds one of them."""
        if isinstance(buckets, list):
            posted = [self._start(b, version, f"bucket {i + 1}/{len(buckets)}") for i, b in enumerate(buckets)]
            for p in posted:
                self._wait(p)
        else:
            number = 0
            for bucket in buckets:  # not enumerate: its cached tuple would keep a bucket alive while the next is built
                number += 1
                self._wait(self._start(bucket, version, f"bucket {number}/{count or '?'}"))
                del bucket
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive(self, manifest: Manifest, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..N: (name, tensor) of every tensor of the version, bucket by bucket as each arrives: the next
        bucket's broadcast is posted before this one's tensors are yielded, so a consumer loads a bucket while the
        next is on the way. Each bucket is a fresh buffer; the tensors are views of it, but for a tensor split over
        buckets (`plan_buckets`): its slices are copied into one tensor allocated at its first slice, yielded whole
        after its last (vLLM's loaders take a tensor only whole), so this side then holds that tensor too. Exhaust
        the iterator: a bucket never asked for leaves the sender waiting."""
        members: list[list[TensorEntry]] = [[] for _ in manifest.buckets]
        for entry in manifest.tensors:
            members[entry.bucket].append(entry)
        count = len(manifest.buckets)

        def post(i: int) -> tuple[torch.Tensor, tuple[Any, int, str]]:
            buffer = torch.empty(manifest.buckets[i].numel, dtype=manifest.buckets[i].dtype, device=self.device)
            return buffer, self._start(buffer, version, f"bucket {i + 1}/{count}")

        upcoming = post(0) if count else None
        whole: torch.Tensor | None = None  # the split tensor being reassembled
        i = 0
        while upcoming is not None:  # bucket i is posted
            buffer, posted = upcoming
            self._wait(posted)
            upcoming = post(i + 1) if i + 1 < count else None
            for e in members[i]:
                piece = buffer[e.offset : e.offset + e.numel].view(e.piece_shape)
                if e.rows is None:
                    yield e.name, piece
                    continue
                if e.rows[0] == 0:
                    whole = torch.empty(e.shape, dtype=e.dtype, device=self.device)
                assert whole is not None  # a split tensor's slices arrive in order
                whole[e.rows[0] : e.rows[1]].copy_(piece)
                if e.rows[1] == e.shape[0]:
                    yield e.name, whole
                    whole = None
            i += 1

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except RuntimeError:  # a group whose peer is gone may refuse a clean shutdown
                pass
            self.group = None
            self.broken = True


def join_group(
    host: str, port: int, rank: int, world_size: int, *, device: torch.device | str, timeout_s: float, side: str,
    store: Any = None,
) -> CollectiveGroup:
    """Join the group whose store is at `host:port` (rank 0 passes its own `store`); returns once all
    `world_size` ranks have joined, else `WeightSyncTimeout` naming the ranks that were awaited."""
    import torch.distributed as dist

    device = torch.device(device)
    try:
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        group = make_group(dist.PrefixStore("asyncflow-weights", store), rank, world_size, backend_for(device),
                            timeout_s)
    except RuntimeError as err:  # DistStoreError and gloo's connect errors are RuntimeErrors
        others = f"ranks 1..{world_size - 1} (the receivers)" if rank == 0 else "rank 0 (the sender) and the others"
        raise WeightSyncTimeout(
            TRANSPORT, None, f"{others} to join the group at {host}:{port}, on {side} ({_side(rank)}): {err}",
            timeout_s,
        ) from err
    return CollectiveGroup(group, rank, world_size, device, timeout_s, side)
