"""Client: the one API every worker uses, whether the queue runs in-process or as Ray actors.

Owns: `TransferQueue` (append rows, write columns into existing rows, request batch metadata,
read the data straight from the storage units, stream micro-batches, optionally prefetched one
ahead by a thread, lifecycle, checkpoints, metrics) and the in-process deployment
(`TransferQueue.local`, threads sharing one controller and N storage units).
`asyncflow.transfer.ray_queue` builds the same client over Ray actors.

Invariants:
- The client keeps no state of its own (bar a round-robin counter): the controller decides, the
  storage units hold the bytes. A client over Ray actors therefore pickles (as actor handles) and
  works from any actor.
- Input is checked (row counts, tensor types, one dtype and trailing shape per column) before
  anything is sent; the controller checks it against the partition's schema, and a rejected append
  or write leaves nothing stored. One append goes to one storage unit (round robin), which numbers
  the rows itself, so it is all-or-nothing; a write spanning several units first `reserve`s its
  cells at the controller, so it is all-or-nothing too.
- Row `i` lives on storage unit `i % num_storage_units`; reads go to those units directly.
- Every call that can block takes a timeout (default `self.timeout`) and ends in `TransferTimeout`.
- A write sent with `wait=False` is not ready to consumers until it is stored; its `PendingWrite.wait()`
  (bounded by `self.timeout`) is where its error surfaces.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import torch

from asyncflow.transfer.controller import Controller
from asyncflow.transfer.samplers import Sampler
from asyncflow.transfer.schema import (
    Batch,
    BatchMeta,
    ColumnSpec,
    TransferTimeout,
    UnknownColumnError,
    check_rows,
    column_rows,
    pack_rows,
    pad_rows,
    unpack_rows,
)
from asyncflow.transfer.storage import StorageUnit

ALIVE_CHECK_S = 1.0  # how often a waiting `loader` asks its `alive` callback

Call = tuple[Any, str, tuple[Any, ...], dict[str, Any]]  # (target, method name, args, kwargs)
_T = TypeVar("_T")


class _Done:
    def __init__(self, results: list[Any] | None = None, error: BaseException | None = None) -> None:
        self.results: list[Any] = [] if results is None else results
        self.error = error

    def wait(self, timeout: float) -> list[Any]:
        if self.error is not None:
            raise self.error
        return self.results


class LocalTransport:
    """Direct calls on in-process objects; they lock internally, so any thread may call. `submit` runs
    the calls at once (an error is raised by `wait`, as a remote transport would)."""

    def submit(self, calls: list[Call]) -> _Done:
        try:
            return _Done([getattr(target, method)(*args, **kwargs) for target, method, args, kwargs in calls])
        except Exception as err:  # noqa: BLE001 - re-raised by wait()
            return _Done(error=err)


class PendingWrite:
    """A write sent with `TransferQueue.write(..., wait=False)`. `wait()` (idempotent) returns once its
    cells are stored, or raises its error after releasing the cells a multi-unit write had reserved."""

    def __init__(self, pending: Any, timeout: float, undo: Callable[[], Any]) -> None:
        self._pending, self._timeout, self._undo = pending, timeout, undo

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait(self._timeout)
        except BaseException:
            self._undo()
            raise


class TransferQueue:
    def __init__(self, controller: Any, units: Sequence[Any], transport: Any, timeout: float = 60.0) -> None:
        """`controller` / `units`: objects or actor handles with the `Controller` / `StorageUnit` methods;
        `transport.submit(calls)` invokes them and returns an object whose `wait(timeout)` returns their
        results in order or raises their error. `timeout`: default wait of blocking calls, and the slack
        every remote call gets on top of its own wait."""
        self._controller = controller
        self._units = list(units)
        self._transport = transport
        self.timeout = timeout
        self._next_unit = 0  # round robin of appends over the storage units

    @classmethod
    def local(
        cls,
        num_storage_units: int = 2,
        capacity: int | None = None,
        on_full: str = "block",
        tasks: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> TransferQueue:
        """In-process queue. `capacity`: default rows in flight per partition (None: unbounded); `on_full`:
        "block" (producers wait) or "error"; `tasks`: consumers that must acknowledge a partition's rows before
        they stop counting against capacity and before the partition clears."""
        controller = Controller(num_storage_units, capacity, on_full, tasks)
        units = [StorageUnit(rank, num_storage_units, controller) for rank in range(num_storage_units)]

        def drop(partition: str) -> None:
            for unit in units:
                unit.drop(partition)

        controller.on_clear = drop
        return cls(controller, units, LocalTransport(), timeout)

    @property
    def num_storage_units(self) -> int:
        return len(self._units)

    # ---- lifecycle ----------------------------------------------------------------------------
    def create_partition(
        self,
        partition: str,
        *,
        num_rows: int | None = None,
        columns: Mapping[str, ColumnSpec] | None = None,
        capacity: int | None = None,
        group_size: int | None = None,
    ) -> None:
        """Optional (appending creates a partition with defaults). `num_rows`: complete once that many rows
        exist; `columns`: the closed set of columns with their schemas; `group_size`: for GroupSampler."""
        cols = dict(columns) if columns is not None else None
        self._control("create_partition", partition, num_rows, cols, capacity, group_size)

    def register_task(self, task: str) -> None:
        """Partitions clear, and rows stop counting against capacity, once every registered task acknowledged them."""
        self._control("register_task", task)

    def seal(self, partition: str) -> None:
        """No more rows will be appended to `partition`."""
        self._control("seal", partition)

    def ack(self, partition: str, task: str, indices: Sequence[int]) -> None:
        """`task` is done with rows it was handed (the loader does this for you). Once every registered task
        acknowledged every row of a complete partition, the partition is cleared and its data dropped."""
        self._control("ack", partition, task, list(indices))

    def clear(self, partition: str) -> None:
        """Drop the partition and its data now, whoever still wanted it."""
        self._control("clear", partition)

    def reset(self, partition: str, task: str | None = None, indices: Sequence[int] | None = None) -> None:
        """Make rows (default: all) deliverable again to `task` (default: every task), e.g. after a failure."""
        self._control("reset", partition, task, None if indices is None else list(indices))

    def release(self, task: str, consumer: str, unless_ready: Sequence[str]) -> dict[str, list[int]]:
        """Make the rows `consumer` took for `task` deliverable again where `unless_ready` columns are not all
        written (the consumer died holding them). Returns the released rows per partition."""
        return cast("dict[str, list[int]]", self._control("release", task, consumer, list(unless_ready)))

    def status(self, partition: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self._control("status", partition))

    # ---- producing ------------------------------------------------------------------------------
    def append(
        self,
        partition: str,
        columns: Mapping[str, Any],
        *,
        group_ids: Sequence[int | None] | None = None,
        weight_version: int | Sequence[int | None] | None = None,
        metadata: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Append new rows; returns their global indices. `columns[c]`: one tensor per row (or a tensor whose
        dim 0 indexes rows). Blocks up to `timeout` while the partition is at capacity."""
        rows = {column: column_rows(value) for column, value in columns.items()}
        num = len(next(iter(rows.values()))) if rows else 0
        names = [f"#{i} of the append" for i in range(num)]
        specs = {column: check_rows(partition, column, r, names) for column, r in rows.items()}
        if not specs:
            raise ValueError(f"partition {partition!r}: append needs at least one column")
        group_ids = _per_row(group_ids, num, "group_ids", partition)
        versions = _per_row(weight_version, num, "weight_version", partition)
        metas = [m or {} for m in _per_row(metadata, num, "metadata", partition)]
        wait = self.timeout if timeout is None else timeout
        unit, self._next_unit = self._next_unit, (self._next_unit + 1) % len(self._units)
        packed = {column: pack_rows(r) for column, r in rows.items()}
        call: Call = (self._units[unit], "append", (partition, packed, group_ids, versions, metas, wait), {})
        return cast("list[int]", self._call([call], wait + self.timeout)[0])

    def write(
        self,
        partition: str,
        indices: Sequence[int],
        columns: Mapping[str, Any],
        *,
        weight_version: int | Sequence[int | None] | None = None,
        metadata: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
        wait: bool = True,
    ) -> PendingWrite | None:
        """Write further columns of existing rows, and update their weight version / metadata with them
        (with no columns, only those row fields are updated).

        With `wait=False` the write is checked and sent, and a `PendingWrite` comes back at once: its
        `wait()` returns when the cells are stored and ready, or raises the write's error. A producer
        keeps computing meanwhile instead of waiting out the round trip."""
        indices = [int(i) for i in indices]
        if not indices:
            return PendingWrite(None, 0.0, lambda: None) if not wait else None
        if len(indices) > 1 and len(set(indices)) != len(indices):
            raise ValueError(f"partition {partition!r}: duplicate row indices in one write")
        rows = {column: column_rows(value) for column, value in columns.items()}
        specs = {column: check_rows(partition, column, r, indices) for column, r in rows.items()}
        versions = _per_row(weight_version, len(indices), "weight_version", partition)
        metas = _per_row(metadata, len(indices), "metadata", partition)
        by_unit = self._by_unit(indices)
        undo: Callable[[], Any] = lambda: None
        if len(by_unit) > 1:  # a write spanning units reserves its cells first, so it is all-or-nothing
            self._control("reserve", partition, indices, specs)
            undo = partial(self._control, "unreserve", partition, indices, list(specs))
        calls: list[Call] = []
        for unit, positions in by_unit.items():
            packed = {column: pack_rows([r[p] for p in positions]) for column, r in rows.items()}

            def pick(values: list[_T]) -> list[_T]:
                return [values[p] for p in positions]

            args = (partition, pick(indices), packed, pick(versions), pick(metas))
            calls.append((self._units[unit], "write", args, {}))
        try:
            pending = PendingWrite(self._transport.submit(calls), self.timeout, undo)
        except BaseException:
            undo()
            raise
        if wait:
            pending.wait()
            return None
        return pending

    # ---- consuming ------------------------------------------------------------------------------
    def request(
        self,
        partition: str,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        block: bool = True,
        ack: Sequence[int] = (),
        consumer: str | None = None,
    ) -> BatchMeta | None:
        """Metadata of up to `batch_size` rows whose `columns` are all ready and that `task` has not consumed
        (marked consumed now). Empty BatchMeta: `partition` is complete and exhausted for `task`. Waits up to
        `timeout`; with `block=False` returns None at once when nothing is ready. `ack`: rows of an earlier
        batch this worker is done with (see `ack`), sent along to save a round trip. `consumer`: who takes
        the rows (see `release`)."""
        wait = self.timeout if timeout is None else timeout
        args = (partition, task, list(columns), batch_size, sampler, wait, block, list(ack), consumer)
        return cast("BatchMeta | None", self._control("request", *args, wait=wait if block else 0.0))

    def get(
        self, meta: BatchMeta, columns: Sequence[str] | None = None, *, padded: bool = False, pad_value: float = 0
    ) -> Batch:
        """Read `columns` (default: those requested) of the rows in `meta`, in meta order, from the units."""
        columns = list(meta.columns if columns is None else columns)
        for column in columns:
            if column not in meta.columns:
                raise UnknownColumnError(
                    f"partition {meta.partition!r} column {column!r}: task {meta.task!r} requested only "
                    f"{meta.columns}, so only those are known to be ready"
                )
        if not meta or not columns:
            return Batch(meta, {}, {}, padded)
        groups = self._by_unit(meta.indices)
        calls: list[Call] = [
            (self._units[u], "read", (meta.partition, [meta.indices[p] for p in pos], columns), {})
            for u, pos in groups.items()
        ]
        results = self._call(calls, self.timeout)
        data: dict[str, torch.Tensor] = {}
        lengths: dict[str, torch.Tensor] = {}
        for column in columns:
            if len(results) == 1:
                values, row_lengths = results[0][column]
            else:
                ordered: list[Any] = [None] * len(meta)
                for positions, result in zip(groups.values(), results):
                    for p, row in zip(positions, unpack_rows(result[column])):
                        ordered[p] = row
                values, row_lengths = pack_rows(ordered)
            if row_lengths is not None:
                lengths[column] = torch.tensor(row_lengths, dtype=torch.int64)
                if padded:
                    values = pad_rows(values, lengths[column], pad_value)
            data[column] = values
        return Batch(meta, data, lengths, padded)

    def loader(
        self,
        partition: str,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        padded: bool = False,
        timeout: float | None = None,
        consumer: str | None = None,
        alive: Callable[[], None] | None = None,
        prefetch: bool = False,
    ) -> Iterator[Batch]:
        """Yield micro-batches of `partition` for `task` as soon as they are ready; stop once it is complete
        and exhausted for `task`. A batch is acknowledged with the request for the next one, so whatever the
        consumer writes back for it happens first. Each wait is bounded by `timeout`; while it waits, `alive`
        (if given) is called every `ALIVE_CHECK_S` and may raise to end the wait early (its producer died).

        With `prefetch`, a thread requests and reads the next batch while the caller works on this one
        (hiding the round trips), which acknowledges this one early: only for consumers that write
        nothing back for their rows."""
        wait = self.timeout if timeout is None else timeout
        batches = self._batches(partition, task, columns, batch_size, sampler, padded, wait, consumer, alive)
        return prefetched(batches, wait + self.timeout) if prefetch else batches

    def _batches(
        self,
        partition: str,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        sampler: Sampler | None,
        padded: bool,
        wait: float,
        consumer: str | None,
        alive: Callable[[], None] | None,
    ) -> Iterator[Batch]:
        done: list[int] = []
        while True:
            deadline = time.monotonic() + wait
            while True:
                remaining = deadline - time.monotonic()
                try:
                    meta = self.request(
                        partition, task, columns, batch_size, sampler=sampler, ack=done, consumer=consumer,
                        timeout=remaining if alive is None else max(0.0, min(remaining, ALIVE_CHECK_S)),
                    )
                    break
                except TransferTimeout as err:
                    if alive is None:
                        raise
                    if time.monotonic() >= deadline:
                        raise TransferTimeout(f"task {task!r} waited {wait:.3g}s in all; {err}") from err
                    done = []  # the controller applies an ack before it waits
                    alive()
            if not meta:
                return
            yield self.get(meta, padded=padded)
            done = meta.indices

    # ---- metrics and checkpoints ------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Controller counters (produced/<column>, consumed/<task>[/<column>], wait_s/<task>, ...) plus
        bytes_written / bytes_read summed over the storage units."""
        out = dict(self._control("metrics"))
        for unit_metrics in self._on_units("metrics"):
            for key, value in unit_metrics.items():
                out[key] = out.get(key, 0) + value
        return out

    def state_dict(self) -> dict[str, Any]:
        """Controller metadata and every unit's cells; plain Python and tensors, for `torch.save`.
        Take it while producers and consumers are paused, so both halves describe the same moment."""
        return {"controller": self._control("state_dict"), "storage": self._on_units("state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["storage"]) != len(self._units):
            raise ValueError(
                f"checkpoint has {len(state['storage'])} storage units, this queue {len(self._units)}; "
                "rows are sharded by index, so the counts must match"
            )
        self._control("load_state_dict", state["controller"])
        self._call([(u, "load_state_dict", (s,), {}) for u, s in zip(self._units, state["storage"])], self.timeout)

    # ---- internals ----------------------------------------------------------------------------------
    def _call(self, calls: list[Call], timeout: float) -> list[Any]:
        return cast("list[Any]", self._transport.submit(calls).wait(timeout))

    def _control(self, method: str, *args: Any, wait: float = 0.0) -> Any:
        return self._call([(self._controller, method, args, {})], wait + self.timeout)[0]

    def _on_units(self, method: str, *args: Any) -> list[Any]:
        return self._call([(unit, method, args, {}) for unit in self._units], self.timeout)

    def _by_unit(self, indices: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for position, index in enumerate(indices):
            groups.setdefault(index % len(self._units), []).append(position)
        return groups


def prefetched(items: Iterator[_T], timeout: float) -> Iterator[_T]:
    """Yield `items`, each produced by a daemon thread while the caller works on the one before (never
    more than one ahead); the producer's error is raised here. Each wait for the next item is bounded
    by `timeout`. Once the generator is closed the thread takes no further item."""
    ready: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
    may_produce = threading.Semaphore(1)  # released each time the caller takes an item
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            while True:
                while not may_produce.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                item = next(items, end)
                ready.put((item, None))
                if item is end:
                    return
        except BaseException as err:  # noqa: BLE001 - re-raised by the consumer
            ready.put((end, err))

    threading.Thread(target=produce, name="prefetch", daemon=True).start()
    try:
        while True:
            try:
                item, error = ready.get(timeout=timeout)
            except queue.Empty:
                raise TransferTimeout(f"prefetch: no batch within {timeout:.3g}s") from None
            if error is not None:
                raise error
            if item is end:
                return
            may_produce.release()
            yield item
    finally:
        stop.set()


def _per_row(value: Any, num: int, name: str, partition: str) -> list[Any]:
    """One entry per row: None or a single int/dict applies to every row; otherwise a sequence of `num`."""
    if value is None or isinstance(value, (int, dict)):
        return [value] * num
    values = list(value)
    if len(values) != num:
        raise ValueError(f"partition {partition!r}: {name} has {len(values)} entries for {num} rows")
    return values
