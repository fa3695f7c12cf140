"""Unified tri-model forward: policy, old-policy and reference log-probs of one micro-batch in one call.

Owns: `TriLogProbs` (with the critic's values, when there is one), `tri_model_logprobs`, `TriModel` (the three
models held together), `make_reference` (frozen copy of the initial policy) and the packing decision `should_pack`.

Invariants: only the policy forward records autograd; old-policy and reference forwards run under
`torch.no_grad()` and their outputs never require grad. `old_policy=None` means "same weights as
the policy" (one update per iteration): the old log-probs are then the policy's, detached, and no
second forward runs. All three use the same path (packed or not), so their values agree in the
same float summation order.

Packing rule (`should_pack`): pack when shared-prompt packing removes at least
`PACK_MIN_TOKEN_SAVING` = 10% of the tokens the unpacked path runs, i.e.
`1 - sum_groups(P + sum R) / (N * max_i(P_i + R_i)) >= 0.10` (the unpacked count includes its
right padding, so mixed response lengths count too). Below that, the index gathers and the second
attention call per layer cost more than the tokens saved. The threshold was measured on CPU
(docs/benchmark-log.md, "packing rule"); on a GPU set `train.packing` explicitly until it is
measured there with a model of real size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from asyncflow.models.logprobs import LogProbs, TrainSample, response_logprobs
from asyncflow.models.moe import RouterReplay
from asyncflow.models.packing import (
    PackingError,
    SharedPromptLayout,
    group_runs,
    packed_response_logprobs,
    plan_shared_prompt,
)
from asyncflow.models.value import ValueHead, ValueModel, packed_response_values, response_values

Packing = Literal["auto", "on", "off"]
PACK_MIN_TOKEN_SAVING = 0.10


@dataclass
class TriLogProbs:
    policy: LogProbs  # logprobs [N, L] with grad; mask [N, L]; entropy [N, L] when requested
    old: torch.Tensor  # [N, L] no grad (the policy's, detached, when old_policy is None)
    ref: torch.Tensor | None  # [N, L] no grad; None without a reference model
    packed: bool = False  # whether this micro-batch ran shared-prompt packed
    values: torch.Tensor | None = None  # [N, L] critic values with grad; None without a critic
    old_values: torch.Tensor | None = None  # [N, L] no grad: the critic's values before this step's update


def should_pack(samples: list[TrainSample]) -> bool:
    """The packing rule of the module docstring; False for samples that cannot be packed."""
    try:
        runs = group_runs(samples)
    except PackingError:
        return False  # the unpacked path is always correct; packing="on" reports the reason
    packed = sum(len(s.response_ids) for s in samples) + sum(len(samples[start].prompt_ids) for start, _ in runs)
    unpacked = len(samples) * max(len(s.prompt_ids) + len(s.response_ids) for s in samples)  # padding included
    return 1.0 - packed / unpacked >= PACK_MIN_TOKEN_SAVING


def make_reference(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen deep copy of `policy` (eval mode, no parameter requires grad)."""
    return copy.deepcopy(policy).eval().requires_grad_(False)


def _critic_values(
    critic: torch.nn.Module, samples: list[TrainSample], current: LogProbs, layout: SharedPromptLayout | None
) -> torch.Tensor:
    """Values `[N, L]` of `critic`: a `ValueHead` reads the policy forward's hidden states (`current.hidden`), a
    `ValueModel` runs its own forward on the same layout (packed or not) as the policy."""
    if isinstance(critic, ValueHead):
        if current.hidden is None:
            raise ValueError("a value head needs the policy forward's hidden states (with_hidden=True)")
        hidden = current.hidden if critic.train_trunk else current.hidden.detach()
        values: torch.Tensor = critic(hidden)
        return values.masked_fill(~current.mask, 0.0)
    separate = cast(ValueModel, critic)  # attach_critic makes a ValueHead or a ValueModel
    if layout is None:
        return response_values(separate, samples)
    device = next(critic.parameters()).device
    if layout.input_ids.device != device:
        layout = plan_shared_prompt(samples, device)
    return packed_response_values(separate, layout)


def tri_model_logprobs(
    policy: torch.nn.Module,
    samples: list[TrainSample],
    *,
    reference: torch.nn.Module | None = None,
    old_policy: torch.nn.Module | None = None,
    packing: Packing = "auto",
    temperature: float = 1.0,
    with_entropy: bool = False,
    critic: torch.nn.Module | None = None,
    replay: RouterReplay | None = None,
) -> TriLogProbs:
    """Policy log-probs with grad, old-policy and reference log-probs without, for one micro-batch.

    Outputs are `[N, L]` in the order of `samples` (see `response_logprobs`) on the policy's device. `critic`
    (`asyncflow.models.value`: a head on the policy's trunk or a separate model) adds its values with grad and,
    detached, as the old values (the engines take one update per step: the critic before it is the critic now).
    `replay` (on `policy`): the policy forward routes as the samples' records say (`asyncflow.models.moe`); the
    reference routes on its own.
    """
    if packing not in ("auto", "on", "off"):
        raise ValueError(f"packing must be 'auto', 'on' or 'off', got {packing!r}")
    device = next(policy.parameters()).device
    packed = packing == "on" or (packing == "auto" and should_pack(samples))
    layout = plan_shared_prompt(samples, device) if packed else None  # one plan for every model on `device`

    def logprobs(model: torch.nn.Module, **kwargs: Any) -> LogProbs:
        if layout is None:
            return response_logprobs(model, samples, temperature=temperature, **kwargs)
        own_plan = layout if next(model.parameters()).device == device else None
        return packed_response_logprobs(model, samples, temperature=temperature, layout=own_plan, **kwargs)

    with torch.no_grad():
        ref = None if reference is None else logprobs(reference).logprobs.to(device)
        old = None if old_policy is None or old_policy is policy else logprobs(old_policy).logprobs.to(device)
    if replay is not None:
        replay.arrange(samples, packed)
    current = logprobs(policy, with_entropy=with_entropy, with_hidden=isinstance(critic, ValueHead))
    values = None if critic is None else _critic_values(critic, samples, current, layout).to(device)
    return TriLogProbs(policy=current, old=current.logprobs.detach() if old is None else old, ref=ref, packed=packed,
                       values=values, old_values=None if values is None else values.detach())


class TriModel:
    """Policy, optional old policy and reference held together; calling it runs `tri_model_logprobs`.

    `reference="copy"` makes the reference a frozen copy of the policy as it is now (initial weights).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        reference: torch.nn.Module | Literal["copy"] | None = None,
        old_policy: torch.nn.Module | None = None,
        *,
        packing: Packing = "auto",
    ) -> None:
        self.policy = policy
        self.reference = make_reference(policy) if isinstance(reference, str) and reference == "copy" else reference
        self.old_policy = old_policy
        self.packing = packing

    def __call__(
        self, samples: list[TrainSample], *, temperature: float = 1.0, with_entropy: bool = False
    ) -> TriLogProbs:
        return tri_model_logprobs(
            self.policy,
            samples,
            reference=self.reference,
            old_policy=self.old_policy,
            packing=self.packing,
            temperature=temperature,
            with_entropy=with_entropy,
        )
