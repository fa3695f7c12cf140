"""Kinds, not branches (docs/architecture.md): every environment and reward kind answers one interface, the
set-up asks the config's kinds and never which kind it has, and a new kind is one registry line."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from asyncflow.config import build_config
from asyncflow.data import Example
from asyncflow.data.prompts import TrainSet
from asyncflow.models.loading import load_tokenizer
from asyncflow.workflow import setup
from asyncflow.workflow.kinds import (
    ENVIRONMENT_KINDS,
    REWARD_KINDS,
    EnvironmentKind,
    environment_kind,
    reward_kind,
)
from asyncflow.workflow.kinds.env_builtin import BuiltinEnvironment
from asyncflow.workflow.kinds.env_verifiers import VerifiersEnvironment


def test_every_kind_answers_the_whole_interface():
    asked = {name for name, value in vars(EnvironmentKind).items() if inspect.isfunction(value)}
    assert {"check", "datasets", "render", "auto_rewards", "multiturn_env", "agent"} <= asked
    for kind in [BuiltinEnvironment, *ENVIRONMENT_KINDS.values()]:
        assert all(callable(getattr(kind, name, None)) for name in asked), kind
    for kind in REWARD_KINDS.values():
        assert isinstance(kind.reads_prompt, bool) and callable(kind.spec), type(kind).__name__


def test_the_set_up_names_no_kind_and_no_runtime():
    source = Path(setup.__file__).read_text()
    for name in ("verifiers_env", "JudgeRewardConfig", "JudgeReward(", "ray_runtime", "ProcessRanks", "runtime.inline"):
        assert name not in source, f"workflow/setup.py names {name}: ask the kind (or the runtime) instead"


def test_kinds_are_picked_by_env_name_prefix_and_entry_kind():
    assert type(environment_kind(build_config({}, []))) is BuiltinEnvironment
    assert type(environment_kind(build_config({}, ["env.name=calculator"]))) is BuiltinEnvironment
    verifiers = build_config({}, ["env.name=verifiers:some_env"])
    kind = environment_kind(verifiers)
    assert type(kind) is VerifiersEnvironment and ENVIRONMENT_KINDS["verifiers:"] is VerifiersEnvironment
    assert kind.config is verifiers, "a kind answers for the config it was built from"
    assert reward_kind("exact_match") is REWARD_KINDS["function"]


class FakeEnvironment:
    """An environment kind of one prompt, recording what the set-up asked (in `asked`, over every instance)."""

    asked: list[str] = []

    def __init__(self, config):
        self.config = config

    def check(self):
        self.asked.append("check")

    def check_tokenizer(self, tokenizer):
        self.asked.append("check_tokenizer")

    def datasets(self):
        self.asked.append("datasets")
        return TrainSet([Example("1+1=", "2", source="fake[0]")], self.config.run.seed), []

    def render(self, tokenizer):
        return lambda text: [7] * len(text)

    def prompt_lengths(self, tokenizer, prompts):
        self.asked.append("prompt_lengths")
        return [len(p) for p in prompts]

    def auto_rewards(self):
        return ["exact_match"]

    def multiturn_env(self):
        return None

    def agent(self):
        raise AssertionError("not an agent's run")


def test_a_new_environment_kind_is_one_registry_line(monkeypatch, tiny_llama_path):
    fake = FakeEnvironment
    monkeypatch.setattr(fake, "asked", [])
    monkeypatch.setitem(ENVIRONMENT_KINDS, "fake:", fake)
    config = build_config({}, [f"model.path={tiny_llama_path}", "env.name=fake:demo", "data.on_long_prompt=error"])
    checked = setup.preflight(config)
    assert [ex.prompt for ex in checked.train_set.examples] == ["1+1="] and checked.test_set == []
    assert fake.asked == ["check", "datasets", "check_tokenizer", "prompt_lengths", "prompt_lengths"]
    assert setup.reward_specs(config) == ["exact_match"]
    assert setup.multiturn_spec(config) is None
    assert setup.prompt_encoder(config, load_tokenizer(tiny_llama_path)).render("abc") == [7, 7, 7]


def test_a_reward_kind_is_asked_through_its_registry_line(monkeypatch, tiny_llama_path):
    class Shouting:
        reads_prompt = True

        def spec(self, entry, config):
            return lambda completion, ground_truth, **metadata: float(completion.isupper())

    config = build_config({}, [f"model.path={tiny_llama_path}", "reward.fns=[exact_match]"])
    assert not setup.prompt_encoder(config, load_tokenizer(tiny_llama_path)).keep_text
    monkeypatch.setitem(REWARD_KINDS, "function", Shouting())
    [fn] = setup.reward_specs(config)
    assert fn("YES", "") == 1.0 and setup.prompt_encoder(config, load_tokenizer(tiny_llama_path)).keep_text


def test_a_judge_entry_is_a_judge_reward_within_the_reward_timeout():
    pytest.importorskip("httpx")
    from asyncflow.rewards.judge import JudgeReward

    config = build_config({}, ["reward.timeout_s=10", "reward.fns=[exact_match, {kind: judge, "
                               "base_url: 'http://127.0.0.1:1/v1', model: m, timeout_s: 30, retries: 0}]"])
    name, judge = setup.reward_specs(config)
    assert name == "exact_match" and isinstance(judge, JudgeReward) and judge.budget_s == pytest.approx(9.0)
    assert reward_kind(config.reward.fns[1]).reads_prompt


@pytest.mark.slow  # a one-step run under a profiler that sees every call (~30 s of CPU)
def test_following_the_config_of_a_run_enters_no_module_more_than_five_times(capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "config_trace.py"
    spec = importlib.util.spec_from_file_location("config_trace", path)
    assert spec is not None and spec.loader is not None
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    code = trace.main(["--max", "5"])
    out = capsys.readouterr()
    counts = {module: int(n) for module, n in (line.split() for line in out.out.splitlines())}
    assert code == 0 and max(counts.values()) <= 5, out.out + out.err
    assert counts["asyncflow.workflow.setup"] >= 3, "the tracer saw the set-up"
