"""Ray deployment of the TransferQueue: one async controller actor and N storage-unit actors.

Owns: the actor wrappers around the very `Controller` and `StorageUnit` classes the in-process
queue uses, the Ray transport behind `TransferQueue`, and `RayTransferQueue.create`. The only
transfer module that imports `ray`.

Invariants:
- The controller actor runs on asyncio: a blocked request or backpressured append awaits an event
  that every state change sets, so many can wait without holding threads, and each ends after its
  own timeout with `TransferTimeout`.
- A storage actor stores cells, then awaits the controller's `mark_ready`; if that fails it discards
  the cells (the same contract as `StorageUnit.write`). Data never passes through the controller.
- Errors raised in an actor reach the caller as their original class; a call past its deadline
  raises `TransferTimeout`, a dead actor `ConnectionError`.
- The queue object holds only actor handles: it pickles, so any actor can use it as a client.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from asyncflow.transfer.client import Call, TransferQueue
from asyncflow.transfer.controller import Controller
from asyncflow.transfer.schema import TransferTimeout
from asyncflow.transfer.storage import StorageUnit


def _cause(err: BaseException) -> BaseException:
    while isinstance(err, RayTaskError) and err.cause is not None:
        err = err.cause
    return err


def _forward(attr: str, name: str, touches: bool = False):
    async def method(self, *args, **kwargs):
        result = getattr(getattr(self, attr), name)(*args, **kwargs)
        if touches:
            self._touched()
        return result

    method.__name__ = name
    return method


class _ControllerActor:
    def __init__(self, **config) -> None:
        self.controller = Controller(**config)
        self._changed = asyncio.Event()

    def _touched(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, attempt: Callable, timeout: float, explain: Callable[[], str], who: str):
        start = time.monotonic()
        try:
            while True:
                result = attempt()
                if result is not None:
                    self._touched()
                    return result
                remaining = start + timeout - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"timed out after {timeout:.3g}s: {explain()}")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.controller.record_wait(who, time.monotonic() - start)

    def attach_units(self, units: list) -> None:
        self.controller.on_clear = lambda partition: [unit.drop.remote(partition) for unit in units]

    async def request(self, partition, task, columns, batch_size, sampler=None, timeout=60.0, block=True, ack=()):
        ctrl = self.controller
        if ack:
            ctrl.ack(partition, task, ack)
            self._touched()
        attempt = lambda: ctrl.try_request(partition, task, columns, batch_size, sampler)  # noqa: E731
        explain = lambda: ctrl.explain_request(partition, task, columns, batch_size)  # noqa: E731
        if not block:
            return self._once(attempt, task)
        return await self._wait(attempt, timeout, explain, task)

    async def allocate(self, partition, num, columns, group_ids, weight_versions, metadata, timeout):
        ctrl = self.controller
        attempt = lambda: ctrl.try_allocate(partition, num, columns, group_ids, weight_versions, metadata)  # noqa: E731
        return await self._wait(attempt, timeout, lambda: ctrl.explain_full(partition, num), "backpressure")

    def _once(self, attempt: Callable, who: str):
        start = time.monotonic()
        result = attempt()
        if result is not None:
            self._touched()
        self.controller.record_wait(who, time.monotonic() - start)
        return result


for _name in ("create_partition", "register_task", "seal", "ack", "clear", "reset", "mark_ready", "load_state_dict"):
    setattr(_ControllerActor, _name, _forward("controller", _name, touches=True))
for _name in ("status", "metrics", "state_dict"):
    setattr(_ControllerActor, _name, _forward("controller", _name))


class _StorageActor:
    def __init__(self, controller) -> None:
        self.unit = StorageUnit()
        self.controller = controller

    async def write(self, partition, rows, columns, weight_versions=None, metadata=None) -> None:
        specs, lengths = self.unit.store(partition, rows, columns)
        try:
            await self.controller.mark_ready.remote(partition, rows, specs, lengths, weight_versions, metadata)
        except BaseException as err:
            self.unit.discard(partition, rows, list(columns))
            raise _cause(err) from None


for _name in ("read", "drop", "metrics", "state_dict", "load_state_dict"):
    setattr(_StorageActor, _name, _forward("unit", _name))

ControllerActor = ray.remote(num_cpus=0)(_ControllerActor)
StorageActor = ray.remote(num_cpus=0)(_StorageActor)


class RayTransport:
    """Calls actor methods concurrently and waits for all of them, bounded by `timeout`."""

    def call_all(self, calls: list[Call], timeout: float) -> list:
        refs = [getattr(target, method).remote(*args, **kwargs) for target, method, args, kwargs in calls]
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            names = sorted({method for _, method, _, _ in calls})
            raise TransferTimeout(f"remote call(s) {names} did not answer within {timeout:.3g}s") from None
        except RayTaskError as err:
            for ref in refs:  # fetch every result, so Ray does not log the other failures as unhandled
                try:
                    ray.get(ref, timeout=timeout)
                except Exception:
                    pass
            raise _cause(err) from None
        except RayActorError as err:
            raise ConnectionError(f"a TransferQueue actor died: {err}") from err


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
    ) -> RayTransferQueue:
        """Start the actors (Ray must be initialised). `name` makes the controller a named actor.
        Storage units are spread over the cluster's nodes."""
        options = {"name": name} if name else {}
        controller = ControllerActor.options(**options).remote(
            num_storage_units=num_storage_units, capacity=capacity, on_full=on_full, tasks=tasks
        )
        units = [StorageActor.options(scheduling_strategy="SPREAD").remote(controller) for _ in range(num_storage_units)]
        queue = cls(controller, units, RayTransport(), timeout)
        queue._control("attach_units", units)  # fails within `timeout` if the controller cannot start
        queue.metrics()
        return queue

    def shutdown(self) -> None:
        """Kill the actors; the data is gone."""
        for actor in [self._controller, *self._units]:
            ray.kill(actor)
