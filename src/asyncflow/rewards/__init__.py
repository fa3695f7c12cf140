"""Rewards for asyncflow: rule-based verifiers, a registry of reward functions, a fault-tolerant
parallel runner with bounded resources, and the error-rate limit of a run.

Owns: the reward-function contract `fn(completion: str, ground_truth: str, **metadata) -> float`
(`contract.py`: what a reward function must accept and may return).
Imports nothing of asyncflow outside this package; `math-verify` is imported lazily.
"""

from asyncflow.rewards.contract import Failure, RewardFailure, RewardSpecError, check_reward_fn, reward_value
from asyncflow.rewards.health import RewardHealth, RewardHealthError
from asyncflow.rewards.registry import (
    REWARDS,
    CompositeReward,
    check_reward_specs,
    register_reward,
    resolve_reward,
)
from asyncflow.rewards.runner import RewardResult, RewardRunner, RewardStuckError
from asyncflow.rewards.verifiers import (
    answer_tag_match,
    exact_match,
    extract_numbers,
    extract_tag,
    format_reward,
    math_verify,
    numeric_match,
)

__all__ = [
    "REWARDS", "CompositeReward", "Failure", "RewardFailure", "RewardHealth", "RewardHealthError", "RewardResult",
    "RewardRunner", "RewardSpecError", "RewardStuckError", "answer_tag_match", "check_reward_fn",
    "check_reward_specs", "exact_match", "extract_numbers", "extract_tag", "format_reward", "math_verify",
    "numeric_match", "register_reward", "resolve_reward", "reward_value",
]
