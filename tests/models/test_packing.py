"""Shared-prompt packing equals the unpacked path; the tri-model forward keeps its grad contract.

Real tiny Llama and Qwen2 presets, fp32. "Equal" means relative difference <= 1e-5 (norm of the
difference over norm of the reference) for log-probs, entropies, a GRPO-style loss and every
parameter gradient.
"""

import copy
import random

import pytest
import torch

from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.models.packing import PackingError, packed_response_logprobs, plan_shared_prompt
from asyncflow.models.tri_model import TriModel, make_reference, should_pack, tri_model_logprobs

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_llama_path, tiny_qwen2_path):
    torch.manual_seed(0)
    return load_model({"llama": tiny_llama_path, "qwen2": tiny_qwen2_path}[request.param])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_batch(groups: list[tuple[int, list[int]]], seed: int = 0, vocab: int = 90) -> list[TrainSample]:
    """groups: (prompt length, response lengths) each; consecutive samples of a group share the prompt."""
    rng = random.Random(seed)
    samples = []
    for group_id, (prompt_len, response_lens) in enumerate(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        samples += [TrainSample(prompt, [rng.randrange(3, vocab) for _ in range(r)], group_id) for r in response_lens]
    return samples


# group sizes 1, 2 and 5; prompts of 1 to 23 tokens; responses of 1 to 19 tokens; several groups per micro-batch
MIXED = [(7, [5]), (23, [1, 12]), (3, [19, 1, 4, 8, 2]), (1, [6, 6])]


def grpo_loss(logprobs, mask, entropy, old, advantages):
    """Clipped surrogate (ratio vs `old`) minus an entropy bonus, token-mean over the mask."""
    ratio = torch.exp(logprobs - old)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    per_token = -surrogate - 0.01 * entropy
    return (per_token * mask).sum() / mask.sum()


def loss_and_grads(model, samples, logprob_fn, temperature):
    model.zero_grad(set_to_none=True)
    out = logprob_fn(model, samples, temperature=temperature, with_entropy=True)
    advantages = torch.linspace(-1.0, 1.5, len(samples))[:, None]
    old = out.logprobs.detach() + 0.05 * torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(1))
    loss = grpo_loss(out.logprobs, out.mask, out.entropy, old, advantages)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out, loss.detach(), grads


@pytest.mark.parametrize("groups", [MIXED, [(11, [1] * 5)], [(4, [3])]], ids=["mixed", "len1-responses", "single"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.slow
def test_packed_equals_unpacked(model, groups, temperature):
    samples = make_batch(groups)
    ref, ref_loss, ref_grads = loss_and_grads(model, samples, response_logprobs, temperature)
    packed, loss, grads = loss_and_grads(model, samples, packed_response_logprobs, temperature)

    assert model.config._attn_implementation == "sdpa"  # switched only for the packed call
    assert torch.equal(packed.mask, ref.mask)
    assert packed.logprobs.shape == ref.logprobs.shape == (len(samples), max(len(s.response_ids) for s in samples))
    assert rel_diff(packed.logprobs, ref.logprobs) <= TOL
    assert rel_diff(packed.entropy, ref.entropy) <= TOL
    assert (packed.logprobs[~packed.mask] == 0).all() and (packed.entropy[~packed.mask] == 0).all()
    assert rel_diff(loss, ref_loss) <= TOL
    assert all(g.abs().sum() > 0 for n, g in ref_grads.items() if "embed" not in n)  # the loss reaches every layer
    for name in ref_grads:
        assert rel_diff(grads[name], ref_grads[name]) <= TOL, name


def test_layout_positions_and_predictors():
    """Prompt once, responses after it; positions continue from the prompt; first token read at the prompt's end."""
    samples = make_batch([(3, [2, 1]), (2, [2])])
    layout = plan_shared_prompt(samples)
    p0, p1 = samples[0].prompt_ids, samples[2].prompt_ids
    expected = p0 + samples[0].response_ids + samples[1].response_ids + p1 + samples[2].response_ids
    assert layout.input_ids[0].tolist() == expected
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3]
    assert layout.predictor_index[:, 0].tolist() == [2, 2, 7]  # last prompt position of each group
    assert layout.predictor_index[0, 1].item() == 3 and layout.predictor_index[2, 1].item() == 8


def test_colliding_group_ids_with_different_prompts_raise(model):
    samples = make_batch([(5, [3, 2]), (6, [4])])
    samples[2].group_id = samples[0].group_id
    with pytest.raises(PackingError, match="group_id 0 is used with different prompts"):
        packed_response_logprobs(model, samples)
    assert model.config._attn_implementation == "sdpa"
    assert not should_pack(samples)
    with pytest.raises(PackingError):
        tri_model_logprobs(model, samples, packing="on")
    samples[1].prompt_ids = samples[1].prompt_ids[:-1]  # same id, same run, different prompt
    with pytest.raises(PackingError, match="different prompts"):
        packed_response_logprobs(model, samples[:2])


def test_adamw_step_same_parameters_with_and_without_packing(model):
    samples = make_batch(MIXED, seed=3)
    ends = []
    for logprob_fn in (response_logprobs, packed_response_logprobs):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3, weight_decay=0.01)
        out = logprob_fn(trained, samples, with_entropy=True)
        advantages = torch.linspace(-1.0, 1.0, len(samples))[:, None]
        grpo_loss(out.logprobs, out.mask, out.entropy, out.logprobs.detach(), advantages).backward()
        optimizer.step()
        ends.append(torch.cat([p.detach().flatten() for p in trained.parameters()]))
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert rel_diff(ends[0], start) > 1e-4  # the step moved the weights
    assert rel_diff(ends[1], ends[0]) <= TOL


@pytest.mark.parametrize("packing", ["on", "off"])
@pytest.mark.slow
def test_tri_model_reference_and_old(model, packing):
    policy = copy.deepcopy(model)
    reference = make_reference(policy)
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    with torch.no_grad():  # the policy has moved since the reference was taken
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    samples = make_batch(MIXED, seed=5)

    out = tri_model_logprobs(policy, samples, reference=reference, packing=packing, with_entropy=True)
    assert out.policy.logprobs.requires_grad and out.policy.entropy is not None
    assert not out.ref.requires_grad and not out.old.requires_grad
    assert torch.equal(out.old, out.policy.logprobs.detach())  # old_policy=None: the policy itself, skipped
    assert rel_diff(out.ref, response_logprobs(reference, samples).logprobs) <= TOL
    assert rel_diff(out.ref, out.policy.logprobs.detach()) > 1e-3  # really a different model

    kl = (out.ref - out.policy.logprobs).exp() - (out.ref - out.policy.logprobs) - 1
    ((kl - out.policy.logprobs) * out.policy.mask).sum().backward()
    assert all(p.grad is None for p in reference.parameters())
    assert all(p.grad is not None for p in policy.parameters())

    with_old = TriModel(policy, reference=reference, old_policy=model, packing=packing)(samples)
    assert rel_diff(with_old.old, response_logprobs(model, samples).logprobs.detach()) <= TOL
    assert not with_old.old.requires_grad


def test_make_reference_is_a_frozen_copy(model):
    policy = copy.deepcopy(model)
    tri = TriModel(policy, reference="copy")
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    policy_first, ref_first = next(policy.parameters()), next(tri.reference.parameters())
    assert rel_diff(ref_first, next(model.parameters())) == 0.0 and not torch.equal(policy_first, ref_first)


def test_should_pack_rule():
    assert should_pack(make_batch([(512, [64] * 8)] * 2))  # long shared prompts: most tokens saved
    assert should_pack(make_batch([(64, [256] * 8)] * 2))  # 17.5% saved
    assert not should_pack(make_batch([(64, [64])] * 4))  # G = 1, equal lengths: nothing to save
    assert not should_pack(make_batch([(8, [128] * 8)] * 2))  # 5% saved: overhead wins
    with pytest.raises(ValueError, match="packing must be"):
        tri_model_logprobs(torch.nn.Linear(1, 1), make_batch([(2, [2])]), packing="yes")
