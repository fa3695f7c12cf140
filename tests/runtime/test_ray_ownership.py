"""Ray started by a run is shut down by the run; a Ray the user started is left running. A trainer's ranks as Ray
actors (`RayRuntime.rank_launcher`) and the Ray runtime each hold Ray (`hold_ray`); the last to close shuts down
the Ray that asyncflow started, also when the run fails."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray  # each test starts (or joins) a local Ray cluster
ray = pytest.importorskip("ray")

from asyncflow.config import build_config  # noqa: E402
from asyncflow.engines.fsdp2_train import RankSpec  # noqa: E402
from asyncflow.models.loading import resolve_model_path  # noqa: E402
from asyncflow.runtime.ray_runtime import RayRuntime  # noqa: E402


def ray_config(tmp_path):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "model.path=preset:tiny-llama", "runtime.kind=ray", "runtime.num_cpus=2",
        "runtime.trainer_cpus=1", "train.engine=fsdp2", "train.world_size=1", "runtime.call_timeout_s=120",
    ])  # fmt: skip


@pytest.fixture
def no_ray_running():
    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process (another test's cluster)")
    yield
    if ray.is_initialized():  # the test failed: leave no cluster behind for the next
        ray.shutdown()


@pytest.mark.slow
def test_ranks_that_started_ray_shut_it_down_as_its_last_holder(tmp_path, no_ray_running, one_torch_thread):
    """The ranks start Ray; a second holder beside them (the Ray runtime, `hold_ray`) releasing twice counts once and
    leaves Ray running; the ranks' close, the last release, shuts it down (one Ray start for both facts)."""
    from asyncflow.runtime.ray_runtime import hold_ray

    config = ray_config(tmp_path)
    launch = RayRuntime.rank_launcher(config)
    assert not ray.is_initialized(), "building the launcher starts nothing"
    spec = RankSpec(model_path=str(resolve_model_path("preset:tiny-llama", seed=0)), timeout_s=120)
    ranks = launch(1, spec, 120.0)
    assert ray.is_initialized()
    release_runtime = hold_ray(config.runtime)  # the Ray runtime beside the ranks
    release_runtime()
    release_runtime()  # idempotent: counts once
    assert ray.is_initialized(), "the ranks still hold it"
    ranks.close()
    assert not ray.is_initialized(), "the Ray the run started outlived the run"


def test_a_failed_launch_shuts_down_the_ray_it_started(tmp_path, no_ray_running):
    launch = RayRuntime.rank_launcher(ray_config(tmp_path))
    with pytest.raises(Exception):  # noqa: B017, PT011 - RankSpec's model folder does not exist: the rank fails
        launch(1, RankSpec(model_path=str(tmp_path / "no-model"), timeout_s=60), 120.0)
    assert not ray.is_initialized(), "a failed launch left its Ray running"


def test_a_ray_the_user_started_is_never_shut_down(tmp_path, ray_cluster):
    from asyncflow.runtime.ray_runtime import hold_ray

    config = ray_config(tmp_path)
    release = hold_ray(config.runtime)
    release()
    assert ray.is_initialized(), "asyncflow shut down the user's Ray"
