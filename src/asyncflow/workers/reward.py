"""Reward worker: scores rollouts with the configured verifiers.

Owns: decoding responses to text, calling the `RewardRunner`, and counting its failures.

Invariants:
- A reward function that raises, returns something that is not a finite number, or times out scores
  0 for that sample and is counted: training samples (`score_ids`, `run_partition`) in `errors` /
  `timeouts` / `samples` (the run logs them as `reward/errors` / `reward/timeouts` and feeds them to
  its `RewardHealth`), held-out samples (`score`, used by evaluation) in `eval_errors` /
  `eval_timeouts`, so a failing evaluation set never counts against the training error-rate limit.
- One sample never stops the run; `RewardStuckError` (too many hung calls under thread isolation)
  propagates.
- `last_failure` describes the latest failing batch's first failure (function, what it did, sample).
"""

from __future__ import annotations

import torch

from asyncflow.rewards import RewardRunner
from asyncflow.workers.rollout import Rollout


class RewardWorker:
    def __init__(self, runner: RewardRunner, tokenizer):
        self.runner = runner
        self.tokenizer = tokenizer
        self.samples = 0  # training samples scored
        self.errors = 0
        self.timeouts = 0
        self.eval_errors = 0
        self.eval_timeouts = 0

    def close(self) -> None:
        """Stop the scorer's worker threads or processes (a run closes its reward worker when it ends)."""
        self.runner.close()

    @property
    def last_failure(self) -> str | None:
        return self.runner.last_failure

    def score(self, rollouts: list[Rollout]) -> set[int]:
        """Set `reward` and `response_text` on each rollout (held-out evaluation: counted in `eval_*`); -> the
        indices of the rollouts whose reward failed (scored 0, not a measurement)."""
        texts = [self.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rollouts]
        for r, text in zip(rollouts, texts):
            r.response_text = text
        result = self.runner.score(texts, [r.answer for r in rollouts], [r.metadata for r in rollouts])
        self.eval_errors += result.n_errors
        self.eval_timeouts += result.n_timeouts
        for r, value in zip(rollouts, result.rewards):
            r.reward = float(value)
        return {i for i, _ in result.failures}

    def score_ids(self, responses: list[list[int]], metadata: list[dict]) -> torch.Tensor:
        """Rewards `[N]` float32 of token-id responses; `metadata[i]["answer"]` is the ground truth."""
        return self.score_texts([self.tokenizer.decode(ids, skip_special_tokens=True) for ids in responses], metadata)

    def score_texts(self, texts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Rewards `[N]` float32 of training responses given as text (an agent's final answers)."""
        result = self.runner.score(texts, [m["answer"] for m in metadata], metadata)
        self.samples += len(texts)
        self.errors += result.n_errors
        self.timeouts += result.n_timeouts
        return torch.tensor(result.rewards, dtype=torch.float32)

    def run_partition(self, queue, partition: str, *, batch_size: int, timeout: float) -> int:
        """Score rows of `partition` as their responses become ready; write the `reward` column."""
        count = 0
        for batch in queue.loader(partition, "reward", ["response_ids"], batch_size, timeout=timeout):
            responses = [ids.tolist() for ids in batch.rows("response_ids")]
            queue.write(partition, batch.meta.indices, {"reward": self.score_ids(responses, batch.meta.metadata)})
            count += len(batch)
        return count
