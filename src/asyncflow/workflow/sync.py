"""The `sync` workflow: the colocated baseline every speed-up is measured against.

Each step: generate the whole batch, then score it, then compute advantages, then update the
policy (micro-batches with gradient accumulation), then push the new weights to the inference
engine. No stage overlaps another.
"""

from __future__ import annotations

import time

import numpy as np

from asyncflow.workers.rollout import Rollout, complete_groups
from asyncflow.workers.trainer import assign_advantages


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    rewards = np.array([r.reward for r in rollouts], dtype=np.float64)
    lengths = np.array([len(r.response_ids) for r in rollouts], dtype=np.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response/truncated_fraction": float(np.mean([r.finish_reason == "length" for r in rollouts])),
        "rollout/samples": float(len(rollouts)),
        "rollout/tokens": float(lengths.sum()),
    }


class SyncWorkflow:
    def step(self, run) -> dict[str, float]:
        cfg = run.config
        t0 = time.perf_counter()
        rollouts = list(run.rollout.generate(run.next_prompts(cfg.rollout.prompts_per_step)))
        t1 = time.perf_counter()
        run.rewards.score(rollouts)
        groups = list(complete_groups(rollouts, cfg.rollout.group_size))
        metrics = assign_advantages(groups, cfg.algo, cfg.rollout.max_new_tokens)
        t2 = time.perf_counter()
        run.trainer.accumulate([r for g in groups for r in g])
        metrics.update(run.trainer.finish_step())
        run.publish_weights()
        t3 = time.perf_counter()
        metrics.update(rollout_metrics(rollouts))
        metrics.update({"time/generate_s": t1 - t0, "time/reward_s": t2 - t1, "time/train_s": t3 - t2})
        return metrics

    def close(self) -> None:
        pass
