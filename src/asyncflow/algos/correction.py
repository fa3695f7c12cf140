"""Train/inference mismatch: its measure, and the importance-sampling corrections for it.

The inference engine samples a token with one log-prob (`rollout_logprobs`, b); the trainer recomputes
another for the same weights (a): kernels, batching and precision differ, so a != b, and the policy
gradient is then slightly off-policy. Per token the gap is the log-ratio `a_t - b_t`.

Owns: pure functions on `[N, L]` tensors (N responses right-padded to L, `mask [N, L]` marking real
response tokens; bool or 0/1 float):
- `truncated_importance_weights` ("token_tis": truncated IS, Yao et al. 2025; verl `rollout_is: token`,
  slime `--use-tis`): w_t = min(exp(a_t - b_t), cap).
- `geometric_masked_weights` ("geo_mis": sequence-level masked IS on the geometric mean; verl
  `rollout_rs: geometric`, its `geo_mis` preset): row i is kept (w = 1) when its geometric-mean ratio
  rho_i = exp(mean_t (a_t - b_t)) lies in [1/c, c], else masked (w = 0) as a whole.
- `correction_weights`: the configured one of those (or none), with how many tokens / rows it truncated
  or masked; `mismatch_sums`: the measured gap.

Invariants: weights are detached and 0 at padding; when a == b every weight is 1 (no truncation, no
mask), so a corrected loss equals the uncorrected one. Masked tokens still count in the loss
normaliser (it is fixed before the forward, which keeps gradient accumulation exact); they add nothing.
"""

from __future__ import annotations

import math

import torch

from asyncflow.algos._checks import check_ndim, check_same_shape, float_mask

MISMATCH_CORRECTIONS = ("off", "token_tis", "geo_mis")
DEFAULT_THRESHOLDS = {"token_tis": 2.0, "geo_mis": 1.001}  # verl's defaults for TIS and its geo_mis preset
_LOG_RATIO_CLAMP = 20.0


def _log_ratio(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_ndim("train_logprobs", train_logprobs, 2)
    check_same_shape(train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    diff = train_logprobs.detach() - rollout_logprobs.to(train_logprobs.dtype)
    return diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP) * float_mask(mask, train_logprobs)


@torch.no_grad()
def truncated_importance_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Token-level truncated IS: w_t = min(exp(a_t - b_t), cap), 0 at padding; detached.

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L].
    """
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    log_ratio = _log_ratio(train_logprobs, rollout_logprobs, mask)
    return torch.exp(log_ratio).clamp(max=cap) * float_mask(mask, train_logprobs)


@torch.no_grad()
def geometric_masked_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float = 1.001
) -> torch.Tensor:
    """Sequence-level masked IS on the geometric-mean ratio: w_it = 1 if 1/c <= rho_i <= c else 0, 0 at padding.

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L] (0/1 float, detached), with
    rho_i = exp(sum_t m_it (a_it - b_it) / n_i) (n_i = valid tokens of row i; a row with none is kept) and
    c = threshold > 1.
    """
    if not threshold > 1:
        raise ValueError(f"geometric mask threshold must be > 1, got {threshold}")
    m = float_mask(mask, train_logprobs)
    mean_log_ratio = _log_ratio(train_logprobs, rollout_logprobs, mask).sum(1) / m.sum(1).clamp(min=1.0)  # [N]
    keep = mean_log_ratio.abs() <= math.log(threshold)
    return keep[:, None].to(m.dtype) * m


def correction_weights(
    mode: str, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
    threshold: float | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The importance weights [N, L] of `mode` (None for "off") and counts over valid tokens / rows:
    `truncated_tokens` (token_tis: weight hit the cap), `masked_tokens` and `masked_sequences` (geo_mis).

    train_logprobs, rollout_logprobs, mask [N, L]; `threshold` None = `DEFAULT_THRESHOLDS[mode]`.
    """
    if mode not in MISMATCH_CORRECTIONS:
        raise ValueError(f"unknown mismatch correction {mode!r}; expected one of {MISMATCH_CORRECTIONS}")
    counts = {"truncated_tokens": 0.0, "masked_tokens": 0.0, "masked_sequences": 0.0}
    if mode == "off":
        return None, counts
    c = DEFAULT_THRESHOLDS[mode] if threshold is None else threshold
    valid = float_mask(mask, train_logprobs) > 0
    if mode == "token_tis":
        weights = truncated_importance_weights(train_logprobs, rollout_logprobs, mask, c)
        counts["truncated_tokens"] = float(((weights >= c) & valid).sum())
    else:
        weights = geometric_masked_weights(train_logprobs, rollout_logprobs, mask, c)
        masked = (weights == 0) & valid
        counts["masked_tokens"] = float(masked.sum())
        counts["masked_sequences"] = float(masked.any(1).sum())
    return weights, counts


@torch.no_grad()
def mismatch_sums(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
    same_version: torch.Tensor | None = None,
) -> dict[str, float]:
    """Sums for the mismatch metrics: `abs_log_ratio` = sum of |a_t - b_t| over valid tokens, and over the
    valid tokens sampled by the weights the trainer holds (`same_version [N, L]` bool, None = all), where the
    gap is the engines' mismatch alone: `abs_log_ratio_same_version` and their count `same_version_tokens`.

    train_logprobs (a), rollout_logprobs (b), mask [N, L]. Divide by the token counts for means.
    """
    gap = _log_ratio(train_logprobs, rollout_logprobs, mask).abs()
    valid = float_mask(mask, train_logprobs)
    same = valid if same_version is None else valid * same_version.to(valid.dtype)
    return {
        "abs_log_ratio": float(gap.sum()),
        "abs_log_ratio_same_version": float((gap * same).sum()),
        "same_version_tokens": float(same.sum()),
    }
