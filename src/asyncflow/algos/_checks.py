"""Input checks shared by the algorithm modules (private).

Owns: shape/dtype validation that turns bad input into a `ValueError` naming the argument,
and mask normalisation (bool or 0/1 float mask -> float mask in the data's dtype).
"""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise if the given (non-None) tensors do not all have the same shape."""
    named = [(k, t) for k, t in tensors.items() if t is not None]
    if not named:
        return
    ref_name, ref = named[0]
    for name, t in named[1:]:
        if t.shape != ref.shape:
            raise ValueError(f"shape mismatch: {name} has shape {tuple(t.shape)}, {ref_name} has {tuple(ref.shape)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`mask` (bool or 0/1 numbers) as a float tensor with `like`'s dtype and device."""
    if mask.is_complex():
        raise ValueError(f"mask must be bool, integer or float, got {mask.dtype}")
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return mask.to(device=like.device, dtype=dtype)
