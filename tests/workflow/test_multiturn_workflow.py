"""A short multi-turn run in every workflow mode, inline and on Ray: episodes answered by an environment train
only their sampled tokens (`train/tokens` = sampled tokens < all response tokens), with the staleness bound
checked per row by the trainer."""

from __future__ import annotations

import pytest

from asyncflow.api import open_run
from asyncflow.config import build_config
from asyncflow.envs import StepResult


class TwoTurnEnv:
    """Any first turn gets an observation (appended, not trained); the second ends the episode, scored."""

    def __init__(self, verifier):
        self.verifier = verifier

    def reset(self, row):
        self.row, self.turns = row, 0

    def step(self, model_text):
        self.turns += 1
        if self.turns == 1:
            return StepResult(observation="7", info={"tool_calls": 1})
        return StepResult(reward=self.verifier(model_text, self.row), done=True, info={"tool_calls": 1})


def two_turn_env(*, toolbox, verifier):
    return TwoTurnEnv(verifier)


def multiturn_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama-tools",
        "data.task=tool_arithmetic", "env.name=test_multiturn_workflow:two_turn_env", "env.max_context_tokens=48",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.max_batch_size=8",
        "rollout.stop_token_ids=[" + ",".join(map(str, range(3, 90))) + "]",  # short turns: both are reached
        "train.micro_batch_size=8", "train.steps=2", "eval.every=0", "data.test_size=2", "checkpoint.every=0",
        "runtime.call_timeout_s=60", "observe.tensorboard=false", *overrides,
    ])  # fmt: skip


def check_history(history, mode):
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["rollout/samples"] == 4
        assert h["env/tool_calls"] == 4, "every episode got its observation"
        assert h["train/tokens"] == h["env/sampled_tokens"] < h["rollout/tokens"], "tool tokens are not trained"
        assert h["staleness/max"] <= (1 if mode == "async" else 0)
    assert "eval/accuracy" in history[-1]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.slow
def test_multiturn_run_inline(tmp_path, mode, one_torch_thread):
    config = multiturn_config(tmp_path, f"workflow.mode={mode}", "runtime.kind=inline")
    with open_run(config) as run:
        check_history(run.train(), mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stream", "async"])
def test_multiturn_run_on_ray(tmp_path, mode, ray_cluster, one_torch_thread):
    config = multiturn_config(tmp_path, f"workflow.mode={mode}", "runtime.kind=ray", "runtime.rollout_cpus=0.5")
    with open_run(config) as run:
        check_history(run.train(), mode)
