"""Train/inference mismatch correction (asyncflow.algos.correction): expected values worked out by hand in
the comments, and the corrected objective against the uncorrected one."""

import math

import pytest
import torch

from asyncflow.algos import (
    MISMATCH_CORRECTIONS,
    CorrectionBounds,
    correction_names,
    correction_weights,
    geometric_masked_weights,
    icepop_weights,
    mismatch_sums,
    second_moment_masked_weights,
    sequence_masked_weights,
    sequence_truncated_weights,
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


@pytest.mark.parametrize("correction", [*MISMATCH_CORRECTIONS, ["token_tis", "seq_mask"], "icepop+m2po+geo_mis"])
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


@pytest.mark.parametrize("correction", [c for c in MISMATCH_CORRECTIONS if c != "off"])
def test_correction_changes_the_loss_when_logprobs_disagree(correction):
    logprobs, mask, advantages = objective_inputs(seed=1)
    old = logprobs.detach()
    rollout = old - 2.5 * torch.rand(old.shape, generator=torch.Generator().manual_seed(2))  # engine far off
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


def ratios_as_rollout(ratios):
    """Rollout log-probs b giving the token ratios exp(a - b) = `ratios` against train log-probs a = 0."""
    return -torch.log(torch.tensor(ratios, dtype=torch.float32))


def test_icepop_keeps_the_ratio_inside_its_band_and_masks_outside():
    train = torch.zeros(1, 5)
    rollout = ratios_as_rollout([[0.4, 0.6, 3.0, 6.0, 1.0]])
    # default band [0.5, 5]: .4 and 6 are outside -> 0; .6 and 3 keep their ratio; the 5th is padding -> 0
    w = icepop_weights(train, rollout, torch.tensor([[1, 1, 1, 1, 0]]))
    close(w, [[0.0, 0.6, 3.0, 0.0, 0.0]])
    close(icepop_weights(train, rollout, torch.ones(1, 5), low=0.3, high=2.0), [[0.4, 0.6, 0.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
        icepop_weights(train, rollout, torch.ones(1, 5), low=1.5, high=2.0)


def test_sequence_truncated_weights_by_hand():
    train = torch.zeros(3, 3)
    rollout = -torch.tensor([
        [0.3, 0.2, 9.0],  # log ratios .3 + .2 (third is padding) = .5 -> e^.5 = 1.6487 < 2: every token 1.6487
        [0.5, 0.5, 9.0],  # 1.0 -> e = 2.718 > 2: capped at 2
        [-1.0, 0.2, 0.3],  # -.5 -> .6065
    ])  # fmt: skip
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    w = sequence_truncated_weights(train, rollout, mask, cap=2.0)
    close(w, [[1.6487, 1.6487, 0.0], [2.0, 2.0, 0.0], [0.6065, 0.6065, 0.6065]], atol=1e-4)
    with pytest.raises(ValueError, match="cap must be > 0"):
        sequence_truncated_weights(train, rollout, mask, cap=-1.0)


def test_sequence_mask_uses_the_product_and_the_geometric_mask_the_mean():
    train = torch.zeros(4, 2)
    rollout = -torch.tensor([[0.3, 0.2], [0.5, 0.5], [-0.25, -0.25], [-0.5, -0.5]])
    mask = torch.ones(4, 2)
    # sums .5, 1, -.5, -1 -> rho 1.65, 2.72, .607, .368 against [1/2, 2]: rows 1 and 3 masked
    close(sequence_masked_weights(train, rollout, mask, threshold=2.0), [[1, 1], [0, 0], [1, 1], [0, 0]])
    # means .25, .5, -.25, -.5 -> 1.28, 1.65, .78, .61 all inside [1/2, 2]: the length-neutral mean keeps them
    close(geometric_masked_weights(train, rollout, mask, threshold=2.0), mask)
    with pytest.raises(ValueError, match="threshold must be > 1"):
        sequence_masked_weights(train, rollout, mask, threshold=0.9)


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_is_under_tau():
    train = torch.zeros(2, 3)
    rollout = -torch.tensor([[0.1, -0.3, 7.0], [0.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # squared log ratios .01, .09 | 0, .25 (padding ignored): mean .35 / 4 = .0875 > .04. Ascending 0, .01, .09,
    # .25 -> prefix means 0, .005, .033, .0875: the longest prefix under .04 keeps three, the .25 token is masked
    close(second_moment_masked_weights(train, rollout, mask, tau=0.04), [[1, 1, 0], [1, 0, 0]])
    close(second_moment_masked_weights(train, rollout, mask, tau=0.1), mask)  # .0875 <= .1: nothing masked
    close(second_moment_masked_weights(train, rollout, mask, tau=0.004), [[0, 0, 0], [1, 0, 0]])  # 0, .005: one kept
    with pytest.raises(ValueError, match="tau must be > 0"):
        second_moment_masked_weights(train, rollout, mask, tau=0.0)


def test_m2po_per_micro_batch_keeps_the_step_under_tau_and_masks_at_least_the_step_mask():
    """The trainer masks each micro-batch on its own: every part's kept mean <= tau bounds the step's kept mean,
    and the step-level mask (the longest sorted prefix) keeps the most tokens any mask under the bound keeps."""
    gen = torch.Generator().manual_seed(3)
    train = torch.zeros(8, 6)
    rollout = 0.3 * torch.randn(8, 6, generator=gen)
    mask = torch.arange(6)[None, :] < torch.randint(1, 7, (8, 1), generator=gen)
    tau = 0.04
    step = second_moment_masked_weights(train, rollout, mask, tau)
    parts = torch.cat([second_moment_masked_weights(train[i:i + 3], rollout[i:i + 3], mask[i:i + 3], tau)
                       for i in range(0, 8, 3)])
    squared = rollout.square()
    for kept in (step, parts):
        assert 0 < kept.sum() < mask.sum()  # the example masks something and keeps something
        assert (squared * kept).sum() / kept.sum() <= tau
    assert parts.sum() <= step.sum()


WEIGHT_FUNCTIONS = [truncated_importance_weights, icepop_weights, sequence_truncated_weights, sequence_masked_weights,
                    geometric_masked_weights, second_moment_masked_weights]


@pytest.mark.parametrize("weights_of", WEIGHT_FUNCTIONS, ids=lambda f: f.__name__)
def test_weights_are_detached_zero_at_padding_and_one_when_logprobs_agree(weights_of):
    gen = torch.Generator().manual_seed(4)
    train = (-torch.rand(4, 5, generator=gen)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    rollout = train.detach() + 0.5 * torch.randn(4, 5, generator=gen)
    w = weights_of(train, rollout, mask)
    assert not w.requires_grad and w.shape == (4, 5)
    assert torch.all(w[mask == 0] == 0)
    assert torch.equal(weights_of(train, train.detach().clone(), mask), mask.float())


def test_a_combination_multiplies_the_weights_and_counts_each_part():
    train = torch.zeros(2, 2)
    rollout = ratios_as_rollout([[3.0, 1.0], [1.5, 1 / 1.2]])
    mask = torch.ones(2, 2)
    # token_tis (cap 2): (2, 1 | 1.5, .833); seq_mask (c 2): products 3 (masked) and 1.25 (kept)
    weights, counts = correction_weights(["token_tis", "seq_mask"], train, rollout, mask)
    close(weights, [[0.0, 0.0], [1.5, 1 / 1.2]])
    # the capped token is masked too: counted as masked, not truncated
    assert counts == {"truncated_tokens": 0.0, "masked_tokens": 2.0, "masked_sequences": 1.0,
                      "seq_mask_masked_sequences": 1.0}
    same, _ = correction_weights("token_tis+seq_mask", train, rollout, mask)
    assert torch.equal(same, weights)


def test_each_correction_reports_its_own_count():
    train = torch.zeros(2, 3)
    rollout = ratios_as_rollout([[0.2, 1.0, 1.0], [3.0, 2.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, counts = correction_weights("icepop", train, rollout, mask)  # .2 is under .5: one token masked
    assert counts["icepop_masked_tokens"] == counts["masked_tokens"] == 1.0 and counts["masked_sequences"] == 1.0
    _, counts = correction_weights("seq_tis", train, rollout, mask)  # products .2 and 6: row 1 capped (2 tokens)
    assert counts["seq_tis_truncated_sequences"] == 1.0 and counts["truncated_tokens"] == 2.0
    _, counts = correction_weights("m2po", train, rollout, mask)  # squared ln .2 = 2.59, ln 3 = 1.21, ln 2 = .48
    assert counts["m2po_masked_tokens"] == counts["masked_tokens"] == 3.0


def test_bounds_and_the_single_threshold():
    train = torch.zeros(1, 2)
    rollout = ratios_as_rollout([[3.0, 0.4]])
    mask = torch.ones(1, 2)
    weights, _ = correction_weights("icepop", train, rollout, mask, bounds=CorrectionBounds(icepop_low=0.3))
    close(weights, [[3.0, 0.4]])
    weights, _ = correction_weights(["token_tis", "m2po"], train, rollout, mask, threshold=2.5,
                                    bounds=CorrectionBounds(m2po_tau=10.0))
    close(weights, [[2.5, 0.4]])  # the threshold is token_tis's cap; m2po's tau comes from the bounds
    with pytest.raises(ValueError, match="one threshold applies to exactly one"):
        correction_weights(["token_tis", "seq_mask"], train, rollout, mask, threshold=2.5)
    with pytest.raises(ValueError, match="one threshold applies to exactly one"):
        correction_weights("icepop", train, rollout, mask, threshold=2.5)


@pytest.mark.parametrize(("value", "error"), [
    ("tis", "unknown mismatch correction 'tis'"), (["m2po", "m2po"], "names a correction twice"),
    ("off+m2po", "'off' cannot be combined"), (["token_tis", "seq_tis"], "both weight each token by its ratio"),
])  # fmt: skip
def test_correction_names_refuses_bad_combinations(value, error):
    with pytest.raises(ValueError, match=error):
        correction_names(value)


def test_correction_names():
    assert correction_names("off") == () and correction_names(["off"]) == ()
    assert correction_names("icepop + seq_mask") == ("icepop", "seq_mask")
    assert correction_names(["geo_mis", "seq_mask", "m2po"]) == ("geo_mis", "seq_mask", "m2po")


def test_the_config_offers_the_corrections_and_defaults_of_this_module():
    """config.py repeats the names and defaults (it does not import torch): they must not drift apart."""
    import dataclasses
    import typing

    from asyncflow import config
    from asyncflow.algos import correction

    assert typing.get_args(config.MismatchCorrection) == correction.MISMATCH_CORRECTIONS
    assert config._RATIO_CORRECTIONS == correction.RATIO_WEIGHTS
    assert config._THRESHOLD_KEYS == correction.THRESHOLD_FIELDS
    assert config.MismatchConfig().model_dump() == dataclasses.asdict(correction.CorrectionBounds())
