"""Tests for asyncflow.algos: advantages, losses, filtering. Expected values are derived by hand
in the comments next to each assertion."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    aggregate,
    aggregation_normalisers,
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    entropy_from_logits,
    gae,
    grpo_advantages,
    keep_groups_with_variance,
    kl_penalty,
    masked_mean,
    outcome_rewards_to_tokens,
    overlong_mask,
    overlong_penalty,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    value_loss,
    whiten,
)
from asyncflow.algos.losses import sft_loss


def close(a, b, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=atol, rtol=0)


# Non-contiguous groups of different sizes: group 0 = idx {0,2,4,5} rewards {1,0,1,0};
# group 7 = idx {1,3} rewards {2,4}; group 3 = idx {6} (size 1) reward 5.
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 1.0, 0.0, 5.0])
GROUPS = torch.tensor([0, 7, 0, 7, 0, 0, 3])


# ---------------------------------------------------------------- group advantages
def test_grpo_by_hand():
    # group 0: mean 0.5, dev +-0.5, unbiased var = 4*0.25/3 = 1/3, std 0.577350 -> +-0.866025
    # group 7: mean 3, dev -1/+1, unbiased var = 2/1, std 1.414214 -> -/+0.707107
    # group 3: size 1 -> dev 0 -> 0
    expected = [0.866025, -0.707107, -0.866025, 0.707107, 0.866025, -0.866025, 0.0]
    close(grpo_advantages(REWARDS, GROUPS), expected)


def test_dr_grpo_is_mean_centred_only():
    close(dr_grpo_advantages(REWARDS, GROUPS), [0.5, -1.0, -0.5, 1.0, 0.5, -0.5, 0.0])
    close(grpo_advantages(REWARDS, GROUPS, scale_by_std=False), [0.5, -1.0, -0.5, 1.0, 0.5, -0.5, 0.0])


def test_rloo_by_hand():
    # group 0: r=1 -> 1 - mean{0,1,0} = 2/3 ; r=0 -> 0 - mean{1,1,0} = -2/3
    # group 7: r=2 -> 2 - 4 = -2 ; r=4 -> 4 - 2 = 2 ; group 3 (size 1) -> 0
    close(rloo_advantages(REWARDS, GROUPS), [2 / 3, -2.0, -2 / 3, 2.0, 2 / 3, -2 / 3, 0.0])


def test_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([4, 4, 4]))
    close(adv, [0.0, 0.0, 0.0])


def test_group_inputs_validated():
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        rloo_advantages(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        grpo_advantages(REWARDS[None], GROUPS)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=12))
def test_group_advantages_sum_to_zero_per_group(pairs):
    groups = torch.tensor([g for g, _ in pairs])
    rewards = torch.tensor([r for _, r in pairs], dtype=torch.float64)
    for adv in (grpo_advantages(rewards, groups), rloo_advantages(rewards, groups)):
        for g in groups.unique():
            assert abs(adv[groups == g].sum().item()) < 1e-6


# ---------------------------------------------------------------- token-level helpers
def test_outcome_rewards_to_tokens_and_broadcast():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    close(outcome_rewards_to_tokens(torch.tensor([3.0, 4.0, 5.0]), mask), [[0, 3, 0], [0, 0, 4], [5, 0, 0]])
    close(broadcast_to_tokens(torch.tensor([3.0, 4.0, 5.0]), mask), [[3, 3, 0], [4, 4, 4], [5, 0, 0]])
    with pytest.raises(ValueError, match=r"responses \[1\] have no valid token"):
        outcome_rewards_to_tokens(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))


def test_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [100.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 0]])
    # valid 1,2,3,5: mean 2.75; devs -1.75 -0.75 0.25 2.25; pop var 8.75/4 = 2.1875, std 1.479020
    close(whiten(x, mask), [[-1.183216, -0.507093, 0.169031], [0.0, 1.521278, 0.0]])
    with pytest.raises(ValueError, match="no valid"):
        whiten(x, torch.zeros_like(mask))


def test_discounted_returns_skip_masked_holes():
    # gamma 0.5, mask [1,0,1]: t2 -> 2; t1 masked (0 out, carries 2); t0 -> 1 + 0.5*2 = 2
    out = discounted_returns(torch.tensor([[1.0, 99.0, 2.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    close(out, [[2.0, 0.0, 2.0]])


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    # token rewards (kl_coef 0.5): row0 [-0.05, -0.1, -0.15 + 1] ; row1 [-0.25, -0.25, pad]
    # gamma=1 returns: row0 [0.70, 0.75, 0.85] ; row1 [-0.50, -0.25]
    # mean 1.55/5 = 0.31 ; devs .39 .44 .54 -.81 -.56 ; pop var 1.607/5 = 0.3214 ; std 0.566922
    std = math.sqrt(0.3214)
    expected = [[0.39 / std, 0.44 / std, 0.54 / std], [-0.81 / std, -0.56 / std, 0.0]]
    close(reinforce_pp_advantages(rewards, mask, kl, kl_coef=0.5, gamma=1.0), expected)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.8, 7.0]])  # 7.0 sits on padding and must be ignored
    mask = torch.tensor([[1, 1, 0]])
    # gamma .9, lam .8. t1: delta = 1 + .9*0 - .8 = .2 ; A1 = .2
    # t0: delta = 0 + .9*.8 - .5 = .22 ; A0 = .22 + .9*.8*.2 = .364 ; returns = A + V
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.364, 0.2, 0.0]])
    close(ret, [[0.864, 1.0, 0.0]])
    # gamma = lam = 1: returns are the reward-to-go (1 at both valid tokens)
    _, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(ret, [[1.0, 1.0, 0.0]])


def test_compute_advantages_dispatch_and_errors():
    mask = torch.ones(7, 2)
    adv, ret = compute_advantages("grpo", REWARDS, mask, group_ids=GROUPS)
    close(adv, broadcast_to_tokens(grpo_advantages(REWARDS, GROUPS), mask))
    assert ret is None
    adv, ret = compute_advantages("gae", torch.tensor([1.0]), torch.ones(1, 2), values=torch.zeros(1, 2), lam=1.0)
    close(ret, [[1.0, 1.0]])  # reward 1 on the last token, gamma = lam = 1, V = 0
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", REWARDS, mask)
    with pytest.raises(ValueError, match="'rloo' needs group_ids"):
        compute_advantages("rloo", REWARDS, mask)
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", REWARDS, mask)


# ---------------------------------------------------------------- aggregation
def test_aggregate_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # third row empty: not counted anywhere
    close(aggregate(loss, mask, "token_mean"), 7 / 3)  # (1 + 2 + 4) / 3 tokens
    close(aggregate(loss, mask, "seq_mean_token_mean"), 2.75)  # ((1+2)/2 + 4/1) / 2 seqs
    close(aggregate(loss, mask, "seq_mean_token_sum"), 3.5)  # ((1+2) + 4) / 2 seqs
    close(aggregate(loss, mask, "token_mean", total_tokens=7), 1.0)  # 7 / 7
    close(aggregate(loss, mask, "seq_mean_token_sum", total_sequences=7), 1.0)
    assert aggregation_normalisers(mask) == (3, 2)
    close(aggregate(loss, torch.zeros_like(mask), "token_mean"), 0.0)  # no tokens -> 0, not NaN
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(loss, mask, "mean")
    with pytest.raises(ValueError, match="total_tokens must be > 0"):
        aggregate(loss, mask, "token_mean", total_tokens=0)


def test_sft_loss_by_hand():
    # row 0 is trained on 2 tokens, row 1 on 1 (a demonstration's tool output and padding are masked out)
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.3], [0.125, 0.9, 0.7]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss = sft_loss(logprobs, mask)
    close(loss, 2 * math.log(2))  # -(ln 1/2 + ln 1/4 + ln 1/8) / 3 tokens = (1 + 2 + 3) ln 2 / 3
    loss.backward()
    close(logprobs.grad, -mask.float() / 3)  # every trained token pulled up by 1/T, the others not at all
    halves = sft_loss(logprobs[:1], mask[:1], total_tokens=3) + sft_loss(logprobs[1:], mask[1:], total_tokens=3)
    close(halves, loss)  # micro-batches normalised by the whole batch's tokens add up to its loss


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    close(masked_mean(x, mask), 2.0)  # (1 + 3) / 2
    close(masked_mean(x, mask, dim=1), [2.0, 0.0])  # row without tokens -> 0


def _random_batch(seed: int, n: int = 6, length: int = 5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 2, 4, 3, 5])[:n]
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return torch.randn(n, length, generator=g), mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_microbatch_sum_equals_whole_batch(mode):
    loss, mask = _random_batch(0)
    whole = aggregate(loss, mask, mode)
    tokens, seqs = aggregation_normalisers(mask)
    parts = [slice(0, 2), slice(2, 5), slice(5, 6)]
    summed = sum(aggregate(loss[s], mask[s], mode, total_tokens=tokens, total_sequences=seqs) for s in parts)
    close(summed, whole, atol=1e-6)
    if mode != "seq_mean_token_sum":  # the naive mean of micro-batch means is NOT the batch loss
        naive = sum(aggregate(loss[s], mask[s], mode) for s in parts) / len(parts)
        assert abs(naive.item() - whole.item()) > 1e-3


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_gradient_accumulation_equals_whole_batch(mode):
    old, mask = _random_batch(1)
    adv, _ = _random_batch(2)
    logits = (old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))).requires_grad_()
    loss, _ = policy_loss(logits, old, adv, mask, aggregation=mode)
    (whole_grad,) = torch.autograd.grad(loss, logits)
    tokens, seqs = aggregation_normalisers(mask)
    total = 0.0
    for s in [slice(0, 3), slice(3, 4), slice(4, 6)]:
        part, _ = policy_loss(logits[s], old[s], adv[s], mask[s], aggregation=mode,
                              total_tokens=tokens, total_sequences=seqs)
        part.backward()
        total = total + part.detach()
    close(total, loss.detach(), atol=1e-6)
    close(logits.grad, whole_grad, atol=1e-6)


# ---------------------------------------------------------------- policy loss
LOGR = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 0.0]])
ADV = torch.tensor([[1.0, -1.0, -2.0, 5.0]])  # padding advantage 5 must be ignored
MASK = torch.tensor([[1, 1, 1, 0]])


def test_policy_loss_clip_higher_by_hand():
    old = torch.zeros(1, 4)
    logp = LOGR.clone().requires_grad_()
    # clip_low .2, clip_high .28:
    # t0 ratio 1.5, A=+1: max(-1.5, -1.28) = -1.28 (clipped) ; t1 ratio .5, A=-1: max(.5, .8) = .8 (clipped)
    # t2 ratio 1.1, A=-2: max(2.2, 2.2) = 2.2 (not clipped) ; token_mean = (-1.28 + .8 + 2.2) / 3 = .573333
    loss, stats = policy_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28)
    close(loss, 1.72 / 3)
    close(stats["clip_fraction"], 2 / 3)
    close(stats["ratio_mean"], 3.1 / 3)  # (1.5 + .5 + 1.1) / 3
    # k3 = r - 1 - log r: .094535, .193147, .004690 -> mean .097457
    close(stats["approx_kl"], 0.097457)
    loss.backward()
    # d/dlogp of -A*ratio/3 on the unclipped token t2: 2*1.1/3 ; clipped and padded tokens: 0
    close(logp.grad, [[0.0, 0.0, 2.2 / 3, 0.0]])


def test_policy_loss_importance_weights_and_dual_clip():
    old = torch.zeros(1, 4)
    w = torch.tensor([[2.0, 1.0, 0.5, 9.0]])
    # per-token (-1.28, .8, 2.2) * (2, 1, .5) = (-2.56, .8, 1.1) -> mean -0.66/3 = -0.22
    loss, _ = policy_loss(LOGR, old, ADV, MASK, clip_high=0.28, importance_weights=w)
    close(loss, -0.22)
    # dual clip c=3: ratio 5, A=-1 -> max(5, 1.2) = 5, capped at -A*c = 3 ; ratio 1.1, A=-2 -> 2.2 (< 6)
    logp = torch.tensor([[math.log(5.0), math.log(1.1)]])
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2), dual_clip=3.0)
    close(loss, (3.0 + 2.2) / 2)
    close(stats["dual_clip_fraction"], 0.5)


def test_policy_loss_rejects_bad_input():
    old = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="shape mismatch: old_logprobs"):
        policy_loss(LOGR, old[:, :3], ADV, MASK)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(LOGR, old, ADV, MASK, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low and clip_high must be >= 0"):
        policy_loss(LOGR, old, ADV, MASK, clip_low=-0.1)


# ---------------------------------------------------------------- KL, entropy, value
def test_kl_estimators_by_hand():
    logp, logq = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # d = logq - logp = log .5 = -0.693147
    close(kl_penalty(logp, logq, "k1"), [0.693147])  # -d
    close(kl_penalty(logp, logq, "k2"), [0.240227])  # .5 * .480453
    close(kl_penalty(logp, logq, "k3"), [0.193147])  # e^d - d - 1 = .5 + .693147 - 1
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, logq, "k4")


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]])
    # uniform over 4 -> ln 4 = 1.386294 ; one-hot-ish -> 0 (no NaN) ;
    # p = (.25, .75): -(.25 ln .25 + .75 ln .75) = .346574 + .215762 = .562335
    close(entropy_from_logits(logits), [1.386294, 0.0, 0.562335])


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 0.0]])
    old = torch.tensor([[0.5, 2.5, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    # t0: (1-2)^2 = 1 ; clipped v = .5 + .2 = .7 -> (.7-2)^2 = 1.69 -> max 1.69
    # t1: (2-2)^2 = 0 ; clipped v = 2.5 - .2 = 2.3 -> .09 -> max .09 ; loss = .5 * (1.69 + .09) / 2
    close(value_loss(values, old, returns, mask, clip=0.2), 0.445)
    close(value_loss(values, old, returns, mask, clip=None), 0.25)  # .5 * (1 + 0) / 2


# ---------------------------------------------------------------- filtering
def test_keep_groups_with_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 5])
    # group 0 all 1 -> drop ; group 1 {0, 1} -> keep ; group 2 all 2 -> drop ; group 5 single -> drop
    assert keep_groups_with_variance(rewards, groups).tolist() == [False, False, True, True, False, False, False]


def test_overlong_mask():
    lengths = torch.tensor([3, 8, 8, 5])
    finished = torch.tensor([True, True, False, False])
    assert overlong_mask(lengths, finished, 8).tolist() == [True, True, False, False]
    assert overlong_mask(lengths, None, 8).tolist() == [True, False, False, True]  # truncated iff len == max
    with pytest.raises(ValueError, match="exceeds max_new_tokens=8"):
        overlong_mask(torch.tensor([9]), None, 8)


def test_overlong_penalty_by_hand():
    # max_len 10, buffer 4 -> free 6 ; factor .5
    # 5, 6 -> 0 ; 7 -> (6-7)/4*.5 = -.125 ; 10 -> (6-10)/4*.5 = -.5 ; 12 (> max) -> -.5
    close(overlong_penalty(torch.tensor([5, 6, 7, 10, 12]), 10, 4, 0.5), [0.0, 0.0, -0.125, -0.5, -0.5])
    with pytest.raises(ValueError, match="0 < buffer_len <= max_len"):
        overlong_penalty(torch.tensor([1]), 10, 0)
