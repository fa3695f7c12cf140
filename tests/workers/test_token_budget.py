"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`): the split keeps every micro-batch under the
budget (counted with padding) whatever the response lengths, keeps GRPO groups together where they fit, and the
step's gradients equal those of the unbudgeted step on the same long-tailed batch."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.config import AlgoConfig
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.workers.rollout import Rollout
from asyncflow.workers.trainer import PolicyTrainer, assign_advantages, token_budget_micro_batches


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=6), min_size=1, max_size=12),
    budget=st.integers(1, 1200),
    max_rows=st.integers(1, 16),
)
@pytest.mark.slow
def test_every_micro_batch_stays_under_the_budget(groups, budget, max_rows):
    lengths = [n for group in groups for n in group]
    group_ids = [g for g, group in enumerate(groups) for _ in group]
    batches = token_budget_micro_batches(lengths, group_ids, budget, max_rows)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        padded = len(batch) * max(lengths[i] for i in batch)
        assert len(batch) <= max_rows
        assert padded <= budget or len(batch) == 1, "only a single row longer than the budget may exceed it"
    start = 0
    for group in groups:  # a group that fits whole is never split
        rows = set(range(start, start + len(group)))
        if len(group) <= max_rows and len(group) * max(group) <= budget:
            assert any(rows <= set(batch) for batch in batches), (group, batches)
        start += len(group)


def long_tailed_rollouts(seed: int, groups: int = 6, group_size: int = 4) -> list[Rollout]:
    """GRPO groups whose response lengths are geometric-like: most short, a few up to 120 tokens."""
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(4, 12))]
        for k in range(group_size):
            length = min(120, int(rng.expovariate(1 / 12)) + 1)
            response = [rng.randrange(3, 60) for _ in range(length)]
            rows.append(Rollout(g, k, prompt, response, [-rng.uniform(0.5, 4) for _ in response], "stop", 0, "",
                                reward=float(rng.random() < 0.5)))
    by_group: dict[int, list[Rollout]] = {}
    for r in rows:
        by_group.setdefault(r.group_id, []).append(r)
    assign_advantages(list(by_group.values()), AlgoConfig(), max_new_tokens=120)
    return rows


class RecordingEngine(TorchTrainEngine):
    """The torch engine, recording each micro-batch's padded forward tokens (rows x longest prompt + response)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.padded_tokens: list[int] = []

    def backward_micro_batch(self, samples, loss_fn, *, temperature=1.0):
        self.padded_tokens.append(len(samples) * max(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        return super().backward_micro_batch(samples, loss_fn, temperature=temperature)


@pytest.mark.parametrize("packing", ["auto", "off"])
@pytest.mark.slow
def test_budgeted_step_has_the_gradients_of_the_unbudgeted_one(tiny_llama_path, one_torch_thread, packing):
    rows = long_tailed_rollouts(0)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
    budget = 2 * max(lengths)  # a long row shares its micro-batch with at most one other
    results = {}
    for name, limit in (("rows", None), ("budget", budget)):
        engine = RecordingEngine(load_model(tiny_llama_path), lr=1e-3, packing=packing)
        trainer = PolicyTrainer(engine, AlgoConfig(), micro_batch_size=len(rows), temperature=1.0,
                                max_tokens_per_micro_batch=limit)
        trainer.accumulate(rows)
        grads = torch.cat([p.grad.flatten() for p in engine.model.parameters() if p.grad is not None])
        results[name] = (grads, engine.padded_tokens, trainer.finish_step())
    grads, padded, metrics = results["budget"]
    want, unbudgeted, want_metrics = results["rows"]
    assert len(unbudgeted) == 1 and unbudgeted[0] > budget, "the test needs a batch over the budget"
    assert len(padded) > 1 and max(padded) <= budget
    assert float((grads - want).norm() / want.norm()) < 1e-5
    assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-5)
    assert metrics["train/tokens"] == want_metrics["train/tokens"]


@pytest.mark.parametrize("seed", range(5))
def test_two_ranks_get_token_counts_within_ten_percent(seed):
    """`assign_rows` (Karmarkar-Karp over whole GRPO groups) on a long-tailed batch of 16 groups of 8."""
    from asyncflow.engines.fsdp2_train import assign_rows
    from asyncflow.models.logprobs import TrainSample

    rows = long_tailed_rollouts(seed, groups=16, group_size=8)
    samples = [TrainSample(r.prompt_ids, r.response_ids, r.group_id) for r in rows]
    shares = assign_rows(samples, 2)
    tokens = []
    for share in shares:
        groups = {samples[i].group_id for i in share}
        assert all(samples[i].group_id not in groups for i in range(len(samples)) if i not in share), "groups whole"
        tokens.append(sum(len(samples[i].response_ids) for i in share)
                      + sum(len(samples[i].prompt_ids) for i in share if i == 0 or i - 1 not in share
                            or samples[i - 1].group_id != samples[i].group_id))
    assert max(tokens) <= 1.1 * min(tokens), tokens
