"""The pieces of a run built from its config: seeding, datasets, prompt encoder, rewards, sampling.

Owns the translation from `Config` sections to the constructor arguments of the layers below, so
that those layers never read the config themselves. Everything here is a pure function of the
config (and a tokenizer), so a Ray actor can rebuild the same piece in its own process.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from asyncflow.config import Config
from asyncflow.data import make_task
from asyncflow.data.prompts import PromptEncoder, TrainSet, open_datasets
from asyncflow.engines.base import SamplingParams
from asyncflow.models.loading import load_tokenizer, render_prompt, resolve_model_path
from asyncflow.rewards import RewardRunner
from asyncflow.workers.reward import RewardWorker


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def datasets(config: Config) -> tuple[TrainSet, list]:
    """The run's training set (seed-ordered) and held-out examples."""
    return open_datasets(config.data, config.run.seed)


def prompt_encoder(config: Config, tokenizer) -> PromptEncoder:
    use_chat = config.model.use_chat_template
    return PromptEncoder(
        lambda text: render_prompt(tokenizer, text, use_chat), config.data.max_prompt_tokens, config.data.on_long_prompt
    )


def reward_specs(config: Config) -> list[str]:
    if config.reward.fns == ["auto"]:
        if not config.data.task:
            raise ValueError("reward.fns is 'auto' but there is no built-in task: name reward functions in reward.fns")
        return [make_task(config.data.task, difficulty=config.data.difficulty, seed=config.run.seed).verifier]
    return list(config.reward.fns)


def build_reward_runner(config: Config) -> RewardRunner:
    """The run's reward runner; its functions are resolved and checked (`check_reward_specs`) when it is built."""
    specs = reward_specs(config)
    weights = config.reward.weights or [1.0] * len(specs)
    r = config.reward
    return RewardRunner(
        list(zip(specs, weights)), timeout_s=r.timeout_s, max_workers=r.workers, isolation=r.isolation,
        max_stuck_calls=r.max_stuck_calls,
    )


def make_reward_worker(config: Config) -> RewardWorker:
    """A reward worker built from config alone (so it can be built in another process)."""
    tokenizer = load_tokenizer(resolve_model_path(config.model.path, seed=config.run.seed))
    return RewardWorker(build_reward_runner(config), tokenizer)


def sampling_params(config: Config, tokenizer, *, greedy: bool = False) -> SamplingParams:
    r = config.rollout
    stop = tuple(dict.fromkeys(i for i in [tokenizer.eos_token_id, *r.stop_token_ids] if i is not None))
    if greedy:
        return SamplingParams(
            temperature=config.eval.temperature, max_new_tokens=config.eval.max_new_tokens or r.max_new_tokens,
            stop_token_ids=stop,
        )
    return SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stop)
