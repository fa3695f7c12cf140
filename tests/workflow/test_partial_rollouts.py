"""Partial rollouts (`rollout.on_weight_update: resume`) in the async workflow, inline and on Ray.

Generation is slowed down (a pause per decode step) so that the trainer publishes new weights while a
partition is still generating: the samples in flight then go on under the new version. The trainer checks
every row against the staleness bound by its oldest token (and raises `StalenessError` otherwise); the test
checks that rows spanning versions were trained, and that every step trained exactly its own rows.
"""

from __future__ import annotations

import logging
import math
import time

import pytest

from asyncflow.api import open_run, train
from asyncflow.config import ConfigError, build_config
from asyncflow.engines.torch_inference import TorchInferenceEngine

STEPS, PER_STEP = 4, 16
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # two torch users (rollout, trainer) share 2 cores


class SlowDecodeEngine(TorchInferenceEngine):
    """The torch engine with a pause before each decode step, so generation outlasts a training step."""

    def _decode(self, cache, slots):
        time.sleep(0.01)
        super()._decode(cache, slots)


def make_slow_engine(*, model_path, **kwargs):
    return SlowDecodeEngine.from_pretrained(model_path, **kwargs)


def partial_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", f"train.steps={STEPS}",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=24", "rollout.max_batch_size=8",
        "rollout.engine=test_partial_rollouts:make_slow_engine", "rollout.on_weight_update=resume",
        "train.micro_batch_size=8", "eval.every=0", "data.test_size=4", "checkpoint.every=0",
        "workflow.mode=async", "workflow.max_staleness=1", "runtime.call_timeout_s=60", *overrides,
    ])  # fmt: skip


def check_partial_run(history: list[dict], run) -> None:
    rows = [h for h in history if "staleness/max" in h]
    assert len(rows) == STEPS and run.version == STEPS
    assert all(h["rollout/samples"] == PER_STEP for h in rows), "each step trains exactly its own rows"
    assert all(0 <= h["staleness/max"] <= 1 and h["staleness/token_max"] <= 1 for h in rows)
    assert all(h["staleness/token_mean"] <= h["staleness/mean"] for h in rows), "a row counts by its oldest token"
    assert max(h["staleness/rows_spanning_versions"] for h in rows) > 0, "no update landed mid-generation"
    for h in rows:
        assert math.isfinite(h["loss"]) and 0 <= h["mismatch/abs_log_ratio"]


@pytest.mark.slow
def test_async_partial_rollouts_inline(tmp_path, caplog):
    config = partial_config(tmp_path, "runtime.kind=inline", "algo.mismatch_correction=token_tis")
    with open_run(config) as run:
        with caplog.at_level(logging.INFO, logger="asyncflow.progress"):
            history = run.train()
    check_partial_run(history, run)
    last = [r.getMessage() for r in caplog.records if r.name == "asyncflow.progress"][-1]
    assert all(f"{label} " in last for label in ("mismatch", "corrected", "stale", "spanning")), last
    handed = [e for e in run.timeline.events if e["name"] == "weights_in_flight"]
    assert handed, "the watcher handed versions to the engine while partitions generated"


@pytest.mark.slow
def test_async_partial_rollouts_on_ray(tmp_path, ray_cluster):
    config = partial_config(tmp_path, "runtime.kind=ray", "runtime.rollout_cpus=0.5")
    with open_run(config) as run:
        history = run.train()
    check_partial_run(history, run)


def test_resume_needs_an_engine_that_updates_in_flight(tmp_path):
    class FinishOnly(TorchInferenceEngine):
        updates_in_flight = False

    from asyncflow.engines.base import register_inference_engine

    register_inference_engine("test_finish_only")(FinishOnly.from_pretrained)
    with pytest.raises(ValueError, match="on_weight_update=resume needs an inference engine.*FinishOnly does not"):
        train(partial_config(tmp_path, "rollout.engine=test_finish_only", "runtime.kind=inline"))
    with pytest.raises(ConfigError, match="rollout.on_weight_update"):
        build_config({}, ["rollout.on_weight_update=abort"])


def test_each_token_trains_against_its_own_sampling_logprob(tiny_llama_path):
    """Rows whose first half was sampled by version 0 and the rest by version 1, trained at version 1: only the
    old half takes its (far-off) recorded log-prob as PPO's old log-prob, so about half as many tokens clip as
    when the whole row is stale, and none when it is all fresh."""
    from test_workflows import GROUPS, MAX_NEW, fixed_rollouts

    from asyncflow.config import AlgoConfig
    from asyncflow.engines.torch_train import TorchTrainEngine
    from asyncflow.models.loading import load_model
    from asyncflow.workers.rollout import Rollout
    from asyncflow.workers.trainer import PolicyTrainer, assign_advantages

    def clip_fraction(split) -> float:
        rows = []
        for r in fixed_rollouts(load_model(tiny_llama_path).config.vocab_size):
            n = len(r["response"])
            versions = [0 if t < split(n) else 1 for t in range(n)]
            rows.append(Rollout(r["group"], r["k"], r["prompt"], r["response"], [-8.0] * n, "stop", min(versions), "",
                                reward=r["reward"], token_versions=versions))
        algo = AlgoConfig()
        assign_advantages([[r for r in rows if r.group_id == g] for g in range(GROUPS)], algo, MAX_NEW)
        trainer = PolicyTrainer(TorchTrainEngine(load_model(tiny_llama_path), lr=1e-4), algo, micro_batch_size=8,
                                temperature=1.0)
        trainer.accumulate(rows, policy_version=1)
        return trainer.finish_step()["clip_fraction"]

    stale, partial, fresh = clip_fraction(lambda n: n), clip_fraction(lambda n: n // 2), clip_fraction(lambda n: 0)
    assert fresh == 0.0 and stale > 0.2
    assert 0.25 * stale < partial < 0.75 * stale, (stale, partial)
