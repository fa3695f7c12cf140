"""The built-in torch training engine: policy (+ frozen reference) on CPU or one GPU.

Owns: the policy module, the frozen reference copy, AdamW with gradient clipping and an LR
schedule, micro-batch forward/backward with gradient accumulation, non-finite loss handling,
and the state that checkpoints save. Every micro-batch goes through the tri-model forward
(`asyncflow.models.tri_model`): policy log-probs with grad, reference log-probs without, and the
old policy taken as the policy itself (one update per step), packed by shared prompt according
to `packing` (`auto`: the rule `should_pack`; `on`; `off`).

Invariants:
- One `optimizer_step` per call; gradients accumulate across `backward_micro_batch` calls until
  then, so the caller decides how many micro-batches make one update.
- A micro-batch whose loss is not finite contributes no gradient; the step it belongs to is
  skipped by `optimizer_step` (reported as `skipped=1`) and the gradients are cleared.
- The reference model is never updated (no gradients, eval mode).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from asyncflow.engines.base import LossFn, register_train_engine
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.tri_model import make_reference, tri_model_logprobs


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


@register_train_engine("torch")
class TorchTrainEngine:
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
        packing: str = "auto",
    ):
        self.model = model
        self.model.train()
        if packing not in ("auto", "on", "off"):
            raise ValueError(f"packing must be 'auto', 'on' or 'off', got {packing!r}")
        self.reference = make_reference(model) if use_reference else None
        self.packing = packing
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(lr_schedule, warmup_steps, total_steps)
        )
        self._nonfinite_in_step = False

    def backward_micro_batch(
        self, samples: list[TrainSample], loss_fn: LossFn, *, temperature: float = 1.0
    ) -> dict[str, float]:
        """Forward the tri-model on one micro-batch, compute `loss_fn`, and accumulate gradients.

        Returns `loss_fn`'s stats plus `loss` and `train/packed_fraction` (the micro-batch's response
        tokens when it ran shared-prompt packed, else 0)."""
        out = tri_model_logprobs(
            self.model,
            samples,
            reference=self.reference,
            old_policy=None,
            packing=self.packing,
            temperature=temperature,
            with_entropy=True,
        )
        loss, stats = loss_fn(out)
        # A token sum like the trainer's other stats: divided by the step's tokens it is the packed fraction.
        stats = {**stats, "train/packed_fraction": float(out.policy.mask.sum()) if out.packed else 0.0}
        if not torch.isfinite(loss):
            self._nonfinite_in_step = True
            return {**stats, "loss": float("nan")}
        loss.backward()
        return {**stats, "loss": float(loss.detach())}

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample], *, temperature: float = 1.0) -> torch.Tensor:
        """Policy log-probs `[N, L]` without gradient (for a separate old-policy pass)."""
        return tri_model_logprobs(
            self.model, samples, reference=None, old_policy=None, packing=self.packing, temperature=temperature
        ).policy.logprobs

    def optimizer_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale the accumulated gradients by `grad_scale` (the loss normaliser of the whole batch,
        known only once every micro-batch has been seen), clip, step, and zero them."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if grad_scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        skipped = self._nonfinite_in_step or not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._nonfinite_in_step = False
        return {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "skipped": float(skipped)}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    def training_state(self) -> dict:
        """Optimizer and schedule state for checkpoints (weights go separately, as safetensors)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_training_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
