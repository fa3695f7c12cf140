"""`asyncflow profile` end to end on a small config: a loadable measured profile whose coefficients come from the
run's own paths (rollout worker, policy trainer, queue, reward functions), packed micro-batches measured apart
unless packing is off; coefficients fitted >= 0 without clipping."""

import re

import numpy as np
import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.plan import measure
from asyncflow.plan.costs import Costs, Profile
from asyncflow.plan.measure import nonnegative_fit

SMALL = ["rollout.max_batch_size=16", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "train.micro_batch_size=16"]  # fmt: skip


@pytest.mark.parametrize(("packing", "budget"), [("auto", None), ("off", None), ("auto", 64)])
@pytest.mark.slow
def test_profile_measures_every_role(tmp_path, packing, budget):
    out = tmp_path / "profile.yaml"
    options = [f"train.max_tokens_per_micro_batch={budget}"] if budget else []
    assert main(["profile", "examples/arithmetic_grpo.yaml", *SMALL, f"train.packing={packing}", *options, "--threads",
                 "1", "--repeats", "2", "--out", str(out)]) == 0  # fmt: skip
    profile = Profile.load(out)
    assert profile.kind == "measured" and profile.model == "preset:tiny-llama"
    assert profile.decode_step_s > 0 and profile.optimizer_step_s > 0
    # under a token budget every micro-batch holds about `budget` tokens: the fixed and per-token parts are near
    # collinear and only their sum at that size is determined (which is what the simulator charges)
    assert (profile.train_micro_batch_s + 64 * profile.train_token_s > 0) if budget else profile.train_token_s > 0
    assert profile.queue_call_s > 0 and profile.reward_row_s > 0 and profile.weight_bytes > 0
    assert profile.put_prompts_s > 0 and profile.notes.startswith("measured on cpu ")
    assert (profile.train_packed_token_s is None) == (packing == "off")
    costs = Costs.from_profile(profile)
    assert costs.train(1000, packed=True) >= costs.train(0) and costs.prefill(16, 1) > 0
    # a read over the token budget is timed against the micro-batches the trainer splits it into
    split = [int(n) for n in re.findall(r"'micro_batches': (\d+)", profile.notes)]
    assert split and (max(split) > 1 if budget else set(split) == {1}), split


def test_a_negative_coefficient_is_fixed_at_zero_and_the_others_fitted_again():
    """seconds = 0.6 x - 0.3 exactly: unconstrained, the intercept is -0.3. Clipping it to 0 would keep the slope 0.6
    (every point 0.3 s too high); fixed at 0, the slope is refitted to sum(xy) / sum(x^2) = 0.5."""
    x = np.array([1.0, 2.0, 3.0, 4.0])
    features, seconds = [[1.0, v] for v in x], (0.6 * x - 0.3).tolist()
    intercept, slope = nonnegative_fit(features, seconds)
    assert intercept == 0.0 and slope == pytest.approx(0.5)
    assert np.abs(slope * x - seconds).max() < np.abs(0.6 * x - seconds).max()
    assert nonnegative_fit([[1.0, v] for v in x], (2 * x + 1).tolist()) == pytest.approx([1.0, 2.0])


def test_a_relative_fit_keeps_the_coefficient_that_only_the_small_points_show():
    """seconds = 1 ms per decode step + 0.1 ms per prefill token, the two long-prefill points 5% off. Absolute least
    squares lets their noise (10 ms) decide the decode step (0.08 ms fitted); relative errors recover it."""
    steps_and_tokens = [[2, 0], [4, 0], [2, 2000], [4, 2000]]
    seconds = [0.002, 0.004, 0.202 * 1.05, 0.204 * 0.95]
    assert nonnegative_fit(steps_and_tokens, seconds)[0] < 1e-4
    assert nonnegative_fit(steps_and_tokens, seconds, relative=True) == pytest.approx([1e-3, 1e-4], rel=0.01)


def test_profile_loads_the_policy_and_the_rollout_engine_on_the_configured_device(monkeypatch):
    """The policy as a run loads it (`model.dtype`, `model.device`), the rollout engine as a run builds it
    (`config.rollout_dtype()`: bfloat16 under train.precision=bf16; `model.device`)."""
    config = load_config("examples/arithmetic_grpo.yaml", ["model.device=cuda:0", "train.precision=bf16"])
    seen, real_load_model = {}, measure.load_model

    class Stop(Exception):
        pass

    def load_model(path, **options):
        seen["policy"] = options
        return real_load_model(path)  # on the CPU

    def make_inference_engine(name, **options):
        seen["rollout"] = (name, options)
        raise Stop  # stop before anything runs on the device

    monkeypatch.setattr(measure, "load_model", load_model)
    monkeypatch.setattr(measure, "make_inference_engine", make_inference_engine)
    with pytest.raises(Stop):
        measure.measure_profile(config, repeats=1)
    assert seen["policy"] == {"dtype": "float32", "device": "cuda:0"}
    name, options = seen["rollout"]
    assert name == "torch" and options["dtype"] == "bfloat16" and options["device"] == "cuda:0"
    assert options["max_batch_size"] == config.rollout.max_batch_size and options["seed"] == config.run.seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_cuda(tmp_path):
    out = tmp_path / "profile.yaml"
    assert main(["profile", "examples/arithmetic_grpo.yaml", *SMALL, "model.device=cuda", "train.precision=bf16",
                 "--repeats", "2", "--out", str(out)]) == 0  # fmt: skip
    profile = Profile.load(out)
    assert profile.notes.startswith(f"measured on cuda ({torch.cuda.get_device_name()})")
    assert profile.decode_step_s > 0 and profile.train_token_s > 0 and profile.optimizer_step_s > 0
