"""PPO with a critic learns its values in every workflow mode: on prompts whose reward their first character decides
(`x...` -> 1, `y...` -> 0), the critic's explained variance starts at 0 (a zero head) and rises above 0.6 within 20
steps of sync, stream and async (a value head in each, a separate value model in sync too)."""

from __future__ import annotations

import json
import random

import pytest

from asyncflow.api import train
from asyncflow.config import build_config

MODES = {
    "sync": ["workflow.mode=sync"],
    "stream": ["workflow.mode=stream"],
    "async": ["workflow.mode=async", "workflow.max_staleness=1"],
    "sync-separate": ["workflow.mode=sync", "algo.critic.kind=separate", "algo.critic.lr=3e-4"],
}


def reward_from_prompt(completion: str, ground_truth: str, **metadata) -> float:
    """The reward a prompt's answer names, whatever was generated: only a critic that reads the prompt predicts it."""
    return float(ground_truth)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.slow
def test_explained_variance_rises(tmp_path, mode, one_torch_thread):
    rng = random.Random(0)
    data = tmp_path / "xy.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{'xy'[i % 2]}{rng.randrange(100)}=", "answer": str(1 - i % 2)})
                            + "\n" for i in range(64)))
    config = build_config({}, [
        f"run.output_dir={tmp_path / 'run'}", "run.progress=false", "model.path=preset:tiny-llama", "data.task=null",
        f"data.path={data}", "rollout.prompts_per_step=8", "rollout.group_size=2", "rollout.max_new_tokens=3",
        "train.steps=20", "train.micro_batch_size=16", "train.lr=1e-5", "eval.every=0", "checkpoint.every=0",
        "runtime.kind=inline", "runtime.lend_idle_cores=false", "reward.fns=[test_ppo_critic:reward_from_prompt]",
        "algo.advantage=gae", "algo.critic.lr=1e-2", *MODES[mode],
    ])  # fmt: skip
    rows = [r for r in train(config).history if "loss" in r]
    explained = [r["value/explained_variance"] for r in rows]
    assert len(rows) == 20 and explained[0] == pytest.approx(0.0, abs=1e-6), explained
    assert sum(explained[-5:]) / 5 > 0.6, explained
    assert all(r["value/clip_fraction"] == 0.0 for r in rows), "one update per step: V = V_old, nothing to clip"
    assert rows[-1]["value/loss"] < rows[0]["value/loss"]
