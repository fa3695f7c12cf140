"""Reward worker: scores rollouts with the configured verifiers.

Owns: decoding responses to text and calling the `RewardRunner`, counting failures.

Invariant: a reward function that raises or times out scores 0 for that sample and is counted
in `errors`/`timeouts`; it never stops the run.
"""

from __future__ import annotations

import torch

from asyncflow.rewards import RewardRunner
from asyncflow.workers.rollout import Rollout


class RewardWorker:
    def __init__(self, runner: RewardRunner, tokenizer):
        self.runner = runner
        self.tokenizer = tokenizer
        self.errors = 0
        self.timeouts = 0

    def score(self, rollouts: list[Rollout]) -> None:
        """Set `reward` and `response_text` on each rollout."""
        for r in rollouts:
            r.response_text = self.tokenizer.decode(r.response_ids, skip_special_tokens=True)
        rewards = self._score(
            [r.response_text for r in rollouts], [r.answer for r in rollouts], [r.metadata for r in rollouts]
        )
        for r, value in zip(rollouts, rewards):
            r.reward = float(value)

    def score_ids(self, responses: list[list[int]], metadata: list[dict]) -> torch.Tensor:
        """Rewards `[N]` float32 of token-id responses; `metadata[i]["answer"]` is the ground truth."""
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
        return torch.tensor(self._score(texts, [m["answer"] for m in metadata], metadata), dtype=torch.float32)

    def _score(self, texts: list[str], answers: list[str], metadata: list[dict]) -> list[float]:
        result = self.runner.score(texts, answers, metadata)
        self.errors += result.n_errors
        self.timeouts += result.n_timeouts
        return result.rewards

    def run_partition(self, queue, partition: str, *, batch_size: int, timeout: float) -> int:
        """Score rows of `partition` as their responses become ready; write the `reward` column."""
        count = 0
        for batch in queue.loader(partition, "reward", ["response_ids"], batch_size, timeout=timeout):
            responses = [ids.tolist() for ids in batch.rows("response_ids")]
            queue.write(partition, batch.meta.indices, {"reward": self.score_ids(responses, batch.meta.metadata)})
            count += len(batch)
        return count
