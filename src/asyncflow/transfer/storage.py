"""Storage unit: one shard of the TransferQueue's data, columnar, holding the rows with `index % N == rank`.

Owns: cells (partition -> column -> row -> tensor, a view into the packed block the row arrived
in, so a write costs no extra copy), the global indices of rows appended through it (rank,
rank + N, rank + 2N, ...: unique without asking anyone) and byte counters. It knows nothing of
readiness or consumers.

Invariants:
- A cell is written once: `store` checks every cell of a call before storing any of them.
- `append` / `write` store first and then tell the controller (`add_rows` / `mark_ready`), so a
  cell the controller calls ready is always readable; if the controller rejects the call, its
  cells are discarded and the unit is exactly as before.
- Stored tensors are copies of what producers passed (the client packs into new tensors) and
  reads return new tensors, so neither side can alter the other's data.
- The lock covers only dictionary updates and lookups; tensor copies for reads run outside it, so
  reads and writes proceed concurrently.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from asyncflow.transfer.schema import ColumnSpec, FilledCellError, Packed, UnknownRowError, pack_rows, unpack_rows


class StorageUnit:
    def __init__(self, rank: int = 0, num_units: int = 1, controller: Any = None) -> None:
        """`controller`: the in-process `Controller` that `append` / `write` report to (None inside Ray actors,
        whose wrapper reports instead)."""
        self.rank, self.num_units, self.controller = rank, num_units, controller
        self._appended = 0
        self._cells: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()

    def new_indices(self, num: int) -> list[int]:
        with self._lock:
            start, self._appended = self._appended, self._appended + num
        return [self.rank + (start + k) * self.num_units for k in range(num)]

    def store(
        self, partition: str, rows: Sequence[int], columns: dict[str, Packed]
    ) -> tuple[dict[str, ColumnSpec], dict[str, list[int] | None]]:
        """Keep the cells (`rows` are distinct: fresh, or checked by the client); returns what the controller
        needs to mark them ready (specs, lengths)."""
        views = {column: unpack_rows(packed) for column, packed in columns.items()}
        with self._lock:
            table = self._cells.setdefault(partition, {})
            for column in columns:
                cells = table.get(column, {})
                for row in rows:
                    if row in cells:
                        raise FilledCellError(f"partition {partition!r} row {row} column {column!r}: already written")
            for column, column_views in views.items():
                table.setdefault(column, {}).update(zip(rows, column_views))
            self._counters["bytes_written"] += sum(v.numel() * v.element_size() for v, _ in columns.values())
            self._counters["cells_written"] += len(rows) * len(columns)
        specs = {c: ColumnSpec(v.dtype, tuple(v.shape[1:]), n is None) for c, (v, n) in columns.items()}
        return specs, {c: n for c, (_, n) in columns.items()}

    def discard(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> None:
        with self._lock:
            table = self._cells.get(partition, {})
            for column in columns:
                for row in rows:
                    table.get(column, {}).pop(row, None)

    def append(
        self,
        partition: str,
        columns: dict[str, Packed],
        group_ids: Sequence[int | None],
        weight_versions: Sequence[int | None],
        metadata: Sequence[dict[str, Any]],
        timeout: float,
    ) -> list[int] | None:
        """Store new rows under fresh indices, then add them to the partition (waiting up to `timeout` while it
        is full). Returns their indices."""
        rows = self.new_indices(len(group_ids))
        specs, lengths = self.store(partition, rows, columns)
        try:
            fields = (group_ids, weight_versions, metadata)
            added: list[int] | None = self.controller.add_rows(partition, rows, specs, lengths, *fields, timeout)
            return added
        except BaseException:
            self.discard(partition, rows, list(columns))
            raise

    def write(
        self,
        partition: str,
        rows: Sequence[int],
        columns: dict[str, Packed],
        weight_versions: Sequence[int | None] | None = None,
        metadata: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """Store cells of existing rows, then tell the controller they are ready (with row-level field updates)."""
        specs, lengths = self.store(partition, rows, columns)
        try:
            self.controller.mark_ready(partition, rows, specs, lengths, weight_versions, metadata)
        except BaseException:
            self.discard(partition, rows, list(columns))
            raise

    def read(self, partition: str, rows: Sequence[int], columns: Sequence[str]) -> dict[str, Packed]:
        """Packed copies of the cells, rows in the order asked."""
        gathered: dict[str, list[torch.Tensor]] = {}
        with self._lock:
            table = self._cells.get(partition, {})
            for column in columns:
                cells = table.get(column, {})
                missing = [row for row in rows if row not in cells]
                if missing:
                    raise UnknownRowError(
                        f"partition {partition!r} row {missing[0]} column {column!r}: not stored "
                        "(never written, or the partition was cleared)"
                    )
                gathered[column] = [cells[row] for row in rows]
        out = {column: pack_rows(cells) for column, cells in gathered.items()}
        with self._lock:
            self._counters["bytes_read"] += sum(v.numel() * v.element_size() for v, _ in out.values())
        return out

    def drop(self, partition: str) -> None:
        with self._lock:
            self._cells.pop(partition, None)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def state_dict(self) -> dict[str, Any]:
        """{"appended": n, "cells": {partition: {column: [rows, values, lengths]}}}, each column packed."""
        with self._lock:
            snapshot = {p: {c: dict(cells) for c, cells in table.items()} for p, table in self._cells.items()}
            appended = self._appended
        state: dict[str, dict[str, list[Any]]] = {}
        for partition, table in snapshot.items():
            state[partition] = {}
            for column, cells in table.items():
                rows = sorted(cells)
                if rows:
                    state[partition][column] = [rows, *pack_rows([cells[r] for r in rows])]
        return {"appended": appended, "cells": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cells = {
            partition: {column: dict(zip(rows, unpack_rows((v, n)))) for column, (rows, v, n) in table.items()}
            for partition, table in state["cells"].items()
        }
        with self._lock:
            self._cells, self._appended = cells, state["appended"]
