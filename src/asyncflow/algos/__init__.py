"""Core RL math for asyncflow: advantage estimators, losses, train/inference mismatch correction, DAPO filtering,
on-policy distillation.

Owns: pure functions on torch tensors only (no asyncflow imports beyond this package, no I/O).
Shapes: per-token `[N, L]` right-padded with a `mask [N, L]`; per-response `[N]`; groups by
`group_ids [N]`. See each module's docstring for its invariants.
"""

from asyncflow.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    outcome_gae,
    outcome_rewards_to_tokens,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from asyncflow.algos.correction import (
    MISMATCH_CORRECTIONS,
    CorrectionBounds,
    correction_names,
    correction_weights,
    geometric_masked_weights,
    icepop_weights,
    mismatch_sums,
    second_moment_masked_weights,
    sequence_masked_weights,
    sequence_truncated_weights,
    truncated_importance_weights,
)
from asyncflow.algos.distill import combine_with_reward, distill_advantages, reverse_kl_sums
from asyncflow.algos.filtering import keep_groups_with_variance, overlong_mask, overlong_penalty
from asyncflow.algos.losses import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    aggregation_normalisers,
    cispo_loss,
    entropy_from_logits,
    explained_variance,
    gspo_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
    value_loss,
    value_objective,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "KL_ESTIMATORS", "MISMATCH_CORRECTIONS", "POLICY_LOSSES",
    "aggregate", "aggregation_normalisers", "broadcast_to_tokens", "cispo_loss", "combine_with_reward",
    "compute_advantages", "distill_advantages", "reverse_kl_sums", "CorrectionBounds", "correction_names",
    "icepop_weights", "second_moment_masked_weights", "sequence_masked_weights", "sequence_truncated_weights",
    "correction_weights", "discounted_returns", "dr_grpo_advantages", "entropy_from_logits", "gae",
    "geometric_masked_weights", "grpo_advantages", "gspo_loss", "keep_groups_with_variance", "kl_penalty",
    "masked_mean", "mismatch_sums", "outcome_rewards_to_tokens", "overlong_mask", "overlong_penalty", "policy_loss",
    "reinforce_pp_advantages", "rloo_advantages", "truncated_importance_weights", "value_loss", "whiten",
    "explained_variance", "outcome_gae", "value_objective",
]
