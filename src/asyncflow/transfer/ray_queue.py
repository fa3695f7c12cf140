"""Ray deployment of the TransferQueue: one async controller actor and N storage-unit actors.

Owns: the actor wrappers around the very `Controller` and `StorageUnit` classes the in-process
queue uses, the Ray transport behind `TransferQueue`, and `RayTransferQueue.create`. The only
transfer module that imports `ray`.

Invariants:
- The controller actor runs on asyncio: a blocked request or backpressured append awaits an event
  that every state change sets, so many can wait without holding threads, and each ends after its
  own timeout with `TransferTimeout`.
- A storage actor stores cells, then awaits the controller's `add_rows` / `mark_ready`; if that fails
  it discards them (the contract of `StorageUnit.append` / `write`). Data never passes through the
  controller; column data travels as numpy arrays where the dtype allows (`_to_wire`).
- Errors raised in an actor reach the caller as their original class; a call past its deadline
  raises `TransferTimeout`, a dead actor `ConnectionError`.
- The queue object holds only actor handles: it pickles, so any actor can use it as a client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from asyncflow.transfer.client import Call, TransferQueue
from asyncflow.transfer.controller import Controller
from asyncflow.transfer.samplers import Sampler
from asyncflow.transfer.schema import BatchMeta, ColumnSpec, Packed, TransferTimeout
from asyncflow.transfer.storage import StorageUnit

T = TypeVar("T")


def _to_wire(columns: dict[str, Packed]) -> dict[str, tuple[np.ndarray | torch.Tensor, list[int] | None]]:
    """Packed columns with numpy values where the dtype has one: Ray ships numpy arrays out of band, much
    faster than pickled tensors (docs/benchmark-log.md). Other dtypes (bfloat16) travel as tensors."""
    out: dict[str, tuple[np.ndarray | torch.Tensor, list[int] | None]] = {}
    for column, (values, lengths) in columns.items():
        try:
            out[column] = (values.numpy(), lengths)
        except TypeError:
            out[column] = (values, lengths)
    return out


def _from_wire(columns: dict[str, tuple[Any, list[int] | None]]) -> dict[str, Packed]:
    """Inverse of `_to_wire`; copies, since arrays Ray hands back may be read-only views of its object store."""
    return {c: (torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v, n) for c, (v, n) in columns.items()}


def _cause(err: BaseException) -> BaseException:
    while isinstance(err, RayTaskError) and err.cause is not None:
        err = err.cause
    return err


def _forward(attr: str, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, attr), name)(*args, **kwargs)

    method.__name__ = name
    return method


class _ControllerActor:
    def __init__(self, **config: Any) -> None:
        self.controller = Controller(**config)
        self.controller.on_change = self._changed
        self._events: dict[str, asyncio.Event] = {}  # per partition, set (and replaced) on every change

    def _changed(self, partition: str | None) -> None:
        for name in [partition] if partition is not None else list(self._events):
            if name in self._events:
                self._events.pop(name).set()

    async def _wait(
        self, partition: str, attempt: Callable[[], T | None], timeout: float, explain: Callable[[], str], who: str,
        block: bool = True,
    ) -> T | None:
        """The asyncio twin of `Controller._block`: waits on an event that every state change sets."""
        start = time.monotonic()
        try:
            while True:
                event = self._events.setdefault(partition, asyncio.Event())
                result = attempt()
                if result is not None or not block:
                    return result
                remaining = start + timeout - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"timed out after {timeout:.3g}s: {explain()}")
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.controller.record_wait(who, time.monotonic() - start)

    def attach_units(self, units: list[Any]) -> None:
        self.controller.on_clear = lambda partition: [unit.drop.remote(partition) for unit in units]

    async def request(
        self,
        partition: str,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        sampler: Sampler | None = None,
        timeout: float = 60.0,
        block: bool = True,
        ack: Sequence[int] = (),
        consumer: str | None = None,
    ) -> BatchMeta | None:
        ctrl = self.controller
        ctrl.ack(partition, task, ack)
        attempt = lambda: ctrl.try_request(partition, task, columns, batch_size, sampler, consumer)
        explain = lambda: ctrl.explain_request(partition, task, columns, batch_size)
        return await self._wait(partition, attempt, timeout, explain, task, block)

    async def add_rows(
        self,
        partition: str,
        indices: Sequence[int],
        columns: dict[str, ColumnSpec],
        lengths: dict[str, list[int] | None],
        group_ids: Sequence[int | None],
        weight_versions: Sequence[int | None],
        metadata: Sequence[dict[str, Any]],
        timeout: float,
    ) -> list[int] | None:
        ctrl = self.controller
        fields = (group_ids, weight_versions, metadata)
        attempt = lambda: ctrl.try_add_rows(partition, indices, columns, lengths, *fields)
        explain = lambda: ctrl.explain_full(partition, len(indices))
        return await self._wait(partition, attempt, timeout, explain, "backpressure")


for _name in ("create_partition", "register_task", "seal", "ack", "clear", "reset", "release", "load_state_dict",
              "reserve", "unreserve", "mark_ready", "status", "metrics", "state_dict"):  # fmt: skip
    setattr(_ControllerActor, _name, _forward("controller", _name))


class _StorageActor:
    def __init__(self, rank: int, num_units: int, controller: Any) -> None:
        self.unit = StorageUnit(rank, num_units)
        self.controller = controller

    async def append(
        self,
        partition: str,
        columns: dict[str, tuple[Any, list[int] | None]],
        group_ids: Sequence[int | None],
        weight_versions: Sequence[int | None],
        metadata: Sequence[dict[str, Any]],
        timeout: float,
    ) -> list[int]:
        packed = _from_wire(columns)
        rows = self.unit.new_indices(len(group_ids))
        specs, lengths = self.unit.store(partition, rows, packed)
        try:
            fields = (group_ids, weight_versions, metadata)
            added: list[int] = await self.controller.add_rows.remote(partition, rows, specs, lengths, *fields, timeout)
            return added
        except BaseException as err:
            self.unit.discard(partition, rows, list(columns))
            raise _cause(err) from None

    async def write(
        self,
        partition: str,
        rows: Sequence[int],
        columns: dict[str, tuple[Any, list[int] | None]],
        weight_versions: Sequence[int | None] | None = None,
        metadata: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        packed = _from_wire(columns)
        specs, lengths = self.unit.store(partition, rows, packed)
        try:
            await self.controller.mark_ready.remote(partition, rows, specs, lengths, weight_versions, metadata)
        except BaseException as err:
            self.unit.discard(partition, rows, list(columns))
            raise _cause(err) from None

    async def read(
        self, partition: str, rows: Sequence[int], columns: Sequence[str]
    ) -> dict[str, tuple[np.ndarray | torch.Tensor, list[int] | None]]:
        return _to_wire(self.unit.read(partition, rows, columns))


for _name in ("drop", "metrics", "state_dict", "load_state_dict"):
    setattr(_StorageActor, _name, _forward("unit", _name))

ControllerActor = ray.remote(num_cpus=0)(_ControllerActor)
StorageActor = ray.remote(num_cpus=0)(_StorageActor)


_PACKED_ARG = {"append": 1, "write": 2}  # position of the packed columns in these storage calls


class _RayPending:
    def __init__(self, calls: list[Call], refs: list[Any]) -> None:
        self.methods = [method for _, method, _, _ in calls]
        self.refs = refs

    def wait(self, timeout: float) -> list[Any]:
        try:
            results = ray.get(self.refs, timeout=timeout)
            return [_from_wire(r) if m == "read" else r for r, m in zip(results, self.methods)]
        except GetTimeoutError:
            names = sorted(set(self.methods))
            raise TransferTimeout(f"remote call(s) {names} did not answer within {timeout:.3g}s") from None
        except RayTaskError as err:
            for ref in self.refs:  # fetch every result, so Ray does not log the other failures as unhandled
                try:
                    ray.get(ref, timeout=timeout)
                except Exception:
                    pass
            raise _cause(err) from None
        except RayActorError as err:
            raise ConnectionError(f"a TransferQueue actor died: {err}") from err


class RayTransport:
    """Calls actor methods concurrently: `submit` sends them and returns at once, `wait` on its result
    collects them, bounded by `timeout`. Column data of `append`, `write` and `read` travels as numpy
    arrays (see `_to_wire`); arguments are serialized when submitted, so callers may reuse them."""

    def submit(self, calls: list[Call]) -> _RayPending:
        refs: list[Any] = []
        for target, method, args, kwargs in calls:
            if method in _PACKED_ARG:
                at = _PACKED_ARG[method]
                args = (*args[:at], _to_wire(args[at]), *args[at + 1 :])
            refs.append(getattr(target, method).remote(*args, **kwargs))
        return _RayPending(calls, refs)


class RayTransferQueue(TransferQueue):
    """The TransferQueue client over Ray actors; same methods as the in-process queue."""

    @classmethod
    def create(
        cls,
        num_storage_units: int = 2,
        capacity: int | None = None,
        on_full: str = "block",
        tasks: Sequence[str] = (),
        timeout: float = 60.0,
        name: str | None = None,
        node_id: str | None = None,
    ) -> RayTransferQueue:
        """Start the actors (Ray must be initialised). `name` makes the controller a named actor. `node_id`: the
        node of the controller, and of the storage unit when there is one; several units are spread over the
        cluster's nodes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)} if node_id else {}
        options = {"name": name, **pinned} if name else pinned
        controller = ControllerActor.options(**options).remote(
            num_storage_units=num_storage_units, capacity=capacity, on_full=on_full, tasks=tasks
        )
        placed = StorageActor.options(**(pinned if num_storage_units == 1 else {"scheduling_strategy": "SPREAD"}))
        units = [placed.remote(rank, num_storage_units, controller) for rank in range(num_storage_units)]
        queue = cls(controller, units, RayTransport(), timeout)
        queue._control("attach_units", units)  # fails within `timeout` if the controller cannot start
        queue.metrics()
        return queue

    def shutdown(self) -> None:
        """Kill the actors; the data is gone."""
        for actor in [self._controller, *self._units]:
            ray.kill(actor)
