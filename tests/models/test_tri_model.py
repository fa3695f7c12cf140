"""The tri-model forward as the trainer uses it: one full GRPO step is the same with and without packing.

Real tiny Llama and Qwen2 presets, fp32, through `TorchTrainEngine` and the trainer's
`PolicyTrainer` (clipped loss, KL to the reference, entropy bonus, gradient accumulation over
micro-batches that split groups, gradient clipping, AdamW). "Same" means relative difference
<= 1e-5. Also: the old-policy forward is skipped when the old policy is the policy, the reference
is a frozen copy of the initial weights, and `train.packing` (`on`/`off`/`auto`) picks the path.
"""

import copy
import random

import pytest
import torch

from asyncflow.config import AlgoConfig
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.packing import ATTENTION_NAME
from asyncflow.models.tri_model import TriModel, should_pack, tri_model_logprobs
from asyncflow.workers.rollout import Rollout
from asyncflow.workers.trainer import PolicyTrainer, assign_advantages

TOL = 1e-5

# (prompt length, response lengths) per group: group sizes 4, 3, 1 and 2; micro-batches of 5 split groups.
STEP_GROUPS = [(17, [6, 1, 9, 4]), (5, [12, 3, 7]), (9, [5]), (2, [8, 8])]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_path(request, tiny_llama_path, tiny_qwen2_path):
    return {"llama": tiny_llama_path, "qwen2": tiny_qwen2_path}[request.param]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def make_rollouts(groups, seed: int, vocab: int = 90) -> list[Rollout]:
    rng = random.Random(seed)
    rows = []
    for group_id, (prompt_len, response_lens) in enumerate(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for k, length in enumerate(response_lens):
            rows.append(Rollout(
                group_id=group_id, sample_index=k, prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(length)],
                rollout_logprobs=[-4.5 + rng.random() for _ in range(length)], finish_reason="stop",
                weight_version=0, answer="", reward=rng.random(),
            ))
    return rows


def score(rows: list[Rollout], algo: AlgoConfig) -> None:
    """Group advantages in place, as the trainer computes them for complete groups."""
    by_group: dict[int, list[Rollout]] = {}
    for r in rows:
        by_group.setdefault(r.group_id, []).append(r)
    assign_advantages(list(by_group.values()), algo, max_new_tokens=64)


def grpo_step(model_path, packing: str):
    """One full GRPO step (the trainer's loss, accumulation over micro-batches, clipping, AdamW).

    The reference is the preset's weights; the policy has moved away from them (a fixed
    perturbation), so the KL term and its gradient are not zero."""
    engine = TorchTrainEngine(
        load_model(model_path), lr=1e-3, weight_decay=0.01, grad_clip=1.0, use_reference=True, packing=packing
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    start = flat_params(engine.model)
    algo = AlgoConfig(kl_coef=0.05, entropy_coef=0.01, mismatch_correction="token_tis")
    trainer = PolicyTrainer(engine, algo, micro_batch_size=5, temperature=0.9)
    rows = make_rollouts(STEP_GROUPS, seed=0)
    score(rows, algo)
    trainer.accumulate(rows)
    grads = torch.cat([p.grad.flatten() for p in engine.model.parameters()])  # accumulated over micro-batches
    return engine, start, grads, trainer.finish_step()


def test_full_grpo_step_same_with_and_without_packing(model_path):
    initial = flat_params(load_model(model_path))
    packed, start, packed_grads, packed_metrics = grpo_step(model_path, "on")
    unpacked, start_unpacked, grads, unpacked_metrics = grpo_step(model_path, "off")
    assert torch.equal(start, start_unpacked)

    assert packed_metrics["train/skipped_step"] == unpacked_metrics["train/skipped_step"] == 0.0
    assert unpacked_metrics["kl"] > 1e-3  # the KL term is really there
    for key in ("loss", "grad_norm", "entropy", "kl", "logprob_gap"):
        a, b = torch.tensor(packed_metrics[key]), torch.tensor(unpacked_metrics[key])
        assert rel_diff(a, b) <= TOL, (key, packed_metrics[key], unpacked_metrics[key])
    assert rel_diff(packed_grads, grads) <= TOL
    # AdamW's first update is about lr * sign(grad), so the parameters, not the update, are compared.
    assert (flat_params(unpacked.model) - start).norm() / start.norm() > 1e-3  # the step moved the weights
    assert rel_diff(flat_params(packed.model), flat_params(unpacked.model)) <= TOL
    for engine in (packed, unpacked):  # the reference is the initial weights, frozen
        assert torch.equal(flat_params(engine.reference), initial)
        assert not engine.reference.training and all(p.grad is None for p in engine.reference.parameters())


def count_forwards(model: torch.nn.Module, log: list, name: str):
    """Record (name, attention implementation) of every top-level forward of `model`."""
    return model.register_forward_pre_hook(lambda module, args: log.append((name, module.config._attn_implementation)))


@pytest.mark.parametrize("packing", ["on", "off"])
def test_old_policy_forward_skipped_when_it_is_the_policy(model_path, packing):
    policy = load_model(model_path)
    other = copy.deepcopy(policy)
    tri = TriModel(policy, reference="copy", packing=packing)
    log: list = []
    hooks = [count_forwards(policy, log, "policy"), count_forwards(tri.reference, log, "ref"),
             count_forwards(other, log, "old")]
    samples = [TrainSample([5, 6, 7], [8, 9], 0), TrainSample([5, 6, 7], [10], 0)]
    try:
        out = tri(samples)
        assert sorted(name for name, _ in log) == ["policy", "ref"]  # no old-policy forward
        assert torch.equal(out.old, out.policy.logprobs.detach()) and not out.old.requires_grad
        log.clear()
        tri_model_logprobs(policy, samples, old_policy=policy, packing=packing)  # the same module: skipped too
        assert [name for name, _ in log] == ["policy"]
        log.clear()
        out = tri_model_logprobs(policy, samples, old_policy=other, packing=packing)  # a distinct old policy runs
        assert sorted(name for name, _ in log) == ["old", "policy"]
        assert not out.old.requires_grad and rel_diff(out.old, out.policy.logprobs.detach()) <= TOL
    finally:
        for hook in hooks:
            hook.remove()
    expected = ATTENTION_NAME if packing == "on" else "sdpa"
    assert {impl for _, impl in log} == {expected}


def test_reference_is_frozen_initial_weights(model_path):
    policy = load_model(model_path)
    initial = flat_params(policy)
    tri = TriModel(policy, reference="copy")
    assert tri.reference is not policy and not tri.reference.training
    assert not any(p.requires_grad for p in tri.reference.parameters())
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)
    assert torch.equal(flat_params(tri.reference), initial)
    out = tri([TrainSample([4, 5, 6, 7], [8, 9, 10], 0)] * 2)
    assert not out.ref.requires_grad and out.policy.logprobs.requires_grad
    assert rel_diff(out.ref, out.policy.logprobs.detach()) > 1e-3


@pytest.mark.parametrize("packing", ["on", "off", "auto"])
def test_trainer_uses_the_configured_packing(tiny_llama_path, packing):
    """Every workflow mode trains through `PolicyTrainer` -> `TorchTrainEngine.backward_micro_batch`;
    `train.packing` decides the path there, `auto` by `should_pack` per micro-batch."""
    engine = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-3, use_reference=True, packing=packing)
    algo = AlgoConfig(kl_coef=0.05)
    trainer = PolicyTrainer(engine, algo, micro_batch_size=8, temperature=1.0)
    long_prompts = make_rollouts([(48, [4] * 4), (40, [3] * 4)], seed=1)  # 8 rows, 2 groups: packing pays
    singles = make_rollouts([(6, [6])] * 8, seed=2)  # 8 groups of 1: nothing to share
    samples = lambda rows: [TrainSample(r.prompt_ids, r.response_ids, r.group_id) for r in rows]  # noqa: E731
    assert should_pack(samples(long_prompts)) and not should_pack(samples(singles))
    log: list = []
    hooks = [count_forwards(engine.model, log, "policy"), count_forwards(engine.reference, log, "ref")]
    try:
        for rows in (long_prompts, singles):
            score(rows, algo)
            trainer.accumulate(rows)
        metrics = trainer.finish_step()
    finally:
        for hook in hooks:
            hook.remove()
    impl = {"on": [ATTENTION_NAME] * 2, "off": ["sdpa"] * 2, "auto": [ATTENTION_NAME, "sdpa"]}[packing]
    assert log == [("ref", impl[0]), ("policy", impl[0]), ("ref", impl[1]), ("policy", impl[1])]
    assert engine.model.config._attn_implementation == "sdpa"  # restored after each packed call
    long_tokens = sum(len(r.response_ids) for r in long_prompts)
    expected = {"on": 1.0, "off": 0.0, "auto": long_tokens / (long_tokens + sum(len(r.response_ids) for r in singles))}
    assert metrics["train/packed_fraction"] == pytest.approx(expected[packing])


def test_engine_rejects_unknown_packing():
    with pytest.raises(ValueError, match="packing must be 'auto', 'on' or 'off', got 'yes'"):
        TorchTrainEngine(torch.nn.Linear(2, 2), lr=1e-3, packing="yes")
