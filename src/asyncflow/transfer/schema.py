"""Shared vocabulary of the data plane: errors, column schemas, batch metadata, and the wire format.

Owns: the exception hierarchy, `ColumnSpec` (dtype + trailing shape of a column), `BatchMeta`
(what the controller hands a consumer: indices and locations, never data), `Batch` (data read
back), and `pack_rows` / `unpack_rows`, the packed form a column takes between clients and
storage units: one `values` tensor with the rows concatenated along dim 0 plus their lengths.

Invariants:
- A 0-d row value makes a scalar column (`lengths` is None, `values` has shape [n]); any other
  row is ragged: dim 0 varies per row and is stored unpadded, dims 1: are the trailing shape.
- Every row of a packed column has the column's dtype and trailing shape; a mismatch is a
  `ColumnSchemaError` naming partition, row and column, raised before anything is stored.
- Errors carry only a message, so they pickle across process boundaries (Ray) unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import torch


class TransferError(Exception):
    """Base class of every data-plane error."""


class UnknownColumnError(TransferError, ValueError):
    """A column the partition (or the request) does not have."""


class ColumnSchemaError(TransferError, ValueError):
    """A value whose dtype, rank or trailing shape conflicts with the column's schema."""


class FilledCellError(TransferError, ValueError):
    """A second write to a (row, column) cell that already holds data."""


class PartitionClosedError(TransferError, ValueError):
    """A write to a cleared partition, a sealed one, or one already holding `num_rows` rows."""


class UnknownRowError(TransferError, ValueError):
    """A row index that does not belong to the partition."""


class UnknownPartitionError(TransferError, ValueError):
    """A partition that was never created."""


class CapacityError(TransferError, RuntimeError):
    """A partition is full and its policy is `on_full="error"`."""


class TransferTimeout(TransferError, TimeoutError):
    """A blocking call ran past its timeout; the message says what it waited for."""


class ColumnSpec(NamedTuple):
    """Schema of one column: element dtype, trailing shape (dims after the ragged one), scalar or ragged.
    Immutable and cheap to build and compare: one is made per column on every write."""

    dtype: torch.dtype
    trailing: tuple[int, ...] = ()
    scalar: bool = False

    def describe(self) -> str:
        return f"scalar {self.dtype}" if self.scalar else f"{self.dtype} [{', '.join(['*', *map(str, self.trailing)])}]"

    def to_plain(self) -> tuple[str, tuple[int, ...], bool]:
        return str(self.dtype).removeprefix("torch."), self.trailing, self.scalar

    @classmethod
    def from_plain(cls, plain: tuple[str, tuple[int, ...], bool]) -> ColumnSpec:
        return cls(getattr(torch, plain[0]), tuple(plain[1]), bool(plain[2]))


Packed = tuple[torch.Tensor, "list[int] | None"]
_T = TypeVar("_T")


def column_rows(value: Any) -> list[Any]:
    """A column as one entry per row: a sequence of tensors, or a tensor whose dim 0 indexes rows."""
    return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)


def check_rows(partition: str, column: str, rows: list[Any], row_names: Sequence[int | str]) -> ColumnSpec:
    """The column's spec, after checking every row is a tensor of one dtype, rank and trailing shape.
    `row_names` name the rows in errors (global indices, or batch positions for new rows)."""
    if len(rows) == 1 == len(row_names) and isinstance(rows[0], torch.Tensor):  # a single-row write: one spec
        row = rows[0]
        return ColumnSpec(row.dtype, tuple(row.shape[1:]), row.dim() == 0)
    where = f"partition {partition!r} column {column!r}"
    if len(rows) != len(row_names):
        raise ValueError(f"{where}: got {len(rows)} rows, expected {len(row_names)}")
    if not rows:
        raise ValueError(f"{where}: no rows")
    first = rows[0]
    for name, row in zip(row_names, rows):
        if not isinstance(row, torch.Tensor):
            raise TypeError(f"{where} row {name}: expected a torch.Tensor, got {type(row).__name__}")
        if row.dtype != first.dtype or row.dim() != first.dim() or row.shape[1:] != first.shape[1:]:
            raise ColumnSchemaError(
                f"{where} row {name}: dtype {row.dtype} shape {tuple(row.shape)} conflicts with row "
                f"{row_names[0]} of the same write (dtype {first.dtype} shape {tuple(first.shape)})"
            )
    return ColumnSpec(first.dtype, tuple(first.shape[1:]), first.dim() == 0)


def pack_rows(rows: Sequence[torch.Tensor]) -> Packed:
    """Checked rows -> (values, lengths): new CPU tensors, concatenated (ragged) or stacked (scalar)."""
    if rows[0].dim() == 0:
        return torch.stack(list(rows)).cpu(), None
    if len(rows) == 1:  # the common single-row write (one completion): a copy without cat's list handling
        row = rows[0]
        return (row.clone() if row.device.type == "cpu" else row.cpu()), [int(row.shape[0])]
    return torch.cat(list(rows)).cpu(), [int(row.shape[0]) for row in rows]


def unpack_rows(packed: Packed) -> list[torch.Tensor]:
    """(values, lengths) -> one view per row (0-d tensors for a scalar column)."""
    values, lengths = packed
    if lengths is None:
        return list(values.unbind(0))
    return [values] if len(lengths) == 1 else list(values.split(lengths))  # one row: the block itself


def pad_rows(values: torch.Tensor, lengths: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
    """Ragged [sum(lengths), *trailing] -> padded [B, max(lengths), *trailing]."""
    rows = values.split(lengths.tolist())
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value)


@dataclass
class BatchMeta:
    """Metadata of a batch handed to one task: no data, only where it is and what it looks like.

    `lengths[column][i]` is the dim-0 length of row i (0 for scalars); `units[i]` the storage unit
    holding row i; `parts` the sizes of consecutive slices for data-parallel ranks (one part unless a
    balancing sampler split the batch). Empty (`len() == 0`) means the partition is exhausted."""

    partition: str
    task: str
    columns: list[str]
    indices: list[int] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    lengths: dict[str, list[int]] = field(default_factory=dict)
    group_ids: list[int | None] = field(default_factory=list)
    weight_versions: list[int | None] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.indices)

    def select(self, positions: Sequence[int]) -> BatchMeta:
        """The rows at `positions` (a single part)."""

        def pick(values: list[_T]) -> list[_T]:
            return [values[p] for p in positions]

        return replace(
            self,
            indices=pick(self.indices),
            units=pick(self.units),
            lengths={c: pick(v) for c, v in self.lengths.items()},
            group_ids=pick(self.group_ids),
            weight_versions=pick(self.weight_versions),
            metadata=pick(self.metadata),
            parts=[len(positions)],
        )

    def split(self) -> list[BatchMeta]:
        """One BatchMeta per part, e.g. per data-parallel rank for a token-balanced batch."""
        out: list[BatchMeta] = []
        start = 0
        for size in self.parts:
            out.append(self.select(range(start, start + size)))
            start += size
        return out


@dataclass
class Batch:
    """Data read for a BatchMeta. `data[c]`: scalar column [B]; ragged column [sum(lengths), *trailing]
    unpadded, or [B, max_len, *trailing] when read with `padded=True`. `lengths[c]`: [B] int64 for
    ragged columns."""

    meta: BatchMeta
    data: dict[str, torch.Tensor]
    lengths: dict[str, torch.Tensor]
    padded: bool = False

    def __len__(self) -> int:
        return len(self.meta)

    def rows(self, column: str) -> list[torch.Tensor]:
        """Per-row tensors of `column`, unpadded."""
        values, lengths = self.data[column], self.lengths.get(column)
        if self.padded and lengths is not None:
            return [values[i, :n] for i, n in enumerate(lengths.tolist())]
        return unpack_rows((values, None if lengths is None else lengths.tolist()))
