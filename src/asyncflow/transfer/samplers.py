"""Samplers: which of the ready rows one request takes, and how a batch splits across ranks.

Owns: the `Sampler` interface and the built-in policies (oldest-first, complete GRPO groups,
token-balanced split across data-parallel ranks by Karmarkar-Karp, similar length). A sampler is
a small picklable object; users add one by subclassing `Sampler` and overriding `select`.

Invariants:
- `select` only returns indices of the candidates it was given, each at most once; the controller
  marks exactly those rows consumed, atomically with the choice.
- Returning [] means "wait for more rows"; when `drain` is true no further row will ever become a
  candidate, so a sampler should hand out what it can (a partial last batch).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from typing import NamedTuple


class Candidate(NamedTuple):
    """A row that is ready for the request's columns and not yet consumed by the task."""

    index: int  # type: ignore[assignment]  # the row's index; shadows tuple.index (a method no caller uses)
    group_id: int | None
    weight_version: int | None
    length: int  # summed dim-0 lengths of the sampler's `length_columns` (0 when it needs none)


def oldest_first(candidates: list[Candidate]) -> list[Candidate]:
    """Lowest weight version first (rows without one count as oldest), then the order given (append order)."""
    return sorted(candidates, key=lambda c: -1 if c.weight_version is None else c.weight_version)


class Sampler(ABC):
    """Base policy. `select` returns parts (lists of row indices; one part unless split across ranks).
    `length_columns`: the columns whose lengths `Candidate.length` sums; None means the requested
    columns, () means the sampler ignores lengths (the controller then skips computing them)."""

    length_columns: tuple[str, ...] | None = None

    @abstractmethod
    def select(
        self, candidates: list[Candidate], batch_size: int, drain: bool, group_size: int | None
    ) -> list[list[int]]:
        """Rows to hand out from `candidates` (in append order; rows re-armed by `reset` come last), or []
        to wait. `group_size` is the partition's, if it declared one."""

    def __repr__(self) -> str:
        return type(self).__name__


class OldestFirst(Sampler):
    """`batch_size` rows, oldest first; fewer only when draining."""

    length_columns = ()

    def select(
        self, candidates: list[Candidate], batch_size: int, drain: bool, group_size: int | None
    ) -> list[list[int]]:
        if len(candidates) < batch_size and not drain:
            return []
        return [[c.index for c in oldest_first(candidates)[:batch_size]]]


class GroupSampler(Sampler):
    """Complete GRPO groups only (all `group_size` rows with one group id ready), oldest group first."""

    length_columns = ()

    def __init__(self, group_size: int | None = None) -> None:
        self.group_size = group_size

    def select(
        self, candidates: list[Candidate], batch_size: int, drain: bool, group_size: int | None
    ) -> list[list[int]]:
        size = self.group_size or group_size
        if not size:
            raise ValueError("GroupSampler needs a group_size (from the sampler or the partition)")
        if batch_size % size:
            raise ValueError(f"GroupSampler: batch_size {batch_size} is not a multiple of group_size {size}")
        groups: dict[int, list[Candidate]] = {}
        for c in oldest_first(candidates):
            if c.group_id is None:
                raise ValueError(f"GroupSampler: row {c.index} has no group_id")
            groups.setdefault(c.group_id, []).append(c)
        complete = [rows for rows in groups.values() if len(rows) == size][: batch_size // size]
        if not complete or (len(complete) * size < batch_size and not drain):
            return []
        return [[c.index for rows in complete for c in rows]]


class SimilarLength(Sampler):
    """`batch_size` rows whose lengths span the narrowest range (less padding, even compute)."""

    def select(
        self, candidates: list[Candidate], batch_size: int, drain: bool, group_size: int | None
    ) -> list[list[int]]:
        if len(candidates) < batch_size:
            return [[c.index for c in oldest_first(candidates)]] if drain and candidates else []
        by_length = sorted(candidates, key=lambda c: c.length)
        windows = range(len(by_length) - batch_size + 1)
        spreads = [by_length[i + batch_size - 1].length - by_length[i].length for i in windows]
        start = spreads.index(min(spreads))
        return [[c.index for c in by_length[start : start + batch_size]]]


class TokenBalanced(Sampler):
    """Rows chosen by `base`, split into `dp_size` parts with near-equal token sums (Karmarkar-Karp)."""

    def __init__(self, dp_size: int, base: Sampler | None = None) -> None:
        if dp_size < 1:
            raise ValueError(f"TokenBalanced: dp_size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.base = base or OldestFirst()

    def select(
        self, candidates: list[Candidate], batch_size: int, drain: bool, group_size: int | None
    ) -> list[list[int]]:
        chosen = [i for part in self.base.select(candidates, batch_size, drain, group_size) for i in part]
        length_of = {c.index: c.length for c in candidates}
        parts = karmarkar_karp([length_of[i] for i in chosen], self.dp_size)
        return [[chosen[p] for p in part] for part in parts] if chosen else []


def karmarkar_karp(lengths: list[int], k: int) -> list[list[int]]:
    """Largest differencing method: positions 0..len(lengths)-1 split into k lists with near-equal sums.

    Repeatedly merges the two partial k-way partitions with the largest spread (max sum - min sum),
    pairing the heaviest set of one with the lightest of the other."""
    tie = itertools.count()
    heap: list[tuple[int, int, list[int], list[list[int]]]] = []
    for pos, n in enumerate(lengths):
        sums, sets = [n] + [0] * (k - 1), [[pos]] + [[] for _ in range(k - 1)]
        heap.append((-n, next(tie), sums, sets))
    heapq.heapify(heap)
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, sums_a, sets_a = heapq.heappop(heap)
        _, _, sums_b, sets_b = heapq.heappop(heap)
        heavy_a = sorted(range(k), key=lambda i: -sums_a[i])
        light_b = sorted(range(k), key=lambda i: sums_b[i])
        sums = [sums_a[a] + sums_b[b] for a, b in zip(heavy_a, light_b)]
        sets = [sets_a[a] + sets_b[b] for a, b in zip(heavy_a, light_b)]
        heapq.heappush(heap, (min(sums) - max(sums), next(tie), sums, sets))
    return [sorted(s) for s in heap[0][3]]
