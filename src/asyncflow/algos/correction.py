"""Train/inference mismatch: its measure, and the importance-sampling corrections for it.

The inference engine samples a token with one log-prob (`rollout_logprobs`, b); the trainer recomputes
another for the same weights (a): kernels, batching and precision differ, so a != b, and the policy
gradient is then slightly off-policy. Per token the gap is the log-ratio `a_t - b_t`, the ratio
rho_t = exp(a_t - b_t), and a response's (arithmetic) sequence ratio is the product
rho_i = prod_t rho_it = exp(sum_t (a_it - b_it)).

Owns: pure functions on `[N, L]` tensors (N responses right-padded to L, `mask [N, L]` marking real
response tokens; bool or 0/1 float), each giving detached weights `[N, L]` that multiply the per-token
policy loss:
- `truncated_importance_weights` ("token_tis": truncated IS, Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"; verl `rollout_is: token`, slime `--use-tis`):
  w_t = min(rho_t, cap).
- `icepop_weights` ("icepop": IcePop, the Ring-1T / Ling team 2025, "Small leak can sink a great ship";
  OpenRLHF `--use_icepop`, verl `rollout_is: token` with a `lower_upper` threshold): the token-level IS
  weight kept inside a two-sided band and 0 outside it, w_t = rho_t if low <= rho_t <= high else 0
  (defaults low 0.5, high 5, the IcePop post's and OpenRLHF's).
- `sequence_truncated_weights` ("seq_tis": sequence-level truncated IS; verl `rollout_is: sequence`):
  every token of row i gets w_i = min(rho_i, cap), rho_i the arithmetic sequence ratio.
- `sequence_masked_weights` ("seq_mask": sequence-level rejection on the arithmetic ratio; verl `rollout_rs:
  sequence`): row i is kept (w = 1) when rho_i lies in [1/c, c], else masked (w = 0) as a whole.
- `geometric_masked_weights` ("geo_mis": the same on the geometric mean; verl `rollout_rs: geometric`, its
  `geo_mis` preset): row i is kept when exp(mean_t (a_t - b_t)) lies in [1/c, c].
- `second_moment_masked_weights` ("m2po": M2PO, Zheng et al. 2025, "Prosperity before collapse: how far can
  off-policy RL reach with stale data on LLMs?"; AReaL's `m2po`): the tokens with the largest squared
  log-ratio are masked until the mean of (a_t - b_t)^2 over the kept tokens is <= tau (default 0.04).
- `correction_weights`: the configured one or combination of those (or none), with how many tokens / rows
  each truncated or masked; `mismatch_sums`: the measured gap.

Combinations (`correction_weights(["token_tis", "seq_mask"], ...)`): the weights multiply, as verl applies an
IS weight (`rollout_is`) and a rejection mask (`rollout_rs`) together. At most one of the corrections that
carry the ratio (token_tis, icepop, seq_tis) may be chosen, since two would weight a token by the ratio twice;
any of the masks (geo_mis, seq_mask, m2po) join it (their kept sets intersect).

Invariants: weights are detached and 0 at padding; when a == b every weight is 1 (no truncation, no
mask), so a corrected loss equals the uncorrected one. Masked tokens still count in the loss
normaliser (it is fixed before the forward, which keeps gradient accumulation exact; M2PO normalises by
all tokens too); they add nothing. M2PO's mask belongs to the batch it is given: the trainer gives it one
micro-batch at a time (see `second_moment_masked_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from asyncflow.algos._checks import check_ndim, check_same_shape, float_mask

MISMATCH_CORRECTIONS = ("off", "token_tis", "geo_mis", "icepop", "seq_tis", "seq_mask", "m2po")
#: Corrections whose weight is the (truncated or banded) ratio itself: at most one per combination.
RATIO_WEIGHTS = ("token_tis", "icepop", "seq_tis")
#: The corrections set by one number, `algo.mismatch_threshold`, and the `CorrectionBounds` field it sets.
THRESHOLD_FIELDS = {"token_tis": "token_tis_cap", "geo_mis": "geo_mis_threshold", "seq_tis": "seq_tis_cap",
                    "seq_mask": "seq_mask_threshold"}
#: Counts of rows (divide by the batch's sequences, not its tokens).
SEQUENCE_COUNTS = ("masked_sequences", "seq_tis_truncated_sequences", "seq_mask_masked_sequences")
#: The count each correction reports of what it changed (logged as `mismatch/{count}_fraction`).
CORRECTION_COUNTS = {
    "token_tis": "truncated_tokens", "geo_mis": "masked_sequences", "icepop": "icepop_masked_tokens",
    "seq_tis": "seq_tis_truncated_sequences", "seq_mask": "seq_mask_masked_sequences", "m2po": "m2po_masked_tokens",
}
_LOG_RATIO_CLAMP = 20.0  # verl's safety bound on log-ratios (and on sequence log-ratio sums): exp(20) ~ 5e8


@dataclass(frozen=True)
class CorrectionBounds:
    """Every correction's parameters (`algo.mismatch` in the config), at the defaults of the frameworks
    that ship them: verl's TIS cap 2 (also its `rollout_is_threshold` for `sequence`, and its
    `rollout_rs_threshold`, which falls back to that), verl's geo_mis preset 1.001, IcePop's [0.5, 5] and
    M2PO's tau 0.04."""

    token_tis_cap: float = 2.0
    geo_mis_threshold: float = 1.001
    seq_tis_cap: float = 2.0
    seq_mask_threshold: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    m2po_tau: float = 0.04


DEFAULT_THRESHOLDS = {name: getattr(CorrectionBounds(), field) for name, field in THRESHOLD_FIELDS.items()}


def _log_ratio(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_ndim("train_logprobs", train_logprobs, 2)
    check_same_shape(train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    diff = train_logprobs.detach() - rollout_logprobs.to(train_logprobs.dtype)
    return diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP) * float_mask(mask, train_logprobs)


def _sequence_log_ratio(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """log rho_i = sum_t m_it (a_it - b_it), safety-bounded to +-20 as verl bounds it -> [N]."""
    return _log_ratio(train_logprobs, rollout_logprobs, mask).sum(1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


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
def icepop_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, low: float = 0.5,
    high: float = 5.0,
) -> torch.Tensor:
    """IcePop's two-sided token mask on the IS weight: w_t = rho_t if low <= rho_t <= high else 0, with
    rho_t = exp(a_t - b_t); 0 at padding; detached. A token outside the band adds no gradient (TIS would
    keep it at the cap); inside it is importance-weighted like token_tis.

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L]; 0 < low <= 1 <= high.
    Source: the IcePop post (Ring-1T / Ling team, 2025; alpha = 0.5, beta = 5) and OpenRLHF `--use_icepop`
    with `--vllm_is_truncated_threshold 0.5 5.0`.
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"IcePop band must satisfy 0 < low <= 1 <= high, got low={low}, high={high}")
    ratio = torch.exp(_log_ratio(train_logprobs, rollout_logprobs, mask))
    inside = (ratio >= low) & (ratio <= high)
    return torch.where(inside, ratio, torch.zeros_like(ratio)) * float_mask(mask, train_logprobs)


@torch.no_grad()
def sequence_truncated_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Sequence-level truncated IS: every token of row i weighted by w_i = min(rho_i, cap), with rho_i =
    exp(sum_t (a_it - b_it)) the product of the row's token ratios (log-sum bounded to +-20); 0 at padding;
    detached. Unbiased for the sequence-level gradient up to the cap, with a variance that grows with length.

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L]. Source: verl
    `rollout_is: sequence` (`rollout_is_threshold` default 2).
    """
    if not cap > 0:
        raise ValueError(f"sequence TIS cap must be > 0, got {cap}")
    weight = torch.exp(_sequence_log_ratio(train_logprobs, rollout_logprobs, mask)).clamp(max=cap)  # [N]
    return weight[:, None] * float_mask(mask, train_logprobs)


def _band_mask(row_log_ratio: torch.Tensor, mask: torch.Tensor, like: torch.Tensor, threshold: float,
               what: str) -> torch.Tensor:
    if not threshold > 1:
        raise ValueError(f"{what} threshold must be > 1, got {threshold}")
    keep = row_log_ratio.abs() <= math.log(threshold)
    m = float_mask(mask, like)
    return keep[:, None].to(m.dtype) * m


@torch.no_grad()
def sequence_masked_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float = 2.0
) -> torch.Tensor:
    """Sequence-level masking on the arithmetic ratio: w_it = 1 if 1/c <= rho_i <= c else 0, 0 at padding,
    with rho_i = exp(sum_t m_it (a_it - b_it)) and c = threshold > 1 (a row with no valid token is kept).

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L] (0/1 float, detached).
    Source: verl `rollout_rs: sequence` (lower bound 1/upper when unset; upper defaults to
    `rollout_is_threshold`, 2). The product grows with length, so long responses are masked first; the
    geometric mean (`geometric_masked_weights`) is the length-neutral variant.
    """
    row = _sequence_log_ratio(train_logprobs, rollout_logprobs, mask)
    return _band_mask(row, mask, train_logprobs, threshold, "sequence mask")


@torch.no_grad()
def geometric_masked_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float = 1.001
) -> torch.Tensor:
    """Sequence-level masked IS on the geometric-mean ratio: w_it = 1 if 1/c <= rho_i <= c else 0, 0 at padding.

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L] (0/1 float, detached), with
    rho_i = exp(sum_t m_it (a_it - b_it) / n_i) (n_i = valid tokens of row i; a row with none is kept) and
    c = threshold > 1.
    """
    m = float_mask(mask, train_logprobs)
    mean_log_ratio = _log_ratio(train_logprobs, rollout_logprobs, mask).sum(1) / m.sum(1).clamp(min=1.0)  # [N]
    return _band_mask(mean_log_ratio, mask, train_logprobs, threshold, "geometric mask")


@torch.no_grad()
def second_moment_masked_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, tau: float = 0.04
) -> torch.Tensor:
    """M2PO's second-moment mask: 0/1 weights [N, L] keeping the most tokens whose mean squared log-ratio
    is <= tau, i.e. the valid tokens with the largest (a_t - b_t)^2 are masked, largest first, until

        M2 = sum_{kept} (a_t - b_t)^2 / |kept| <= tau.

    Sorting the valid tokens' squared log-ratios ascending, the prefix means are non-decreasing, so the kept
    set is the longest prefix whose mean is <= tau (ties at the boundary broken by position); when the whole
    batch's M2 is already <= tau nothing is masked. 0 at padding; detached.

    train_logprobs [N, L] (a), rollout_logprobs [N, L] (b), mask [N, L] -> [N, L]; tau > 0. Source: M2PO
    (Zheng et al. 2025; tau = 0.04) as AReaL ships it (`m2po`, every valid token a candidate). The paper's
    final version applies the bound only to the tokens PPO's clip would act on (advantage > 0 with ratio > 1,
    or advantage < 0 with ratio < 1); this function does not (it sees no advantages).

    The mask is the batch's: given one micro-batch, it bounds that micro-batch's M2. The trainer computes the
    trainer-side log-probs in each micro-batch's own forward, so it masks per micro-batch; every micro-batch's
    kept M2 <= tau keeps the step's <= tau too, and it masks at least as many tokens as the step-level mask
    would (the step-level mask keeps the most tokens any mask under the bound can). With one micro-batch per
    step it is the paper's batch mask exactly.
    """
    if not tau > 0:
        raise ValueError(f"M2PO tau must be > 0, got {tau}")
    m = float_mask(mask, train_logprobs)
    squared = _log_ratio(train_logprobs, rollout_logprobs, mask).square().flatten()
    valid = torch.nonzero(m.flatten() > 0).squeeze(1)
    keep = torch.zeros_like(squared)
    if valid.numel():
        values, order = torch.sort(squared[valid].double(), stable=True)
        prefix_means = values.cumsum(0) / torch.arange(1, values.numel() + 1, dtype=values.dtype,
                                                       device=values.device)
        kept = int((prefix_means <= tau).sum())
        keep[valid[order[:kept]]] = 1.0
    return keep.view_as(m) * m


def correction_names(correction: str | Sequence[str]) -> tuple[str, ...]:
    """The corrections of a `mismatch_correction` value: a name, a `+`-joined string or a list of names
    ("off" = none); checked: known names, no repeats, "off" alone, at most one of `RATIO_WEIGHTS`."""
    if isinstance(correction, str):
        names = tuple(part.strip() for part in correction.split("+"))
    else:
        names = tuple(correction)
    unknown = [n for n in names if n not in MISMATCH_CORRECTIONS]
    if unknown:
        raise ValueError(f"unknown mismatch correction {unknown[0]!r}; expected one of {MISMATCH_CORRECTIONS}")
    if len(set(names)) != len(names):
        raise ValueError(f"mismatch correction {list(names)} names a correction twice")
    if "off" in names:
        if len(names) > 1:
            raise ValueError(f"mismatch correction {list(names)}: 'off' cannot be combined with a correction")
        return ()
    ratios = [n for n in names if n in RATIO_WEIGHTS]
    if len(ratios) > 1:
        raise ValueError(f"mismatch corrections {ratios} both weight each token by its ratio; combine at most one of "
                         f"{RATIO_WEIGHTS} with any of the masks geo_mis, seq_mask, m2po")
    return names


def _bounds_with_threshold(names: tuple[str, ...], bounds: CorrectionBounds | None,
                           threshold: float | None) -> CorrectionBounds:
    bounds = CorrectionBounds() if bounds is None else bounds
    if threshold is None:
        return bounds
    thresholded = [n for n in names if n in THRESHOLD_FIELDS]
    if len(thresholded) != 1:
        raise ValueError(f"one threshold applies to exactly one of {tuple(THRESHOLD_FIELDS)}, but the corrections are "
                         f"{list(names)}: give each its own bound (CorrectionBounds, `algo.mismatch`)")
    return replace(bounds, **{THRESHOLD_FIELDS[thresholded[0]]: threshold})


def correction_weights(
    mode: str | Sequence[str], train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
    threshold: float | None = None, bounds: CorrectionBounds | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The importance weights [N, L] of `mode` (None for "off"): one correction, or several (a list or a
    `+`-joined string, see `correction_names`) whose weights multiply; and counts over valid tokens / rows:

    - `truncated_tokens`: tokens whose weight hit a cap (token_tis, seq_tis);
    - `masked_tokens`, `masked_sequences`: tokens given weight 0 by any mask, and the rows with such a token;
    - each chosen correction's own count (`CORRECTION_COUNTS`): `icepop_masked_tokens`,
      `seq_tis_truncated_sequences`, `seq_mask_masked_sequences`, `m2po_masked_tokens` (token_tis and geo_mis
      report through `truncated_tokens` and `masked_sequences`).
    Row counts (`SEQUENCE_COUNTS`) are divided by sequences, the others by tokens, for fractions.

    train_logprobs, rollout_logprobs, mask [N, L]; `bounds` each correction's parameters (None = the
    defaults); `threshold` (None = keep `bounds`) replaces the one number of the single thresholded
    correction chosen (`THRESHOLD_FIELDS`), as `algo.mismatch_threshold` does.
    """
    names = correction_names(mode)
    counts = {"truncated_tokens": 0.0, "masked_tokens": 0.0, "masked_sequences": 0.0}
    counts.update({CORRECTION_COUNTS[n]: 0.0 for n in names})
    if not names:
        return None, counts
    b = _bounds_with_threshold(names, bounds, threshold)
    valid = float_mask(mask, train_logprobs) > 0
    weights = float_mask(mask, train_logprobs).detach().clone()
    truncated = torch.zeros_like(valid)
    for name in names:
        if name == "token_tis":
            w = truncated_importance_weights(train_logprobs, rollout_logprobs, mask, b.token_tis_cap)
            truncated |= (w >= b.token_tis_cap) & valid
        elif name == "seq_tis":
            w = sequence_truncated_weights(train_logprobs, rollout_logprobs, mask, b.seq_tis_cap)
            hit = (w >= b.seq_tis_cap) & valid
            truncated |= hit
            counts["seq_tis_truncated_sequences"] = float(hit.any(1).sum())
        elif name == "icepop":
            w = icepop_weights(train_logprobs, rollout_logprobs, mask, b.icepop_low, b.icepop_high)
            counts["icepop_masked_tokens"] = float(((w == 0) & valid).sum())
        elif name == "seq_mask":
            w = sequence_masked_weights(train_logprobs, rollout_logprobs, mask, b.seq_mask_threshold)
            counts["seq_mask_masked_sequences"] = float(((w == 0) & valid).any(1).sum())
        elif name == "geo_mis":
            w = geometric_masked_weights(train_logprobs, rollout_logprobs, mask, b.geo_mis_threshold)
        else:  # m2po
            w = second_moment_masked_weights(train_logprobs, rollout_logprobs, mask, b.m2po_tau)
            counts["m2po_masked_tokens"] = float(((w == 0) & valid).sum())
        weights = weights * w
    masked = (weights == 0) & valid
    counts["truncated_tokens"] = float((truncated & ~masked).sum())
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
