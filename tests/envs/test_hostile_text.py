"""Model text cannot hurt the trainer through the tool-call parser, the calculator or an environment: nothing
raises, nothing takes longer than its bound, and a normal call works afterwards (hypothesis-generated text plus
the cases that broke the earlier code: deep JSON, long integers, thousands of unclosed tags, nested powers)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.envs.tool_calls import ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from asyncflow.envs.tools import CalculatorError, calculator
from asyncflow.workers.multiturn import Episode, EpisodeRunner

BOUND_S = 1.0

HOSTILE_TEXT = [
    "<tool_call>" + "[" * 100_000 + "</tool_call>",  # RecursionError in json
    '<tool_call>{"name":"c","arguments":{"x":' + "1" * 5000 + "}}</tool_call>",  # int over 4300 digits
    "<tool_call>" * 20_000,  # thousands of unclosed tags: quadratic with a lazy regex
    "</tool_call>" * 20_000,
    "<tool_call>" + "x" * 100_000 + "</tool_call>",
]


def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=["deep-json", "long-int", "unclosed", "stray-close", "huge"])
def test_parser_refuses_hostile_text_quickly(text):
    result, seconds = timed(parse_tool_calls, text)
    assert isinstance(result, ToolCallError) and seconds < BOUND_S


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/tool_call{}[]":,0123456789 name arguments')), max_size=400))
def test_parser_never_raises(text):
    result, seconds = timed(parse_tool_calls, text)
    assert isinstance(result, (list, ToolCallError)) and seconds < BOUND_S
    call = format_tool_call("calculator", {"expression": "1+1"})
    assert parse_tool_calls(call) == [ToolCall("calculator", {"expression": "1+1"})]


@pytest.mark.parametrize("expression", ["(((9**64)**64)**64)**64", "((9**64)**64)**64", "2**64**64",
                                        "9**64*9**64*9**64*9**64*9**64*9**64*9**64*9**64",
                                        "(" * 60 + "1" + ")" * 60, "1/3**64/3**64/3**64"])
def test_calculator_refuses_huge_numbers_before_computing(expression):
    t0 = time.perf_counter()
    try:
        calculator(expression)
    except CalculatorError:
        pass
    assert time.perf_counter() - t0 < BOUND_S


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789.+-*/%() ")), max_size=60))
def test_calculator_only_raises_its_own_error(expression):
    t0 = time.perf_counter()
    try:
        calculator(expression)
    except CalculatorError:
        pass
    assert time.perf_counter() - t0 < BOUND_S
    assert calculator("6*7") == "42"


class RaisingEnv:
    def __init__(self, where: str):
        self.where = where

    def reset(self, row):
        if self.where == "reset":
            raise RuntimeError("reset broke")

    def step(self, text):
        raise RuntimeError("step broke")


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_environment_that_raises_fails_its_episode_not_the_rollout(where):
    from asyncflow.engines.base import Completion, SamplingParams
    from asyncflow.workers.multiturn import TurnTemplate

    class Tokenizer:
        eos_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return "text"

    runner = EpisodeRunner(Tokenizer(), TurnTemplate((), ()), lambda: RaisingEnv(where), SamplingParams(),
                           max_turns=2, max_context_tokens=64)

    def generate(ids, params):
        return Completion(0, ids, [5, 0], [-0.1, -0.2], "stop", 3)

    episode = runner.run(generate, [1, 2], {"answer": "1"})
    assert isinstance(episode, Episode) and episode.reward == 0.0 and episode.finish_reason == "error"
    assert episode.info["env_errors"] == 1
