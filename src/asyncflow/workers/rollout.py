"""Rollout worker: turns prompts into sampled responses with an inference engine.

Owns: the `Rollout` record (one sampled response and everything later stages add to it), the `RolloutRole`
protocol every rollout worker implements (single-turn here; multi-turn and agent workers elsewhere) and
`GeneratingRole`, those that also sample prompts given outside the queue, the `RowWriter` they all write
finished rows through, and `RolloutWorker`, which expands each prompt into `group_size` requests and yields
rollouts in completion order.

Invariants:
- Every rollout carries the weight version of the engine that generated it. A partial rollout (its
  tokens sampled by several versions: `rollout.on_weight_update: resume`) carries each token's
  version; the row's version, which the queue stores and the staleness bound reads, is its oldest.
  In the queue the per-token versions travel as row metadata `version_runs`, `[[first token, version],
  ...]` at each version change (a few integers, present only on rows spanning versions).
- Under router replay (`algo.router_replay`) a row carries the experts its engine chose (`ROUTED_EXPERTS_COLUMN`,
  `Completion.routed_experts`: `[P + R - 1, layers, k]`, uint8 or int16).
- A group is complete when all `group_size` of its rollouts have finished; `complete_groups`
  yields each group exactly once, in the order groups complete.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from asyncflow.data.prompts import Prompt
from asyncflow.engines.base import Completion, GenerationRequest, InferenceEngine, SamplingParams


@dataclass
class Rollout:
    group_id: int
    sample_index: int  # position within the group, 0..group_size-1
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    weight_version: int  # the oldest version among the response's tokens
    answer: str
    metadata: dict = field(default_factory=dict)
    reward: float | None = None
    advantages: torch.Tensor | None = None  # [len(response_ids)] float32
    response_text: str | None = None
    token_versions: list[int] | None = None  # per response token; None = all `weight_version`
    loss_mask: list[int] | None = None  # per response token, 1 = trained; None = all (see `Completion.loss_mask`)
    routed_experts: torch.Tensor | None = None  # router replay: `Completion.routed_experts`

    @property
    def row_id(self) -> tuple[int, int]:
        return (self.group_id, self.sample_index)

    def versions(self) -> list[int]:
        """The weight version of every response token."""
        if self.token_versions is not None:
            return self.token_versions
        return [self.weight_version] * len(self.response_ids)


def version_runs(token_versions: list[int]) -> list[list[int]]:
    """Per-token versions -> `[[first token, version], ...]`, one entry where the version changes."""
    return [[t, v] for t, v in enumerate(token_versions) if t == 0 or v != token_versions[t - 1]]


def expand_version_runs(runs: list[list[int]], length: int) -> list[int]:
    """Inverse of `version_runs` for a response of `length` tokens."""
    bounds = [start for start, _ in runs[1:]] + [length]
    return [v for (start, v), end in zip(runs, bounds) for _ in range(end - start)]


def row_fields(completion: Completion) -> tuple[int, dict]:
    """(row version, row metadata) of a completion as the queue stores it: its oldest token's version, its
    finish reason and, when it spans versions, its `version_runs`."""
    meta = {"finish_reason": completion.finish_reason}
    versions = completion.token_versions
    if not versions or min(versions) == max(versions):
        return (versions[0] if versions else completion.weight_version), meta
    return min(versions), {**meta, "version_runs": version_runs(versions)}


PROMPT_COLUMNS = ["prompt_ids"]
RESPONSE_COLUMNS = ["response_ids", "rollout_logprobs"]
LOSS_MASK_COLUMN = "loss_mask"  # per response token, 1 = model-sampled (trained): multi-turn and agent rows
TRAINED_PROMPT_COLUMN = "trained_prompt_ids"  # the prompt that is trained, where it is not `prompt_ids` (an agent's)
ROUTED_EXPERTS_COLUMN = "routed_experts"  # router replay: the experts the engine chose per position [S, layers, k]
WRITE_ROWS = 32  # finished responses per queue write


class RolloutRole(Protocol):
    """What a runtime and a workflow need of a rollout worker (single-turn, multi-turn or an agent's)."""

    engine: InferenceEngine
    scores_rows: bool
    """`run_partition` writes each row's reward itself (no reward stage reads its partitions)."""

    def run_partition(self, queue, partition: str, *, batch_size: int, timeout: float, consumer: str | None = None,
                      scorer=None) -> int:
        """Generate every row of `partition` not yet taken by another rollout worker; returns rows written."""
        ...

    def close(self) -> None: ...


class GeneratingRole(RolloutRole, Protocol):
    """A rollout worker that also samples prompts given to it outside the queue (evaluation, benchmarks):
    single-turn and multi-turn workers; an agent's worker runs episodes only from the queue."""

    def generate(self, prompts: Iterable[Prompt]) -> Iterator[Rollout]:
        """One rollout per (prompt, sample) as it finishes."""
        ...


@dataclass
class FinishedRow:
    """A finished row as the queue stores it; optional parts are written by the workers that have them."""

    index: int
    response_ids: list[int]
    logprobs: list[float]
    version: int
    metadata: dict
    reward: float | None = None
    loss_mask: list[int] | None = None
    trained_prompt_ids: list[int] | None = None
    routed_experts: torch.Tensor | None = None


class RowWriter:
    """Writes a partition's finished rows in writes of `max(WRITE_ROWS, group_size)` rows, so a remote queue
    sees one round trip per few groups' worth of rows (a Ray write costs a few ms). A write travels while the
    worker goes on; it is awaited before the next one and by `close`, so a failed write fails the partition.
    Rows without a reward are scored by `scorer` (a `RewardWorker` beside the worker) in the same write; the
    optional per-token columns are written when the rows have them. Use as a context manager."""

    def __init__(self, queue, partition: str, *, group_size: int, scorer=None, row_meta: dict[int, dict] | None = None):
        self.queue, self.partition, self.scorer = queue, partition, scorer
        self.row_meta = row_meta  # index -> the row's queue metadata (what a scorer reads: answer ...)
        self.batch = max(WRITE_ROWS, group_size)
        self.rows: list[FinishedRow] = []
        self.written = 0
        self._in_flight = None

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()

    def add(self, row: FinishedRow) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.batch:
            self.flush()

    def flush(self) -> None:
        rows, self.rows = self.rows, []
        if not rows:
            return
        columns: dict[str, Any] = {  # a column: a tensor per row, or one tensor of a value per row
            "response_ids": [torch.tensor(r.response_ids, dtype=torch.int64) for r in rows],
            "rollout_logprobs": [torch.tensor(r.logprobs, dtype=torch.float32) for r in rows],
        }
        if rows[0].loss_mask is not None:
            columns[LOSS_MASK_COLUMN] = [torch.tensor(r.loss_mask, dtype=torch.int8) for r in rows]
        if rows[0].trained_prompt_ids is not None:
            columns[TRAINED_PROMPT_COLUMN] = [torch.tensor(r.trained_prompt_ids, dtype=torch.int64) for r in rows]
        if rows[0].routed_experts is not None:
            columns[ROUTED_EXPERTS_COLUMN] = [r.routed_experts for r in rows]
        if rows[0].reward is not None:
            columns["reward"] = torch.tensor([r.reward for r in rows], dtype=torch.float32)
        elif self.scorer is not None:
            assert self.row_meta is not None, "a scorer reads the rows' metadata"
            columns["reward"] = self.scorer.score_ids([r.response_ids for r in rows],
                                                      [self.row_meta[r.index] for r in rows])
        if self._in_flight is not None:
            self._in_flight.wait()
        self._in_flight = self.queue.write(
            self.partition, [r.index for r in rows], columns, wait=False,
            weight_version=[r.version for r in rows], metadata=[r.metadata for r in rows],
        )
        self.written += len(rows)

    def close(self) -> int:
        """Write what is left and wait for the last write; returns rows written."""
        self.flush()
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None
        return self.written


class RolloutWorker:
    scores_rows = False

    def __init__(self, engine: InferenceEngine, params: SamplingParams, group_size: int):
        self.engine = engine
        self.params = params
        self.group_size = group_size

    def close(self) -> None:
        self.engine.close()

    def run_partition(
        self, queue, partition: str, *, batch_size: int, timeout: float, consumer: str | None = None, scorer=None
    ) -> int:
        """Generate every row of `partition` not yet taken by another rollout worker.

        Prompt rows are pulled from the queue as engine slots free up; finished responses go through a
        `RowWriter` (with their weight versions, see `row_fields`; with a `scorer`, a `RewardWorker` placed
        beside this worker, the `reward` column goes in the same write). Returns rows generated.
        """
        metadata: dict[int, dict] = {}

        def requests():
            for batch in queue.loader(
                partition, "rollout", PROMPT_COLUMNS, batch_size, timeout=timeout, consumer=consumer
            ):
                for index, prompt_ids, meta in zip(batch.meta.indices, batch.rows("prompt_ids"), batch.meta.metadata):
                    metadata[index] = meta
                    yield GenerationRequest(index, prompt_ids.tolist())

        with RowWriter(queue, partition, group_size=self.group_size, scorer=scorer, row_meta=metadata) as writer:
            for completion in self.engine.generate(requests(), self.params):
                writer.add(FinishedRow(completion.request_id, completion.response_ids, completion.logprobs,
                                       *row_fields(completion), loss_mask=completion.loss_mask,
                                       routed_experts=completion.routed_experts))
        return writer.written

    def generate(self, prompts: Iterable[Prompt]) -> Iterator[Rollout]:
        """Yield one rollout per (prompt, sample) as soon as it finishes; prompts are pulled lazily."""
        by_group: dict[int, Prompt] = {}

        def requests():
            for prompt in prompts:
                by_group[prompt.group_id] = prompt
                for k in range(self.group_size):
                    yield GenerationRequest((prompt.group_id, k), prompt.prompt_ids)

        for completion in self.engine.generate(requests(), self.params):
            group_id, k = completion.request_id
            prompt = by_group[group_id]
            yield Rollout(
                group_id=group_id,
                sample_index=k,
                prompt_ids=prompt.prompt_ids,
                response_ids=list(completion.response_ids),
                rollout_logprobs=list(completion.logprobs),
                finish_reason=completion.finish_reason,
                weight_version=row_fields(completion)[0],
                answer=prompt.answer,
                metadata=prompt.metadata,
                token_versions=completion.token_versions,
            )


def rollouts_from_batch(batch) -> list[Rollout]:
    """Queue rows (prompt, response and optional reward and loss-mask columns) -> `Rollout` records."""
    meta = batch.meta
    columns = batch.data
    rewards = columns["reward"].tolist() if "reward" in columns else [None] * len(meta)
    masks = [m.tolist() for m in batch.rows(LOSS_MASK_COLUMN)] if LOSS_MASK_COLUMN in columns else [None] * len(meta)
    prompts, responses, logprobs = batch.rows("prompt_ids"), batch.rows("response_ids"), batch.rows("rollout_logprobs")
    if TRAINED_PROMPT_COLUMN in columns:
        prompts = batch.rows(TRAINED_PROMPT_COLUMN)
    routed = batch.rows(ROUTED_EXPERTS_COLUMN) if ROUTED_EXPERTS_COLUMN in columns else [None] * len(meta)
    return [
        Rollout(
            group_id=meta.group_ids[i],
            sample_index=meta.metadata[i].get("sample_index", 0),
            prompt_ids=prompts[i].tolist(),
            response_ids=responses[i].tolist(),
            rollout_logprobs=logprobs[i].tolist(),
            finish_reason=meta.metadata[i].get("finish_reason", "stop"),
            weight_version=meta.weight_versions[i],
            answer=meta.metadata[i]["answer"],
            metadata=meta.metadata[i],
            reward=rewards[i],
            token_versions=(
                expand_version_runs(meta.metadata[i]["version_runs"], len(responses[i]))
                if "version_runs" in meta.metadata[i] else None
            ),
            loss_mask=masks[i],
            routed_experts=routed[i],
        )
        for i in range(len(meta))
    ]


def complete_groups(rollouts: Iterable[Rollout], group_size: int) -> Iterator[list[Rollout]]:
    """Regroup a stream of rollouts into complete groups (sorted by sample index), in completion order."""
    pending: dict[int, list[Rollout]] = defaultdict(list)
    for rollout in rollouts:
        group = pending[rollout.group_id]
        group.append(rollout)
        if len(group) == group_size:
            del pending[rollout.group_id]
            yield sorted(group, key=lambda r: r.sample_index)
    if pending:
        raise RuntimeError(f"rollout stream ended with incomplete groups: {sorted(pending)}")
