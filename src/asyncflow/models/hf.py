"""`causal_lm`: a model held as a `torch.nn.Module`, typed as the transformers causal LM it is.

The models asyncflow trains and serves are transformers `PreTrainedModel`s, some behind a wrapper that forwards
their attributes (PEFT's `PeftModel`, FSDP2's sharded class). Code holds them as `torch.nn.Module`, whose typing
makes any other attribute a `Tensor | Module`; `causal_lm(model).config` and the like say what they are. A cast
only: no runtime check, and transformers is not imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """`model` itself, typed as a transformers causal LM."""
    return cast("PreTrainedModel", model)
