"""On-policy distillation's per-token signal (`asyncflow.algos.distill`) against values computed by hand, and the
config's refusal of a teacher together with a KL penalty to the reference."""

from __future__ import annotations

import math

import pytest
import torch

from asyncflow.algos.distill import combine_with_reward, distill_advantages, reverse_kl_sums
from asyncflow.config import AlgoConfig

STUDENT = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]])
TEACHER = torch.tensor([[-0.2, -1.5, -0.7], [-0.1, -1.0, -9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)  # row 1: 2 tokens, the third is padding


def test_advantage_is_minus_the_log_ratio_on_sampled_tokens():
    # -(s - t): row 0: -(-0.5+0.2)=0.3, -(-1.0+1.5)=-0.5, -(-2.0+0.7)=1.3; row 1: 0, 2.0, masked -> 0
    expected = torch.tensor([[0.3, -0.5, 1.3], [0.0, 2.0, 0.0]])
    assert torch.allclose(distill_advantages(STUDENT, TEACHER, MASK), expected, atol=1e-6)


def test_masked_tokens_get_zero_whatever_their_log_probs():
    out = distill_advantages(STUDENT, TEACHER, torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))
    float_mask = MASK.float()
    assert torch.equal(distill_advantages(STUDENT, TEACHER, float_mask), distill_advantages(STUDENT, TEACHER, MASK))


def test_identical_teacher_gives_zero_signal_and_zero_kl():
    assert torch.equal(distill_advantages(STUDENT, STUDENT.clone(), MASK), torch.zeros(2, 3))
    assert reverse_kl_sums(STUDENT, STUDENT.clone(), MASK) == 0.0


def test_reverse_kl_sum_is_the_masked_sum_of_log_ratios():
    # (s - t) on unmasked tokens: -0.3 + 0.5 - 1.3 + 0.0 - 2.0 = -3.1
    assert math.isclose(reverse_kl_sums(STUDENT, TEACHER, MASK), -3.1, abs_tol=1e-6)


def test_signal_carries_no_gradient_to_the_student():
    student = STUDENT.clone().requires_grad_(True)
    assert not distill_advantages(student, TEACHER, MASK).requires_grad


def test_combination_with_a_reward_advantage():
    reward_adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    signal = distill_advantages(STUDENT, TEACHER, MASK)
    alone = combine_with_reward(reward_adv, signal, teacher_coef=0.5, with_reward=False)
    assert torch.allclose(alone, torch.tensor([[0.15, -0.25, 0.65], [0.0, 1.0, 0.0]]), atol=1e-6)
    both = combine_with_reward(reward_adv, signal, teacher_coef=0.5, with_reward=True)
    assert torch.allclose(both, torch.tensor([[1.15, 0.75, 1.65], [-1.0, 0.0, 0.0]]), atol=1e-6)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="shape mismatch"):
        distill_advantages(STUDENT, TEACHER[:, :2], MASK)
    with pytest.raises(ValueError, match="2-D"):
        distill_advantages(STUDENT[0], TEACHER[0], MASK[0])


def test_teacher_with_a_kl_penalty_is_refused():
    with pytest.raises(ValueError, match="teacher takes the reference model's place"):
        AlgoConfig(teacher="preset:small-llama", kl_coef=0.1)
    assert AlgoConfig(teacher="preset:small-llama").teacher_coef == 1.0
