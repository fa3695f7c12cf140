"""User stages: a function of the user's over the TransferQueue, streamed like the built-in workers.

A stage names its consumer (the queue task), the columns it reads and the per-row scalar columns it writes.
Its `StageWorker` reads batches of rows as soon as their input columns are ready, calls the function, and
writes the outputs back by row index; the trainer waits for the outputs like for any other column, and
`reward.columns` can add them to the reward. For example, a second reward computed from the response:

    def brevity(batch: StageBatch) -> dict[str, list[float]]:
        return {"brevity": [1.0 / (1 + len(ids)) for ids in batch.columns["response_ids"]]}

    stages: [{name: brevity, fn: "my_stages:brevity", inputs: [response_ids], outputs: [brevity]}]
    reward: {columns: {brevity: 0.1}}

Invariants: a row is handed to a stage once (its task's consumed bit); a function that returns the wrong
columns, the wrong number of rows or a value that is not a finite number fails the run with an error naming
the stage and the column, before anything is written for that batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow.workers.loops import partition_name

StageFn = Callable[["StageBatch"], dict[str, list[float]]]


@dataclass
class StageBatch:
    """Rows handed to a stage: `columns[name][i]` is row i's value of input column `name` (a list of ids or
    floats for per-token columns, a float for scalar ones); `metadata[i]` its row metadata (`answer`, ...)."""

    columns: dict[str, list[Any]]
    metadata: list[dict]

    def __len__(self) -> int:
        return len(self.metadata)


class StageError(RuntimeError):
    """A stage function broke its contract (columns, row count, non-finite values)."""


class StageWorker:
    """Runs `fn` over the rows of each partition for queue task `name`; see the module docstring."""

    def __init__(self, name: str, fn: StageFn, inputs: list[str], outputs: list[str], batch_size: int):
        self.name, self.fn, self.inputs, self.outputs, self.batch_size = name, fn, inputs, outputs, batch_size

    def run_partition(self, queue, partition: str, *, timeout: float, timeline=None) -> int:
        """Every row of `partition` not yet handed to this stage; returns rows written."""
        count = 0
        for batch in queue.loader(partition, self.name, self.inputs, self.batch_size, timeout=timeout):
            t0 = time.time()
            rows = StageBatch({c: [v.tolist() for v in batch.rows(c)] for c in self.inputs},
                              [dict(m) for m in batch.meta.metadata])
            values = self._checked(self.fn(rows), len(rows))
            queue.write(partition, batch.meta.indices,
                        {c: torch.tensor(values[c], dtype=torch.float32) for c in self.outputs})
            count += len(rows)
            if timeline is not None:
                timeline.add_span(self.name, "stage", t0, time.time(), partition=partition, rows=len(rows))
        return count

    def _checked(self, values, n: int) -> dict[str, list[float]]:
        if not isinstance(values, dict) or set(values) != set(self.outputs):
            got = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise StageError(f"stage {self.name!r} must return a dict of its outputs {self.outputs}, got {got}")
        for column in self.outputs:
            column_values = [float(v) for v in values[column]]
            if len(column_values) != n:
                raise StageError(f"stage {self.name!r}: column {column!r} has {len(column_values)} values for {n} rows")
            if not all(math.isfinite(v) for v in column_values):
                raise StageError(f"stage {self.name!r}: column {column!r} holds a value that is not a finite number")
            values[column] = column_values
        return values


def stage_loop(worker: StageWorker, queue, steps: range, *, timeout: float, timeline=None) -> None:
    """The stage over partitions `steps`, in order (the long-running side, as `reward_loop`)."""
    for step in steps:
        worker.run_partition(queue, partition_name(step), timeout=timeout, timeline=timeline)
