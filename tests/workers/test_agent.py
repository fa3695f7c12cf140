"""Training an agent written against the `openai` client: the rows hold the ids the server recorded for the
agent's calls (prompt = first call's prompt, later context with loss mask 0, sampled ids with mask 1), the reward
is the agent's number or its answer scored by the task, a failing agent scores 0, and `asyncflow train` trains it."""

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from asyncflow.api import open_run  # noqa: E402
from asyncflow.cli import main  # noqa: E402
from asyncflow.config import build_config  # noqa: E402
from asyncflow.runtime.factory import runtime_kind  # noqa: E402
from asyncflow.serving.episodes import CallRecord, episode_row  # noqa: E402
from asyncflow.transfer import TransferQueue  # noqa: E402
from asyncflow.workers.rollout import rollouts_from_batch  # noqa: E402
from asyncflow.workflow.checkpoint import load_weights  # noqa: E402
from asyncflow.workflow.pipeline import feed_prompts  # noqa: E402
from asyncflow.workflow.serve import load_served  # noqa: E402

SEEN: dict[str, list] = {}  # episode id -> the choices the agent got back
_lock = threading.Lock()


def two_call_agent(client, row):
    """Asks once, appends '=' to what it got and asks again; sample 1 returns a number, sample 2 fails."""
    first = client.completions.create(model=row.model, prompt=row.prompt, max_tokens=3, temperature=0.3).choices[0]
    second = client.completions.create(model=row.model, prompt=row.prompt + first.text + "=", max_tokens=3)
    with _lock:
        SEEN[row.episode_id] = [first, second.choices[0]]
    if row.metadata["sample_index"] == 1:
        return 0.5
    if row.metadata["sample_index"] == 2:
        raise RuntimeError("agent bug")
    return second.choices[0].text


def test_episode_row_ends_at_a_call_that_rewrites_history():
    calls = [CallRecord([1, 2], [3, 4], [-0.1, -0.2], 5, "length"),
             CallRecord([1, 2, 3, 4, 9], [6], [-0.3], 5, "stop"),
             CallRecord([1, 7], [8], [-0.4], 5, "stop")]
    row = episode_row(calls)
    assert row.prompt_ids == [1, 2] and row.response_ids == [3, 4, 9, 6]
    assert row.loss_mask == [1, 1, 0, 1] and row.logprobs == [-0.1, -0.2, 0.0, -0.3]
    assert (row.calls, row.dropped_calls, row.finish_reason, row.weight_version) == (2, 1, "stop", 5)
    assert episode_row([]) is None


def agent_config(tmp_path, *overrides):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.max_batch_size=8",
        "train.micro_batch_size=8", "eval.every=0", "data.test_size=4", "checkpoint.every=0",
        "runtime.call_timeout_s=60", "agent.fn=test_agent:two_call_agent", *overrides,
    ])  # fmt: skip


def test_agent_rows_hold_the_recorded_ids_masks_and_rewards(tmp_path, one_torch_thread):
    config = agent_config(tmp_path)
    queue = TransferQueue.local(num_storage_units=1, tasks=["rollout", "train"], timeout=60)
    with open_run(config) as run:
        feed_prompts(queue, 0, run.prompts.next_prompts(2), 4)
        assert run.runtime.local_rollout.run_partition(queue, "step_0", batch_size=8, timeout=60) == 8
        columns = ["prompt_ids", "response_ids", "rollout_logprobs", "reward", "loss_mask", "trained_prompt_ids"]
        [batch] = list(queue.loader("step_0", "train", columns, 8, timeout=60))
    rows = rollouts_from_batch(batch)
    by_episode = {}
    for index in batch.meta.indices:
        [episode] = [e for e in SEEN if e.startswith(f"step_0-{index}-")]
        by_episode[index] = SEEN[episode]
    for index, row in zip(batch.meta.indices, rows):
        first, second = by_episode[index]
        added = second.prompt_token_ids[len(first.prompt_token_ids) + len(first.token_ids):]
        assert row.prompt_ids == first.prompt_token_ids  # the agent's own first prompt, not the task's rendering
        assert row.response_ids == first.token_ids + added + second.token_ids
        assert row.loss_mask == [1] * len(first.token_ids) + [0] * len(added) + [1] * len(second.token_ids)
        assert row.rollout_logprobs == pytest.approx(first.token_logprobs + [0.0] * len(added) + second.token_logprobs)
        assert row.metadata["agent_calls"] == 2 and row.weight_version == 0
        expected = {1: 0.5, 2: 0.0}.get(row.sample_index)
        if expected is not None:
            assert row.reward == expected
        assert (row.metadata["agent_error"] is not None) == (row.sample_index == 2)
    assert len(added) == 1  # '=' appended as its own id after the sampled ones (the sampled ids were reused)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_asyncflow_train_trains_an_openai_client_agent(tmp_path, capsys, one_torch_thread, mode):
    code = main(["train", f"--output={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
                 f"workflow.mode={mode}", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                 "rollout.max_new_tokens=4", "train.micro_batch_size=8", "eval.every=0", "data.test_size=4",
                 "checkpoint.every=0",
                 "agent.fn=test_agent:two_call_agent", "--threads=1"])
    assert code == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "loss" in s]
    assert len(trained) == 2
    for s in trained:
        assert s["agent/calls_mean"] == 2.0 and s["agent/errors"] == 2.0 and s["agent/trained_tokens"] > 0
        assert torch.isfinite(torch.tensor(s["loss"])) and s["grad_norm"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    served = load_served(str(tmp_path))  # `asyncflow serve RUN_DIR`: the newest checkpoint, its weight version
    assert served.name == f"{tmp_path.name}/step_2" and served.weight_version == 2
    trained = load_weights(tmp_path / "checkpoints" / "step_2")
    assert all(torch.equal(served.model.state_dict()[k], v) for k, v in trained.items())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stream", "async"])
def test_an_agent_trains_on_ray_replicas(tmp_path, monkeypatch, mode, ray_cluster, one_torch_thread):
    """The agent runs inside the rollout actor (its server on 127.0.0.1 there; none in the driver), given as a file
    path relative to the driver's working directory (the actor's differs)."""
    from asyncflow.serving import server

    started, start = [], server.ServerThread.start
    monkeypatch.setattr(server.ServerThread, "start", lambda self: started.append(self) or start(self))
    monkeypatch.chdir(Path(__file__).parent)
    out = tmp_path / "run"
    assert main(["train", f"--output={out}", "run.progress=false", "model.path=preset:tiny-llama",
                 f"workflow.mode={mode}", "runtime.kind=ray", "runtime.rollout_cpus=0.5", "train.steps=2",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
                 "train.micro_batch_size=8", "eval.every=0", "data.test_size=4", "checkpoint.every=0",
                 "runtime.call_timeout_s=60", "agent.fn=test_agent.py:two_call_agent", "--threads=1"]) == 0
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["agent/calls_mean"] == 2.0 and r["agent/errors"] == 2.0 and r["agent/trained_tokens"] > 0
        assert r["staleness/max"] <= (1 if mode == "async" else 0) and r["grad_norm"] > 0
        assert r["rollout/samples"] == 8
    assert started == [], "the agent's server runs in the replica only"


def test_an_agent_run_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(Exception, match="on_weight_update=resume"):
        agent_config(tmp_path, "workflow.mode=async", "rollout.on_weight_update=resume")
    assert runtime_kind(agent_config(tmp_path, "workflow.mode=async")) == "inline"  # `auto` stays inline for agents
    out = tmp_path / "run"
    assert main(["train", f"--output={out}", "model.path=preset:tiny-llama", "agent.fn=no_such_module:f"]) == 1
    assert not out.exists()  # refused before the run folder is written


@pytest.mark.slow
def test_async_agent_run_checkpoints_its_rows_ahead_and_resumes_them(tmp_path, one_torch_thread):
    """async k=1: the checkpoint after step 2 holds step 3's agent rows (their own prompt ids, loss masks, calls);
    resumed from it, step 3 trains exactly those rows (same prompts, rewards, loss) and step 4 follows."""
    args = ["train", f"--output={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "train.steps=4",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
            "train.micro_batch_size=8", "eval.every=0", "data.test_size=4", "checkpoint.every=1", "checkpoint.keep=4",
            "workflow.mode=async", "workflow.max_staleness=1", "runtime.lend_idle_cores=false",
            "agent.fn=test_agent:two_call_agent", "--threads=1"]  # fmt: skip
    assert main(args) == 0
    first = {s["step"]: s for s in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    state = json.loads((tmp_path / "checkpoints" / "step_2" / "state.json").read_text())
    ahead = {rows["step"]: rows for rows in state["workflow"]["rollouts_ahead"]}  # partitions count from 0
    assert 2 in ahead and set(ahead[2]["columns"]) == {"loss_mask", "trained_prompt_ids"}
    assert all(m["agent_calls"] == 2 for m in ahead[2]["metadata"])
    for step in (3, 4):
        shutil.rmtree(tmp_path / "checkpoints" / f"step_{step}")
    assert main([*args, "--resume"]) == 0
    second = {s["step"]: s for s in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(second) == sorted(first)
    keys = ("data/group_id_min", "data/group_id_max", "reward/mean", "agent/calls_mean", "agent/errors",
            "agent/trained_tokens", "staleness/max", "loss")
    assert {k: second[3][k] for k in keys} == {k: first[3][k] for k in keys}  # the replayed rows, trained again
    assert (second[4]["data/group_id_min"], second[4]["agent/calls_mean"]) == (first[4]["data/group_id_min"], 2.0)
