"""GSPO and CISPO (asyncflow.algos.losses.gspo_loss / cispo_loss, and `rl_objective(loss=...)`): expected values
worked out by hand in the comments, gradients against torch.autograd of the papers' explicit formulas, and the
invariants every policy loss keeps (masked tokens, zero advantages, stale rows, micro-batch accumulation)."""

import math

import pytest
import torch

from asyncflow.algos import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    aggregation_normalisers,
    cispo_loss,
    grpo_advantages,
    gspo_loss,
)
from asyncflow.algos.losses import rl_objective


def close(a, b, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=atol, rtol=0)


def random_batch(seed: int, n: int = 6, length: int = 5):
    """logprobs [n, length] (leaf with grad), old log-probs within +-0.3 of them, advantages constant per row,
    and a mask of rows with 1..length valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(n, length, generator=gen)).requires_grad_()
    old = logprobs.detach() + 0.3 * (2 * torch.rand(n, length, generator=gen) - 1)
    advantages = torch.randn(n, 1, generator=gen).expand(n, length).contiguous()
    mask = torch.arange(length)[None, :] < torch.tensor([1, 5, 2, 4, 3, 5])[:n, None]
    return logprobs, old, advantages, mask


def grad_of(loss: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


# ---------------------------------------------------------------- GSPO
# Row 0: token log-ratios (.3, -.1, padding) -> mean .1 -> s_0 = e^.1 = 1.105171, advantage +1.
# Row 1: (-.2, -.2, -.2) -> s_1 = e^-.2 = .818731, advantage -2. Padding: log-prob 7, advantage 5 (ignored).
GSPO_LOGP = torch.tensor([[0.3, -0.1, 7.0], [-0.2, -0.2, -0.2]])
GSPO_ADV = torch.tensor([[1.0, 1.0, 5.0], [-2.0, -2.0, -2.0]])
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_gspo_by_hand():
    logp = GSPO_LOGP.clone().requires_grad_()
    old = torch.zeros(2, 3)
    # clip range [.8, 1.1]: row 0, A > 0: max(-1.105171, -1.1) = -1.1 (clipped) on its 2 tokens;
    # row 1, A < 0, s inside the band: 2 * .818731 = 1.637462 on its 3 tokens
    loss, stats = gspo_loss(logp, old, GSPO_ADV, GSPO_MASK, clip_low=0.2, clip_high=0.1)
    close(loss, (2 * -1.1 + 3 * 1.637462) / 5)  # token_mean = .542477
    close(stats["clip_fraction"], 2 / 5)
    close(stats["ratio_mean"], (2 * 1.105171 + 3 * 0.818731) / 5)  # s_i on each of its tokens
    # approx_kl from the token ratios: k3(.3) = .049859, k3(-.1) = .004837, k3(-.2) = .018731 (x3)
    close(stats["approx_kl"], (0.049859 + 0.004837 + 3 * 0.018731) / 5)
    # gradient: row 0 clipped -> 0; row 1: -A * s_1 / T = 2 * .818731 / 5 = .327492 per token; padding 0
    close(grad_of(loss, logp), [[0.0, 0.0, 0.0], [0.327492] * 3])
    # seq_mean_token_mean (the paper's): (-1.1 + 1.637462) / 2, gradient 2 * .818731 / (2 * 3) = .272910
    loss, _ = gspo_loss(logp, old, GSPO_ADV, GSPO_MASK, clip_low=0.2, clip_high=0.1, aggregation="seq_mean_token_mean")
    close(loss, (-1.1 + 1.637462) / 2)
    close(grad_of(loss, logp), [[0.0, 0.0, 0.0], [0.272910] * 3])


def test_gspo_default_clip_range_is_the_papers():
    # 1 - 3e-4 <= s <= 1 + 4e-4: row 0's s = e^.1 is far out (clipped), a row with s = e^.0003 = 1.0003 is in
    logp = torch.tensor([[0.1, 0.1], [0.0003, 0.0003]], requires_grad=True)
    _, stats = gspo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2))
    close(stats["clip_fraction"], 0.5)
    loss, _ = gspo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2))
    close(grad_of(loss, logp), [[0.0, 0.0], [-math.exp(0.0003) / 4] * 2])


def explicit_gspo(logprobs, old, advantages, mask, clip_low, clip_high, aggregation):
    """The GSPO paper's sequence-level objective, written out: s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|) with grad,
    l_i = max(-A_i s_i, -A_i clip(s_i)), weighted per row by the aggregation (token_mean: n_i / T,
    seq_mean_token_mean: 1 / S, seq_mean_token_sum: n_i / S)."""
    m = mask.float()
    n = m.sum(1)
    s = torch.exp(((logprobs - old) * m).sum(1) / n)
    a = advantages[:, 0]
    per_row = torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high))
    weight = {"token_mean": n / n.sum(), "seq_mean_token_mean": torch.ones_like(n) / len(n),
              "seq_mean_token_sum": n / len(n)}[aggregation]
    return (weight * per_row).sum()


@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.02, 0.03)])  # wide: nothing clipped; narrow: some rows clipped
def test_gspo_matches_the_sequence_level_formula_and_its_autograd(aggregation, clip):
    logprobs, old, advantages, mask = random_batch(0)
    loss, stats = gspo_loss(logprobs, old, advantages, mask, *clip, aggregation=aggregation)
    expected = explicit_gspo(logprobs, old, advantages, mask, *clip, aggregation)
    close(loss, expected, atol=1e-6)
    close(grad_of(loss, logprobs), grad_of(expected, logprobs), atol=1e-6)
    assert (stats["clip_fraction"] > 0) == (clip == (0.02, 0.03))


# ---------------------------------------------------------------- CISPO
# Token ratios (5, .5, 1.2, padding) with log-probs (-.5, -2, -1, padding 9); advantages (1, -1, 2, padding 5).
CISPO_LOGP = torch.tensor([[-0.5, -2.0, -1.0, 9.0]])
CISPO_OLD = CISPO_LOGP - torch.log(torch.tensor([[5.0, 0.5, 1.2, 1.0]]))
CISPO_ADV = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
CISPO_MASK = torch.tensor([[1, 1, 1, 0]])


def test_cispo_by_hand():
    logp = CISPO_LOGP.clone().requires_grad_()
    # defaults: no lower bound, weights <= 1 + 3 = 4 -> w = (4, .5, 1.2)
    # l = -w * A * logp = (-4 * 1 * -.5, -.5 * -1 * -2, -1.2 * 2 * -1) = (2, -1, 2.4) -> token_mean 3.4 / 3
    loss, stats = cispo_loss(logp, CISPO_OLD, CISPO_ADV, CISPO_MASK)
    close(loss, 3.4 / 3)
    close(stats["clip_fraction"], 1 / 3)
    close(stats["ratio_mean"], (5 + 0.5 + 1.2) / 3)
    # gradient -w * A / 3 on every valid token, the clipped one included (PPO would give it 0)
    close(grad_of(loss, logp), [[-4 / 3, 0.5 / 3, -2.4 / 3, 0.0]])
    # a lower bound: clip_low .2 -> w = (4, .8, 1.2), two weights clipped
    loss, stats = cispo_loss(logp, CISPO_OLD, CISPO_ADV, CISPO_MASK, clip_low=0.2)
    close(stats["clip_fraction"], 2 / 3)
    close(grad_of(loss, logp), [[-4 / 3, 0.8 / 3, -2.4 / 3, 0.0]])


@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
def test_cispo_matches_its_formula_under_autograd(aggregation):
    """CISPO's gradient is the importance-weighted policy gradient -min(r, 1 + eps) * A * grad log pi, written here as
    the unclipped IS surrogate -A * r scaled token by token by the constant min(r, 1 + eps) / r."""
    logprobs, old, advantages, mask = random_batch(1)
    cap = 1.1  # clip_high .1: some of the ratios within e^+-.3 are above it
    loss, stats = cispo_loss(logprobs, old, advantages, mask, clip_high=cap - 1, aggregation=aggregation)
    ratio = torch.exp(logprobs - old)
    surrogate = -advantages * ratio * (ratio.clamp(max=cap) / ratio).detach()
    m = mask.float()
    n = m.sum(1)
    per_row = (surrogate * m).sum(1)
    expected = {"token_mean": per_row.sum() / n.sum(), "seq_mean_token_mean": (per_row / n).sum() / len(n),
                "seq_mean_token_sum": per_row.sum() / len(n)}[aggregation]
    close(grad_of(loss, logprobs), grad_of(expected, logprobs), atol=1e-6)
    assert stats["clip_fraction"] > 0


# ---------------------------------------------------------------- invariants of every policy loss
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_equal_rewards_give_zero_loss_and_gradient(loss):
    logprobs, old, _, mask = random_batch(2)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # two groups, each all-equal
    advantages = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]))[:, None].expand(6, 5)
    value, _ = rl_objective(logprobs, mask, old, old.clone(), advantages, loss=loss)
    assert value.item() == 0.0
    assert torch.equal(grad_of(value, logprobs), torch.zeros_like(logprobs))


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
def test_masked_tokens_change_nothing(loss, aggregation):
    logprobs, old, advantages, mask = random_batch(3)
    value, stats = POLICY_LOSSES[loss](logprobs, old, advantages, mask, aggregation=aggregation)
    grad = grad_of(value, logprobs)
    noise = 5 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(4)) * ~mask
    moved = (logprobs.detach() + noise).requires_grad_()
    moved_value, moved_stats = POLICY_LOSSES[loss](moved, old - noise, advantages + noise, mask,
                                                   aggregation=aggregation)
    assert torch.equal(moved_value, value) and moved_stats == stats
    moved_grad = grad_of(moved_value, moved)
    assert torch.equal(moved_grad, grad) and not moved_grad[~mask].any()


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
def test_on_policy_the_three_losses_have_one_gradient(loss, aggregation):
    """pi_old = pi (one update per step, rows of the current policy): every ratio is 1, nothing is clipped and each
    loss's gradient is the plain policy gradient -A_t * grad log pi_t, aggregated."""
    logprobs, _, advantages, mask = random_batch(5)
    value, stats = POLICY_LOSSES[loss](logprobs, logprobs.detach(), advantages, mask, aggregation=aggregation)
    ppo, _ = POLICY_LOSSES["ppo"](logprobs, logprobs.detach(), advantages, mask, aggregation=aggregation)
    close(grad_of(value, logprobs), grad_of(ppo, logprobs), atol=1e-7)
    assert stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_stale_rows_train_against_their_sampling_logprobs():
    """Row 0 is stale: its old log-probs are its rollout log-probs (-.1, -.3), so its ratios are e^.1 and e^.3;
    row 1 is fresh: ratio 1 against the trainer's own old log-probs, whatever its rollout log-probs."""
    logprobs = torch.zeros(2, 2, requires_grad=True)
    old = torch.zeros(2, 2)
    rollout = torch.tensor([[-0.1, -0.3], [-5.0, -5.0]])
    advantages, mask, stale = torch.ones(2, 2), torch.ones(2, 2), torch.tensor([True, False])
    # GSPO: row 0's s = e^.2 = 1.221403 > 1 + 4e-4 with A > 0: clipped, no gradient; row 1: s = 1, gradient -1
    value, stats = rl_objective(logprobs, mask, old, rollout, advantages, stale=stale, loss="gspo",
                                clip_low=3e-4, clip_high=4e-4)
    close(value, -2 * 1.0004 - 2 * 1.0)  # a sum over tokens
    close(stats["clip_fraction"], 2.0)  # token sums: row 0's two tokens
    close(stats["ratio_mean"], 2 * math.exp(0.2) + 2.0)
    close(grad_of(value, logprobs), [[0.0, 0.0], [-1.0, -1.0]])
    # CISPO: weights (e^.1, e^.3) on row 0 (under the cap 4), 1 on row 1; log-probs 0 -> loss 0, gradient -w * A
    value, stats = rl_objective(logprobs, mask, old, rollout, advantages, stale=stale, loss="cispo",
                                clip_low=1.0, clip_high=3.0)
    assert value.item() == 0.0 and stats["clip_fraction"] == 0.0
    close(grad_of(value, logprobs), [[-math.exp(0.1), -math.exp(0.3)], [-1.0, -1.0]])
    # not stale: row 0 trains against the trainer's old log-probs too, ratio 1
    value, _ = rl_objective(logprobs, mask, old, rollout, advantages, loss="cispo", clip_low=1.0, clip_high=3.0)
    close(grad_of(value, logprobs), -torch.ones(2, 2))


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_a_row_masked_by_the_mismatch_correction_trains_nothing(loss):
    """geo_mis leaves out a row whose engine log-probs are far from the trainer's; the other rows train as without
    the correction."""
    logprobs, old, advantages, mask = random_batch(6)
    rollout = old.clone()
    rollout[1] -= 1.0  # row 1's geometric-mean ratio e^1 is outside [1/1.001, 1.001]

    def gradient(correction):
        value, stats = rl_objective(logprobs, mask, old, rollout, advantages, loss=loss, correction=correction)
        return grad_of(value, logprobs), stats

    plain, _ = gradient("off")
    corrected, stats = gradient("geo_mis")
    assert not corrected[1].any() and plain[1].any()
    keep = torch.arange(6) != 1
    assert torch.equal(corrected[keep], plain[keep])
    assert stats["mismatch/masked_sequences_fraction"] == 1.0


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
def test_micro_batches_add_up_to_the_whole_batch(loss, aggregation):
    logprobs, old, advantages, mask = random_batch(7)
    clip = {"clip_low": 0.02, "clip_high": 0.03}  # some rows / tokens clipped
    whole, _ = POLICY_LOSSES[loss](logprobs, old, advantages, mask, aggregation=aggregation, **clip)
    whole_grad = grad_of(whole, logprobs)
    tokens, sequences = aggregation_normalisers(mask)
    total = 0.0
    for rows in [slice(0, 3), slice(3, 4), slice(4, 6)]:
        part, _ = POLICY_LOSSES[loss](logprobs[rows], old[rows], advantages[rows], mask[rows], aggregation=aggregation,
                                      total_tokens=tokens, total_sequences=sequences, **clip)
        part.backward()
        total = total + part.detach()
    close(total, whole.detach(), atol=1e-6)
    close(logprobs.grad, whole_grad, atol=1e-6)


def test_unknown_loss_and_bad_clip_are_named():
    logprobs, old, advantages, mask = random_batch(8)
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        rl_objective(logprobs, mask, old, old, advantages, loss="grpo")
    for loss in ("gspo", "cispo"):
        with pytest.raises(ValueError, match="clip_low and clip_high must be >= 0"):
            POLICY_LOSSES[loss](logprobs, old, advantages, mask, clip_high=-1.0)
        with pytest.raises(ValueError, match="shape mismatch: old_logprobs"):
            POLICY_LOSSES[loss](logprobs, old[:, :3], advantages, mask)
