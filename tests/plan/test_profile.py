"""`asyncflow profile` end to end on a small config: a loadable measured profile whose coefficients come from the
run's own paths (rollout worker, policy trainer, queue, reward functions), packed micro-batches measured apart
unless packing is off."""

import pytest

from asyncflow.cli import main
from asyncflow.plan.costs import Costs, Profile

SMALL = ["rollout.max_batch_size=16", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "train.micro_batch_size=16"]  # fmt: skip


@pytest.mark.parametrize("packing", ["auto", "off"])
def test_profile_measures_every_role(tmp_path, packing):
    out = tmp_path / "profile.yaml"
    assert main(["profile", "examples/arithmetic_grpo.yaml", *SMALL, f"train.packing={packing}", "--threads", "1",
                 "--repeats", "2", "--out", str(out)]) == 0  # fmt: skip
    profile = Profile.load(out)
    assert profile.kind == "measured" and profile.model == "preset:tiny-llama"
    assert profile.decode_step_s > 0 and profile.train_token_s > 0 and profile.optimizer_step_s > 0
    assert profile.queue_call_s > 0 and profile.reward_row_s > 0 and profile.weight_bytes > 0
    assert (profile.train_packed_token_s is None) == (packing == "off")
    costs = Costs.from_profile(profile)
    assert costs.train(1000, packed=True) >= costs.train(0) and costs.prefill(16, 1) > 0
