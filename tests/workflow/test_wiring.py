"""How a run is wired: one owner of run state, and each piece built only where the runtime places it.

- Only the step loop (`asyncflow.workflow.run`) changes `RunState`; workflows and runtimes never receive the run.
- Async on Ray builds exactly one inference engine per replica and none in the driver (an agent's rollouts start
  no HTTP server in the driver either: tests/workers/test_agent.py); `asyncflow eval` builds no training engine
  and no optimizer.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import asyncflow.runtime.inline as inline_runtime
import asyncflow.runtime.ray_runtime as ray_runtime
import asyncflow.workflow.pipeline as pipeline
from asyncflow.api import open_run, train
from asyncflow.cli import main
from asyncflow.config import build_config
from asyncflow.engines.torch_inference import make_torch_inference_engine
from asyncflow.runtime.base import Runtime, build_rollout_worker
from asyncflow.workers.rollout import RolloutWorker
from asyncflow.workflow import run as run_module
from asyncflow.workflow.evaluation import evaluation_spec
from asyncflow.workflow.run import RunState


def wiring_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path / 'run'}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.max_batch_size=8",
        "train.micro_batch_size=8", "train.steps=2", "eval.every=1", "data.test_size=4", "checkpoint.every=1",
        "runtime.call_timeout_s=120", "observe.tensorboard=false", *overrides,
    ])  # fmt: skip


# ---------------------------------------------------------------- one owner of run state
def test_workflows_and_runtimes_never_receive_the_run():
    receivers = [pipeline.PipelineWorkflow, inline_runtime.InlineRuntime, ray_runtime.RayRuntime, Runtime]
    for cls in receivers:
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            params = inspect.signature(fn).parameters
            assert "run" not in params, f"{cls.__name__}.{name} takes the run"
            assert not any("RLRun" in str(p.annotation) or "RunState" in str(p.annotation) for p in params.values())
    for module in (pipeline, inline_runtime, ray_runtime):
        source = Path(module.__file__).read_text()
        assert "RLRun" not in source and "RunState" not in source, f"{module.__name__} knows the run"


def test_a_run_is_built_by_the_api_only():
    """One way into a run: `asyncflow.api` (`open_run`, `train`) builds every `RLRun`, after claiming, planning
    and checking; no other module, test, benchmark or example calls its constructor (but the memory benchmark, for
    the checkouts from before `open_run` it also measures)."""
    root = Path(__file__).resolve().parents[2]
    needle = "RLRun" + "("
    callers = {str(path.relative_to(root)) for folder in ("src", "tests", "benchmarks", "examples")
               for path in (root / folder).rglob("*.py") if needle in path.read_text()}
    assert callers == {"src/asyncflow/api.py", "benchmarks/bench_driver_memory.py"}


class GuardedState(RunState):
    """A `RunState` that fails a write from anywhere but the step loop's module."""

    writers: set[str] = set()

    def __setattr__(self, name, value):
        writer = sys._getframe(1).f_globals.get("__name__")
        GuardedState.writers.add(writer)
        if writer not in (run_module.__name__, "dataclasses") and not writer.startswith("<"):
            raise AssertionError(f"{writer} changed RunState.{name}")
        super().__setattr__(name, value)


@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
@pytest.mark.slow
def test_only_the_step_loop_changes_run_state(tmp_path, monkeypatch, one_torch_thread, mode):
    monkeypatch.setattr(run_module, "RunState", GuardedState)
    config = wiring_config(tmp_path, f"workflow.mode={mode}", "runtime.kind=inline", "eval.every=0")
    with open_run(config) as run:
        assert isinstance(run.state, GuardedState)
        history = run.train()
    assert run.step == run.version == 2 and history[-1]["step"] == 2
    assert run_module.__name__ in GuardedState.writers


# ---------------------------------------------------------------- pieces built where they run
def counting_engine(*, count_file: str, **kwargs):
    """The torch engine, recording the pid of the process that built it."""
    with open(count_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    return make_torch_inference_engine(**kwargs)


def builders(count_file: Path) -> list[int]:
    return [int(line) for line in count_file.read_text().split()] if count_file.exists() else []


@pytest.mark.slow
def test_async_on_ray_builds_one_engine_per_replica_and_none_in_the_driver(tmp_path, ray_cluster, one_torch_thread):
    count_file = tmp_path / "engines.txt"
    config = wiring_config(
        tmp_path, "workflow.mode=async", "runtime.kind=ray", "rollout.replicas=2", "runtime.rollout_cpus=0.5",
        "rollout.engine=test_wiring:counting_engine", f"rollout.engine_options={{count_file: {count_file}}}",
        "eval.every=0", "data.test_size=0",
    )
    with open_run(config) as run:
        assert run.runtime.local_rollout is None
        assert builders(count_file) == [], "nothing is generated in the driver"
        run.train()
    pids = builders(count_file)
    assert len(pids) == 2 and len(set(pids)) == 2, f"one engine in each replica: {pids}"
    assert os.getpid() not in pids


@pytest.mark.slow
def test_evaluation_on_ray_builds_no_engine_in_the_driver(tmp_path, ray_cluster, one_torch_thread):
    count_file = tmp_path / "engines.txt"
    config = wiring_config(
        tmp_path, "workflow.mode=stream", "runtime.kind=ray", "runtime.rollout_cpus=0.5",
        "rollout.engine=test_wiring:counting_engine", f"rollout.engine_options={{count_file: {count_file}}}",
    )
    history = train(config).history
    assert [h["step"] for h in history if "eval/accuracy" in h] == [0, 1, 2]
    assert os.getpid() not in builders(count_file), "evaluation generates with the trainer's own policy module"


def test_evaluation_generates_with_the_trainers_policy_not_a_copy(tmp_path, ray_cluster, one_torch_thread):
    """Outside `sync`, evaluation borrows the trainer's module: the greedy tokens of an engine loaded with a copy
    of its weights, and the module trains on afterwards. (`async` runs on Ray: the session's cluster, not one of
    its own.)"""
    with open_run(wiring_config(tmp_path, "workflow.mode=async")) as run:
        policy = run.train_engine.policy_module()
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # weights no engine was loaded with
        assert "eval/accuracy" in run.evaluate()
        assert run.eval_worker.engine.model is policy and policy.training
        copy = build_rollout_worker(evaluation_spec(run.spec, run.eval_params), None)
        copy.engine.update_weights(run.train_engine.state_dict(), 1)
        prompts = [run.eval_encoder.encode(example, i) for i, example in enumerate(run.test_set)]

        def greedy(engine):
            rollouts = RolloutWorker(engine, run.eval_params, group_size=1).generate(prompts)
            return [(r.response_ids, r.rollout_logprobs) for r in rollouts]

        borrowed, copied = greedy(run.eval_worker.engine), greedy(copy.engine)
        assert [ids for ids, _ in borrowed] == [ids for ids, _ in copied]
        assert torch.allclose(torch.tensor(sum((lp for _, lp in borrowed), [])),
                              torch.tensor(sum((lp for _, lp in copied), [])), atol=1e-5)
        history = run.train()
        assert [h["step"] for h in history if "eval/accuracy" in h] == [0, 1, 2]


@pytest.mark.slow
def test_sync_evaluates_on_its_idle_rollout_engine(tmp_path, one_torch_thread):
    count_file = tmp_path / "engines.txt"
    config = wiring_config(tmp_path, "workflow.mode=sync", "rollout.engine=test_wiring:counting_engine",
                           f"rollout.engine_options={{count_file: {count_file}}}")
    history = train(config).history
    assert [h["step"] for h in history if "eval/accuracy" in h] == [0, 1, 2]
    assert builders(count_file) == [os.getpid()], "one engine: generation and evaluation share it"


@pytest.mark.slow
def test_eval_command_builds_no_trainer(tmp_path, one_torch_thread, monkeypatch, capsys):
    config_args = [f"run.output_dir={tmp_path / 'run'}", "run.progress=false", "model.path=preset:tiny-llama",
                   "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=1",
                   "eval.every=0", "data.test_size=4", "observe.tensorboard=false"]
    assert main(["train", *config_args]) == 0
    capsys.readouterr()
    built = []
    original = torch.optim.Optimizer.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", counting)
    assert main(["eval", *config_args, "--checkpoint", str(tmp_path / "run" / "checkpoints" / "step_1")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= result["eval/accuracy"] <= 1.0
    assert built == [], f"eval built optimizers: {built}"


@pytest.mark.slow
def test_ray_is_an_extra_named_when_missing(tmp_path, monkeypatch):
    from asyncflow.config import ConfigError
    from asyncflow.runtime.factory import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"workflow.mode=async with runtime.kind=auto.*asyncflow-rl\[ray\]"):
        require_ray(wiring_config(tmp_path, "workflow.mode=async"))
    result = train(wiring_config(tmp_path, "workflow.mode=sync", "train.steps=1", "eval.every=0", "data.test_size=0"))
    assert result.step == 1
