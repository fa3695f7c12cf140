"""PPO's critic in the training engines (tiny Llama, CPU, real torch): FSDP2 on 2 ranks gives the policy AND value
gradients of one process for a value head and for a separate value model; the value forward is the same packed
or not; under LoRA the value head trains fully while the base stays frozen; checkpoints carry the critic, keep
`state_dict` a plain policy, and a restored engine takes bit-identically the same next step."""

from __future__ import annotations

import io
import random

import pytest
import torch

from asyncflow.config import AlgoConfig
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.tri_model import tri_model_logprobs
from asyncflow.models.value import CriticSpec, attach_critic, is_critic_key
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.workers.trainer import PolicyLoss

LR = 1e-3
HP = dict(lr=LR, weight_decay=0.01, grad_clip=1.0, lr_schedule="cosine", warmup_steps=1, total_steps=10)


def groups(seed: int, n_groups: int, group_size: int = 3) -> list[TrainSample]:
    """Groups sharing a prompt, responses of 1..9 tokens, prompts of growing length (unequal ranks)."""
    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, 30) for _ in range(3 + 2 * g)]
        for _ in range(group_size):
            samples.append(TrainSample(prompt, [rng.randrange(3, 30) for _ in range(rng.randrange(1, 10))], g))
    return samples


def gae_loss(samples: list[TrainSample], seed: int, value_clip: float | None = 0.2) -> PolicyLoss:
    """The trainer's loss with a critic: 0/1 rewards, GAE from the forward's values, stale rows on rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = [len(s.response_ids) for s in samples]
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    rollout_logprobs = (torch.rand(len(samples), width, generator=g) * -3.0) * mask
    stale = torch.tensor([i % 4 == 0 for i in range(len(samples))])[:, None] & mask
    rewards = (torch.rand(len(samples), generator=g) > 0.5).float()
    algo = AlgoConfig(advantage="gae", lam=0.9, gamma=0.99, critic={"value_clip": value_clip, "value_coef": 0.7})
    return PolicyLoss(torch.zeros(len(samples), width), rollout_logprobs, stale, ~stale, lengths, algo, rewards)


def random_critic(engine: TorchTrainEngine, seed: int) -> dict[str, torch.Tensor]:
    """The engine's critic weights with the (zero-initialised) value head set at random, under the policy's names."""
    g = torch.Generator().manual_seed(seed)
    state = {f"critic.{k}": v.clone() for k, v in engine.critic.state_dict().items()}
    for key in state:
        if ".head." in key or key.startswith("critic.head."):
            state[key] = torch.randn(state[key].shape, generator=g) * 0.5
    return state


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    difference = sum(float((a[k] - b[k]).norm()) ** 2 for k in b) ** 0.5
    return difference / sum(float(b[k].norm()) ** 2 for k in b) ** 0.5


@pytest.mark.parametrize("kind", ["head", "separate"])
@pytest.mark.slow
def test_two_ranks_give_the_policy_and_value_gradients_of_one_process(kind, tiny_llama_path, one_torch_thread):
    """One PPO step of two micro-batches (gradient accumulation), ranks holding unequal token counts: stats (value
    loss, clip fraction, the explained-variance sums) within 1e-5, the gradients of every parameter, policy and
    critic (trunk included), within 1e-6 relative of one process, the same clipped gradient norms, and after AdamW
    the same policy weights within 0.1 * lr."""
    spec = CriticSpec(kind=kind, path=str(tiny_llama_path) if kind == "separate" else None, lr=3 * LR)
    reference = TorchTrainEngine(load_model(tiny_llama_path), critic=spec, **HP)
    ranks = FSDP2TrainEngine(load_model(tiny_llama_path), model_path=tiny_llama_path, world_size=2,
                             launcher=ProcessRanks, critic=spec, **HP)
    try:
        start = {**reference.state_dict(), **random_critic(reference, seed=1)}  # a head that is not zero
        reference.load_state_dict(start)
        ranks.load_state_dict(start)
        micro_batches = [groups(1, 5), groups(2, 3)]
        for k, samples in enumerate(micro_batches):
            loss = gae_loss(samples, seed=k)
            got, want = ranks.backward_micro_batch(samples, loss), reference.backward_micro_batch(samples, loss)
            assert got.keys() == want.keys() and "value/loss" in want and want["value/loss"] > 0
            for key in want:  # the value sums add signed terms: their float order shows at ~3e-6
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
        grads = ranks.gradients()
        want = {name: p.grad for name, p in reference.model.named_parameters() if p.grad is not None}
        assert grads.keys() == want.keys()
        critic_grads = {k: v for k, v in want.items() if is_critic_key(k)}
        assert critic_grads and all(float(v.norm()) > 0 for k, v in critic_grads.items() if "head" in k)
        policy_grads = {k: v for k, v in want.items() if not is_critic_key(k)}
        assert relative_difference({k: grads[k] for k in policy_grads}, policy_grads) < 1e-6
        assert relative_difference({k: grads[k] for k in critic_grads}, critic_grads) < 1e-6
        if kind == "separate":  # the critic's own trunk is trained through its head
            assert any(float(v.norm()) > 0 for k, v in critic_grads.items() if ".trunk." in k)
        scale = 1.0 / sum(len(s.response_ids) for samples in micro_batches for s in samples)
        got, expected = ranks.optimizer_step(scale), reference.optimizer_step(scale)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
        assert got["value/grad_norm"] == pytest.approx(expected["value/grad_norm"], rel=1e-6)
        weights, policy = ranks.state_dict(), reference.state_dict()
        assert weights.keys() == policy.keys() and not any(map(is_critic_key, policy)), "a plain policy"
        assert max(float((weights[k] - policy[k]).abs().max()) for k in policy) < 0.1 * LR
    finally:
        ranks.close()


@pytest.mark.parametrize("kind", ["head", "separate"])
def test_values_are_the_same_packed_or_not(kind, tiny_llama_path, one_torch_thread):
    policy = load_model(tiny_llama_path)
    spec = CriticSpec(kind=kind, path=str(tiny_llama_path) if kind == "separate" else None)
    critic = attach_critic(policy, spec)
    with torch.no_grad():
        for p in critic.parameters():
            if p.shape[0] == 1:  # the value head
                p.normal_()
    samples = groups(3, 3)
    packed = tri_model_logprobs(policy, samples, packing="on", critic=critic)
    unpacked = tri_model_logprobs(policy, samples, packing="off", critic=critic)
    assert packed.packed and not unpacked.packed
    assert packed.values.requires_grad and not packed.old_values.requires_grad
    assert torch.equal(packed.values == 0, ~packed.policy.mask), "0 exactly at padding, nonzero elsewhere"
    torch.testing.assert_close(packed.values, unpacked.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.policy.logprobs, unpacked.policy.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_value_head_starts_at_zero_and_only_reaches_the_trunk_when_asked(tiny_llama_path, one_torch_thread):
    samples = groups(4, 2)
    for train_trunk in (True, False):
        policy = load_model(tiny_llama_path)
        critic = attach_critic(policy, CriticSpec(train_trunk=train_trunk))
        assert float(tri_model_logprobs(policy, samples, critic=critic).values.detach().abs().max()) == 0.0
        with torch.no_grad():
            critic.head.weight.normal_()
        tri_model_logprobs(policy, samples, critic=critic).values.sum().backward()
        trunk = [p.grad for n, p in policy.named_parameters() if not is_critic_key(n)]
        assert any(g is not None and float(g.norm()) > 0 for g in trunk) == train_trunk
        assert float(critic.head.weight.grad.norm()) > 0


def test_lora_trains_the_value_head_fully_and_the_base_stays_frozen(tiny_llama_path, one_torch_thread):
    pytest.importorskip("peft")
    from asyncflow.engines.peft_lora import LoRASettings

    settings = LoRASettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    engine = TorchTrainEngine(load_model(tiny_llama_path), lora=settings, critic=CriticSpec(lr=1e-2), lr=1e-2)
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    head = list(engine.critic.parameters())
    assert {id(p) for p in head} <= optimized and all(p.requires_grad for p in head)
    assert engine.optimizer.param_groups[1]["lr"] == 1e-2 and len(engine.optimizer.param_groups) == 2
    base = {k: v.clone() for k, v in engine.model.state_dict().items() if ".lora_" not in k and not is_critic_key(k)}
    samples = groups(5, 2)
    for step in range(3):
        engine.backward_micro_batch(samples, gae_loss(samples, seed=step))
        assert engine.optimizer_step(0.1)["skipped"] == 0.0
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items()), "the frozen base did not move"
    assert float(engine.critic.head.weight.detach().abs().max()) > 0, "the zero-initialised head trained"
    state = engine.training_state()
    assert set(state) == {"optimizer", "scheduler", "adapter", "critic"}
    assert not any(map(is_critic_key, engine.state_dict())), "rollout engines get a plain (merged) policy"


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.slow
def test_a_checkpoint_restores_the_critic_and_the_next_step_bit_identically(lora, tiny_llama_path,
                                                                           one_torch_thread):
    options = dict(critic=CriticSpec(lr=2e-3), **HP)
    if lora:
        pytest.importorskip("peft")
        from asyncflow.engines.peft_lora import LoRASettings

        options["lora"] = LoRASettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    samples = groups(6, 3)

    def step(engine, seed) -> dict[str, float]:
        stats = engine.backward_micro_batch(samples, gae_loss(samples, seed))
        return {**stats, **engine.optimizer_step(0.05)}

    engine = TorchTrainEngine(load_model(tiny_llama_path), **options)
    for seed in range(2):
        step(engine, seed)
    buffer = io.BytesIO()  # through bytes, as a checkpoint is: nothing shared with the live engine
    torch.save((engine.state_dict(), engine.training_state()), buffer)
    buffer.seek(0)
    weights, state = torch.load(buffer, weights_only=False)
    restored = TorchTrainEngine(load_model(tiny_llama_path), **options)
    restored.load_checkpoint(weights, state)
    assert step(restored, 7) == step(engine, 7)
    for k, v in engine.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[k], v), k
    with pytest.raises(ValueError, match="without a critic"):
        TorchTrainEngine(load_model(tiny_llama_path), **options).load_training_state(
            {k: v for k, v in state.items() if k != "critic"})
