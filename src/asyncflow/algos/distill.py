"""On-policy distillation: the reverse KL to a teacher as a per-token advantage.

Owns: `distill_advantages` (the per-token signal), `combine_with_reward` (how it joins a reward's
advantage) and `reverse_kl_sums` (what `distill/reverse_kl` reports).

The student samples its own responses; the teacher scores the same tokens. On a sampled token t the
single-sample estimate of the reverse KL KL(pi_student || pi_teacher) is
`log pi_student(t) - log pi_teacher(t)`, and its negation is the token's advantage: the policy
gradient with it lowers the reverse KL (the on-policy distillation estimator of Agarwal et al. 2024
and Thinking Machines' "On-Policy Distillation", 2025). The signal is dense (one value per token)
and needs no reward.

Invariants: masked tokens get advantage 0; a teacher equal to the student gives 0 everywhere; the
student log-probs are taken without gradient (the advantage is a constant of the loss).
"""

from __future__ import annotations

import torch

from asyncflow.algos._checks import check_ndim, check_same_shape, float_mask


def distill_advantages(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token advantage `-(log pi_student - log pi_teacher)` on sampled tokens, 0 where masked.

    student_logprobs [N, L] (detached inside), teacher_logprobs [N, L], mask [N, L] (bool or 0/1) -> [N, L].
    """
    check_ndim("student_logprobs", student_logprobs, 2)
    check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    m = float_mask(mask, student_logprobs)
    return -(student_logprobs.detach() - teacher_logprobs.to(student_logprobs)) * m


def combine_with_reward(
    reward_advantages: torch.Tensor, distill: torch.Tensor, *, teacher_coef: float, with_reward: bool
) -> torch.Tensor:
    """The advantage trained on: `teacher_coef * distill`, plus `reward_advantages` when `with_reward`.

    reward_advantages [N, L], distill [N, L] (from `distill_advantages`) -> [N, L].
    """
    check_same_shape(reward_advantages=reward_advantages, distill=distill)
    signal = teacher_coef * distill
    return reward_advantages.to(signal) + signal if with_reward else signal


def reverse_kl_sums(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum over unmasked tokens of `log pi_student - log pi_teacher` (divided by the step's tokens it is the
    per-token reverse KL estimate, `distill/reverse_kl`). student_logprobs, teacher_logprobs, mask [N, L] -> float."""
    return float(-distill_advantages(student_logprobs, teacher_logprobs, mask).sum())
