"""Controller: the metadata half of the TransferQueue. It never holds data.

Owns: partitions (rows with group id, weight version, metadata, and per column a ready bit with
the cell's length), per-task consumed and acknowledged bits, column schemas, capacity accounting,
the partition lifecycle (append -> seal or reach `num_rows` -> acknowledged by every registered
task -> cleared, which drops its data through `on_clear`), and row/wait metrics.

Invariants (every public method runs under one lock, so each is atomic):
- `try_request` returns only rows whose requested columns are all ready and that the task has not
  consumed, and marks them consumed in the same step: a row reaches a task at most once until
  `reset` (or `release`, for the unfinished rows a dead consumer held) re-arms it.
- A cell becomes ready once; a second write of it raises `FilledCellError` and changes nothing.
  Writes to existing rows `reserve` their cells first, so a bad write fails before any data moves
  and a write spread over several storage units is all-or-nothing. A call is validated completely
  before anything is applied.
- A column's schema is fixed by its declaration or its first write and checked on every write.
- A row is consumed when handed out and acknowledged when its reader is done with it (the loader
  acknowledges a batch with its next request). Rows in flight (appended, not yet acknowledged by
  every registered task) never exceed capacity, and a partition is cleared only when it is complete
  and every registered task acknowledged every row, so no reader loses data it still reads.
- Names of cleared partitions are remembered: a late write fails loudly; a registered task asking
  for a partition cleared because everyone finished it sees it exhausted.
Blocking (`add_rows`, `request`) waits on a condition variable here; the Ray controller actor
wraps the same non-blocking `try_*` cores with asyncio instead.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncflow.transfer.samplers import Candidate, OldestFirst, Sampler
from asyncflow.transfer.schema import (
    BatchMeta,
    CapacityError,
    ColumnSchemaError,
    ColumnSpec,
    FilledCellError,
    PartitionClosedError,
    TransferError,
    TransferTimeout,
    UnknownColumnError,
    UnknownPartitionError,
    UnknownRowError,
)

T = TypeVar("T")


@dataclass
class _Row:
    index: int
    group_id: int | None
    weight_version: int | None
    metadata: dict[str, Any]
    ready: dict[str, int] = field(default_factory=dict)  # column -> dim-0 length (0 for scalars)
    candidate: Candidate = None  # type: ignore[assignment]  # without length; rebuilt when the version changes

    def __post_init__(self) -> None:
        self.set_version(self.weight_version)

    def set_version(self, version: int | None) -> None:
        self.weight_version = version
        self.candidate = Candidate(self.index, self.group_id, version, 0)


@dataclass
class _Partition:
    num_rows: int | None
    capacity: int | None
    group_size: int | None
    closed_columns: bool  # columns declared at creation: no others may be written or requested
    schema: dict[str, ColumnSpec]
    sealed: bool = False
    rows: dict[int, _Row] = field(default_factory=dict)  # insertion order = append order
    consumed: dict[str, set[int]] = field(default_factory=dict)
    pending: dict[str, dict[int, None]] = field(default_factory=dict)  # per task: unconsumed rows, re-armed last
    acked: dict[str, set[int]] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)  # acknowledged by every registered task
    reserved: set[tuple[int, str]] = field(default_factory=set)  # (row, column) cells being written
    holders: dict[str, dict[int, str]] = field(default_factory=dict)  # per task: row -> consumer that took it

    def pending_for(self, task: str) -> dict[int, None]:
        """Rows `task` has not consumed, kept incrementally so a request scans only those."""
        if task not in self.pending:
            consumed = self.consumed.get(task, set())
            self.pending[task] = dict.fromkeys(i for i in self.rows if i not in consumed)
        return self.pending[task]

    @property
    def complete(self) -> bool:
        return self.sealed or (self.num_rows is not None and len(self.rows) >= self.num_rows)


class Controller:
    def __init__(
        self, num_storage_units: int = 1, capacity: int | None = None, on_full: str = "block", tasks: Sequence[str] = ()
    ) -> None:
        if on_full not in ("block", "error"):
            raise ValueError(f"on_full must be 'block' or 'error', got {on_full!r}")
        self.num_storage_units = num_storage_units
        self.capacity = capacity
        self.on_full = on_full
        self._lock = threading.RLock()
        self._conditions: dict[str, threading.Condition] = {}  # per partition, so waiters wake for their own
        self.on_change: Callable[[str | None], None] | None = None  # the Ray actor's wake-up hook
        self._partitions: dict[str, _Partition] = {}
        self._cleared: dict[str, str] = {}  # name -> "consumed" (finished by every registered task) or "cleared"
        self.on_clear: Callable[[str], object] | None = None  # drops the partition's data from the storage units
        self._tasks: list[str] = list(dict.fromkeys(tasks))
        self._counters: Counter[str] = Counter()

    # ---- lifecycle ---------------------------------------------------------------------------
    def create_partition(
        self,
        partition: str,
        num_rows: int | None = None,
        columns: dict[str, ColumnSpec] | None = None,
        capacity: int | None = None,
        group_size: int | None = None,
    ) -> None:
        """Declare a partition. `columns` closes its column set; `capacity` overrides the queue default."""
        with self._lock:
            if partition in self._partitions:
                raise ValueError(f"partition {partition!r} already exists")
            self._check_not_cleared(partition, "create")
            self._partitions[partition] = _Partition(
                num_rows, capacity if capacity is not None else self.capacity, group_size,
                columns is not None, dict(columns or {}),
            )  # fmt: skip
            self._wake(partition)

    def register_task(self, task: str) -> None:
        """A task whose consumption gates capacity and clearing, in every partition."""
        with self._lock:
            if task not in self._tasks:
                self._tasks.append(task)
                for part in self._partitions.values():
                    self._recount_retired(part)
                self._wake()

    def seal(self, partition: str) -> None:
        """No more rows will be appended: consumers drain the rest and then see the partition exhausted."""
        with self._lock:
            part = self._partition_for_write(partition, "seal")
            part.sealed = True
            self._clear_if_finished(partition, part)
            self._wake(partition)

    def ack(self, partition: str, task: str, indices: Sequence[int]) -> None:
        """`task` is done with these rows it was handed. Clears the partition once it is complete and every
        registered task acknowledged every row."""
        with self._lock:
            if not indices or self._cleared.get(partition) == "consumed":
                return
            action = f"acknowledge row {indices[0]} (task {task!r}) of"
            part = self._partition_for_write(partition, action, create=False)
            consumed = part.consumed.get(task, set())
            if not consumed.issuperset(indices):
                stray = [i for i in indices if i not in consumed]
                raise UnknownRowError(
                    f"partition {partition!r} row {stray[0]}: task {task!r} acknowledged a row it was not handed"
                )
            part.acked.setdefault(task, set()).update(indices)
            self._retire(part, indices)
            self._clear_if_finished(partition, part)
            self._wake(partition)

    def clear(self, partition: str) -> None:
        """Drop the partition now, whoever still wanted it; later writes and requests fail."""
        with self._lock:
            self._clear(partition, "cleared")

    def reset(self, partition: str, task: str | None = None, indices: Sequence[int] | None = None) -> None:
        """Forget consumption (of `indices`, or all rows) by `task` (or every task), e.g. to retry."""
        with self._lock:
            part = self._partition_for_write(partition, "reset", create=False)
            for name in [task] if task is not None else list(part.consumed):
                consumed = part.consumed.setdefault(name, set())
                rearmed = [i for i in (part.rows if indices is None else indices) if i in consumed]
                for bits in (consumed, part.acked.setdefault(name, set())):
                    bits.difference_update(rearmed)
                if name in part.pending:
                    part.pending[name].update(dict.fromkeys(rearmed))  # re-armed rows queue behind the others
            self._recount_retired(part)
            self._wake(partition)

    def release(self, task: str, consumer: str, unless_ready: Sequence[str]) -> dict[str, list[int]]:
        """Re-arm, for `task`, every row `consumer` took (in any partition) whose `unless_ready` columns are
        not all ready: the consumer died holding them, so another one must produce them. Returns the rows
        released per partition."""
        released: dict[str, list[int]] = {}
        needed = set(unless_ready)
        with self._lock:
            for name, part in self._partitions.items():
                held = part.holders.get(task, {})
                rows = [i for i, who in held.items() if who == consumer and not part.rows[i].ready.keys() >= needed]
                if not rows:
                    continue
                for i in rows:
                    del held[i]
                    part.consumed.get(task, set()).discard(i)
                    part.acked.get(task, set()).discard(i)
                part.pending.pop(task, None)
                self._recount_retired(part)
                self._counters[f"released/{task}"] += len(rows)
                released[name] = rows
                self._wake(name)
        return released

    # ---- producing -----------------------------------------------------------------------------
    def try_add_rows(
        self,
        partition: str,
        indices: Sequence[int],
        columns: dict[str, ColumnSpec],
        lengths: dict[str, list[int] | None],
        group_ids: Sequence[int | None],
        weight_versions: Sequence[int | None],
        metadata: Sequence[dict[str, Any]],
    ) -> list[int] | None:
        """Called by the storage unit that just stored new rows (`indices` are its own, unique): they join the
        partition with their `columns` ready, all at once. None while the partition is full."""
        with self._lock:
            num = len(indices)
            what = f"{num} rows (rows {indices[0]}..{indices[-1]}, column(s) {', '.join(columns)})"
            part = self._partition_for_write(partition, f"append {what} to")
            if part.sealed:
                raise PartitionClosedError(f"partition {partition!r} is sealed: cannot append {what}")
            if part.num_rows is not None and len(part.rows) + num > part.num_rows:
                raise PartitionClosedError(
                    f"partition {partition!r} holds {len(part.rows)} of its num_rows={part.num_rows}: "
                    f"cannot append {what}"
                )
            taken = [i for i in indices if i in part.rows]
            if taken:
                raise ValueError(f"partition {partition!r} row {taken[0]}: index already in use")
            self._check_schema(partition, part, columns, indices[0])
            in_flight = len(part.rows) - len(part.retired)
            if part.capacity is not None and in_flight + num > part.capacity:
                if num > part.capacity or self.on_full == "error":
                    raise CapacityError(self.explain_full(partition, num))
                return None
            for i, (index, group_id, version, meta) in enumerate(zip(indices, group_ids, weight_versions, metadata)):
                ready = {c: 0 if n is None else n[i] for c, n in lengths.items()}
                part.rows[index] = _Row(index, group_id, version, dict(meta), ready)
            for pending in part.pending.values():
                pending.update(dict.fromkeys(indices))
            part.schema.update({c: spec for c, spec in columns.items() if c not in part.schema})
            self._counters["rows_appended"] += num
            for column in columns:
                self._counters[f"produced/{column}"] += num
            self._wake(partition)
            return list(indices)

    def add_rows(
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
        """`try_add_rows`, blocking up to `timeout` seconds while the partition is full (backpressure)."""
        fields = (group_ids, weight_versions, metadata)
        attempt = lambda: self.try_add_rows(partition, indices, columns, lengths, *fields)
        explain = lambda: self.explain_full(partition, len(indices))
        return self._block(partition, attempt, timeout, explain, "backpressure")

    def reserve(self, partition: str, rows: Sequence[int], columns: dict[str, ColumnSpec]) -> None:
        """Claim the cells a write to existing rows is about to fill, after checking all of them (partition
        open, rows exist, schema, cells empty and unclaimed), so a bad write fails before any data moves."""
        with self._lock:
            part = self._cells_for_write(partition, rows, columns, allow_reserved=False)
            part.reserved.update((row, column) for row in rows for column in columns)
            part.schema.update({c: spec for c, spec in columns.items() if c not in part.schema})

    def unreserve(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> None:
        """Give back claimed cells of a write that failed in transit."""
        with self._lock:
            part = self._partitions.get(partition)
            if part is not None:
                part.reserved.difference_update((row, column) for row in rows for column in columns)

    def mark_ready(
        self,
        partition: str,
        rows: Sequence[int],
        columns: dict[str, ColumnSpec],
        lengths: dict[str, list[int] | None],
        weight_versions: Sequence[int | None] | None = None,
        metadata: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """Called by a storage unit after storing cells: they become ready, with their row-level fields."""
        with self._lock:
            part = self._cells_for_write(partition, rows, columns, allow_reserved=True)
            for i, row in enumerate(rows):
                entry = part.rows[row]
                for column, column_lengths in lengths.items():
                    entry.ready[column] = 0 if column_lengths is None else column_lengths[i]
                    part.reserved.discard((row, column))
                if weight_versions is not None and weight_versions[i] is not None:
                    entry.set_version(weight_versions[i])
                extra = None if metadata is None else metadata[i]
                if extra:
                    entry.metadata.update(extra)
            part.schema.update({c: spec for c, spec in columns.items() if c not in part.schema})
            for column in columns:
                self._counters[f"produced/{column}"] += len(rows)
            self._wake(partition)

    # ---- consuming -----------------------------------------------------------------------------
    def try_request(
        self, partition: str, task: str, columns: Sequence[str], batch_size: int, sampler: Sampler | None = None,
        consumer: str | None = None,
    ) -> BatchMeta | None:
        """Pick, mark consumed and describe rows for `task`. None: nothing to hand out yet. An empty
        BatchMeta: the partition is complete and `task` consumed all of it (or, for a registered task,
        it was cleared because every registered task finished it). `consumer` names who takes the rows,
        so that `release` can hand them out again if it dies."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        sampler = sampler or OldestFirst()
        with self._lock:
            part = self._partitions.get(partition)
            if part is None:
                if self._cleared.get(partition) == "consumed" and task in self._tasks:
                    return BatchMeta(partition, task, list(columns))
                self._check_not_cleared(partition, f"request (task {task!r}) from")
                return None
            unknown = [c for c in columns if part.closed_columns and c not in part.schema]
            if unknown:
                raise UnknownColumnError(
                    f"partition {partition!r} column {unknown[0]!r}: requested by task {task!r} but not declared "
                    f"(columns: {sorted(part.schema)})"
                )
            pending = part.pending_for(task)
            if part.complete and not pending:
                self._clear_if_finished(partition, part)
                return BatchMeta(partition, task, list(columns))
            needed = set(columns)
            ready = [row for row in map(part.rows.__getitem__, pending) if row.ready.keys() >= needed]
            length_columns = columns if sampler.length_columns is None else sampler.length_columns
            if length_columns:
                lengths = [sum([row.ready.get(c, 0) for c in length_columns]) for row in ready]
                candidates = [row.candidate._replace(length=n) for row, n in zip(ready, lengths)]
            else:
                candidates = [row.candidate for row in ready]
            if not candidates:
                return None
            drain = part.complete and len(candidates) == len(pending)
            parts = sampler.select(candidates, batch_size, drain, part.group_size)
            chosen = [i for p in parts for i in p]
            if not chosen:
                if drain:
                    raise TransferError(
                        f"partition {partition!r} is complete but {sampler!r} cannot batch the {len(candidates)} rows "
                        f"task {task!r} has left (rows {[c.index for c in candidates[:8]]})"
                    )
                return None
            allowed = {c.index for c in candidates}
            if len(set(chosen)) != len(chosen) or not allowed.issuperset(chosen):
                raise TransferError(f"{sampler!r} returned rows that are not distinct ready candidates: {chosen}")
            part.consumed.setdefault(task, set()).update(chosen)
            if consumer is not None:
                part.holders.setdefault(task, {}).update(dict.fromkeys(chosen, consumer))
            for i in chosen:
                del pending[i]
            self._counters[f"consumed/{task}"] += len(chosen)
            for column in columns:
                self._counters[f"consumed/{task}/{column}"] += len(chosen)
            self._wake(partition)
            rows = [part.rows[i] for i in chosen]
            return BatchMeta(
                partition, task, list(columns), chosen,
                units=[i % self.num_storage_units for i in chosen],
                lengths={c: [row.ready[c] for row in rows] for c in columns},
                group_ids=[row.group_id for row in rows],
                weight_versions=[row.weight_version for row in rows],
                metadata=[dict(row.metadata) for row in rows],
                parts=[len(p) for p in parts],
            )  # fmt: skip

    def request(
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
        """`ack` the rows of the previous batch, then `try_request`, waiting up to `timeout` seconds for a
        batch (or returning None at once if not `block`)."""
        self.ack(partition, task, ack)
        attempt = lambda: self.try_request(partition, task, columns, batch_size, sampler, consumer)
        explain = lambda: self.explain_request(partition, task, columns, batch_size)
        return self._block(partition, attempt, timeout, explain, task, block)

    # ---- introspection, metrics, checkpoints ----------------------------------------------------
    def status(self, partition: str) -> dict[str, Any]:
        with self._lock:
            part = self._partitions.get(partition)
            if part is None:
                return {"exists": False, "cleared": self._cleared.get(partition)}
            ready = Counter(c for row in part.rows.values() for c in row.ready)
            return {
                "exists": True, "rows": len(part.rows), "complete": part.complete, "sealed": part.sealed,
                "in_flight": len(part.rows) - len(part.retired), "ready": dict(ready),
                "consumed": {t: len(s) for t, s in part.consumed.items()},
                "acked": {t: len(s) for t, s in part.acked.items()},
            }  # fmt: skip

    def explain_request(self, partition: str, task: str, columns: Sequence[str], batch_size: int) -> str:
        with self._lock:
            part = self._partitions.get(partition)
            if part is None:
                return f"task {task!r}: partition {partition!r} does not exist"
            pending = [part.rows[i] for i in part.pending_for(task)]
            waiting = [row for row in pending if not row.ready.keys() >= set(columns)]
            oldest = (
                f"; oldest not ready: row {waiting[0].index} lacks column(s) "
                f"{[c for c in columns if c not in waiting[0].ready]}" if waiting else ""
            )  # fmt: skip
            return (
                f"task {task!r} wants {batch_size} rows of partition {partition!r} with columns {list(columns)} ready: "
                f"{len(pending) - len(waiting)} of its {len(pending)} unconsumed rows are ready{oldest}, "
                f"partition complete={part.complete}"
            )

    def explain_full(self, partition: str, num: int) -> str:
        with self._lock:
            part = self._partitions.get(partition)
            if part is None:
                return f"partition {partition!r} is gone: cannot append {num} rows"
            return (
                f"partition {partition!r} is full: cannot append {num} rows, {len(part.rows) - len(part.retired)} "
                f"in flight of capacity {part.capacity} (registered tasks {self._tasks} must acknowledge rows first)"
            )

    def record_wait(self, who: str, seconds: float) -> None:
        with self._lock:
            # seconds are floats: a Counter adds any numbers, though typeshed types its values as int
            self._counters[f"wait_s/{who}"] += seconds  # type: ignore[assignment]
            self._counters[f"waits/{who}"] += 1
            longest = f"wait_max_s/{who}"
            self._counters[longest] = max(self._counters[longest], seconds)  # type: ignore[assignment]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python (loadable with `torch.load(weights_only=True)`)."""
        with self._lock:
            partitions = {
                name: {
                    "num_rows": p.num_rows, "capacity": p.capacity, "group_size": p.group_size,
                    "closed_columns": p.closed_columns, "sealed": p.sealed,
                    "schema": {c: spec.to_plain() for c, spec in p.schema.items()},
                    "rows": {i: [r.group_id, r.weight_version, dict(r.metadata), dict(r.ready)]
                             for i, r in p.rows.items()},
                    "consumed": {t: sorted(s) for t, s in p.consumed.items()},
                    "acked": {t: sorted(s) for t, s in p.acked.items()},
                }
                for name, p in self._partitions.items()
            }  # fmt: skip
            return {
                "tasks": list(self._tasks), "cleared": dict(self._cleared),
                "partitions": partitions, "counters": dict(self._counters),
            }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._tasks = list(state["tasks"])
            self._cleared = dict(state["cleared"])
            self._counters = Counter(state["counters"])
            self._partitions = {}
            for name, p in state["partitions"].items():
                part = _Partition(
                    p["num_rows"], p["capacity"], p["group_size"], p["closed_columns"],
                    schema={c: ColumnSpec.from_plain(s) for c, s in p["schema"].items()}, sealed=p["sealed"],
                    rows={int(i): _Row(int(i), g, v, dict(m), dict(r)) for i, (g, v, m, r) in p["rows"].items()},
                    consumed={t: set(s) for t, s in p["consumed"].items()},
                    acked={t: set(s) for t, s in p["acked"].items()},
                )  # fmt: skip
                self._recount_retired(part)
                self._partitions[name] = part
            self._wake()

    # ---- internals -------------------------------------------------------------------------------
    def _wake(self, partition: str | None = None) -> None:
        """Wake the waiters of `partition` (None: all)."""
        for name, condition in self._conditions.items():
            if partition is None or name == partition:
                condition.notify_all()
        if self.on_change is not None:
            self.on_change(partition)

    def _block(
        self, partition: str, attempt: Callable[[], T | None], timeout: float, explain: Callable[[], str], who: str,
        block: bool = True,
    ) -> T | None:
        """`attempt()` until it returns a result (at once if not `block`), waiting up to `timeout` seconds;
        the time spent counts as `who`'s wait."""
        start = time.monotonic()
        try:
            with self._lock:
                while True:
                    result = attempt()
                    if result is not None or not block:
                        return result
                    remaining = start + timeout - time.monotonic()
                    if remaining <= 0:
                        raise TransferTimeout(f"timed out after {timeout:.3g}s: {explain()}")
                    self._conditions.setdefault(partition, threading.Condition(self._lock)).wait(remaining)
        finally:
            self.record_wait(who, time.monotonic() - start)

    def _clear(self, partition: str, reason: str) -> None:
        self._wake(partition)  # before dropping the partition's condition, so its waiters see the clear
        self._conditions.pop(partition, None)
        self._partitions.pop(partition, None)
        self._cleared[partition] = reason
        self._counters["partitions_cleared"] += 1
        if self.on_clear is not None:
            self.on_clear(partition)

    def _clear_if_finished(self, partition: str, part: _Partition) -> None:
        if self._tasks and part.complete and len(part.retired) == len(part.rows):
            self._clear(partition, "consumed")

    def _check_not_cleared(self, partition: str, action: str) -> None:
        if partition in self._cleared:
            raise PartitionClosedError(f"cannot {action} partition {partition!r}: it was cleared")

    def _partition_for_write(self, partition: str, action: str, create: bool = True) -> _Partition:
        part = self._partitions.get(partition)
        if part is None:
            self._check_not_cleared(partition, action)
            if not create:
                raise UnknownPartitionError(f"cannot {action} partition {partition!r}: it does not exist")
            part = self._partitions[partition] = _Partition(None, self.capacity, None, False, {})
        return part

    def _cells_for_write(
        self, partition: str, rows: Sequence[int], columns: dict[str, ColumnSpec], allow_reserved: bool
    ) -> _Partition:
        names = ", ".join(columns)
        part = self._partition_for_write(partition, f"write row {rows[0]} column(s) {names} of", create=False)
        for row in rows:
            if row not in part.rows:
                raise UnknownRowError(f"partition {partition!r} row {row} column(s) {names}: no such row")
        self._check_schema(partition, part, columns, rows[0])
        for column in columns:
            for row in rows:
                if column in part.rows[row].ready:
                    raise FilledCellError(f"partition {partition!r} row {row} column {column!r}: already written")
                if not allow_reserved and (row, column) in part.reserved:
                    raise FilledCellError(f"partition {partition!r} row {row} column {column!r}: already being written")
        return part

    def _check_schema(self, partition: str, part: _Partition, columns: dict[str, ColumnSpec], row: int) -> None:
        for column, spec in columns.items():
            known = part.schema.get(column)
            if known is None and part.closed_columns:
                raise UnknownColumnError(
                    f"partition {partition!r} row {row} column {column!r}: not declared "
                    f"(columns: {sorted(part.schema)})"
                )
            if known is not None and known != spec:
                raise ColumnSchemaError(
                    f"partition {partition!r} row {row} column {column!r}: value is {spec.describe()}, "
                    f"but the column holds {known.describe()}"
                )

    def _retire(self, part: _Partition, rows: Sequence[int]) -> None:
        if self._tasks:
            done = set(rows)
            for task in self._tasks:
                done &= part.acked.get(task, set())
            part.retired |= done

    def _recount_retired(self, part: _Partition) -> None:
        part.retired = set()
        self._retire(part, list(part.rows))
