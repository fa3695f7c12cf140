"""Held-out evaluation: greedy accuracy of an inference engine's current weights.

Invariant: a prompt counts as solved when its single sample scores a reward >= 1, the same
reward functions training uses.
"""

from __future__ import annotations

import numpy as np

from asyncflow.data import Example
from asyncflow.data.prompts import PromptEncoder
from asyncflow.engines.base import InferenceEngine, SamplingParams
from asyncflow.workers.multiturn import MultiTurnRolloutWorker
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import RolloutWorker


def evaluate(
    engine: InferenceEngine, rewards: RewardWorker, encoder: PromptEncoder, test: list[Example], params: SamplingParams,
    *, episodes: MultiTurnRolloutWorker | None = None,
) -> dict[str, float]:
    """Held-out accuracy: fraction of prompts whose single sample scores a reward >= 1. With `episodes` (a
    multi-turn worker over `engine`, group size 1) each sample is an episode scored by its environment."""
    prompts = [p for i, ex in enumerate(test) if (p := encoder.encode(ex, i)) is not None]
    if not prompts:
        return {}
    if episodes is not None:
        rollouts = list(episodes.generate(prompts))
    else:
        rollouts = list(RolloutWorker(engine, params, group_size=1).generate(prompts))
        rewards.score(rollouts)
    scores = np.array([r.reward for r in rollouts])
    return {"eval/accuracy": float((scores >= 1.0).mean()), "eval/reward_mean": float(scores.mean())}
