"""User stages over the TransferQueue: rows streamed to a user function, its columns written back by index and
added to the reward the trainer sees, in every workflow, inline and on Ray, and on the timeline."""

from __future__ import annotations

import pytest
import torch

from asyncflow.api import open_run, train
from asyncflow.config import ConfigError, build_config
from asyncflow.transfer import TransferQueue
from asyncflow.workers.stage import StageBatch, StageError, StageWorker


def bonus(batch: StageBatch) -> dict[str, list[float]]:
    """One point per row, whatever it holds."""
    return {"bonus": [1.0] * len(batch)}


def length_and_answer(batch: StageBatch) -> dict[str, list[float]]:
    return {"length": [float(len(ids)) for ids in batch.columns["response_ids"]],
            "has_answer": [float(bool(m["answer"])) for m in batch.metadata]}


def stage_config(tmp_path, *overrides: str):
    return build_config({"stages": [{"name": "bonus_stage", "fn": "test_stages:bonus", "inputs": ["response_ids"],
                                     "outputs": ["bonus"], "batch_size": 4}]}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.max_batch_size=8",
        "train.micro_batch_size=8", "train.steps=2", "eval.every=0", "data.test_size=0", "checkpoint.every=0",
        "runtime.call_timeout_s=120", "observe.tensorboard=false", "export.at_end=false", *overrides,
    ])  # fmt: skip


def fed_queue(tasks, rows: int = 4) -> TransferQueue:
    queue = TransferQueue.local(tasks=tasks, timeout=10)
    queue.create_partition("step_0", num_rows=rows, group_size=rows)
    indices = queue.append("step_0", {"prompt_ids": [torch.tensor([1, 2])] * rows}, group_ids=[0] * rows,
                           metadata=[{"answer": "7", "sample_index": k} for k in range(rows)])
    queue.write("step_0", indices, {"response_ids": [torch.arange(k + 1) for k in range(rows)]})
    return queue


def test_stage_writes_its_columns_by_row():
    queue = fed_queue(["stage", "train"])
    worker = StageWorker("stage", length_and_answer, ["response_ids"], ["length", "has_answer"], batch_size=3)
    assert worker.run_partition(queue, "step_0", timeout=10) == 4
    [batch] = list(queue.loader("step_0", "train", ["response_ids", "length", "has_answer"], 4, timeout=10))
    lengths = [len(ids) for ids in batch.rows("response_ids")]
    assert batch.data["length"].tolist() == [float(n) for n in lengths]
    assert batch.data["has_answer"].tolist() == [1.0] * 4


@pytest.mark.parametrize(("fn", "message"), [
    (lambda b: [1.0] * len(b), "must return a dict of its outputs"),
    (lambda b: {"x": [1.0]}, "column 'x' has 1 values for 4 rows"),
    (lambda b: {"x": [float("nan")] * len(b)}, "not a finite number"),
])  # fmt: skip
def test_a_stage_breaking_its_contract_is_named(fn, message):
    queue = fed_queue(["stage", "train"])
    with pytest.raises(StageError, match=message):
        StageWorker("stage", fn, ["response_ids"], ["x"], batch_size=4).run_partition(queue, "step_0", timeout=10)


def test_stage_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="reward.columns: 'nope' is written by no stage"):
        stage_config(tmp_path, "reward.columns={nope: 1.0}")
    with pytest.raises(ValueError, match=r"stages\[0\].fn 'test_stages:missing'"):
        train(build_config({"stages": [{"name": "s", "fn": "test_stages:missing", "outputs": ["x"]}]},
                           [f"run.output_dir={tmp_path}", "data.test_size=0"]))


@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
@pytest.mark.slow
def test_stage_column_reaches_the_trainer_inline(tmp_path, one_torch_thread, mode):
    plain = train(stage_config(tmp_path / "plain", f"workflow.mode={mode}", "runtime.kind=inline")).history
    with open_run(stage_config(tmp_path / "staged", f"workflow.mode={mode}", "runtime.kind=inline",
                               "reward.columns={bonus: 1.0}")) as run:
        staged = run.train()
    for a, b in zip(plain[1:], staged[1:]):  # same seed, same samples: the reward is one point higher
        assert b["reward/mean"] == pytest.approx(a["reward/mean"] + 1.0)
    spans = [e for e in run.timeline.events if e["worker"] == "bonus_stage" and e["name"] == "stage"]
    assert sum(e["args"]["rows"] for e in spans) == 2 * 16, "every row of both steps went through the stage"


@pytest.mark.slow
def test_stage_runs_beside_ray_replicas(tmp_path, ray_cluster, one_torch_thread):
    with open_run(stage_config(tmp_path, "workflow.mode=async", "runtime.kind=ray", "runtime.rollout_cpus=0.5",
                               "reward.columns={bonus: 1.0}")) as run:
        history = run.train()
    assert all(1.0 <= h["reward/mean"] <= 2.0 for h in history[1:])
    assert any(e["worker"] == "bonus_stage" for e in run.timeline.events)
