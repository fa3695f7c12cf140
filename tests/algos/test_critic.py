"""PPO with a critic, by hand on small tensors: GAE of outcome rewards (masked tokens inside and after a row, an
empty row), all-equal rewards (the critic, not the group, is the baseline), the clipped value loss with its clip
fraction and gradient, explained variance (and its micro-batch sums), and the trainer's loss on a stale row."""

from __future__ import annotations

import math

import pytest
import torch

from asyncflow.algos import explained_variance, outcome_gae, value_objective
from asyncflow.algos.losses import VALUE_SUMS, explained_variance_from_sums
from asyncflow.config import AlgoConfig
from asyncflow.models.logprobs import LogProbs
from asyncflow.models.tri_model import TriLogProbs
from asyncflow.workers.trainer import PolicyLoss


def test_outcome_gae_by_hand_with_masked_tokens():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    values = torch.tensor([
        [0.5, 0.6, 0.2],
        [0.3, 0.4, 7.0],   # 7.0 on padding: ignored
        [0.2, 9.0, 0.5],   # 9.0 on a masked token inside the row (a tool's output): skipped
        [5.0, 5.0, 5.0],   # no valid token at all
    ])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]])
    adv, ret = outcome_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: r = [0, 0, 1]. t2: d = 1 - 0.2 = 0.8, A = 0.8; t1: d = 0.9*0.2 - 0.6 = -0.42, A = -0.42 + 0.45*0.8 = -0.06;
    #        t0: d = 0.9*0.6 - 0.5 = 0.04, A = 0.04 + 0.45*(-0.06) = 0.013
    # row 1: r on token 1. t1: d = 0 - 0.4, A = -0.4; t0: d = 0.9*0.4 - 0.3 = 0.06, A = 0.06 + 0.45*(-0.4) = -0.12
    # row 2: t2: d = 1 - 0.5 = 0.5; t1 skipped; t0: d = 0.9*0.5 - 0.2 = 0.25, A = 0.25 + 0.45*0.5 = 0.475
    expected_adv = torch.tensor([[0.013, -0.06, 0.8], [-0.12, -0.4, 0.0], [0.475, 0.0, 0.5], [0.0, 0.0, 0.0]])
    expected_ret = torch.tensor([[0.513, 0.54, 1.0], [0.18, 0.0, 0.0], [0.675, 0.0, 1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-6)


def test_all_equal_rewards_keep_an_advantage_until_the_critic_predicts_them():
    """GRPO gives a group of equal rewards no signal; GAE's baseline is the critic: with V = 0 (a fresh head) each
    token's advantage is the reward, and with a critic that predicts it exactly it is 0."""
    rewards = torch.ones(3)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    adv, ret = outcome_gae(rewards, torch.zeros(3, 2), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, mask.float())
    torch.testing.assert_close(ret, mask.float())
    adv, ret = outcome_gae(rewards, torch.ones(3, 2), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.zeros(3, 2))
    torch.testing.assert_close(ret, mask.float())  # R = A + V


def test_value_objective_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.5, 2.9, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_objective(values, old, returns, mask, clip=0.2)
    assert loss.requires_grad
    loss_value = float(loss.detach())
    # token 0: (1-2)^2 = 1 vs clipped V = 0.7: 1.69 (larger, active); token 1: 0 vs V = 2.3: 0.09 (active);
    # token 2: V moved 0.1 < 0.2, the clipped value is V itself: (3-1)^2 = 4 (not active). Per token 0.5 * max.
    assert loss_value == pytest.approx(0.5 * (1.69 + 0.09 + 4.0))
    assert stats["value/loss"] == pytest.approx(0.5 * (1.69 + 0.09 + 4.0))
    assert stats["value/clip_fraction"] == 2.0  # a count of tokens: the trainer divides by the step's tokens
    loss.backward()  # a saturated clip has no gradient; token 2's is V - R = 2; padding none
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 2.0, 0.0]]))
    unclipped, stats = value_objective(values, old, returns, mask, clip=None)
    assert float(unclipped.detach()) == pytest.approx(0.5 * (1.0 + 0.0 + 4.0)) and stats["value/clip_fraction"] == 0.0
    # EV sums use the old values: R - V_old = [1.5, -0.5, -1.9]
    sums = [stats[k] for k in VALUE_SUMS]
    assert sums == pytest.approx([3.0, 5.0, 9.0, -0.9, 1.5**2 + 0.25 + 1.9**2])


def test_value_objective_sums_rows_like_the_policy_loss():
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    returns = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    for aggregation, want in [("token_mean", 4.5), ("seq_mean_token_mean", (2.5 / 2) + 2.0),
                              ("seq_mean_token_sum", 4.5)]:
        loss, _ = value_objective(values, values, returns, mask, clip=0.2, aggregation=aggregation)
        assert float(loss.detach()) == pytest.approx(want), aggregation  # normalisers 1: a sum, divided once per step


def test_explained_variance_by_hand_and_from_micro_batch_sums():
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding: its 3.0 must not count
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.full((1, 5), 0.5), returns, mask) == pytest.approx(0.0)  # the mean: no more
    assert explained_variance(torch.tensor([[0.75, 0.25, 0.75, 0.25, -9.0]]), returns, mask) == pytest.approx(0.75)
    assert math.isnan(explained_variance(torch.zeros(1, 5), torch.ones(1, 5), mask)), "constant returns"
    values = torch.tensor([[0.9, 0.2, 0.4, 0.1, 0.0]])
    halves = [value_objective(values[:, s], values[:, s], returns[:, s], mask[:, s])[1]
              for s in (slice(0, 2), slice(2, 5))]
    sums = [halves[0][k] + halves[1][k] for k in VALUE_SUMS]
    assert explained_variance_from_sums(*sums) == pytest.approx(explained_variance(values, returns, mask))


def test_a_stale_row_is_clipped_against_its_behaviour_policy_and_valued_by_the_current_critic():
    """The trainer's loss with a critic on two rows: row 0 stale (its PPO old log-prob is its sampling
    log-prob), row 1 current. GAE uses the critic's values of this forward for both; the value loss does not depend
    on staleness; the whole loss = policy sum + value_coef * value sum, by hand."""
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    values = torch.tensor([[0.25, 0.5], [0.75, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    rollout = torch.tensor([[-1.5, -2.0], [-0.4, 0.0]])
    out = TriLogProbs(LogProbs(logprobs, mask), old=logprobs.detach(), ref=None, values=values,
                      old_values=values.detach())
    algo = AlgoConfig(advantage="gae", gamma=1.0, lam=1.0, loss={"clip_low": 0.2, "clip_high": 0.2},
                      critic={"value_coef": 0.5})
    stale = torch.tensor([[True, True], [False, False]]) & mask
    loss_fn = PolicyLoss(torch.zeros(2, 2), rollout, stale, ~stale, [2, 1], algo, torch.tensor([1.0, 0.0]))
    loss, stats = loss_fn(out)
    # GAE (gamma = lam = 1): A_t = R - V_t: row 0 [0.75, 0.5], row 1 [-0.75]; returns R: [1, 1], [0].
    # row 0 stale: ratio = exp(logp - rollout) = [e^0.5, 1], clipped at 1.2 with A > 0: -A * min(r, 1.2).
    # row 1 current: ratio 1: -A = 0.75.
    policy = -0.75 * 1.2 - 0.5 * 1.0 + 0.75
    value = 0.5 * (0.75**2 + 0.5**2 + 0.75**2)
    assert float(loss.detach()) == pytest.approx(policy + 0.5 * value)
    assert stats["value/loss"] == pytest.approx(value) and stats["clip_fraction"] == pytest.approx(1.0)
    fresh, fresh_stats = PolicyLoss(torch.zeros(2, 2), rollout, None, torch.ones(2, 2, dtype=torch.bool), [2, 1],
                                    algo, torch.tensor([1.0, 0.0]))(out)
    assert fresh_stats["value/loss"] == stats["value/loss"], "staleness changes the policy part only"
    assert float(fresh.detach()) == pytest.approx(-0.75 - 0.5 + 0.75 + 0.5 * value)
    loss.backward()
    torch.testing.assert_close(values.grad, 0.5 * torch.tensor([[-0.75, -0.5], [0.75, 0.0]]))


def test_gae_without_values_is_a_clear_error():
    algo = AlgoConfig(advantage="gae")
    out = TriLogProbs(LogProbs(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)), old=torch.zeros(1, 1), ref=None)
    loss_fn = PolicyLoss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.ones(1, 1, dtype=torch.bool), [1], algo,
                         torch.ones(1))
    with pytest.raises(ValueError, match="ran no critic"):
        loss_fn(out)
