"""Train/inference mismatch correction (asyncflow.algos.correction): expected values worked out by hand in
the comments, and the corrected objective against the uncorrected one."""

import math

import pytest
import torch

from asyncflow.algos import (
    MISMATCH_CORRECTIONS,
    correction_weights,
    geometric_masked_weights,
    mismatch_sums,
    truncated_importance_weights,
)
from asyncflow.algos.losses import rl_objective


def close(a, b, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=atol, rtol=0)


def test_truncated_importance_weights():
    train = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[-math.log(0.5), -math.log(3.0), 0.0]])
    # exp(a - b) = (.5, 3, 1) ; cap 2 -> (.5, 2, 1) ; padding -> 0 ; detached
    w = truncated_importance_weights(train, rollout, torch.tensor([[1, 1, 0]]), cap=2.0)
    close(w, [[0.5, 2.0, 0.0]])
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(train, rollout, torch.ones(1, 3), cap=0.0)


def test_geometric_masked_weights_by_hand():
    train = torch.zeros(3, 3)
    rollout = torch.tensor([
        [-0.3, 0.1, 0.0],  # log ratios .3, -.1 (third is padding) -> mean .1 -> rho e^.1 = 1.105 <= 1.2: kept
        [-0.3, -0.3, 0.0],  # mean .3 -> rho 1.35 > 1.2: masked
        [0.2, 0.2, 0.2],  # mean -.2 -> rho .819 < 1/1.2 = .833: masked
    ])  # fmt: skip
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    w = geometric_masked_weights(train, rollout, mask, threshold=1.2)
    close(w, [[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    close(geometric_masked_weights(train, rollout, mask, threshold=1.5), mask)  # 1.35, .819 inside [.667, 1.5]
    with pytest.raises(ValueError, match="must be > 1"):
        geometric_masked_weights(train, rollout, mask, threshold=1.0)


def test_correction_weights_counts():
    train = torch.zeros(2, 3)
    rollout = torch.tensor([[-math.log(3.0), 0.0, 0.0], [-0.3, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights, counts = correction_weights("off", train, rollout, mask)
    assert weights is None and counts == {"truncated_tokens": 0.0, "masked_tokens": 0.0, "masked_sequences": 0.0}
    # token_tis, default cap 2: ratios (3, 1, 1 | e^.3 = 1.35, 1.35) -> only the 3 is truncated
    weights, counts = correction_weights("token_tis", train, rollout, mask)
    close(weights, [[2.0, 1.0, 1.0], [1.3499, 1.3499, 0.0]], atol=1e-4)
    assert counts["truncated_tokens"] == 1.0 and counts["masked_tokens"] == 0.0
    # geo_mis, c = 1.2: row 0 mean log ratio ln(3)/3 = .366 -> rho 1.44 masked (3 tokens); row 1 .3 -> 1.35 masked
    weights, counts = correction_weights("geo_mis", train, rollout, mask, threshold=1.2)
    close(weights, torch.zeros(2, 3))
    assert counts == {"truncated_tokens": 0.0, "masked_tokens": 5.0, "masked_sequences": 2.0}
    with pytest.raises(ValueError, match="unknown mismatch correction 'tis'"):
        correction_weights("tis", train, rollout, mask)


def test_mismatch_sums_by_hand():
    train = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    rollout = torch.tensor([[-1.5, -1.0, 7.0], [-0.5, -0.25, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    same = torch.tensor([[True, False, True], [True, True, True]])
    # |a - b| = (.5, 1, pad | 0, .25, .5): all 2.25 ; same version (.5 | 0, .25, .5) = 1.25 over 4 tokens
    assert mismatch_sums(train, rollout, mask, same_version=same) == pytest.approx(
        {"abs_log_ratio": 2.25, "abs_log_ratio_same_version": 1.25, "same_version_tokens": 4.0}
    )
    assert mismatch_sums(train, rollout, mask)["same_version_tokens"] == 5.0


def objective_inputs(seed: int = 0, n: int = 6, length: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(n, length, generator=gen) * 3).requires_grad_()
    mask = torch.arange(length)[None, :] < torch.randint(1, length + 1, (n, 1), generator=gen)
    advantages = torch.randn(n, length, generator=gen)
    return logprobs, mask, advantages


@pytest.mark.parametrize("correction", MISMATCH_CORRECTIONS)
def test_corrected_loss_equals_uncorrected_when_logprobs_agree(correction):
    """Trainer and engine agree (rollout log-probs = the trainer's old log-probs): every weight is 1, nothing is
    truncated or masked, and the loss and its gradient are the uncorrected ones."""
    logprobs, mask, advantages = objective_inputs()
    old = logprobs.detach() - 0.1  # one update behind: ratios != 1, so the clip is exercised too

    def run(mode):
        logprobs.grad = None
        loss, stats = rl_objective(logprobs, mask, old, old.clone(), advantages, correction=mode)
        loss.backward()
        return loss.detach(), logprobs.grad.clone(), stats

    loss, grad, stats = run(correction)
    plain_loss, plain_grad, _ = run("off")
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert stats["mismatch/truncated_tokens_fraction"] == stats["mismatch/masked_tokens_fraction"] == 0.0


@pytest.mark.parametrize("correction", ["token_tis", "geo_mis"])
def test_correction_changes_the_loss_when_logprobs_disagree(correction):
    logprobs, mask, advantages = objective_inputs(seed=1)
    old = logprobs.detach()
    rollout = old - 1.5 * torch.rand(old.shape, generator=torch.Generator().manual_seed(2))  # engine far off
    plain, _ = rl_objective(logprobs, mask, old, rollout, advantages)
    corrected, stats = rl_objective(logprobs, mask, old, rollout, advantages, correction=correction)
    assert not torch.isclose(plain, corrected)
    moved = stats["mismatch/truncated_tokens_fraction"] + stats["mismatch/masked_tokens_fraction"]
    assert moved > 0


def test_stale_tokens_train_against_their_own_sampling_logprobs():
    """Per-token `stale` [N, L]: a partial rollout's old-version tokens take the rollout log-prob as PPO's old
    log-prob, its current-version tokens the trainer's."""
    logprobs = torch.zeros(1, 4, requires_grad=True)
    old = torch.zeros(1, 4)
    rollout = torch.full((1, 4), -1.0)
    advantages = torch.ones(1, 4)
    stale = torch.tensor([[True, True, False, False]])
    _, stats = rl_objective(logprobs, torch.ones(1, 4), old, rollout, advantages, stale=stale, clip_high=0.28)
    # ratios e^{0 - (-1)} = 2.718 on the stale tokens (clipped at 1.28), 1 on the fresh ones: clip fraction 2/4
    assert stats["clip_fraction"] == pytest.approx(2.0)  # a token sum (4 tokens x 0.5)
    assert stats["ratio_mean"] == pytest.approx(2 * math.e + 2)
