"""DAPO sample filtering and length shaping: dynamic sampling, overlong filtering, soft overlong
punishment.

Owns: pure functions on per-response tensors `[N]`.
- `keep_groups_with_variance`: dynamic sampling — a group whose rewards are all equal has zero
  GRPO advantage and contributes no gradient; drop it (bool keep-mask [N], whole groups at once).
- `overlong_mask`: overlong filtering — a truncated response (did not stop by EOS/stop token)
  is excluded from the loss (bool keep-mask [N]).
- `overlong_penalty`: soft overlong punishment, a reward term (<= 0) added to the task reward.
Invariant: keep-masks are bool tensors of shape [N]; the penalty is in [-penalty_factor, 0].
"""

from __future__ import annotations

import torch

from asyncflow.algos._checks import check_ndim


@torch.no_grad()
def keep_groups_with_variance(rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """rewards [N], group_ids [N] (integer) -> bool [N]: True for responses whose group has
    max(r) - min(r) > atol (i.e. not all rewards equal). Groups of size 1 are always dropped.
    """
    check_ndim("rewards", rewards, 1)
    check_ndim("group_ids", group_ids, 1)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards has {rewards.shape[0]} entries, group_ids has {group_ids.shape[0]}")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    hi = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amin")
    return ((hi - lo) > atol)[inverse]


@torch.no_grad()
def overlong_mask(
    response_lengths: torch.Tensor, finished: torch.Tensor | None, max_new_tokens: int
) -> torch.Tensor:
    """response_lengths [N], finished [N] (bool: stopped by EOS/stop token) -> bool keep [N].

    keep_i = finished_i. With finished=None, truncation is inferred from length:
    keep_i = length_i < max_new_tokens. A length above max_new_tokens is an error.
    """
    check_ndim("response_lengths", response_lengths, 1)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if (response_lengths > max_new_tokens).any():
        raise ValueError(f"a response length {int(response_lengths.max())} exceeds max_new_tokens={max_new_tokens}")
    if finished is None:
        return response_lengths < max_new_tokens
    check_ndim("finished", finished, 1)
    if finished.shape != response_lengths.shape:
        raise ValueError(f"finished has {finished.shape[0]} entries, response_lengths has {response_lengths.shape[0]}")
    return finished.to(torch.bool).clone()


@torch.no_grad()
def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment: lengths [N] -> float32 [N] reward term.

    With free = max_len - buffer_len:
        0                                  if L <= free
        (free - L) / buffer_len * factor   if free < L <= max_len   (linear from 0 to -factor)
        -factor                            if L > max_len
    """
    check_ndim("lengths", lengths, 1)
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    length = lengths.to(torch.float32)
    free = max_len - buffer_len
    ramp = (free - length) / buffer_len
    return ramp.clamp(min=-1.0, max=0.0) * penalty_factor
