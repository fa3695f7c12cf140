"""Held-out evaluation: greedy accuracy of an inference engine's current weights, and of the model a reference
names (a checkpoint, a run folder, a Hugging Face folder, a preset); `evaluation_spec`, the one description of
an evaluation engine (the run's, `asyncflow eval`'s and the SFT warm-up's validation).

Invariants: a prompt counts as solved when its single sample scores a reward >= 1, the same
reward functions training uses; evaluating a model builds an inference engine and a reward worker
only (no training engine, no optimizer). Reward calls that fail are counted in the evaluation's own
`eval/reward_errors` / `eval/reward_timeouts` (never in training's), left out of `eval/reward_mean`
and count as unsolved; when every call failed there is no score: accuracy and mean are NaN (null in
metrics.jsonl) with a warning.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from asyncflow.data import Example
from asyncflow.data.prompts import PromptEncoder
from asyncflow.engines.base import InferenceEngine, SamplingParams
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import GeneratingRole, RolloutWorker

if TYPE_CHECKING:
    from asyncflow.runtime.base import RolloutSpec

log = logging.getLogger(__name__)


def evaluate(
    engine: InferenceEngine, rewards: RewardWorker, encoder: PromptEncoder, test: list[Example], params: SamplingParams,
    *, episodes: GeneratingRole | None = None,
) -> dict[str, float]:
    """Held-out accuracy: fraction of prompts whose single sample scores a reward >= 1. With `episodes` (a
    multi-turn worker over `engine`, group size 1) each sample is an episode scored by its environment."""
    prompts = [p for i, ex in enumerate(test) if (p := encoder.encode(ex, i)) is not None]
    if not prompts:
        return {}
    failed: set[int] = set()
    counts = {}
    if episodes is not None:
        rollouts = list(episodes.generate(prompts))
    else:
        rollouts = list(RolloutWorker(engine, params, group_size=1).generate(prompts))
        errors, timeouts = rewards.eval_errors, rewards.eval_timeouts
        failed = rewards.score(rollouts)
        counts = {"eval/reward_errors": float(rewards.eval_errors - errors),
                  "eval/reward_timeouts": float(rewards.eval_timeouts - timeouts)}
    scores = np.array([r.reward for r in rollouts])
    measured = np.array([r.reward for i, r in enumerate(rollouts) if i not in failed])
    if not len(measured):
        log.warning("held-out evaluation: the reward failed on all %d samples (%s): no accuracy is reported",
                    len(rollouts), rewards.last_failure or "see the reward warnings")
        return {"eval/accuracy": math.nan, "eval/reward_mean": math.nan, **counts}
    return {"eval/accuracy": float((scores >= 1.0).mean()), "eval/reward_mean": float(measured.mean()), **counts}


def evaluation_spec(spec: RolloutSpec, params: SamplingParams) -> RolloutSpec:
    """An evaluation engine built as `spec`'s replicas are: greedy `params`, one sample per prompt, no agent
    (an agent's episodes are not evaluated; an environment's are, on the engine), loading full weights (a
    checkpoint's, the merged ones under LoRA) rather than adapters."""
    return replace(spec, params=params, group_size=1, agent=None, adapter=None)


def evaluate_model(config, model: str | Path, test: list[Example]) -> dict[str, float]:
    """Held-out accuracy of `model`: a run's checkpoint `RUN_DIR/checkpoints/step_N` (on its run's own base
    model), a run folder (its newest checkpoint), a Hugging Face folder or `preset:NAME` (see
    `asyncflow.workflow.serve`), on a rollout engine built as the run's replicas are, with `config`'s task,
    prompts and rewards."""
    from asyncflow.models.loading import load_tokenizer
    from asyncflow.runtime.base import build_generating_worker
    from asyncflow.workflow.checkpoint import load_weights, pinned
    from asyncflow.workflow.serve import resolve_model_ref
    from asyncflow.workflow.setup import build_reward_runner, prompt_encoder, rollout_spec, sampling_params

    with pinned(lambda: resolve_model_ref(str(model)), lambda resolved: resolved.checkpoint) as ref:  # not pruned
        weights = None if ref.checkpoint is None else load_weights(ref.checkpoint)  # verified before a model loads
    tokenizer = load_tokenizer(ref.model_path)
    params = sampling_params(config, tokenizer, greedy=True, model_path=ref.model_path)
    spec = evaluation_spec(rollout_spec(config, ref.model_path, tokenizer), params)
    worker = build_generating_worker(spec)
    try:
        if weights is not None:
            worker.engine.update_weights(weights, 1)
        rewards = RewardWorker(build_reward_runner(config), tokenizer)
        episodes = worker if spec.multiturn is not None else None
        return evaluate(worker.engine, rewards, prompt_encoder(config, tokenizer), test, params, episodes=episodes)
    finally:
        worker.close()
