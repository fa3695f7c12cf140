"""Short runs of the workflow with `rollout.engine=vllm` (marker `vllm`: `bash scripts/test_vllm.sh`): sync inline,
and async k=1 on Ray with the vLLM engine inside the rollout replica, each training every row of every step."""

import pytest

from asyncflow.config import build_config
from asyncflow.workflow.pipeline import make_workflow
from asyncflow.workflow.run import RLRun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="needs vLLM: bash scripts/test_vllm.sh")


def vllm_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "rollout.engine=vllm",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.max_batch_size=16",
        "train.micro_batch_size=16", "eval.every=0", "data.test_size=4", "checkpoint.every=0",
        "runtime.call_timeout_s=300", *overrides,
    ])  # fmt: skip


def test_sync_inline(tmp_path):
    config = vllm_config(tmp_path, "train.steps=3", "workflow.mode=sync", "runtime.kind=inline")
    run = RLRun(config)
    try:
        assert type(run.inference_engine).__name__ == "VLLMInferenceEngine"
        history = run.train(make_workflow(config, run))
        rows = [h for h in history if "staleness/max" in h]
        assert [h["staleness/max"] for h in rows] == [0.0, 0.0, 0.0]
        assert all(h["rollout/samples"] == 16 for h in rows)
        assert run.inference_engine.weight_version == run.version == 3  # each new version reached vLLM
    finally:
        run.inference_engine.shutdown()


def test_async_k1_on_ray(tmp_path, ray_cluster):
    config = vllm_config(
        tmp_path, "train.steps=4", "workflow.mode=async", "workflow.max_staleness=1", "runtime.kind=ray",
    )
    run = RLRun(config)
    try:
        history = run.train(make_workflow(config, run))
    finally:
        run.inference_engine.shutdown()  # the driver's copy (unused in async); the replica's engine dies with it
    rows = [h for h in history if "staleness/max" in h]
    assert len(rows) == 4 and all(0 <= h["staleness/max"] <= 1 for h in rows)
    assert max(h["staleness/max"] for h in rows) == 1, "rollout never ran ahead of training"
    assert all(h["rollout/samples"] == 16 for h in rows)
