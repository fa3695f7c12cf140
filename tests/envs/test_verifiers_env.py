"""verifiers environments (`env.name: verifiers:MODULE_OR_ID`), defined here through the library's own API and run
with the tiny preset model: the dataset becomes the training prompts, every model call of an episode goes through
the run's server, the rows train on the ids it sampled (a multi-turn row holds the environment's turns with loss
mask 0, earlier turns not re-tokenised), the reward is the rubric's, and a missing extra is a one-line error."""

import json
import sys
from pathlib import Path

import pytest
import torch

vf = pytest.importorskip("verifiers")
pytest.importorskip("fastapi")
from datasets import Dataset  # noqa: E402

from asyncflow.api import open_run  # noqa: E402
from asyncflow.cli import main  # noqa: E402
from asyncflow.config import ConfigError, build_config  # noqa: E402
from asyncflow.envs.base import EnvironmentSpecError  # noqa: E402
from asyncflow.envs.verifiers_env import load_verifiers_env, render_messages  # noqa: E402
from asyncflow.transfer import TransferQueue  # noqa: E402
from asyncflow.workers.rollout import rollouts_from_batch  # noqa: E402
from asyncflow.workflow.pipeline import feed_prompts  # noqa: E402
from asyncflow.workflow.setup import preflight  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
TURNS = 3
QUESTIONS = [("2+3", "5"), ("7+1", "8"), ("4+4", "8"), ("9+0", "9")]


# ---------------------------------------------------------------- the environments, through verifiers' own API
def reply_length(completion, parser, **kwargs) -> float:
    """Single-turn reward: the reply's length / 10 (varies with the sample, so the check below means something)."""
    return len(parser.parse_answer(completion) or "") / 10


def model_turns(completion, parser, **kwargs) -> float:
    """Multi-turn reward: the model turns the environment saw."""
    return float(len(parser.get_assistant_messages(completion)))


class CountingEnv(vf.MultiTurnEnv):
    """Answers each model turn with a message that depends on the reply, for `TURNS` model turns."""

    async def env_response(self, messages, state, **kwargs):
        reply = messages[-1].content or ""
        return [vf.UserMessage(content=f"you said {len(reply)} chars, turn {len(state['trajectory'])}")]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct_answer(completion, answer, parser, **kwargs) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def load_environment(kind: str = "single"):
    dataset = Dataset.from_list([{"question": q, "answer": a} for q, a in QUESTIONS])
    parser = vf.Parser()
    if kind == "tool":  # OpenAI function calling: the tools reach the server as the request's `tools`
        return vf.ToolEnv(dataset=dataset, tools=[add], max_turns=2, parser=parser,
                          rubric=vf.Rubric(funcs=[correct_answer], parser=parser))
    if kind == "single":
        return vf.SingleTurnEnv(dataset=dataset, system_prompt="add", parser=parser,
                                rubric=vf.Rubric(funcs=[reply_length], parser=parser))
    return CountingEnv(dataset=dataset, parser=parser, rubric=vf.Rubric(funcs=[model_turns], parser=parser),
                       max_turns=TURNS)


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def verifiers_config(tmp_path, template_file, kind, *overrides):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.max_batch_size=8",
        "train.micro_batch_size=8", "eval.every=0", "checkpoint.every=0", "runtime.call_timeout_s=60",
        "env.name=verifiers:test_verifiers_env", f"env.options={{kind: {kind}}}",
        f"agent.chat_template={template_file}", *overrides,
    ])  # fmt: skip


def run_one_partition(config, monkeypatch):
    """One partition of 8 episodes through the run's agent worker: (rows, recorded calls by row index)."""
    with open_run(config) as run:
        worker = run.runtime.local_rollout
        calls = {}
        close = worker.recorder.close

        def keep(episode_id):  # what the server recorded for each episode, as the worker reads it
            recorded = close(episode_id)
            calls[int(episode_id.split("-")[1])] = recorded
            return recorded

        monkeypatch.setattr(worker.recorder, "close", keep)
        queue = TransferQueue.local(num_storage_units=1, tasks=["rollout", "train"], timeout=60)
        feed_prompts(queue, 0, run.prompts.next_prompts(2), 4)
        assert worker.run_partition(queue, "step_0", batch_size=8, timeout=60) == 8
        columns = ["prompt_ids", "response_ids", "rollout_logprobs", "reward", "loss_mask", "trained_prompt_ids"]
        [batch] = list(queue.loader("step_0", "train", columns, 8, timeout=60))
        tokenizer = run.tokenizer
    rows = rollouts_from_batch(batch)
    return rows, {index: calls[index] for index in batch.meta.indices}, tokenizer


def segments(row):
    """The row's response as (loss mask, ids) runs."""
    runs = []
    for token, mask in zip(row.response_ids, row.loss_mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


# ---------------------------------------------------------------- tests
def test_single_turn_rows_train_the_sampled_ids_and_the_rubric_reward(tmp_path, template_file, monkeypatch,
                                                                      one_torch_thread):
    config = verifiers_config(tmp_path, template_file, "single")
    rows, calls, tokenizer = run_one_partition(config, monkeypatch)
    env = load_verifiers_env("verifiers:test_verifiers_env", {"kind": "single"})
    for recorded, row in zip(calls.values(), rows):
        [call] = recorded  # one model call per episode
        question = env.get_dataset()[row.metadata["verifiers_index"]]
        messages = [{"role": "system", "content": "add"}, {"role": "user", "content": question["question"]}]
        assert row.prompt_ids == call.prompt_ids == render_messages(tokenizer, json.dumps(messages), TEMPLATE)
        assert row.response_ids == call.response_ids and row.loss_mask == [1] * len(call.response_ids)
        assert row.rollout_logprobs == pytest.approx(call.logprobs)
        reply = tokenizer.decode(call.response_ids, skip_special_tokens=True)
        assert row.reward == pytest.approx(len(reply) / 10)  # the rubric's own score of the reply
        assert row.metadata["agent_scores"]["reply_length"] == pytest.approx(len(reply) / 10)
        assert row.metadata["answer"] == question["answer"] and row.metadata["agent_error"] is None
    assert len({r.reward for r in rows}) > 1


@pytest.mark.slow
def test_multi_turn_rows_hold_the_envs_turns_with_loss_mask_0(tmp_path, template_file, monkeypatch,
                                                              one_torch_thread):
    config = verifiers_config(tmp_path, template_file, "multi")
    rows, calls, tokenizer = run_one_partition(config, monkeypatch)
    multi = 0
    for recorded, row in zip(calls.values(), rows):
        assert 1 <= len(recorded) <= TURNS
        kept = recorded[: row.metadata["agent_calls"]]
        # later calls continue from the ids sampled before, never a re-tokenisation of them; a call whose
        # context does not (a reply the library's text no longer matches, e.g. one holding a special token) ends
        # the trained row, and it and later calls are counted as dropped
        continued = 1
        for before, after in zip(recorded, recorded[1:]):
            context = before.prompt_ids + before.response_ids
            if after.prompt_ids[: len(context)] != context:
                break
            continued += 1
        assert row.metadata["agent_calls"] == continued
        assert row.metadata["agent_dropped_calls"] == len(recorded) - continued
        sampled = [ids for mask, ids in segments(row) if mask == 1]
        added = [ids for mask, ids in segments(row) if mask == 0]
        assert row.prompt_ids == recorded[0].prompt_ids
        assert [i for ids in sampled for i in ids] == [i for call in kept for i in call.response_ids]
        trained_logprobs = [lp for lp, m in zip(row.rollout_logprobs, row.loss_mask) if m]
        assert trained_logprobs == pytest.approx([lp for call in kept for lp in call.logprobs])
        assert all(lp == 0.0 for lp, m in zip(row.rollout_logprobs, row.loss_mask) if not m)
        for call, after in zip(kept, kept[1:]):  # the environment's message, with the template's pieces
            new = after.prompt_ids[len(call.prompt_ids) + len(call.response_ids):]
            assert new in added
            assert "user: you said " in tokenizer.decode(new)
        multi += len(kept) > 1
        last_reply = tokenizer.decode(recorded[-1].response_ids, skip_special_tokens=True)
        turns = len(recorded) - (last_reply == "")  # an empty reply ends the rollout unseen by the rubric
        assert row.reward == turns and row.metadata["agent_scores"]["model_turns"] == turns
        assert row.metadata["agent_scores"]["num_turns"] == turns  # the library's own monitor metric
    assert multi >= 4  # most episodes ran several turns


@pytest.mark.slow
def test_asyncflow_train_trains_a_verifiers_environment(tmp_path, template_file, capsys, one_torch_thread):
    code = main(["train", f"--output={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
                 "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                 "train.micro_batch_size=8", "eval.every=0", "checkpoint.every=0",
                 "env.name=verifiers:test_verifiers_env", "env.options={kind: multi}",
                 f"agent.chat_template={template_file}", "--threads=1"])
    assert code == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "loss" in s]
    assert len(trained) == 2
    for s in trained:
        assert s["agent/calls_mean"] > 1 and s["agent/trained_tokens"] > 0 and s["agent/errors"] == 0
        assert s["agent/scores/model_turns"] >= 1 and torch.isfinite(torch.tensor(s["loss"]))


@pytest.mark.slow
def test_a_tool_env_sends_its_tools_through_the_chat_template_and_trains(tmp_path, monkeypatch, one_torch_thread):
    """verifiers' `ToolEnv` on a model whose chat template renders `tools` (the Qwen2.5 shape with its ChatML
    template): the episodes' prompts hold the tool's signature as the template renders it, and 3 steps train."""
    qwen = ["model.path=preset:qwen2.5-tiny", "agent.chat_template=null", "env.options={kind: tool}"]
    config = verifiers_config(tmp_path / "one", None, "tool", *qwen)
    rows, calls, tokenizer = run_one_partition(config, monkeypatch)
    for row in rows:
        prompt = tokenizer.decode(row.prompt_ids)
        assert "<tools>" in prompt and '"name": "add"' in prompt and "The first integer." in prompt
        assert row.metadata["agent_error"] is None
    code = main(["train", f"--output={tmp_path / 'train'}", "run.progress=false", *qwen, "train.steps=3",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "train.micro_batch_size=8", "eval.every=0", "checkpoint.every=0", "export.at_end=false",
                 "env.name=verifiers:test_verifiers_env", "--threads=1"])
    assert code == 0
    trained = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in trained if "loss" in s]
    assert len(trained) == 3 and all(s["agent/errors"] == 0 and s["agent/trained_tokens"] > 0 for s in trained)
    assert all(s["rollout/retokenize_drift_tokens"] == 0 for s in trained if "rollout/retokenize_drift_tokens" in s)


def test_config_and_preflight_errors(tmp_path, template_file, monkeypatch):
    with pytest.raises(ConfigError, match="leave data.task unset"):
        verifiers_config(tmp_path, template_file, "single", "data.task=countdown")
    with pytest.raises(ConfigError, match="leave agent.fn unset"):
        verifiers_config(tmp_path, template_file, "single", "agent.fn=x:y")
    with pytest.raises(ConfigError, match="env.options are the load_environment arguments"):
        build_config({}, ["env.options={a: 1}"])
    with pytest.raises(EnvironmentSpecError, match="unexpected keyword argument"):
        preflight(verifiers_config(tmp_path, template_file, "single", "env.options={nope: 1}"))
    with pytest.raises(ValueError, match="no chat template: give one with agent.chat_template"):
        preflight(verifiers_config(tmp_path, template_file, "single", "agent.chat_template=null"))
    assert len(preflight(verifiers_config(tmp_path, template_file, "single")).train_set.examples) == len(QUESTIONS)

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if the extra were not installed
    with pytest.raises(EnvironmentSpecError) as err:
        preflight(verifiers_config(tmp_path, template_file, "single", "env.options={kind: other}"))
    assert str(err.value) == ("env.name verifiers:test_verifiers_env needs verifiers: "
                              "pip install 'asyncflow-rl[verifiers]'")


@pytest.mark.slow
def test_a_verifiers_environment_trains_on_a_ray_replica(tmp_path, monkeypatch, template_file, ray_cluster,
                                                         one_torch_thread):
    """The environment is loaded and its rollouts run inside the rollout actor (given as a file path relative to
    the driver's working directory; the actor's differs)."""
    monkeypatch.chdir(Path(__file__).parent)
    out = tmp_path / "run"
    assert main(["train", f"--output={out}", "run.progress=false", "model.path=preset:tiny-llama",
                 "workflow.mode=stream", "runtime.kind=ray", "runtime.rollout_cpus=0.5", "train.steps=2",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                 "train.micro_batch_size=8", "eval.every=0", "checkpoint.every=0", "runtime.call_timeout_s=60",
                 "env.name=verifiers:test_verifiers_env.py", "env.options={kind: multi}",
                 f"agent.chat_template={template_file}", "--threads=1"]) == 0
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["agent/calls_mean"] > 1 and r["agent/errors"] == 0 and r["agent/scores/model_turns"] >= 1


def test_an_agents_reward_with_scores_is_checked():
    from asyncflow.workers.agent import _scored

    assert _scored({"reward": 0.5, "scores": {"a": 1, "b": 0.25}}) == (0.5, {"a": 1.0, "b": 0.25})
    assert _scored({"reward": 1.0}) == (1.0, {})
    for bad in ({"reward": 1.0, "extra": 2}, {"reward": 1.0, "scores": {"a": float("nan")}},
                {"reward": 1.0, "scores": {"a": True}}, {"reward": 1.0, "scores": [1.0]}):
        assert _scored(bad)[1] is None
