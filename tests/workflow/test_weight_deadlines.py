"""A stall in any phase of the weight path ends the run within its deadline, with an error that names the side,
the version and the phase. Stalls are real sleeps in a phase hook (inline) or in an engine's update (Ray)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from asyncflow.api import train
from asyncflow.config import ConfigError, build_config
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.weights.deadlines import WeightDeadlineError, phase_hooks, within_deadline

DEADLINE_S = 2.0
STALL_S = 12.0


def config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.max_batch_size=4",
        "train.micro_batch_size=4", "eval.every=0", "data.test_size=4", "checkpoint.every=0", "train.steps=6",
        "runtime.call_timeout_s=120", "workflow.mode=async", f"weights.publish_timeout_s={DEADLINE_S}",
        f"weights.receive_timeout_s={DEADLINE_S}", f"weights.apply_timeout_s={DEADLINE_S}", *overrides,
    ])  # fmt: skip


def error_chain(err: BaseException) -> str:
    parts = []
    while err is not None:
        parts.append(str(err))
        err = err.__cause__
    return " | ".join(parts)


def test_within_deadline_names_side_version_and_phase():
    started = time.monotonic()
    with pytest.raises(WeightDeadlineError, match=r"replica r, version 7, apply phase.*weights.apply_timeout_s"):
        within_deadline(lambda: time.sleep(3), side="replica r", version=7, phase="apply", timeout_s=0.3)
    assert time.monotonic() - started < 2
    assert within_deadline(lambda: 5, side="s", version=1, phase="publish", timeout_s=5) == 5


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "side"), [("publish", "the trainer"), ("receive", "rollout replica rollout"),
                                             ("apply", "rollout replica rollout")])
def test_a_stalled_phase_ends_the_inline_run_within_its_deadline(tmp_path, phase, side, one_torch_thread):
    stalled_at: list[float] = []

    def stall(who: str, version: int) -> None:
        if version >= 2 and not stalled_at:
            stalled_at.append(time.monotonic())
            time.sleep(STALL_S)

    phase_hooks[phase].append(stall)
    try:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the phase's error is in the chain, checked below
            train(config(tmp_path, "runtime.kind=inline"))
    finally:
        phase_hooks[phase].remove(stall)
    ended = time.monotonic()
    message = error_chain(caught.value)
    assert stalled_at, f"the {phase} phase never reached version 2"
    assert f"{side}, version " in message and f"{phase} phase" in message, message
    assert ended - stalled_at[0] < DEADLINE_S + 8, "the run must end soon after the deadline, not after the stall"


class StallingEngine(TorchInferenceEngine):
    """The torch engine, stuck for a while in its update to version 2 (a reload that hangs)."""

    def update_weights(self, state_dict, version):
        if version == 2:
            time.sleep(STALL_S)
        super().update_weights(state_dict, version)


def make_stalling_engine(*, model_path, **kwargs):
    return StallingEngine.from_pretrained(model_path, **kwargs)


@pytest.mark.slow
def test_a_stalled_engine_reload_ends_the_ray_run_within_its_deadline(tmp_path, ray_cluster):
    started, threads_before = time.monotonic(), threading.active_count()
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the phase's error is in the chain, checked below
        train(config(tmp_path, "runtime.kind=ray", "runtime.max_restarts=0", "runtime.lend_idle_cores=false",
                     "rollout.engine=test_weight_deadlines:make_stalling_engine"))
    message = error_chain(caught.value)
    assert "rollout replica rollout_0, version 2, apply phase" in message, message
    assert time.monotonic() - started < 120
    assert threading.active_count() < threads_before + 50  # this run's threads, not the whole session's


class EngineStallingOnce(TorchInferenceEngine):
    """The torch engine, stuck in its update to version 2 the first time any incarnation of it gets there (`marker`
    is the file that tells them apart)."""

    marker: Path

    def update_weights(self, state_dict, version):
        if version == 2 and not self.marker.exists():
            self.marker.touch()
            time.sleep(STALL_S)
        super().update_weights(state_dict, version)


def make_engine_stalling_once(*, model_path, stall_marker, **kwargs):
    engine = EngineStallingOnce.from_pretrained(model_path, **kwargs)
    engine.marker = Path(stall_marker)
    return engine


@pytest.mark.slow
def test_a_replica_that_missed_its_apply_deadline_is_restarted_when_configured(tmp_path, ray_cluster):
    marker = tmp_path / "stalled_once"
    result = train(config(
        tmp_path / "run", "runtime.kind=ray", "runtime.max_restarts=1", "runtime.lend_idle_cores=false",
        "weights.on_apply_deadline=restart", "weights.publish_timeout_s=120", "weights.receive_timeout_s=120",
        "rollout.engine=test_weight_deadlines:make_engine_stalling_once",
        f"rollout.engine_options={{stall_marker: '{marker}'}}",
    ))
    assert marker.exists(), "the first incarnation stalled in its update to version 2"
    steps = [row["step"] for row in result.history if "staleness/max" in row]
    assert steps == list(range(1, 7)), "the restarted replica generated every step's rows"
    restarts = [e for e in json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
                if e.get("name") == "restart"]
    assert len(restarts) == 1, restarts


def test_restarting_a_replica_on_a_missed_deadline_needs_ray(tmp_path):
    with pytest.raises(ConfigError, match="on_apply_deadline: restart needs runtime.kind: ray"):
        config(tmp_path, "runtime.kind=inline", "weights.on_apply_deadline=restart")
