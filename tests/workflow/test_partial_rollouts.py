"""Partial rollouts (`rollout.on_weight_update: resume`) in the async workflow, inline and on Ray.

Generation is slowed down (a pause per decode step) so that the trainer publishes new weights while a
partition is still generating: the samples in flight then go on under the new version. The trainer checks
every row against the staleness bound by its oldest token (and raises `StalenessError` otherwise); the test
checks that rows spanning versions were trained, and that every step trained exactly its own rows.
"""

from __future__ import annotations

import math
import time

import pytest

from asyncflow.config import ConfigError, build_config
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.workflow.pipeline import make_workflow
from asyncflow.workflow.run import RLRun

STEPS, PER_STEP = 4, 16
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # two torch users (rollout, trainer) share 2 cores


class SlowDecodeEngine(TorchInferenceEngine):
    """The torch engine with a pause before each decode step, so generation outlasts a training step."""

    def _decode(self, cache, slots, params):
        time.sleep(0.01)
        super()._decode(cache, slots, params)


def make_slow_engine(*, model, **kwargs):
    return SlowDecodeEngine(model, **kwargs)


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
def test_async_partial_rollouts_inline(tmp_path):
    config = partial_config(tmp_path, "runtime.kind=inline")
    run = RLRun(config)
    history = run.train(make_workflow(config, run))
    check_partial_run(history, run)
    handed = [e for e in run.timeline.events if e["name"] == "weights_in_flight"]
    assert handed, "the watcher handed versions to the engine while partitions generated"


@pytest.mark.slow
def test_async_partial_rollouts_on_ray(tmp_path, ray_cluster):
    config = partial_config(tmp_path, "runtime.kind=ray", "runtime.rollout_cpus=0.5")
    run = RLRun(config)
    history = run.train(make_workflow(config, run))
    check_partial_run(history, run)


def test_resume_needs_an_engine_that_updates_in_flight(tmp_path):
    class FinishOnly(TorchInferenceEngine):
        updates_in_flight = False

    from asyncflow.engines.base import register_inference_engine

    register_inference_engine("test_finish_only")(lambda *, model, **kw: FinishOnly(model, **kw))
    with pytest.raises(ValueError, match="on_weight_update=resume needs an inference engine.*FinishOnly does not"):
        RLRun(partial_config(tmp_path, "rollout.engine=test_finish_only", "runtime.kind=inline"))
    with pytest.raises(ConfigError, match="rollout.on_weight_update"):
        build_config({}, ["rollout.on_weight_update=abort"])
