"""Advantage estimators for RL post-training: GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE.

Owns: pure functions on tensors that turn rewards (and, for PPO, critic values: `gae`, `outcome_gae`) into
advantages,
plus the registry `ADVANTAGE_ESTIMATORS` and the dispatcher `compute_advantages`.

Conventions (shared by every function here):
- N responses, L = longest response (right-padded). Per-token tensors are `[N, L]`; `mask [N, L]`
  (bool or 0/1 float) marks real response tokens. Per-response tensors are `[N]`.
- `group_ids [N]` (integer) names the group (prompt) of each response. Groups need not be
  contiguous and may have different sizes.
Invariants:
- Outputs are exactly 0 at padding (mask == 0) positions.
- Nothing here keeps autograd history it does not need: advantages are computed under
  `torch.no_grad()` and returned detached.
- Every response must have at least one valid token wherever a per-response reward is placed on
  tokens (otherwise its reward would silently vanish): a `ValueError` says which row is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncflow.algos._checks import check_ndim, check_same_shape, float_mask


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.float32)


def _group_index(group_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map `group_ids [N]` to dense indices. Returns (inverse [N] in 0..G-1, counts [G])."""
    check_ndim("group_ids", group_ids, 1)
    if group_ids.shape[0] != n:
        raise ValueError(f"group_ids has {group_ids.shape[0]} entries, rewards has {n}")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def _group_mean(x: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-group mean of `x [N]`, gathered back to `[N]`."""
    sums = torch.zeros(counts.shape[0], dtype=x.dtype, device=x.device).index_add_(0, inverse, x)
    return (sums / counts.to(x.dtype))[inverse]


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages: A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    rewards [N], group_ids [N] -> [N]. std is the unbiased (Bessel, n-1) standard deviation of the
    group, as in the GRPO paper's reference implementations; a group of size 1 has std 0 and
    advantage 0. `scale_by_std=False` gives Dr.GRPO (A_i = r_i - mean_g(r)).
    """
    check_ndim("rewards", rewards, 1)
    r = _as_float(rewards)
    inverse, counts = _group_index(group_ids, r.shape[0])
    dev = r - _group_mean(r, inverse, counts)
    if not scale_by_std:
        return dev
    sq = torch.zeros(counts.shape[0], dtype=r.dtype, device=r.device).index_add_(0, inverse, dev * dev)
    std = (sq / (counts - 1).clamp(min=1).to(r.dtype)).sqrt()
    return dev / (std[inverse] + eps)


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantages: r_i - mean_g(r) (no std scaling). rewards [N], group_ids [N] -> [N]."""
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j in g, j != i} r_j = n/(n-1) * (r_i - mean_g(r)).

    rewards [N], group_ids [N] -> [N]. A group of size 1 has no baseline: its advantage is 0.
    """
    check_ndim("rewards", rewards, 1)
    r = _as_float(rewards)
    inverse, counts = _group_index(group_ids, r.shape[0])
    n = counts.to(r.dtype)[inverse]
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return scale * (r - _group_mean(r, inverse, counts))


@torch.no_grad()
def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise `x` to zero mean, unit variance over the valid (mask == 1) elements.

    x [...], mask [...] (same shape) -> [...]: (x - mean) / sqrt(var + eps), where mean and the
    population variance (divide by count) are taken over valid elements only; padding -> 0.
    `shift_mean=False` rescales without removing the mean (the mean is added back).
    """
    check_same_shape(x=x, mask=mask)
    m = float_mask(mask, x)
    count = m.sum()
    if count == 0:
        raise ValueError("whiten: mask has no valid elements")
    mean = (x * m).sum() / count
    var = (((x - mean) * m) ** 2).sum() / count
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def _check_tokens(name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_ndim(name, x, 2)
    check_same_shape(**{name: x, "mask": mask})
    return float_mask(mask, _as_float(x))


@torch.no_grad()
def outcome_rewards_to_tokens(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each response's scalar reward on its last valid token.

    rewards [N], mask [N, L] -> [N, L], zero everywhere except at (i, last valid index of row i).
    Raises if a row has no valid token.
    """
    check_ndim("rewards", rewards, 1)
    check_ndim("mask", mask, 2)
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} entries, mask has {mask.shape[0]} rows")
    r = _as_float(rewards)
    m = float_mask(mask, r)
    valid = m > 0
    empty = (~valid.any(dim=1)).nonzero().flatten()
    if empty.numel() > 0:
        raise ValueError(f"responses {empty.tolist()} have no valid token: their reward cannot be placed")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values  # [N]
    out = torch.zeros_like(m)
    out[torch.arange(m.shape[0], device=m.device), last] = r
    return out


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} where t' is the next valid token (masked positions are skipped).

    token_rewards [N, L], mask [N, L] -> [N, L] returns, 0 at padding.
    """
    m = _check_tokens("token_rewards", token_rewards, mask)
    r = _as_float(token_rewards)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * running
        running = torch.where(m[:, t] > 0, new, running)
        out[:, t] = running * m[:, t]
    return out


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++: token rewards r_t = -kl_coef * kl_t (+ outcome reward on the last valid token),
    discounted returns G_t over valid tokens, then whitened over all valid tokens of the batch.

    rewards [N], mask [N, L], kl [N, L] or None (per-token KL to the reference, e.g. k1) -> [N, L].
    """
    token_rewards = outcome_rewards_to_tokens(rewards, mask)
    if kl is not None:
        m = _check_tokens("kl", kl, mask)
        token_rewards = token_rewards - kl_coef * kl.to(token_rewards.dtype) * m
    return whiten(discounted_returns(token_rewards, mask, gamma), mask)


@torch.no_grad()
def gae(
    rewards_per_token: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (PPO with a critic).

    rewards_per_token [N, L], values [N, L], mask [N, L] -> (advantages [N, L], returns [N, L]).
    Over valid tokens t (with t' the next valid token, V = 0 after the last one):
        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t
    Masked positions inside a row are skipped (they neither reset nor contribute); both outputs
    are 0 at masked positions. Advantages are not whitened (call `whiten` if wanted).
    """
    m = _check_tokens("rewards_per_token", rewards_per_token, mask)
    check_same_shape(rewards_per_token=rewards_per_token, values=values)
    r = _as_float(rewards_per_token)
    v = values.to(r.dtype)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        valid = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(valid, a, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        adv[:, t] = a * m[:, t]
    return adv, (adv + v) * m


@torch.no_grad()
def outcome_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE of outcome-rewarded responses (PPO with a critic): each response's reward on its last valid token, then
    `gae`. rewards [N], values [N, L] (the critic's, before the update), mask [N, L] -> (advantages [N, L],
    returns [N, L] = advantages + values on valid tokens). A row with no valid token gets zeros (nothing of it is
    trained) instead of an error.
    """
    check_ndim("mask", mask, 2)
    m = float_mask(mask, _as_float(values))
    nonempty = (m > 0).any(dim=1)
    adv = torch.zeros_like(m)
    returns = torch.zeros_like(m)
    if nonempty.any():
        token_rewards = outcome_rewards_to_tokens(rewards[nonempty], m[nonempty])
        adv[nonempty], returns[nonempty] = gae(token_rewards, values[nonempty], m[nonempty], gamma, lam)
    return adv, returns


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response values [N] -> per-token [N, L]: row i is advantages[i] on valid tokens, 0 elsewhere."""
    check_ndim("advantages", advantages, 1)
    check_ndim("mask", mask, 2)
    if advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages has {advantages.shape[0]} entries, mask has {mask.shape[0]} rows")
    a = _as_float(advantages)
    return a[:, None] * float_mask(mask, a)


def _need(name: str, estimator: str, x: torch.Tensor | None) -> torch.Tensor:
    if x is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {name}")
    return x


_Estimate = tuple[torch.Tensor, torch.Tensor | None]


def _grpo(
    rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: torch.Tensor | None = None, eps: float = 1e-6, **_: Any
) -> _Estimate:
    return broadcast_to_tokens(grpo_advantages(rewards, _need("group_ids", "grpo", group_ids), eps=eps), mask), None


def _dr_grpo(
    rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: torch.Tensor | None = None, **_: Any
) -> _Estimate:
    return broadcast_to_tokens(dr_grpo_advantages(rewards, _need("group_ids", "dr_grpo", group_ids)), mask), None


def _rloo(rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: torch.Tensor | None = None, **_: Any) -> _Estimate:
    return broadcast_to_tokens(rloo_advantages(rewards, _need("group_ids", "rloo", group_ids)), mask), None


def _reinforce_pp(
    rewards: torch.Tensor, mask: torch.Tensor, *, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
    gamma: float = 1.0, **_: Any,
) -> _Estimate:
    return reinforce_pp_advantages(rewards, mask, kl, kl_coef, gamma), None


def _gae(
    rewards: torch.Tensor, mask: torch.Tensor, *, values: torch.Tensor | None = None, kl: torch.Tensor | None = None,
    kl_coef: float = 0.0, gamma: float = 1.0, lam: float = 0.95, **_: Any,
) -> _Estimate:
    token_rewards = outcome_rewards_to_tokens(rewards, mask)
    if kl is not None:
        token_rewards = token_rewards - kl_coef * kl.to(token_rewards.dtype) * _check_tokens("kl", kl, mask)
    return gae(token_rewards, _need("values", "gae", values), mask, gamma, lam)


# name -> fn(rewards [N], mask [N, L], **kwargs) -> (advantages [N, L], returns [N, L] or None)
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "gae": _gae,
}


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages [N, L] (and returns [N, L] for "gae", else None) by estimator name.

    rewards [N] (outcome reward per response), mask [N, L]. Group estimators (grpo, dr_grpo, rloo)
    need `group_ids [N]`; "gae" needs `values [N, L]`; `kl [N, L]` * `kl_coef` is subtracted from
    the token rewards by "reinforce_pp" and "gae" (GRPO-style methods put KL in the loss instead).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator](
        rewards, mask, group_ids=group_ids, values=values, kl=kl, kl_coef=kl_coef, gamma=gamma, lam=lam, eps=eps
    )
