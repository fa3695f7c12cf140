"""Model-based rewards against a live local HTTP server that speaks OpenAI's chat/completions protocol (the
happy path through `asyncflow serve` itself is tests/serving/test_judge_end_to_end.py): scores parsed and
mapped, identical requests sent once, retries with backoff, and a judge that times out or answers garbage
scored 0 and counted in the reward errors, never fatal, never past its budget."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402

import asyncflow  # noqa: E402
from asyncflow.rewards import RewardRunner  # noqa: E402
from asyncflow.rewards.judge import JudgeError, JudgeReward, parse_score, template_fields  # noqa: E402
from asyncflow.serving.server import ServerThread  # noqa: E402


def chat_completion(content: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}


def fake_judge_app(seen: list[dict]) -> FastAPI:
    """A judge whose behaviour is its `model` name: `grader` answers `Score: 10` when the response equals the
    answer (template `{response}|{answer}`), else `Score: 0`; `slow` answers after 3 s; `garbage` answers text
    without a number; `not-json` a plain-text body; `flaky` a 503 on every first try of a request;
    `every-other` garbage on every other request. Every request body is appended to `seen`."""
    app = FastAPI()
    tries: Counter = Counter()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        behaviour, content = body["model"], body["messages"][-1]["content"]
        tries[json.dumps(body)] += 1
        if behaviour == "slow":
            await asyncio.sleep(3)
        if behaviour == "garbage" or (behaviour == "every-other" and len(seen) % 2):
            return chat_completion("I would rather not say.")
        if behaviour == "not-json":
            return PlainTextResponse("<html>bad gateway</html>")
        if behaviour == "flaky" and tries[json.dumps(body)] == 1:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        response, _, answer = content.partition("|")
        return chat_completion(f"Score: {10 if response.strip() == answer.strip() else 0}")

    return app


@pytest.fixture(scope="module")
def judge_server():
    seen: list[dict] = []
    server = ServerThread(fake_judge_app(seen)).start()
    try:
        yield server.url + "/v1", seen
    finally:
        server.stop()


def judge(url: str, model: str, **options) -> JudgeReward:
    settings = dict(template="{response}|{answer}", score_pattern=r"Score: (\d+)", score_range=(0, 10),
                    timeout_s=2.0, retries=1, backoff_s=0.05)
    return JudgeReward(url, model, **{**settings, **options})


def test_template_fields_and_score_parsing():
    assert template_fields("Q: {prompt} A: {answer} R: {response} {{literal}}") == {"prompt", "answer", "response"}
    with pytest.raises(ValueError, match=r"names \['question'\]"):
        template_fields("{question}")
    with pytest.raises(ValueError, match="malformed"):
        template_fields("{response")
    pattern = JudgeReward("http://x/v1", "m", template="{response}", score_pattern=r"(\d+)/10").pattern
    assert parse_score("I give it 7/10.", pattern, 0, 10) == pytest.approx(0.7)
    for text, match in [("no score here", "holds no score"), ("11/10", "outside score_range")]:
        with pytest.raises(JudgeError, match=match):
            parse_score(text, pattern, 0, 10)


def test_a_judge_without_httpx_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)
    entry = {"kind": "judge", "base_url": "http://127.0.0.1:1/v1", "model": "m"}
    with pytest.raises(asyncflow.ConfigError, match=r"pip install 'asyncflow-rl\[judge\]'"):
        asyncflow.build_config({"reward": {"fns": [entry]}})


def test_a_judge_scores_through_a_live_server_and_sends_identical_requests_once(judge_server):
    url, seen = judge_server
    grader = judge(url, "grader", system="Grade strictly.")
    runner = RewardRunner(grader, timeout_s=5, max_workers=4)
    completions = ["42", "41", "42", "42", "7"]
    result = runner.score(completions, ["42"] * 5, [{"prompt": "6*7="}] * 5)
    assert result.rewards == [1.0, 0.0, 1.0, 1.0, 0.0] and result.n_errors == result.n_timeouts == 0
    assert grader.requests_sent == 3 and grader.cache_hits == 2, "one request per distinct (completion, answer)"
    mine = [body for body in seen if body["model"] == "grader"]
    assert sorted(body["messages"][1]["content"] for body in mine) == ["41|42", "42|42", "7|42"]
    assert mine[0]["messages"][0] == {"role": "system", "content": "Grade strictly."}
    assert mine[0]["max_tokens"] == 16 and mine[0]["temperature"] == 0.0
    assert runner.score(["42"], ["42"]).rewards == [1.0] and grader.requests_sent == 3, "a cached score"


def test_an_overloaded_judge_is_retried_with_backoff(judge_server):
    url, _ = judge_server
    flaky = judge(url, "flaky", backoff_s=0.2)
    start = time.monotonic()
    assert flaky("3", "3") == 1.0
    assert flaky.requests_sent == 2 and time.monotonic() - start >= 0.2


@pytest.mark.parametrize("behaviour, error", [
    ("slow", "ReadTimeout"), ("garbage", "holds no score"), ("not-json", "not a chat completion"),
])
def test_a_judge_that_times_out_or_answers_garbage_is_counted_not_fatal(judge_server, behaviour, error, caplog):
    url, _ = judge_server
    # no backoff: the budget is then both attempts' timeouts, so a first attempt that overran its 0.3 s under load
    # still leaves the retry time to start
    failing = judge(url, behaviour, timeout_s=0.3, retries=1, backoff_s=0.0, cache_size=0)
    runner = RewardRunner([failing, "exact_match"], timeout_s=5, max_workers=4)
    start = time.monotonic()
    result = runner.score(["1", "2", "3", "4"], ["1", "2", "3", "4"])
    assert time.monotonic() - start < 2.5, "every attempt stops at the judge's timeout"
    assert result.rewards == [0.0] * 4 and result.n_errors == 4 and result.n_timeouts == 0
    assert runner.stuck_calls == 0, "the judge gave up before the runner had to abandon a thread"
    assert error in runner.last_failure and "judge:" + behaviour in runner.last_failure
    if behaviour == "slow":  # a retry that no longer fits the budget is skipped: under load, some are
        assert 4 < failing.requests_sent <= 8, "timeouts are retried"
    else:
        assert failing.requests_sent == 4, "answers are not retried"


def test_a_judges_calls_end_within_its_budget(judge_server):
    url, _ = judge_server
    slow = judge(url, "slow", timeout_s=2.5, retries=3, backoff_s=0.5, budget_s=0.6)
    start = time.monotonic()
    with pytest.raises(JudgeError, match="ReadTimeout"):
        slow("1", "1")
    assert time.monotonic() - start < 2.0 and slow.requests_sent == 1, "the budget cut the 2.5 s request timeout"


@pytest.mark.slow
def test_a_judge_is_a_reward_fns_entry_of_a_run_and_its_failures_are_counted(judge_server, tmp_path, one_torch_thread):
    url, seen = judge_server
    entry = {"kind": "judge", "base_url": url, "model": "every-other", "template": "{prompt}|{response}",
             "score_pattern": r"Score: (\d+)", "score_range": [0, 10], "timeout_s": 2, "retries": 0}
    config = asyncflow.build_config(
        {"reward": {"fns": [entry], "timeout_s": 5}},
        [f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "train.steps=1",
         "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "eval.every=0",
         "data.test_size=0", "checkpoint.every=0", "observe.tensorboard=false", "export.at_end=false"])
    result = asyncflow.train(config)
    step = next(row for row in result.history if "rollout/samples" in row)
    assert 0 < step["reward/errors"] < 8 and step["reward/timeouts"] == 0, "half the judge's answers are garbage"
    prompts = {body["messages"][-1]["content"].partition("|")[0] for body in seen if body["model"] == "every-other"}
    assert all(p.endswith("=") for p in prompts), f"the judge reads each row's prompt text: {prompts}"
