"""TransferQueue: the streaming data plane between RL stages (the bottom layer; imports nothing of asyncflow).

A partition is a table of rows (samples) and columns (fields). The `Controller` keeps metadata only
(ready bits per cell, consumed bits per task); `StorageUnit`s keep the data, sharded by row; the
`TransferQueue` client appends rows, writes columns, requests batches and reads them straight from
the storage units. `TransferQueue.local()` runs it in-process; `asyncflow.transfer.ray_queue.
RayTransferQueue.create()` runs the same classes as Ray actors (imported lazily, so `ray` stays optional).
"""

from asyncflow.transfer.client import TransferQueue
from asyncflow.transfer.controller import Controller
from asyncflow.transfer.samplers import (
    Candidate,
    GroupSampler,
    OldestFirst,
    Sampler,
    SimilarLength,
    TokenBalanced,
    karmarkar_karp,
)
from asyncflow.transfer.schema import (
    Batch,
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
from asyncflow.transfer.storage import StorageUnit

__all__ = [
    "Batch",
    "BatchMeta",
    "Candidate",
    "CapacityError",
    "ColumnSchemaError",
    "ColumnSpec",
    "Controller",
    "FilledCellError",
    "GroupSampler",
    "OldestFirst",
    "PartitionClosedError",
    "Sampler",
    "SimilarLength",
    "StorageUnit",
    "TokenBalanced",
    "TransferError",
    "TransferQueue",
    "TransferTimeout",
    "UnknownColumnError",
    "UnknownPartitionError",
    "UnknownRowError",
    "karmarkar_karp",
]
