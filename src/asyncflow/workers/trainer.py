"""Trainer worker: advantages for complete groups, and the policy update by gradient accumulation.

Owns: turning scored groups into per-token advantages (the configured estimator, DAPO dynamic
sampling and overlong filtering) and accumulating the clipped policy loss (+ KL to the
reference, entropy bonus, optional truncated importance sampling) micro-batch by micro-batch.

Invariants:
- Losses are accumulated as *sums* and the whole batch's normaliser (tokens or sequences) is
  applied once at `finish_step`, so feeding the same rows in any split or order (sync: all at
  once; stream: group by group as they complete) gives the same update up to float summation order.
- Exactly one optimizer step per `finish_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncflow.algos.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from asyncflow.algos.filtering import keep_groups_with_variance
from asyncflow.algos.losses import kl_penalty, policy_loss, truncated_importance_weights
from asyncflow.config import AlgoConfig
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.tri_model import TriLogProbs
from asyncflow.workers.rollout import Rollout

GROUP_ESTIMATORS = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


def padded(values: list[list[float]] | list[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad ragged 1-D sequences with zeros to `[N, length]` float32."""
    out = torch.zeros(len(values), length)
    for i, v in enumerate(values):
        v = torch.as_tensor(v, dtype=torch.float32)
        out[i, : len(v)] = v
    return out


def assign_advantages(groups: list[list[Rollout]], algo: AlgoConfig, max_new_tokens: int) -> dict[str, float]:
    """Compute per-token advantages in place; returns how many rollouts were filtered out.

    Rollouts excluded from the loss (a zero-variance group under dynamic sampling, a truncated
    response under overlong filtering) get `advantages = None`.
    """
    rollouts = [r for g in groups for r in g]
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    group_ids = torch.tensor([r.group_id for r in rollouts])
    lengths = [len(r.response_ids) for r in rollouts]
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    if algo.advantage in GROUP_ESTIMATORS:
        per_seq = GROUP_ESTIMATORS[algo.advantage](rewards, group_ids)
        per_token = per_seq[:, None].expand_as(mask) * mask
    elif algo.advantage == "reinforce_pp":
        per_token = reinforce_pp_advantages(rewards, mask.float(), None, 0.0, algo.gamma)
    else:
        raise ValueError(f"algo.advantage={algo.advantage!r} needs a critic, which the torch engine does not train")
    keep = torch.ones(len(rollouts), dtype=torch.bool)
    if algo.dynamic_sampling:
        keep &= keep_groups_with_variance(rewards, group_ids)
    if algo.overlong_filter:
        keep &= torch.tensor([r.finish_reason == "stop" for r in rollouts])
    for i, r in enumerate(rollouts):
        r.advantages = per_token[i, : lengths[i]].clone() if keep[i] else None
    return {"filtered/dropped_samples": float((~keep).sum())}


@dataclass
class StepAccumulator:
    tokens: int = 0
    sequences: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    def add(self, stats: dict[str, float], weight: float) -> None:
        for k, v in stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v * weight


class PolicyTrainer:
    def __init__(self, engine: TorchTrainEngine, algo: AlgoConfig, *, micro_batch_size: int, temperature: float):
        self.engine = engine
        self.algo = algo
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature if temperature > 0 else 1.0
        self.acc = StepAccumulator()

    def accumulate(self, rollouts: list[Rollout]) -> None:
        """Forward/backward the rollouts (those with advantages) in micro-batches, summing the loss."""
        rollouts = [r for r in rollouts if r.advantages is not None and len(r.response_ids) > 0]
        for start in range(0, len(rollouts), self.micro_batch_size):
            self._micro_batch(rollouts[start : start + self.micro_batch_size])

    def _micro_batch(self, batch: list[Rollout]) -> None:
        algo = self.algo
        samples = [TrainSample(r.prompt_ids, r.response_ids, r.group_id) for r in batch]
        L = max(len(r.response_ids) for r in batch)
        advantages = padded([r.advantages for r in batch], L)
        rollout_logprobs = padded([r.rollout_logprobs for r in batch], L)
        sum_mode = {"total_tokens": 1.0} if algo.loss_agg == "token_mean" else {"total_sequences": 1.0}

        def loss_fn(out: TriLogProbs):
            logp, mask = out.policy.logprobs, out.policy.mask
            old = out.old if out.old is not None else logp.detach()
            weights = None
            if algo.tis_cap is not None:
                weights = truncated_importance_weights(old, rollout_logprobs, mask, algo.tis_cap)
            loss, stats = policy_loss(
                logp, old, advantages, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                aggregation=algo.loss_agg, importance_weights=weights, **sum_mode,
            )
            maskf = mask.float()
            n_tok = maskf.sum()
            entropy = (out.policy.entropy * maskf).sum()  # with grad: the bonus term below
            stats = {k: float(v) * float(n_tok) for k, v in stats.items()}
            stats["entropy"] = float(entropy.detach())
            stats["logprob_gap"] = float(((old - rollout_logprobs).abs() * maskf).sum())
            if out.ref is not None:
                kl = (kl_penalty(logp, out.ref, algo.kl_estimator) * maskf)
                stats["kl"] = float(kl.sum())
                if algo.kl_coef > 0:
                    loss = loss + algo.kl_coef * (kl.sum() if algo.loss_agg == "token_mean" else (kl.sum(1) / maskf.sum(1).clamp(min=1)).sum())
            if algo.entropy_coef > 0:
                loss = loss - algo.entropy_coef * (entropy if algo.loss_agg == "token_mean" else ((out.policy.entropy * maskf).sum(1) / maskf.sum(1).clamp(min=1)).sum())
            return loss, stats

        stats = self.engine.backward_micro_batch(samples, loss_fn, temperature=self.temperature)
        n_tokens = sum(len(r.response_ids) for r in batch)
        self.acc.tokens += n_tokens
        self.acc.sequences += len(batch)
        self.acc.add({k: v for k, v in stats.items() if k != "loss"}, 1.0)
        self.acc.add({"loss": stats["loss"]}, 1.0)

    def finish_step(self) -> dict[str, float]:
        """Apply the batch normaliser, take one optimizer step, and report per-token averages."""
        acc, self.acc = self.acc, StepAccumulator()
        if acc.sequences == 0:
            self.engine.optimizer_step(grad_scale=0.0)
            return {"train/sequences": 0.0}
        denom = acc.tokens if self.algo.loss_agg == "token_mean" else acc.sequences
        result = self.engine.optimizer_step(grad_scale=1.0 / denom)
        metrics = {k: v / acc.tokens for k, v in acc.stats.items() if k != "loss"}
        metrics["loss"] = acc.stats.get("loss", 0.0) / denom
        metrics.update({"grad_norm": result["grad_norm"], "lr": result["lr"], "train/skipped_step": result["skipped"]})
        metrics.update({"train/sequences": float(acc.sequences), "train/tokens": float(acc.tokens)})
        return metrics
