"""Property-based: generated request bodies (hostile values in every field, raw bytes, streamed or not) sent to the
live server never get a 5xx or a broken answer, and a normal request succeeds after each one."""

import json

import httpx
import pytest

pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_fixture import KEY, NAME, TEMPLATE, running_server  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@pytest.fixture(scope="module")
def http(tiny_llama_path, one_torch_thread):
    with running_server(tiny_llama_path, TEMPLATE) as (thread, _, _):
        with httpx.Client(base_url=thread.url, headers=AUTH, timeout=60) as client:
            yield client


junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.lists(st.integers(-5, 40_000), max_size=6),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
extreme = st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-8, 1e-6, float("nan"), float("inf"), -float("inf")])
words = st.lists(st.sampled_from("the a one two three plus minus equals is 1 2 3 = +".split()), min_size=1,
                 max_size=30).map(" ".join)
token_ids = st.lists(st.one_of(st.integers(0, 300), st.integers(-(2**70), 2**70)), min_size=0, max_size=20)
stops = st.one_of(st.text(max_size=200), st.lists(st.one_of(words, st.text(max_size=150)), max_size=12))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"])},
    optional={"content": st.one_of(words, st.text(max_size=200), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": words}), max_size=3), junk), "name": junk}), max_size=4)

# A plausible request, then up to three of its fields replaced by hostile values (extreme floats, junk of any type),
# so that most bodies get past the other checks and reach the one under attack.
plausible = {"model": st.just(NAME), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
             "top_p": st.floats(0, 1), "top_k": st.integers(-1, 50), "n": st.integers(1, 4),
             "stream": st.booleans()}
hostile = {
    "model": junk, "max_tokens": st.one_of(st.sampled_from([0, -1, 10**20, "4", 1.5]), junk),
    "temperature": st.one_of(extreme, junk), "top_p": st.one_of(extreme, junk),
    "top_k": st.one_of(st.sampled_from([2**64, -2, 10**6]), junk), "n": st.one_of(st.integers(-1, 70), junk),
    "stop": st.one_of(stops, junk), "logprobs": st.one_of(st.integers(-1, 3), st.booleans(), junk),
    "seed": junk, "user": junk, "presence_penalty": junk, "stream_options": junk, "unknown_field": junk,
}


def bodies(required: dict, hostile_fields: dict):
    def attacked(keys):
        return st.fixed_dictionaries({**plausible, **required}).flatmap(
            lambda body: st.fixed_dictionaries({k: hostile_fields[k] for k in keys}).map(lambda bad: {**body, **bad}))
    return st.lists(st.sampled_from(sorted(hostile_fields)), max_size=3, unique=True).flatmap(attacked)


completion_bodies = bodies({"prompt": st.one_of(words, st.text(max_size=100), token_ids, st.lists(words, max_size=4),
                                                st.lists(token_ids, max_size=3))},
                           {**hostile, "prompt": junk, "echo": junk})
chat_bodies = bodies({"messages": messages}, {**hostile, "messages": junk, "top_logprobs": junk})


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and all(e == "[DONE]" or isinstance(json.loads(e), dict) for e in events), response.text
    else:
        assert response.json()["choices"], response.text


def normal_request_succeeds(http) -> None:
    out = http.post("/v1/completions", json={"model": NAME, "prompt": "12+34=", "max_tokens": 2})
    assert out.status_code == 200, out.text


@FUZZ
@given(body=completion_bodies)
@pytest.mark.slow
def test_generated_completion_bodies(http, body):
    check(http.post("/v1/completions", content=json.dumps(body)))  # json.dumps writes NaN / Infinity as such
    normal_request_succeeds(http)


@FUZZ
@given(body=chat_bodies)
@pytest.mark.slow
def test_generated_chat_bodies(http, body):
    check(http.post("/v1/chat/completions", content=json.dumps(body)))
    normal_request_succeeds(http)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/episodes/x/v1/completions"]))
@pytest.mark.slow
def test_generated_raw_bodies(http, raw, path):
    response = http.post(path, content=raw)
    assert response.status_code < 500 and "error" in response.json(), response.text
    normal_request_succeeds(http)
