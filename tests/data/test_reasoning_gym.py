"""reasoning-gym's datasets as tasks (`data.task: reasoning_gym:NAME`), with the real library: its config keys
passed through, seeded splits that never share a prompt, its own `score_answer` as the reward, one training
step, and the one-line error naming the extra when the library is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

import asyncflow  # noqa: E402
from asyncflow.data import DatasetError  # noqa: E402
from asyncflow.data.reasoning_gym import ReasoningGymScore, _dataset  # noqa: E402
from asyncflow.data.tasks import make_task  # noqa: E402
from asyncflow.workflow.setup import reward_specs  # noqa: E402

OPTIONS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reasoning_gym_grpo.yaml"


def test_splits_are_seeded_distinct_and_take_the_librarys_config():
    task = make_task("reasoning_gym:chain_sum", seed=3, options=OPTIONS)
    train, test = task.examples("train", 300), task.examples("test", 40)
    assert train == make_task("reasoning_gym:chain_sum", seed=3, options=OPTIONS).examples("train", 300)
    assert train != make_task("reasoning_gym:chain_sum", seed=4, options=OPTIONS).examples("train", 300)
    assert not {e.prompt for e in train} & {e.prompt for e in test}, "no held-out prompt is trained on"
    library = reasoning_gym.create_dataset("chain_sum", seed=0, size=2**31, **OPTIONS)
    for example in train[:20] + test[:20]:
        item = library[example.metadata["reasoning_gym_index"]]
        assert (example.prompt, example.answer) == (item["question"], item["answer"])
        assert 2 <= item["metadata"]["num_terms"] <= 3, "the difficulty keys reached the library"


def test_the_reward_is_the_librarys_score_answer():
    task = make_task("reasoning_gym:chain_sum", options=OPTIONS)
    library = reasoning_gym.create_dataset("chain_sum", seed=0, size=2**31, **OPTIONS)
    score = task.verifier
    for example in task.examples("test", 10):
        item = library[example.metadata["reasoning_gym_index"]]
        for completion, extracted in [(example.answer, example.answer), ("7", "7"), (" 12 ", "12"),
                                      (f"so <answer>{example.answer}</answer>", example.answer)]:
            expected = library.score_answer(extracted, item)
            assert score(completion, example.answer, **example.metadata) == expected
    assert score(example.answer, example.answer, **example.metadata) == 1.0
    with pytest.raises(ValueError, match="is not its item's"):
        score("1", "not the answer", **example.metadata)


def test_without_partial_credit_only_the_librarys_full_credit_pays():
    partial = make_task("reasoning_gym:chain_sum", options=OPTIONS).verifier
    exact = make_task("reasoning_gym:chain_sum", options=OPTIONS, partial_credit=False).verifier
    example = make_task("reasoning_gym:chain_sum", options=OPTIONS).examples("test", 1)[0]
    padded = "1" + example.answer  # contains the answer: the library's partial credit
    assert 0.0 < partial(padded, example.answer, **example.metadata) < 1.0
    assert exact(padded, example.answer, **example.metadata) == 0.0
    assert exact(example.answer, example.answer, **example.metadata) == 1.0
    with pytest.raises(ValueError, match="data.partial_credit=false is for reasoning_gym"):
        make_task("arithmetic", partial_credit=False)


def test_bad_names_and_options_and_a_missing_library_are_one_line_errors(monkeypatch):
    with pytest.raises(DatasetError, match="not registered"):
        make_task("reasoning_gym:no_such_dataset")
    with pytest.raises(DatasetError, match="not that dataset's config"):
        make_task("reasoning_gym:chain_sum", options={"no_such_key": 1})
    with pytest.raises(DatasetError, match=r"\['seed'\] are set by asyncflow"):
        ReasoningGymScore("chain_sum", {"seed": 1})
    with pytest.raises(ValueError, match="task_options are the config of a reasoning_gym:NAME task, not 'arithmetic'"):
        make_task("arithmetic", options=OPTIONS)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    _dataset.cache_clear()
    try:
        with pytest.raises(DatasetError, match=r"pip install 'asyncflow-rl\[reasoning-gym\]'"):
            make_task("reasoning_gym:chain_sum")
    finally:
        _dataset.cache_clear()


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_one_step_scored_by_the_librarys_verifier(tmp_path, one_torch_thread):
    config = asyncflow.build_config(
        {"data": {"task": "reasoning_gym:chain_sum", "task_options": OPTIONS, "train_size": 200, "test_size": 8}},
        [f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "train.steps=1",
         "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "eval.every=1",
         "checkpoint.every=0", "observe.tensorboard=false", "export.at_end=false"])
    [verifier] = reward_specs(config)
    assert isinstance(verifier, ReasoningGymScore) and verifier.name == "chain_sum"
    result = asyncflow.train(config)
    trained = [row for row in result.history if "rollout/samples" in row]
    assert result.step == 1 and trained[0]["rollout/samples"] == 8
    assert trained[0]["reward/errors"] == 0, "every sample was scored by the library"
    assert "eval/accuracy" in result.history[-1]


def test_the_example_config_opens_its_task_with_a_test_split_of_its_size():
    config = asyncflow.load_config(EXAMPLE)
    task = make_task(config.data.task, seed=config.run.seed, options=config.data.task_options)
    assert len(task.examples("test", config.data.test_size)) == config.data.test_size
