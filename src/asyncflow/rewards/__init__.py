"""Rewards for asyncflow: rule-based verifiers, a registry of reward functions, and a
fault-tolerant parallel runner.

Owns: the reward-function contract `fn(completion: str, ground_truth: str, **metadata) -> float`.
Imports nothing of asyncflow outside this package; `math-verify` is imported lazily.
"""

from asyncflow.rewards.registry import REWARDS, CompositeReward, RewardSpecError, register_reward, resolve_reward
from asyncflow.rewards.runner import RewardResult, RewardRunner
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
    "REWARDS", "CompositeReward", "RewardResult", "RewardRunner", "RewardSpecError", "answer_tag_match",
    "exact_match", "extract_numbers", "extract_tag", "format_reward", "math_verify", "numeric_match",
    "register_reward", "resolve_reward",
]
