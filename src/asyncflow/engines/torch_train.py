"""The built-in torch training engine: policy (+ frozen reference) on CPU or one GPU.

Owns: the policy module, the frozen reference copy, AdamW with gradient clipping and an LR
schedule, micro-batch forward/backward with gradient accumulation, non-finite loss handling,
and the state that checkpoints save. Every micro-batch goes through the tri-model forward
(`asyncflow.models.tri_model`): policy log-probs with grad, reference log-probs without, and the
old policy taken as the policy itself (one update per step), packed by shared prompt according
to `packing` (`auto`: the rule `should_pack`; `on`; `off`). With `lora` (`asyncflow.engines.peft_lora`)
the policy gets adapters and only they are optimized; `state_dict` is then the merged weights under
the base model's names (what checkpoints' `model.safetensors` and rollout engines under `train.lora.sync: merged`
take), `adapter_weights` the adapter alone (what rollout engines take under `train.lora.sync: adapter`), and
`training_state` carries the adapter, so `load_checkpoint` restores it onto the frozen base.
`precision="bf16"` runs the forward and backward under bfloat16 autocast (`compute_precision`) while the
parameters, gradients and AdamW state stay float32; `activation_checkpointing` recomputes each decoder
layer in the backward instead of keeping its activations (`enable_activation_checkpointing`). With `critic`
(`asyncflow.models.value`) the value model is attached to the policy module (after LoRA: it trains fully), runs in
the tri-model forward, has its own AdamW group (`critic.lr`) and its own gradient clip, and its weights travel in
`training_state` (`state_dict` stays the plain policy).

Invariants:
- One `optimizer_step` per call; gradients accumulate across `backward_micro_batch` calls until
  then, so the caller decides how many micro-batches make one update.
- A micro-batch whose loss is not finite contributes no gradient; the step it belongs to is
  skipped by `optimizer_step` (reported as `skipped=1`) and the gradients are cleared.
- The reference model is never updated (no gradients, eval mode).
- Under LoRA the base weights never change: the optimizer holds the adapter parameters only.
- Under `bf16` the master weights are float32 (a policy in another dtype is rejected) and log-probs, losses
  and gradients are float32; only the matmuls and activations inside the model are bfloat16.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from asyncflow.engines.base import LossFn, TrainEngineBase, register_train_engine
from asyncflow.models.hf import causal_lm
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.moe import RouterReplay, capture_routers, router_loss
from asyncflow.models.packing import keep_shared_prompt_attention
from asyncflow.models.tri_model import Packing, make_reference, tri_model_logprobs
from asyncflow.models.value import CriticSpec, attach_critic, critic_parameters, is_critic_key, policy_weights

if TYPE_CHECKING:
    from asyncflow.engines.base import LoRASettings
    from asyncflow.engines.peft_lora import LoRAWrapper


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step `s` (0-based): linear warm-up, then the schedule."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


PRECISIONS = ("fp32", "bf16")


def check_precision(precision: str, model: torch.nn.Module | None = None) -> None:
    """Raise a one-line error for an unknown `train.precision`, or for bf16 over parameters that are not float32
    (mixed precision keeps float32 master weights)."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and model is not None:
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes != {torch.float32}:
            raise ValueError(
                f"train.precision=bf16 keeps float32 master weights: set model.dtype=float32 (the policy's parameters "
                f"are {sorted(str(d).removeprefix('torch.') for d in dtypes)})"
            )


def compute_precision(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context a training forward runs in: bfloat16 autocast on `device` for `bf16` (matmuls and activations in
    bf16, parameters and their gradients float32), nothing for `fp32`."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def enable_activation_checkpointing(model: torch.nn.Module, packing: Packing) -> None:
    """Recompute every decoder layer's activations during the backward (Hugging Face gradient checkpointing,
    non-reentrant: frozen or adapter-only parameters and keyword inputs pass through). Same gradients, less memory
    held between forward and backward; it applies in training mode only. With packing possible, the model keeps
    the shared-prompt attention between calls, so a layer recomputed in the backward runs what its forward ran."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.activation_checkpointing: {type(model).__name__} does not support gradient "
                         "checkpointing (set train.activation_checkpointing=false)")
    if packing != "off":
        keep_shared_prompt_attention(model)
    options = {"use_reentrant": False}
    lm = causal_lm(model)
    if hasattr(lm, "activation_checkpointing_enable"):  # the name of newer transformers releases
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if getattr(lm.config, "use_cache", False):
        lm.config.use_cache = False  # a recomputed layer must not append to a KV cache again


@register_train_engine("torch")
class TorchTrainEngine(TrainEngineBase):
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        grad_clip: float = 1.0,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        total_steps: int = 1,
        use_reference: bool = False,
        packing: Packing = "auto",
        lora: LoRASettings | None = None,
        precision: str = "fp32",
        activation_checkpointing: bool = False,
        teacher: torch.nn.Module | None = None,
        critic: CriticSpec | None = None,
        router_aux_loss_coef: float | None = None,
        router_replay: bool = False,
    ):
        """`teacher`: a model that takes the reference's place (on-policy distillation, `algo.teacher`): frozen
        here, its log-probs are the tri-model forward's `ref`; not with `use_reference`. `router_aux_loss_coef`: an
        MoE policy's load-balancing loss weight (None: its config's; `asyncflow.models.moe`). `router_replay`: the
        policy's forwards route as the samples' recorded experts say (`algo.router_replay`; `RouterReplay`)."""
        if teacher is not None and use_reference:
            raise ValueError("a training engine holds a reference model or a teacher, not both")
        self.model = model
        self.router_loss = router_loss(model, router_aux_loss_coef)
        if packing not in ("auto", "on", "off"):
            raise ValueError(f"packing must be 'auto', 'on' or 'off', got {packing!r}")
        check_precision(precision, model)
        self.precision = precision
        self.reference = make_reference(model) if use_reference else None  # the base, before any adapter
        if teacher is not None:
            self.reference = teacher.eval().requires_grad_(False)
        if activation_checkpointing:
            enable_activation_checkpointing(model, packing)
        # peft's wrapper of `model` under LoRA (the model itself is trained and run)
        self.adapted: LoRAWrapper | None = None
        if lora is not None:
            from asyncflow.engines import peft_lora as lora_adapter  # peft is imported only when asked for

            self.adapted = lora_adapter.add_adapters(model, lora)
        self.critic = attach_critic(model, critic) if critic is not None else None  # after LoRA: trained fully
        self.replay = RouterReplay(model) if router_replay else None  # after the reference copy: it routes on its own
        self.model.train()
        self.packing = packing
        self.grad_clip = grad_clip
        self.optimizer, self.scheduler = make_optimizer(
            model, critic, lr, betas, weight_decay, lr_schedule, warmup_steps, total_steps
        )
        self._nonfinite_in_step = False

    def backward_micro_batch(
        self, samples: list[TrainSample], loss_fn: LossFn, *, temperature: float = 1.0
    ) -> dict[str, float]:
        """Forward the tri-model on one micro-batch, compute `loss_fn`, and accumulate gradients.

        Returns `loss_fn`'s stats plus `loss` and `train/packed_fraction` (the micro-batch's response
        tokens when it ran shared-prompt packed, else 0)."""
        with compute_precision(self.precision, self.device), capture_routers(self.router_loss) as routed:
            out = tri_model_logprobs(
                self.model,
                samples,
                reference=self.reference,
                packing=self.packing,
                temperature=temperature,
                with_entropy=True,
                critic=self.critic,
                replay=self.replay,
            )
        loss, stats = loss_fn(out)
        # A token sum like the trainer's other stats: divided by the step's tokens it is the packed fraction.
        stats = {**stats, "train/packed_fraction": float(out.policy.mask.sum()) if out.packed else 0.0}
        if self.router_loss is not None:
            extra, moe_stats = self.router_loss.term(routed, out.policy.mask.sum())
            loss, stats = loss + extra, {**stats, **moe_stats}
        if not torch.isfinite(loss):
            self._nonfinite_in_step = True
            return {**stats, "loss": float("nan")}
        loss.backward()
        return {**stats, "loss": float(loss.detach())}

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample], *, temperature: float = 1.0) -> torch.Tensor:
        """Policy log-probs `[N, L]` without gradient (for a separate old-policy pass)."""
        with compute_precision(self.precision, self.device):
            out = tri_model_logprobs(self.model, samples, packing=self.packing, temperature=temperature,
                                     replay=self.replay)
        return out.policy.logprobs

    def optimizer_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        stats = clip_and_step(self.model, self.optimizer, self.scheduler, grad_scale, self.grad_clip,
                              skip=self._nonfinite_in_step)
        self._nonfinite_in_step = False
        return stats

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def close(self) -> None:
        """Free what only further training needs: the optimizer's moments, the gradients and the reference (or
        teacher) model. A run closes its engine after its last checkpoint, which holds them; the weights stay."""
        self.optimizer.state.clear()
        self.model.zero_grad(set_to_none=True)
        self.reference = None
        # Give the C heap's free memory back to the OS (glibc's malloc_trim): freed CPU tensors otherwise stay
        # resident, and what a run does next (plots: Python objects) does not reuse them.
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # no glibc

    def policy_module(self) -> torch.nn.Module:
        return self.model  # under LoRA the adapted model: its forward is the merged policy

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the base model's names (merged with the adapter under LoRA), without the
        critic's (`training_state` carries those)."""
        if self.adapted is not None:
            from asyncflow.engines.peft_lora import merged_state_dict

            return policy_weights(merged_state_dict(self.model))
        return policy_weights({k: v.detach() for k, v in self.model.state_dict().items()})

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors alone (peft's names): what a weight version carries under
        `train.lora.sync: adapter`. ValueError without LoRA."""
        if self.adapted is None:
            raise ValueError("adapter weights need LoRA (train.lora.rank > 0)")
        from asyncflow.engines.peft_lora import adapter_state_dict

        return adapter_state_dict(self.adapted)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load full policy weights. Under LoRA they become the base and the adapter starts again from B = 0
        (so `state_dict()` returns them unchanged); `load_checkpoint` restores a LoRA run instead."""
        if self.adapted is None:
            result = self.model.load_state_dict(state_dict, strict=self.critic is None)
            missing = [key for key in result.missing_keys if not is_critic_key(key)]
            if missing or result.unexpected_keys:
                raise KeyError(f"policy weights do not match: missing {missing[:5]}, "
                               f"unexpected {list(result.unexpected_keys)[:5]}")
            return
        from asyncflow.engines.peft_lora import reset_adapters

        result = self.model.load_state_dict(_adapted_names(self.model, state_dict), strict=False)
        missing = [key for key in result.missing_keys if ".lora_" not in key and not is_critic_key(key)]
        if missing:
            raise KeyError(f"policy weights missing from the state dict: {missing[:5]}")
        reset_adapters(self.model)

    def training_state(self) -> dict[str, Any]:
        """Optimizer and schedule state for checkpoints (weights go separately, as safetensors); under LoRA
        also the adapter (`adapter`, peft's names); with a critic its weights (`critic`)."""
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state["critic"] = {k: v.detach().clone() for k, v in self.critic.state_dict().items()}
        if self.adapted is not None:
            from asyncflow.engines.peft_lora import adapter_state_dict

            state["adapter"] = adapter_state_dict(self.adapted)
        return state

    def load_training_state(self, state: dict[str, Any]) -> None:
        for present, key, what in ((self.adapted is not None, "adapter", "LoRA (train.lora.rank)"),
                                   (self.critic is not None, "critic", "a critic (algo.advantage: gae)")):
            if present != (key in state):
                raise ValueError(f"the checkpoint was written {'without' if present else 'with'} {what} "
                                 "and cannot resume this run's engine")
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.adapted is not None:
            from asyncflow.engines.peft_lora import load_adapter_state_dict

            load_adapter_state_dict(self.adapted, state["adapter"])

    def load_checkpoint(self, weights: Mapping[str, torch.Tensor], training_state: dict[str, Any]) -> None:
        """Restore what `state_dict()` and `training_state()` returned at a checkpoint. Under LoRA the frozen
        base stays as loaded from the model folder and the adapter comes from `training_state`; the result
        must reproduce the checkpoint's merged weights (else the model folder changed since the run began)."""
        if self.adapted is None:
            self.load_state_dict(weights)
            self.load_training_state(training_state)
            return
        self.load_training_state(training_state)
        restored = self.state_dict()
        for key, value in weights.items():
            if not torch.allclose(restored[key], value.to(restored[key].device), rtol=1e-4, atol=1e-5):
                raise ValueError(
                    f"LoRA checkpoint: the base model's {key} plus the saved adapter does not give the checkpoint's "
                    "weights; was model.path changed after the run started?"
                )


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_scale: float, grad_clip: float, *, skip: bool,
) -> dict[str, float]:
    """Scale the accumulated gradients by `grad_scale` (the loss normaliser of the whole batch, known only once every
    micro-batch has been seen), clip the policy's and the critic's each on its own (the value loss's scale does not
    shrink the policy's update), step optimizer and schedule unless `skip` or a norm is not finite, zero them."""
    params, critic_params = critic_parameters(model)
    for p in params + critic_params:
        if p.grad is not None:
            p.grad.mul_(grad_scale)  # under FSDP2 a local op on this rank's shard

    def clip(group: list[torch.nn.Parameter]) -> float:
        norm = torch.nn.utils.clip_grad_norm_(group, grad_clip)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: the global norm

    grad_norm = clip(params)
    extra = {"value/grad_norm": clip(critic_params)} if critic_params else {}
    skipped = skip or not all(map(math.isfinite, [grad_norm, *extra.values()]))
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": float(scheduler.get_last_lr()[0]), "skipped": float(skipped), **extra}


def make_optimizer(model: torch.nn.Module, critic: CriticSpec | None, lr: float, betas: tuple[float, float],
                   weight_decay: float, lr_schedule: str, warmup_steps: int, total_steps: int,
                   ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """-> (AdamW, its LR schedule): over the policy's trainable parameters, then the critic's at `critic.lr`."""
    policy, critic_params = critic_parameters(model)
    groups: list[dict[str, Any]] = [{"params": policy}]
    if critic_params:
        if critic is None:
            raise ValueError("the model carries a critic, but no critic spec (its learning rate) was given")
        groups.append({"params": critic_params, "lr": critic.lr})
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(lr_schedule, warmup_steps, total_steps))


def _adapted_names(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain-model keys -> the keys of the same tensors once LoRA layers wrap them (`x.weight` ->
    `x.base_layer.weight`); every key must exist in `model`."""
    own = set(model.state_dict())
    renamed: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        module, _, leaf = key.rpartition(".")
        wrapped = f"{module}.base_layer.{leaf}"
        name = wrapped if wrapped in own else key
        if name not in own:
            raise KeyError(f"{key}: not a weight of the policy")
        renamed[name] = value
    return renamed
