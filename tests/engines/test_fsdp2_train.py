"""The FSDP2 training engine on CPU (gloo, one thread per rank, tiny Llama): 2 ranks give the update of one process
on the same global batch, sharded checkpoints resume bit-identically (and into 1 rank), a dead rank is a clear error.

The ranks are forked by one fork server per test session (it imports torch and transformers once), so each engine
starts in about a second."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from asyncflow.config import AlgoConfig
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine, RankFailedError, assign_rows
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.workers.trainer import PolicyLoss

LR = 1e-3
HP = dict(lr=LR, weight_decay=0.01, grad_clip=1.0, lr_schedule="cosine", warmup_steps=1, total_steps=10)


def groups(seed: int, n_groups: int, group_size: int = 3) -> list[TrainSample]:
    """GRPO groups (a shared prompt, responses of 1..11 tokens); prompt lengths grow with the group index, so a
    contiguous split would give the ranks very different token counts."""
    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, 30) for _ in range(3 + 2 * g)]
        for _ in range(group_size):
            samples.append(TrainSample(prompt, [rng.randrange(3, 30) for _ in range(rng.randrange(1, 12))], g))
    return samples


def policy_loss(
    samples: list[TrainSample], seed: int, aggregation: str = "token_mean", loss: str = "ppo"
) -> PolicyLoss:
    g = torch.Generator().manual_seed(seed)
    lengths = [len(s.response_ids) for s in samples]
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    advantages = torch.randn(len(samples), width, generator=g) * mask
    rollout_logprobs = (torch.rand(len(samples), width, generator=g) * -3.0) * mask
    stale = torch.tensor([i % 4 == 0 for i in range(len(samples))])[:, None] & mask  # rows on rollout log-probs
    algo = AlgoConfig(loss=loss, loss_agg=aggregation, mismatch_correction="token_tis", mismatch_threshold=2.0)
    return PolicyLoss(advantages, rollout_logprobs, stale, ~stale, lengths, algo)


def normaliser(samples: list[TrainSample], aggregation: str) -> float:
    return sum(len(s.response_ids) for s in samples) if aggregation == "token_mean" else len(samples)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |b| over all tensors as one vector (a parameter with a tiny gradient carries little weight)."""
    difference = sum(float((a[k] - b[k]).norm()) ** 2 for k in b) ** 0.5
    return difference / sum(float(b[k].norm()) ** 2 for k in b) ** 0.5


def start(path, world_size: int = 2, **options) -> FSDP2TrainEngine:
    return FSDP2TrainEngine(load_model(path), model_path=path, world_size=world_size,
                            launcher=ProcessRanks, **{**HP, **options})


@pytest.fixture(scope="module")
def two_ranks(tiny_llama_path, one_torch_thread):
    engine = start(tiny_llama_path)
    yield engine
    engine.close()


def test_assign_rows_balances_tokens_and_keeps_groups():
    samples = groups(0, 5)
    shares = assign_rows(samples, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(samples)))
    for share in shares:  # whole groups only
        ids = {samples[i].group_id for i in share}
        assert sum(samples[i].group_id in ids for i in range(len(samples))) == len(share)
    cost = [sum(len(samples[i].response_ids) for i in s) + sum(len(samples[s[k]].prompt_ids) for k in range(len(s))
            if k == 0 or samples[s[k]].group_id != samples[s[k - 1]].group_id) for s in shares]
    total = sum(cost)
    assert max(cost) - min(cost) <= max(len(s.prompt_ids) + 3 * 11 for s in samples), (cost, total)
    one_group = [s for s in samples if s.group_id == 0]
    assert all(shares_ for shares_ in assign_rows(one_group, 2)), "fewer groups than ranks: rows are split"
    assert assign_rows(one_group[:1], 2)[1] == [], "a rank may get nothing when there are fewer rows than ranks"


@pytest.mark.slow
def test_two_ranks_give_the_update_of_one_process(two_ranks, tiny_llama_path, one_torch_thread):
    """One step per `algo.loss_agg` mode (each with another `algo.loss`), each of two micro-batches (gradient
    accumulation), the ranks holding unequal token counts: loss and statistics within 1e-5 relative of one
    process (a sum of terms of both signs, added in the ranks' two chunks instead of one: CISPO's token-sum loss
    differed by 4e-6 relative on an AMD EPYC machine, under 1e-6 on others), gradients within 1e-6 (the gradient
    as one vector; a tensor alone differs by what one process summing the same rows in the ranks' two chunks
    differs by, up to ~1e-6 here), the same clipped gradient norm and LR, and after AdamW the same weights within
    0.1 * lr (AdamW's first steps turn float-order noise in tiny gradients into a few % of lr; each step starts
    the reference from the engine's weights)."""
    reference = TorchTrainEngine(load_model(tiny_llama_path), **HP)
    initial = reference.state_dict()
    assert all(torch.equal(two_ranks.state_dict()[k], initial[k]) for k in initial), "this test runs first"
    micro_batches = [groups(1, 5), groups(2, 3)]
    shares = assign_rows(micro_batches[0], 2)
    tokens = [sum(len(micro_batches[0][i].response_ids) for i in share) for share in shares]
    assert tokens[0] != tokens[1], "the test needs unequal token counts on the ranks"
    modes = [("token_mean", "ppo"), ("seq_mean_token_mean", "gspo"), ("seq_mean_token_sum", "cispo")]
    for step, (aggregation, loss_name) in enumerate(modes):
        reference.load_state_dict(two_ranks.state_dict())  # the same weights (AdamW left them ~1e-5 apart)
        for k, samples in enumerate(micro_batches):
            loss = policy_loss(samples, seed=10 * step + k, aggregation=aggregation, loss=loss_name)
            got, want = two_ranks.backward_micro_batch(samples, loss), reference.backward_micro_batch(samples, loss)
            assert got.keys() == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (aggregation, key)
        grads = two_ranks.gradients()
        want = {name: p.grad for name, p in reference.model.named_parameters() if p.grad is not None}
        assert grads.keys() == want.keys()
        assert relative_difference(grads, want) < 1e-6, aggregation
        scale = 1.0 / sum(normaliser(samples, aggregation) for samples in micro_batches)
        got, want = two_ranks.optimizer_step(scale), reference.optimizer_step(scale)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6) and got["lr"] == want["lr"]
        weights, expected = two_ranks.state_dict(), reference.state_dict()
        assert two_ranks.state_dict() is weights, "gathered once per version"
        assert max(float((weights[k] - expected[k]).abs().max()) for k in expected) < 0.1 * LR, aggregation


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_identically(two_ranks, tiny_llama_path, one_torch_thread, tmp_path):
    """Save at a step boundary, train on: a fresh 2-rank engine that loads the checkpoint takes exactly the same
    next step (bit for bit); a 1-rank engine loads the 2-rank checkpoint (resharded) to the same weights."""
    samples = groups(3, 4)
    two_ranks.backward_micro_batch(samples, policy_loss(samples, seed=100))
    two_ranks.optimizer_step(1.0 / normaliser(samples, "token_mean"))  # optimizer state exists, the schedule moved
    two_ranks.save_sharded(tmp_path / "sharded")
    training_state, saved = two_ranks.training_state(), dict(two_ranks.state_dict())
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    def next_step(engine) -> dict[str, torch.Tensor]:
        engine.backward_micro_batch(samples, policy_loss(samples, seed=20))
        engine.optimizer_step(1.0 / normaliser(samples, "token_mean"))
        return engine.state_dict()

    straight = next_step(two_ranks)
    resumed_engine, one_rank = start(tiny_llama_path), start(tiny_llama_path, world_size=1)
    try:
        resumed_engine.load_sharded(tmp_path / "sharded")
        resumed_engine.load_training_state(training_state)
        resumed = next_step(resumed_engine)
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), "bit-identical continuation"
        one_rank.load_sharded(tmp_path / "sharded")
        one_rank.load_training_state(training_state)
        assert all(torch.equal(saved[k], one_rank.state_dict()[k]) for k in saved), "2 -> 1 rank: same weights"
        continued = next_step(one_rank)
        assert max(float((continued[k] - straight[k]).abs().max()) for k in straight) < 0.1 * LR
    finally:
        resumed_engine.close()
        one_rank.close()


class FailingLoss(PolicyLoss):
    """Raises on the rank whose rows include the first row of the micro-batch."""

    def __call__(self, out):
        if self.lengths[0] == -1:
            raise RuntimeError("loss failed on purpose")
        return super().__call__(out)


@pytest.mark.slow
def test_a_failing_rank_is_a_clear_error(tiny_llama_path, one_torch_thread):
    engine = start(tiny_llama_path, timeout_s=60)
    try:
        samples = groups(5, 2)
        loss = policy_loss(samples, seed=0)
        failing = FailingLoss(loss.advantages, loss.rollout_logprobs, loss.stale, loss.current,
                              [-1, *loss.lengths[1:]], loss.algo)
        with pytest.raises(RankFailedError, match=r"rank \d \(pid \d+\) failed: RuntimeError: loss failed on purpose"):
            engine.backward_micro_batch(samples, failing)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_dead_rank_is_a_clear_error(tiny_llama_path, one_torch_thread):
    engine = start(tiny_llama_path, timeout_s=60)
    try:
        os.kill(engine.ranks.pids[1], signal.SIGKILL)
        samples = groups(4, 2)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code -9 during backward"):
            engine.backward_micro_batch(samples, policy_loss(samples, seed=0))
        assert time.monotonic() - started < 30
        assert engine.ranks.processes == [], "the other rank was stopped"
    finally:
        engine.close()
