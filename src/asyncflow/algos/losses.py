"""Losses for post-training: the policy losses (PPO/GRPO/DAPO's clipped surrogate, GSPO, CISPO), KL
penalties, entropy, the critic's clipped value loss (`value_loss`, `value_objective`, `explained_variance`), masked
aggregation, the RL objective with its train/inference mismatch correction (the weights themselves are
`asyncflow.algos.correction`), and the supervised (SFT) loss.

Owns: pure functions on tensors. Per-token tensors are `[N, L]` (N responses, right-padded to L)
with `mask [N, L]` (bool or 0/1 float) marking real response tokens.

Aggregation (`aggregate`) — the one place the loss over tokens becomes a scalar:
- "token_mean":          sum_{i,t} m_it * l_it / T        T = number of valid tokens
- "seq_mean_token_mean": sum_i [ sum_t m_it * l_it / n_i ] / S   n_i = valid tokens of row i
- "seq_mean_token_sum":  sum_i [ sum_t m_it * l_it ] / S          S = rows with n_i > 0
Invariant (gradient accumulation): T and S default to the counts of the tensors given; pass the
counts of the WHOLE batch (`total_tokens`, `total_sequences`, see `aggregation_normalisers`) and
the sum over micro-batches of the aggregated losses equals the loss of the whole batch, for every
mode. With zero valid tokens the loss is 0 (and still connected to the graph), never NaN.

Policy losses (`POLICY_LOSSES`, one per-token loss each, then `aggregate`): "ppo" (`policy_loss`) clips the
token ratio pi/pi_old, "gspo" (`gspo_loss`) the sequence ratio (the geometric mean of its tokens' ratios),
"cispo" (`cispo_loss`) clips the token ratio as a stop-gradient weight on log pi and drops no token. A row's
loss depends on that row alone, so splitting a batch by rows keeps the invariant above. When pi_old = pi (one
update per step, on-policy) every ratio is 1 and the three have the same gradient, -A_t * grad log pi_t per
token: they differ once rows are stale or updated more than once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from asyncflow.algos._checks import check_ndim, check_same_shape, float_mask
from asyncflow.algos.correction import CorrectionBounds, correction_weights

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
_LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped here before exp() to keep ratios finite


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over valid (mask == 1) elements.

    x [...], mask [...] (same shape). dim=None -> scalar over all valid elements; dim=d -> the
    mean along d (that dimension removed). Where there is no valid element the result is 0.
    """
    check_same_shape(x=x, mask=mask)
    m = float_mask(mask, x)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def aggregation_normalisers(mask: torch.Tensor) -> tuple[int, int]:
    """(total_tokens, total_sequences) of a batch: valid tokens, and rows with >= 1 valid token.

    mask [N, L]. Pass these to `aggregate` / `policy_loss` for each micro-batch of that batch.
    """
    check_ndim("mask", mask, 2)
    m = mask.to(torch.float32)
    return int(m.sum().item()), int((m.sum(dim=1) > 0).sum().item())


def aggregate(
    loss_per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    total_tokens: int | float | None = None,
    total_sequences: int | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, L] to a scalar (see the module docstring for the formulas).

    total_tokens / total_sequences: the global normalisers T / S (whole batch across micro-
    batches); None uses this tensor's own counts. Only the one the mode uses is read.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    check_ndim("loss_per_token", loss_per_token, 2)
    check_same_shape(loss_per_token=loss_per_token, mask=mask)
    m = float_mask(mask, loss_per_token)
    masked = loss_per_token * m
    if mode == "token_mean":
        denom = _normaliser("total_tokens", total_tokens, m.sum())
        return masked.sum() / denom
    tokens_per_seq = m.sum(dim=1)  # [N]
    per_seq = masked.sum(dim=1)  # [N]
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / tokens_per_seq.clamp(min=1.0)
    denom = _normaliser("total_sequences", total_sequences, (tokens_per_seq > 0).sum().to(m.dtype))
    return per_seq.sum() / denom


def _normaliser(name: str, given: int | float | None, local: torch.Tensor) -> torch.Tensor | float:
    if given is None:
        return local.clamp(min=1.0)
    if not given > 0:
        raise ValueError(f"{name} must be > 0, got {given}")
    return float(given)


def _checked_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    importance_weights: torch.Tensor | None, clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy loss's input checks; -> (log pi/pi_old [N, L] clamped to +-20, with grad; advantages detached)."""
    check_ndim("logprobs", logprobs, 2)
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                     importance_weights=importance_weights)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    log_ratio = (logprobs - old_logprobs.detach().to(logprobs.dtype)).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio, advantages.detach().to(logprobs.dtype)


def _weighted_aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, importance_weights: torch.Tensor | None, aggregation: str,
    total_tokens: int | float | None, total_sequences: int | float | None,
) -> torch.Tensor:
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach().to(per_token.dtype)
    return aggregate(per_token, mask, aggregation, total_tokens, total_sequences)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)) [N, L], and where the clipped term wins."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@torch.no_grad()
def _ratio_stats(
    clipped: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """clip_fraction (of valid tokens where `clipped`), approx_kl (k3 estimate of KL(old || new) from the token
    log-ratios) and ratio_mean (of the ratio the loss clips)."""
    return {
        "clip_fraction": masked_mean(clipped.float(), mask).item(),
        "approx_kl": masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask).item(),
        "ratio_mean": masked_mean(ratio, mask).item(),
    }


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
    total_tokens: int | float | None = None,
    total_sequences: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate policy loss (PPO / GRPO; DAPO clip-higher via clip_low != clip_high).

    logprobs [N, L] (with grad), old_logprobs [N, L], advantages [N, L], mask [N, L].
        ratio_t = exp(logp_t - old_logp_t)              (log-ratio clamped to +-20)
        l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
        dual clip (c = dual_clip > 1): where A_t < 0, l_t = min(l_t, -A_t * c)
        l_t    *= importance_weights_t                  (e.g. TIS weights; treated as constants)
    then `aggregate(l, mask, aggregation, total_tokens, total_sequences)`.
    Returns (loss scalar, stats) with stats (floats, over this micro-batch's valid tokens):
    clip_fraction (tokens where the clipped term is active), approx_kl (k3 estimate of
    KL(old || new)), ratio_mean, and dual_clip_fraction when dual_clip is set.
    """
    log_ratio, adv = _checked_log_ratio(logprobs, old_logprobs, advantages, mask, importance_weights,
                                        clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    ratio = torch.exp(log_ratio)
    per_token, clip_active = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    stats: dict[str, float] = {}
    if dual_clip is not None:
        lower_bound = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > lower_bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, lower_bound), per_token)
        stats["dual_clip_fraction"] = masked_mean(dual_active.float(), mask).item()
    loss = _weighted_aggregate(per_token, mask, importance_weights, aggregation, total_tokens, total_sequences)
    stats.update(_ratio_stats(clip_active, ratio, log_ratio, mask))
    return loss, stats


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    aggregation: str = "token_mean",
    importance_weights: torch.Tensor | None = None,
    total_tokens: int | float | None = None,
    total_sequences: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on the sequence-level, length-normalised ratio.

    logprobs [N, L] (with grad), old_logprobs [N, L], advantages [N, L], mask [N, L]; in GSPO-token form:
        s_i   = exp(sum_t m_it (logp_it - old_logp_it) / n_i)     (n_i valid tokens of row i; token log-ratios
                                                                    clamped to +-20)
        s_it  = sg[s_i] * pi_it / sg[pi_it]                       (value s_i, gradient s_i * grad logp_it)
        l_it  = max(-A_it * s_it, -A_it * clip(s_it, 1 - clip_low, 1 + clip_high))
        l_it *= importance_weights_it                             (treated as constants)
    then `aggregate(l, mask, aggregation, total_tokens, total_sequences)`. With advantages constant along a row
    and `seq_mean_token_mean` this is the paper's sequence-level objective (and its gradient); the defaults are
    its clip range. A row's clip is all or nothing: all its tokens keep their gradient or none does.
    Returns (loss, stats) as `policy_loss` (clip_fraction: the valid tokens of clipped rows; ratio_mean: s_i).
    """
    log_ratio, adv = _checked_log_ratio(logprobs, old_logprobs, advantages, mask, importance_weights,
                                        clip_low, clip_high)
    sequence_log_ratio = masked_mean(log_ratio.detach(), mask, dim=1)  # [N]
    ratio = torch.exp(sequence_log_ratio[:, None] + log_ratio - log_ratio.detach())
    per_token, clip_active = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    loss = _weighted_aggregate(per_token, mask, importance_weights, aggregation, total_tokens, total_sequences)
    return loss, _ratio_stats(clip_active, ratio, log_ratio, mask)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 3.0,
    aggregation: str = "token_mean",
    importance_weights: torch.Tensor | None = None,
    total_tokens: int | float | None = None,
    total_sequences: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, stop-gradient token ratio; no token dropped.

    logprobs [N, L] (with grad), old_logprobs [N, L], advantages [N, L], mask [N, L].
        r_t   = exp(logp_t - old_logp_t)                          (log-ratio clamped to +-20)
        l_t   = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * logp_t
        l_t  *= importance_weights_t                              (treated as constants)
    then `aggregate(l, mask, aggregation, total_tokens, total_sequences)` (the paper's is `token_mean`).
    clip_low = 1 (the default) sets no lower bound, as MiniMax-M1 did. Every valid token keeps a gradient,
    -w_t * A_t * grad logp_t with 0 <= w_t <= 1 + clip_high.
    Returns (loss, stats) as `policy_loss` (clip_fraction: tokens whose weight was clipped; ratio_mean: r_t).
    """
    log_ratio, adv = _checked_log_ratio(logprobs, old_logprobs, advantages, mask, importance_weights,
                                        clip_low, clip_high)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * adv * logprobs
    loss = _weighted_aggregate(per_token, mask, importance_weights, aggregation, total_tokens, total_sequences)
    return loss, _ratio_stats(weight != ratio, ratio, log_ratio, mask)


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "ppo": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss,
}


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, total_tokens: int | float | None = None) -> torch.Tensor:
    """Supervised cross-entropy on demonstration tokens: their mean negative log-likelihood.

    logprobs [N, L] (policy log-probs of the response tokens, with grad), mask [N, L] (the tokens trained:
    an answer and its EOS, or a demonstration's model turns) -> scalar
        loss = -sum_{i,t} m_it * logprobs_it / T       T = total_tokens (default: the valid tokens of `mask`)
    Pass the whole batch's T for each micro-batch (or rank) and their losses add up to the batch's.
    """
    return aggregate(-logprobs, mask, "token_mean", total_tokens)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token log-probs (Schulman's estimators).

    logprobs [...] (policy p, sampled from p), ref_logprobs [...] (reference q) -> [...]; with
    d = logq - logp:  k1 = -d = logp - logq;  k2 = 0.5 * d^2;  k3 = exp(d) - d - 1 (>= 0, unbiased).
    Mask or aggregate the result yourself.
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = ref_logprobs.to(logprobs.dtype) - logprobs
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logits [..., V] -> [...].

    H = logsumexp(z) - sum_v softmax(z)_v * z_v (stable for large logits).
    """
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}")
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
    total_tokens: int | float | None = None,
    total_sequences: int | float | None = None,
) -> torch.Tensor:
    """Clipped PPO value loss: values, old_values, returns, mask [N, L] -> scalar.

        v_clip_t = old_v_t + clip(v_t - old_v_t, -clip, clip)
        l_t      = 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2)     (clip=None: 0.5 * (v_t - R_t)^2)
    aggregated like the policy loss (`aggregate`).
    """
    check_ndim("values", values, 2)
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip must be > 0 (or None), got {clip}")
    unclipped, clipped = _value_errors(values, old_values.detach().to(values.dtype), returns.detach().to(values.dtype),
                                       clip)
    per_token = unclipped if clipped is None else torch.maximum(unclipped, clipped)
    return aggregate(0.5 * per_token, mask, aggregation, total_tokens, total_sequences)


def _value_errors(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(v - R)^2 and, with `clip`, (v_clip - R)^2 where v_clip = old_v + clip(v - old_v, -clip, clip); all [N, L]."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return unclipped, None
    return unclipped, (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2


VALUE_SUMS = ("value/_tokens", "value/_returns", "value/_returns_sq", "value/_error", "value/_error_sq")


def value_objective(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's part of one micro-batch's objective, as an unnormalised SUM like `rl_objective`.

    values [N, L] (with grad), old_values [N, L], returns [N, L], mask [N, L] -> (`value_loss` aggregated by
    `aggregation` with normalisers 1, stats). Stats are sums over valid tokens: `value/loss` (the per-token loss
    0.5 * max((V - R)^2, (V_clip - R)^2)), `value/clip_fraction` (tokens where the clipped term is the larger),
    and `VALUE_SUMS` (count, sum R, sum R^2, sum (R - V), sum (R - V)^2 with V = old_values), from which
    `explained_variance_from_sums` gives the batch's explained variance.
    """
    loss = value_loss(values, old_values, returns, mask, clip, aggregation, total_tokens=1.0, total_sequences=1.0)
    with torch.no_grad():
        m = float_mask(mask, values)
        old, r = old_values.float(), returns.float()
        unclipped, clipped = _value_errors(values.detach().float(), old, r, clip)
        if clipped is None:
            per_token, clipped_larger = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
        else:
            per_token, clipped_larger = torch.maximum(unclipped, clipped), clipped > unclipped
        error = (r - old) * m
        stats = {
            "value/loss": float((0.5 * per_token * m).sum()),
            "value/clip_fraction": float((clipped_larger.float() * m).sum()),
            "value/_tokens": float(m.sum()),
            "value/_returns": float((r * m).sum()),
            "value/_returns_sq": float((r * r * m).sum()),
            "value/_error": float(error.sum()),
            "value/_error_sq": float((error * error).sum()),
        }
    return loss, stats


def explained_variance_from_sums(
    tokens: float, returns: float, returns_sq: float, error: float, error_sq: float
) -> float:
    """1 - Var(R - V) / Var(R) over tokens, from the sums of `value_objective`'s `VALUE_SUMS` (population variances);
    NaN when the returns do not vary (or there is no token)."""
    if tokens <= 0:
        return float("nan")
    var_returns = returns_sq / tokens - (returns / tokens) ** 2
    var_error = error_sq / tokens - (error / tokens) ** 2
    return 1.0 - var_error / var_returns if var_returns > 1e-12 else float("nan")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens. values, returns, mask [N, L] -> float (NaN if R is constant)."""
    check_same_shape(values=values, returns=returns, mask=mask)
    m = float_mask(mask, values.float())
    r, e = returns.float() * m, (returns.float() - values.float()) * m
    return explained_variance_from_sums(float(m.sum()), float(r.sum()), float((r * r).sum()), float(e.sum()),
                                        float((e * e).sum()))


def rl_objective(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    stale: torch.Tensor | None = None,
    loss: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    correction: str | Sequence[str] = "off",
    correction_threshold: float | None = None,
    correction_bounds: CorrectionBounds | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The RL training objective of one micro-batch, as an unnormalised SUM (divide by the whole batch's
    token or sequence count once every micro-batch is in: see the module docstring's invariant).

    logprobs [N, L] (policy, with grad), mask [N, L], old_logprobs [N, L] or None (= logprobs: one update
    per step, ratio 1), rollout_logprobs [N, L] (each token's sampling log-prob), advantages [N, L],
    entropy [N, L] (policy entropy, with grad) or None, ref_logprobs [N, L] or None, stale [N] (rows) or
    [N, L] (tokens) bool or None: sampled by an older policy than `old_logprobs` (partial rollouts span versions).
    `loss` names the policy loss (`POLICY_LOSSES`: ppo, gspo, cispo) and clip_low / clip_high its clip range.

        old_t   = rollout_logprobs_t for stale tokens (the behaviour policy that sampled them), else old_logprobs_t
        w_t     = correction_weights(correction, old, rollout_logprobs, correction_threshold, correction_bounds)
                  (a name, a list of names whose weights multiply, or "off": none)
        obj     = POLICY_LOSSES[loss](logprobs, old, advantages, w)                 (e.g. the clipped surrogate)
                + kl_coef * agg(kl_penalty(logprobs, ref_logprobs))                 (ref_logprobs given)
                - entropy_coef * agg(entropy)
    with every term aggregated by `aggregation` as a sum (normalisers 1).

    Returns (loss, stats) with stats as sums over valid tokens (divide by the batch's tokens for means):
    the policy loss's stats, `entropy`, `logprob_gap` (|old - rollout_logprobs|), `kl` when ref given, and
    the correction's counts as `mismatch/{count}_fraction` (`correction_weights`: `truncated_tokens`,
    `masked_tokens`, `masked_sequences` and each chosen correction's own; the counts of rows,
    `correction.SEQUENCE_COUNTS`, are divided by the batch's sequences).
    """
    if loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}; expected one of {tuple(POLICY_LOSSES)}")
    as_sum = {"total_tokens": 1.0, "total_sequences": 1.0}
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    if stale is not None:
        old = torch.where(stale if stale.ndim == 2 else stale[:, None], rollout_logprobs, old)
    weights, counts = correction_weights(correction, old, rollout_logprobs, mask, correction_threshold,
                                         correction_bounds)
    objective, stats = POLICY_LOSSES[loss](
        logprobs, old, advantages, mask, clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
        importance_weights=weights, **as_sum,
    )
    maskf = float_mask(mask, logprobs)
    n_tokens = float(maskf.sum())
    stats = {k: v * n_tokens for k, v in stats.items()}
    stats["logprob_gap"] = float(((old - rollout_logprobs).abs() * maskf).sum())
    stats.update({f"mismatch/{name}_fraction": value for name, value in counts.items()})
    if entropy is not None:
        stats["entropy"] = float((entropy.detach() * maskf).sum())
        if entropy_coef > 0:
            objective = objective - entropy_coef * aggregate(entropy, mask, aggregation, **as_sum)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        stats["kl"] = float((kl.detach() * maskf).sum())
        if kl_coef > 0:
            objective = objective + kl_coef * aggregate(kl, mask, aggregation, **as_sum)
    return objective, stats
