"""What every workflow shares: seeding, datasets, tokenized prompts, rewards, evaluation.

Owns: `seed_everything`, `open_datasets` (built-in task or files -> a `TrainSet` with a resumable,
seed-determined order, and the held-out list), `PromptEncoder` (text -> `Prompt`, with the
long-prompt policy), `build_reward_runner`, and `evaluate` (greedy accuracy on held-out data).

Invariant: the order of training prompts is a pure function of (seed, position), so a run
resumed at data position P sees exactly the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncflow.config import Config
from asyncflow.data import Example, load_examples, make_task
from asyncflow.engines.base import InferenceEngine, SamplingParams
from asyncflow.models.loading import render_prompt
from asyncflow.rewards import RewardRunner, resolve_reward
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import Prompt, RolloutWorker

log = logging.getLogger(__name__)

TRAIN_POOL_SIZE = 50_000  # built-in tasks: distinct training problems drawn per run


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainSet:
    examples: list[Example]
    seed: int
    _epoch: int | None = field(default=None, init=False, repr=False, compare=False)
    _order: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.examples:
            raise ValueError("the training set is empty")

    def sample(self, rng: random.Random) -> Example:
        return self.examples[rng.randrange(len(self.examples))]

    def at(self, position: int) -> Example:
        """The example served at global position `position` (epochs reshuffled by seed)."""
        epoch, offset = divmod(position, len(self.examples))
        if self._epoch != epoch:  # the order of one epoch is computed once, not per example
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            self._epoch = epoch
        return self.examples[int(self._order[offset])]


def open_datasets(config: Config) -> tuple[TrainSet, list[Example]]:
    data = config.data
    task = make_task(data.task, difficulty=data.difficulty, seed=config.run.seed) if data.task else None
    if data.path:
        train = load_examples(data.path, prompt_field=data.prompt_field, answer_field=data.answer_field)
    else:
        train = task.examples("train", TRAIN_POOL_SIZE)
    if data.test_path:
        test = load_examples(data.test_path, prompt_field=data.prompt_field, answer_field=data.answer_field)
    elif task is not None:
        test = task.examples("test", data.test_size)
    else:
        test = []
    return TrainSet(train, config.run.seed), test[: data.test_size]


def reward_specs(config: Config) -> list[str]:
    if config.reward.fns == ["auto"]:
        if not config.data.task:
            raise ValueError("reward.fns is 'auto' but there is no built-in task: name reward functions in reward.fns")
        return [make_task(config.data.task, difficulty=config.data.difficulty, seed=config.run.seed).verifier]
    return list(config.reward.fns)


def build_reward_runner(config: Config) -> RewardRunner:
    fns = [resolve_reward(spec) for spec in reward_specs(config)]
    weights = config.reward.weights or [1.0] * len(fns)
    return RewardRunner(list(zip(fns, weights)), timeout_s=config.reward.timeout_s, max_workers=config.reward.workers)


def make_reward_worker(config: Config) -> RewardWorker:
    """A reward worker built from config alone (so it can be built in another process)."""
    from asyncflow.models.loading import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(config.model.path, seed=config.run.seed))
    return RewardWorker(build_reward_runner(config), tokenizer)


class PromptEncoder:
    """Tokenizes examples into `Prompt`s, applying the long-prompt policy (skip and count, or stop)."""

    def __init__(self, tokenizer, config: Config):
        self.tokenizer = tokenizer
        self.max_tokens = config.data.max_prompt_tokens
        self.on_long = config.data.on_long_prompt
        self.use_chat = config.model.use_chat_template
        self.skipped = 0

    def encode(self, example: Example, group_id: int) -> Prompt | None:
        ids = render_prompt(self.tokenizer, example.prompt, self.use_chat)
        if len(ids) > self.max_tokens:
            if self.on_long == "error":
                raise ValueError(
                    f"prompt of {example.source or 'example'} has {len(ids)} tokens > data.max_prompt_tokens="
                    f"{self.max_tokens} (set data.on_long_prompt=skip to skip such prompts)"
                )
            self.skipped += 1
            return None
        return Prompt(group_id, ids, example.answer, dict(example.metadata))


def sampling_params(config: Config, tokenizer, *, greedy: bool = False) -> SamplingParams:
    r = config.rollout
    stop = tuple(dict.fromkeys(i for i in [tokenizer.eos_token_id, *r.stop_token_ids] if i is not None))
    if greedy:
        return SamplingParams(temperature=config.eval.temperature, max_new_tokens=config.eval.max_new_tokens or r.max_new_tokens, stop_token_ids=stop)
    return SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stop)


def evaluate(engine: InferenceEngine, rewards: RewardWorker, encoder: PromptEncoder, test: list[Example], params: SamplingParams) -> dict[str, float]:
    """Held-out accuracy: fraction of prompts whose single sample scores a reward >= 1."""
    prompts = [p for i, ex in enumerate(test) if (p := encoder.encode(ex, i)) is not None]
    if not prompts:
        return {}
    rollouts = list(RolloutWorker(engine, params, group_size=1).generate(prompts))
    rewards.score(rollouts)
    scores = np.array([r.reward for r in rollouts])
    return {"eval/accuracy": float((scores >= 1.0).mean()), "eval/reward_mean": float(scores.mean())}
