"""Short runs of the workflow with `rollout.engine=vllm` (marker `vllm`: `bash scripts/test_vllm.sh`): sync (weights
by the collective path, vLLM's greedy output checked against the trainer's), async k=1 (weights swapped into vLLM
by the rollout thread while the trainer trains; file path), multi-turn, and async k=1 on Ray (collective path inside
the rollout replica), each training every row of every step."""

import pytest

from asyncflow.api import open_run, train
from asyncflow.config import build_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]  # an engine start each, ~20 CPU-s
pytest.importorskip("vllm", reason="needs vLLM: bash scripts/test_vllm.sh")


def vllm_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "rollout.engine=vllm",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.max_batch_size=16",
        "train.micro_batch_size=16", "eval.every=0", "data.test_size=4", "checkpoint.every=0",
        "runtime.call_timeout_s=300", "rollout.vllm.executor=uni", *overrides,
    ])  # fmt: skip


def test_sync_inline(tmp_path):
    """Weights by the collective path; after each step's update vLLM's greedy output is the trainer's."""
    config = vllm_config(
        tmp_path, "train.steps=3", "workflow.mode=sync", "runtime.kind=inline",
        "rollout.vllm.weight_transfer=collective",
    )
    checked = []

    def check_engine(row):  # before train() closes the engine; compared where it holds the trainer's version
        engine = run.runtime.local_rollout.engine
        if "loss" in row and engine.weight_version == run.state.version:
            assert_greedy_equals_the_trainers(run, engine)
            checked.append(run.state.version)

    with open_run(config, on_step=check_engine) as run:
        assert type(run.runtime.local_rollout.engine).__name__ == "VLLMInferenceEngine"
        # one process fewer: the model runs in vLLM's engine core (vLLM's CPU platform alone would make it `mp`)
        assert run.runtime.local_rollout.engine._llm.vllm_config.parallel_config.distributed_executor_backend == "uni"
        history = run.train()
        rows = [h for h in history if "staleness/max" in h]
        assert [h["staleness/max"] for h in rows] == [0.0, 0.0, 0.0]
        assert all(h["rollout/samples"] == 16 for h in rows)
        engine = run.runtime.local_rollout.engine
        assert engine.weight_version == run.version == 3  # each new version reached vLLM
        assert engine.weight_transfer == "collective"
        assert checked, "vLLM never held the trainer's newest version when a step was logged"


def assert_greedy_equals_the_trainers(run, engine) -> None:
    """vLLM's greedy responses are those of the trainer's current weights (the built-in torch engine on them)."""
    import random

    from asyncflow.engines.base import GenerationRequest, SamplingParams
    from asyncflow.engines.torch_inference import TorchInferenceEngine
    from asyncflow.models.loading import load_model

    trainer_model = load_model(run.spec.model_path).eval()
    trainer_model.load_state_dict(run.train_engine.state_dict())
    rng = random.Random(0)
    requests = [GenerationRequest(i, [1] + [rng.randrange(3, 98) for _ in range(12)]) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    got = {c.request_id: c.response_ids for c in engine.generate(requests, params)}
    want = {c.request_id: c.response_ids for c in TorchInferenceEngine(trainer_model).generate(requests, params)}
    assert got == want


def test_async_k1(tmp_path):
    config = vllm_config(
        tmp_path, "train.steps=4", "workflow.mode=async", "workflow.max_staleness=1", "runtime.kind=inline"
    )
    with open_run(config) as run:
        history = run.train()
        # swapped in by the rollout thread: partition 3 needs >= 2
        assert run.runtime.local_rollout.engine.weight_version >= 2
    rows = [h for h in history if "staleness/max" in h]
    assert len(rows) == 4 and all(0 <= h["staleness/max"] <= 1 for h in rows)
    assert max(h["staleness/max"] for h in rows) == 1, "rollout never ran ahead of training"
    assert all(h["rollout/samples"] == 16 for h in rows)



def test_multiturn_sync(tmp_path):
    """Episodes through vLLM: every first turn gets an observation (appended as ids, not trained), then a second."""
    config = vllm_config(
        tmp_path, "train.steps=2", "workflow.mode=sync", "runtime.kind=inline", "model.path=preset:tiny-llama-tools",
        "data.task=tool_arithmetic", "env.name=test_multiturn_workflow:two_turn_env", "env.max_context_tokens=48",
        "rollout.stop_token_ids=[" + ",".join(map(str, range(3, 90))) + "]",  # short turns: both are reached
    )
    with open_run(config) as run:
        assert type(run.runtime.local_rollout.engine).__name__ == "VLLMInferenceEngine"
        history = run.train()
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["rollout/samples"] == 16 and h["env/tool_calls"] == 16
        assert h["train/tokens"] == h["env/sampled_tokens"] < h["rollout/tokens"], "observations are not trained"


def test_async_k1_on_ray_by_the_collective_path(tmp_path, ray_cluster):
    """A Ray rollout replica's vLLM engine takes each version by the collective path (the replica's process is
    rank 0): with max_staleness 1, the run reaches its last step only if new versions keep reaching vLLM."""
    config = vllm_config(
        tmp_path, "train.steps=4", "workflow.mode=async", "workflow.max_staleness=1", "runtime.kind=ray",
        "runtime.rollout_cpus=1", "rollout.vllm.weight_transfer=collective",
    )
    history = train(config).history
    rows = [h for h in history if "staleness/max" in h]
    assert len(rows) == 4 and all(0 <= h["staleness/max"] <= 1 for h in rows)
    assert all(h["rollout/samples"] == 16 for h in rows)
