"""The value model of PPO with a critic: a scalar head on the policy's trunk, or a separate model.

Owns: `CriticSpec` (what to build, picklable for FSDP2 ranks), `ValueHead` (hidden states -> values),
`ValueModel` (a causal LM's trunk + `ValueHead`), `attach_critic` (adds the critic to the policy module as the
submodule `CRITIC`, so one optimizer, one FSDP2 root and one sharded checkpoint hold it), `policy_weights`
(a state dict without the critic) and the value forwards of the separate model (`response_values`, packed or
not), aligned like the log-probs.

Alignment: the value of response token j is read at the hidden state that predicts it (the last prompt position
for j = 0), the same position whose logits give token j's log-prob: V_j estimates the return of the state before
token j is sampled. Values are float32, `[N, L]`, 0 at masked positions.

Invariants:
- The head starts at zero (V = 0 everywhere), on every rank and in every process alike.
- The policy's own weights never depend on the critic: `policy_weights` drops every `CRITIC.` key, so weight
  sync, `model.safetensors` and export carry a plain policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from asyncflow.models.hf import causal_lm
from asyncflow.models.logprobs import TrainSample, padded_rows
from asyncflow.models.packing import ATTENTION_NAME, SharedPromptLayout, _attention_implementation

CRITIC = "critic"  # the critic's submodule name on the policy module (its state-dict prefix is "critic.")


@dataclass(frozen=True)
class CriticSpec:
    """`kind`: `head` (a linear head on the policy's last hidden states) or `separate` (`path`: a model folder
    loaded like the policy, with its own head). `lr`: the critic parameters' learning rate. `train_trunk` (head):
    whether the value loss also trains the shared trunk (False: the head learns on detached features)."""

    kind: Literal["head", "separate"] = "head"
    path: str | None = None
    dtype: str = "float32"
    lr: float = 1e-4
    train_trunk: bool = True


class ValueHead(torch.nn.Module):
    """hidden [..., H] -> values [...] (float32): one linear unit, initialised to zero."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32, train_trunk: bool = True) -> None:
        super().__init__()
        self.train_trunk = train_trunk  # on the policy's trunk: whether the value loss reaches the trunk
        self.head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor = self.head(hidden.to(self.head.weight.dtype))
        return values.squeeze(-1).to(torch.float32, copy=True)  # not a view


class ValueModel(torch.nn.Module):
    """A separate critic: `trunk` (a causal LM, used up to its final hidden states) + `value` (`ValueHead`).
    forward(input_ids [B, T], **model kwargs) -> values [B, T] at every position."""

    def __init__(self, trunk: torch.nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.value = ValueHead(causal_lm(trunk).config.hidden_size, next(trunk.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        hidden = causal_lm(self.trunk).base_model(input_ids=input_ids, **kwargs).last_hidden_state
        values: torch.Tensor = self.value(hidden)
        return values


def attach_critic(policy: torch.nn.Module, spec: CriticSpec) -> torch.nn.Module:
    """Add the critic of `spec` to `policy` as its submodule `CRITIC` (trainable); returns the critic."""
    weight = next(policy.parameters())
    critic: torch.nn.Module
    if spec.kind == "head":
        critic = ValueHead(causal_lm(policy).config.hidden_size, weight.dtype, spec.train_trunk)
    elif spec.kind == "separate":
        from asyncflow.models.loading import load_model

        if spec.path is None:
            raise ValueError("a separate critic needs a model path")
        critic = ValueModel(load_model(spec.path, dtype=spec.dtype, device=str(weight.device)))
    else:
        raise ValueError(f"unknown critic kind {spec.kind!r}; expected 'head' or 'separate'")
    critic.to(weight.device).train().requires_grad_(True)
    policy.add_module(CRITIC, critic)
    return critic


def critic_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The critic `attach_critic` added to `model`, or None."""
    return model._modules.get(CRITIC)


def is_critic_key(key: str) -> bool:
    return key.startswith(CRITIC + ".") or f".{CRITIC}." in key


def policy_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without the critic's tensors (the plain policy)."""
    return {k: v for k, v in state_dict.items() if not is_critic_key(k)}


def critic_parameters(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(policy parameters, critic parameters) of `model` that require grad, in module order."""
    policy: list[torch.nn.Parameter] = []
    critic: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (critic if is_critic_key(name) else policy).append(p)
    return policy, critic


def response_values(critic: ValueModel, samples: list[TrainSample]) -> torch.Tensor:
    """Values `[N, L]` of a separate critic on right-padded prompt + response rows (the unpacked path)."""
    input_ids, attention, mask, positions = padded_rows(samples, next(critic.parameters()).device)
    values: torch.Tensor = critic(input_ids, attention_mask=attention)  # [N, T]
    return values.gather(1, positions).masked_fill(~mask, 0.0)


def packed_response_values(critic: ValueModel, layout: SharedPromptLayout) -> torch.Tensor:
    """Values `[N, L]` of a separate critic on a shared-prompt packed row (`plan_shared_prompt`)."""
    with _attention_implementation(critic.trunk, ATTENTION_NAME):
        values: torch.Tensor = critic(
            layout.input_ids, position_ids=layout.position_ids, shared_prompt_layout=layout
        )  # [1, T]
    return values[0, layout.predictor_index].masked_fill(~layout.mask, 0.0)
