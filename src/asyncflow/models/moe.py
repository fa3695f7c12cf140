"""Mixture-of-experts models in training: their routers' logits, read during a forward, and the load-balancing loss.

Owns: `routers` (a model's router modules), `load_balancing_loss` (pure), `RouterLoss` (captures the routers'
logits during a forward; the term a training engine adds to a micro-batch's loss) and `router_loss`.

Invariants:
- A router is a module with a `top_k` attribute and a `weight [E, H]` whose forward returns the router logits
  first (Hugging Face's `*TopKRouter` of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE); a model with none is dense and
  costs nothing here.
- The loss is the Switch Transformer / Mixtral auxiliary loss, as Hugging Face's `load_balancing_loss_func`
  computes it without an attention mask: every token the routers saw counts (padding and a packed row's shared
  prompt included), layers concatenated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of each MoE layer of `model`, in layer order (empty for a dense model)."""
    def is_router(module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return type(module).__name__.endswith("Router") and hasattr(module, "top_k") \
            and isinstance(weight, torch.Tensor) and weight.dim() == 2

    return [m for m in model.modules() if is_router(m)]


def load_balancing_loss(logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Auxiliary load-balancing loss `E * sum_e f_e * P_e` over the tokens of every layer (`logits`: per layer
    `[T, E]`): `f_e` is the fraction of (token, choice) slots routed to expert `e` among the `top_k` chosen per token,
    `P_e` the mean router probability of `e` (Hugging Face's `aux_loss`): `top_k` when routing is balanced, up to `E`
    (the number of experts) when one expert takes every token."""
    stacked = torch.cat([x.float() for x in logits], dim=0)  # [L*T, E]
    experts = stacked.shape[-1]
    probs = torch.softmax(stacked, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # [L*T, k]
    slots = torch.nn.functional.one_hot(chosen, experts).float()  # [L*T, k, E]
    tokens_per_expert = slots.mean(dim=0)  # [k, E]
    prob_per_expert = probs.mean(dim=0)  # [E]
    return experts * (tokens_per_expert * prob_per_expert[None, :]).sum()


class RouterLoss:
    """`coef` * the load-balancing loss of a micro-batch's forward, weighted like the policy loss's token sums
    (`weight`: the micro-batch's trained tokens), logged as `moe/load_balancing_loss` (a per-token mean; `top_k`
    when balanced). Built by `router_loss` for MoE models only."""

    def __init__(self, found: list[torch.nn.Module], coef: float) -> None:
        self.routers, self.coef = found, coef
        self.top_k = int(found[0].top_k)  # type: ignore[arg-type]

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that a forward inside the block fills with each router's logits `[T, E]`."""
        captured: list[torch.Tensor] = []

        def keep(module: torch.nn.Module, args: object, output: object) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            captured.append(logits.reshape(-1, logits.shape[-1]))  # type: ignore[union-attr]

        handles = [router.register_forward_hook(keep) for router in self.routers]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def term(self, captured: list[torch.Tensor], weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """(what to add to the loss, its stats) after a forward inside `capture`."""
        aux = load_balancing_loss(captured, self.top_k)
        return self.coef * aux * weight, {"moe/load_balancing_loss": float(aux.detach()) * float(weight)}


def router_loss(model: torch.nn.Module, configured: float | None) -> RouterLoss | None:
    """The `RouterLoss` of an MoE `model` (None for a dense one), weighted by `train.router_aux_loss_coef` if set,
    else by the model config's own `router_aux_loss_coef` (0: logged, not trained)."""
    found = routers(model)
    if not found:
        return None
    coef = configured if configured is not None else getattr(getattr(model, "config", None), "router_aux_loss_coef", 0)
    return RouterLoss(found, float(coef or 0.0))


@contextmanager
def capture_routers(loss: RouterLoss | None) -> Iterator[list[torch.Tensor]]:
    """`loss.capture()`, or an empty list for a dense model (nothing hooked)."""
    if loss is None:
        yield []
        return
    with loss.capture() as captured:
        yield captured
