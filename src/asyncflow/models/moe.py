"""Mixture-of-experts models: their routers' logits, read during a forward, the load-balancing loss, and router
replay (R3: the trainer's forward reuses the experts the rollout engine chose).

Owns: `routers` (a model's router modules), `load_balancing_loss` (pure), `RouterLoss` (captures the routers'
logits during a forward; the term a training engine adds to a micro-batch's loss) and `router_loss`;
`RoutingRecorder` (an inference engine's record of the experts each forward chose; `routing_recorder`),
`replayed_gates` (pure), `replay_order` (a micro-batch's recorded choices in its forward's token order) and
`RouterReplay` (the training forward's routers take those choices); `tie_experts`, routers whose choice flips on
float rounding (what router replay's tests and benchmark measure it on).

Invariants:
- A router is a module with a `top_k` attribute and a `weight [E, H]` whose forward returns the router logits
  first (Hugging Face's `*TopKRouter` of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE); a model with none is dense and
  costs nothing here.
- The loss is the Switch Transformer / Mixtral auxiliary loss, as Hugging Face's `load_balancing_loss_func`
  computes it without an attention mask: every token the routers saw counts (padding and a packed row's shared
  prompt included), layers concatenated.
- Router replay, per sequence: the recorded choices are `[S, layers, k]` (`routing_dtype`: uint8 up to 256 experts),
  row p the experts chosen for the token at position p of prompt + response; an engine records every position it
  ran, S = P + R - 1 (the last response token is never fed). The prompt is replayed too: its keys/values and its last
  position feed every response token, so replaying the response alone would leave the log-probs apart. A replayed
  router keeps its logits (the load-balancing loss and the gradient read them) and returns the replayed experts
  with gates softmax(logits) gathered there (renormalised where the router renormalises its top-k): the router is
  still trained through its gate values, as verl's and SkyRL's R3. Positions without a record (padding, the last
  response token) keep the router's own choice. A packed group replays its first sample's prompt record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch

from asyncflow.models.logprobs import TrainSample
from asyncflow.models.packing import group_runs


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


@contextmanager
def _hooked(found: list[torch.nn.Module], keep: Callable[[int, tuple[Any, ...]], None]) -> Iterator[None]:
    """Calls `keep(layer, router output)` after each router's forward inside the block."""
    handles = [router.register_forward_hook(lambda module, args, output, i=i: keep(i, output))
               for i, router in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def tie_experts(model: torch.nn.Module, relative: float = 1e-7, first: int = 6, second: int = 7,
                seed: int = 0) -> torch.nn.Module:
    """In place, every router's row `second` := row `first` plus Gaussian noise of `relative` times the row's mean
    |weight|: the two experts' logits then differ by about float32 rounding, so which of them a token picks depends
    on the summation order of the forward that routes it (an engine's cached decode or a trainer's full forward),
    as bf16 kernels decide real near-ties. Returns `model`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(model):
            weight = cast(torch.Tensor, router.weight)
            row = weight[first]
            noise = torch.randn(row.shape, generator=g, dtype=row.dtype)
            weight[second] = row + relative * row.abs().mean() * noise
    return model


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of recorded expert indices: uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class RoutingRecorder:
    """An inference engine's record of its routers' choices (`routing_recorder` makes one for an MoE model)."""

    def __init__(self, found: list[torch.nn.Module]) -> None:
        self.routers = found
        self.dtype = routing_dtype(int(cast(torch.Tensor, found[0].weight).shape[0]))

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that holds, after one forward inside the block, the experts it chose `[T, layers, k]`
        (`T`: the forward's tokens, batch-major), in the compact dtype."""
        per_layer: dict[int, torch.Tensor] = {}
        result: list[torch.Tensor] = []
        with _hooked(self.routers, lambda layer, output: per_layer.__setitem__(layer, output[2])):
            yield result
        result.append(torch.stack([per_layer[i] for i in range(len(self.routers))], 1).to(self.dtype))


def routing_recorder(model: torch.nn.Module) -> RoutingRecorder:
    """The `RoutingRecorder` of an MoE `model`; ValueError naming `algo.router_replay` for a dense one."""
    found = routers(model)
    if not found:
        raise ValueError("algo.router_replay: the model has no mixture-of-experts routers to record")
    return RoutingRecorder(found)


def replayed_gates(logits: torch.Tensor, experts: torch.Tensor, normalise: bool) -> torch.Tensor:
    """Gate values of given experts: softmax(logits) `[T, E]` gathered at `experts` `[T, k]` (long) -> `[T, k]`
    float32, divided by their sum when `normalise` (a router that renormalises its top-k: Qwen3-MoE, Mixtral).
    Differentiable in `logits`: the router trains through them."""
    gates = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return gates / gates.sum(dim=-1, keepdim=True) if normalise else gates


def replay_order(samples: list[TrainSample], packed: bool, layers: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's recorded choices (`TrainSample.routed_experts`, `[S, layers, k]`) in the token order of the
    micro-batch's forward -> (experts `[T, layers, k]` long, recorded `[T]` bool). Unpacked (`response_logprobs`):
    `[N, max(P+R)]` rows flattened; packed (`plan_shared_prompt`): per group the prompt (its first sample's record),
    then each response. A position without a record is False in `recorded`."""
    def positions(sample: TrainSample, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        experts = torch.zeros(end - start, layers, k, dtype=torch.long)
        recorded = torch.zeros(end - start, dtype=torch.bool)
        record = sample.routed_experts
        if record is not None:
            if tuple(record.shape[1:]) != (layers, k):
                raise ValueError(f"algo.router_replay: a row's recorded routing has shape {tuple(record.shape)}, the "
                                 f"policy has {layers} MoE layers of {k} experts per token")
            got = record[start:end].long()
            experts[: len(got)], recorded[: len(got)] = got, True
        return experts, recorded

    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    if packed:
        for start, end in group_runs(samples):
            p = len(samples[start].prompt_ids)
            pieces.append(positions(samples[start], 0, p))
            pieces += [positions(samples[i], p, p + len(samples[i].response_ids)) for i in range(start, end)]
    else:
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        pieces = [positions(s, 0, width) for s in samples]
    return torch.cat([e for e, _ in pieces]), torch.cat([r for _, r in pieces])


class RouterReplay:
    """Router replay in a training engine's policy: after `arrange(samples, packed)`, the policy's next forward (and
    the recomputation of its layers in the backward, under activation checkpointing) routes every recorded token to
    its recorded experts (the module docstring); any other forward of the model routes as it would."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("algo.router_replay: the policy has no mixture-of-experts routers to replay")
        self.top_k = int(self.routers[0].top_k)  # type: ignore[arg-type]
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None
        self._armed = False
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(lambda module, args, output, i=layer: self._replace(module, i, output))
        model.register_forward_pre_hook(self._forward_starts)

    def arrange(self, samples: list[TrainSample], packed: bool) -> None:
        """Replay `samples`' records in the model's next forward (`packed`: shared-prompt packed, else unpacked)."""
        experts, recorded = replay_order(samples, packed, len(self.routers), self.top_k)
        self._plan, self._armed = (experts, recorded), True

    def _forward_starts(self, module: torch.nn.Module, args: Any) -> None:
        if not self._armed:
            self._plan = None  # a forward nobody arranged (evaluation through the policy module) is not replayed
        self._armed = False

    def _replace(self, router: torch.nn.Module, layer: int, output: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._plan is None:
            return None
        logits, scores, own = output[:3]
        experts, recorded = self._plan
        if experts.shape[0] != own.shape[0]:
            raise RuntimeError(f"router replay: the forward routes {own.shape[0]} tokens, the arranged records cover "
                               f"{experts.shape[0]}")
        chosen = torch.where(recorded.to(own.device)[:, None], experts[:, layer].to(own.device), own)
        gates = replayed_gates(logits, chosen, bool(getattr(router, "norm_topk_prob", True)))
        return (logits, gates.to(scores.dtype), chosen, *output[3:])
