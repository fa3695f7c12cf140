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
def test_ranks_launched_on_a_ray_they_started_shut_it_down_when_closed(tmp_path, no_ray_running, one_torch_thread):
    config = ray_config(tmp_path)
    launch = RayRuntime.rank_launcher(config)
    assert not ray.is_initialized(), "building the launcher starts nothing"
    spec = RankSpec(model_path=str(resolve_model_path("preset:tiny-llama", seed=0)), timeout_s=120)
    ranks = launch(1, spec, 120.0)
    assert ray.is_initialized()
    ranks.close()
    assert not ray.is_initialized(), "the Ray the run started outlived the run"


@pytest.mark.slow
def test_the_last_holder_shuts_down_the_ray_asyncflow_started(tmp_path, no_ray_running):
    from asyncflow.runtime.ray_runtime import hold_ray

    config = ray_config(tmp_path)
    release_ranks = hold_ray(config.runtime)  # the trainer's ranks
    release_runtime = hold_ray(config.runtime)  # the Ray runtime beside them
    release_ranks()
    release_ranks()  # idempotent: counts once
    assert ray.is_initialized(), "the runtime still holds it"
    release_runtime()
    assert not ray.is_initialized()


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
