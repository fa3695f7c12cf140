"""The OpenAI-compatible server, driven by the real `openai` client over HTTP on loopback: models, completions,
chat (the tokenizer's chat template), streaming, the extra token-id / log-prob fields against the engine's
own output, the API key, 4xx errors that leave the engine serving, and episodes recorded for training."""

import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixture import KEY, NAME, running_server  # noqa: E402

from asyncflow.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from asyncflow.engines.torch_inference import TorchInferenceEngine  # noqa: E402
from asyncflow.models.loading import load_model, load_tokenizer  # noqa: E402
from asyncflow.serving.episodes import episode_row  # noqa: E402
from asyncflow.serving.server import ServerThread  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama_path, one_torch_thread):
    """The server with a chat template and an episode recorder, on a free port."""
    with running_server(tiny_llama_path, TEMPLATE) as (thread, service, recorder):
        yield thread, service, recorder, load_tokenizer(tiny_llama_path)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def engine_greedy(tiny_llama_path, prompt_ids, max_new_tokens):
    engine = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=4)
    tokenizer = load_tokenizer(tiny_llama_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    [done] = engine.generate([GenerationRequest(0, prompt_ids)], params)
    return done


def test_models_and_completions_return_the_engines_ids_and_logprobs(server, client, tiny_llama_path):
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.completions.create(model=NAME, prompt="12+34=", max_tokens=6, temperature=0, logprobs=1)
    choice = out.choices[0]
    tokenizer = server[3]
    prompt_ids = [tokenizer.bos_token_id] + tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    expected = engine_greedy(tiny_llama_path, prompt_ids, 6)
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == expected.response_ids
    assert choice.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert choice.text == tokenizer.decode(expected.response_ids, skip_special_tokens=True)
    assert choice.weight_version == 0 and out.usage.completion_tokens == len(expected.response_ids)
    by_ids = client.completions.create(model=NAME, prompt=prompt_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].token_ids == expected.response_ids


def test_chat_uses_the_chat_template_and_streams_the_same_tokens(server, client, tiny_llama_path):
    tokenizer = server[3]
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    choice = out.choices[0]
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert text == "<s>system: add</s><s>user: 2+2</s><s>assistant: "
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = engine_greedy(tiny_llama_path, prompt_ids, 8)
    assert choice.prompt_token_ids == prompt_ids and choice.token_ids == expected.response_ids
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(expected.logprobs, abs=1e-5)
    assert choice.message.content == tokenizer.decode(expected.response_ids, skip_special_tokens=True)

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    streamed_ids = [i for c in chunks if c.choices for i in (getattr(c.choices[0], "token_ids", None) or [])]
    assert "".join(pieces) == choice.message.content and streamed_ids == choice.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(choice.token_ids)


def test_sampling_n_stop_strings_and_concurrent_callers(server, client):
    out = client.completions.create(model=NAME, prompt="ab", max_tokens=12, temperature=1.0, top_p=0.9, n=3, seed=1)
    assert len(out.choices) == 3 and all(len(c.token_ids) == len(c.token_logprobs) for c in out.choices)
    text = client.completions.create(model=NAME, prompt="ab", max_tokens=12, temperature=0).choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model=NAME, prompt="ab", max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"

    results = []
    threads = [threading.Thread(target=lambda: results.append(
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5)))
        for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6


def test_requests_without_the_key_are_refused(server):
    url = server[0].url
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    response = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": NAME, "prompt": [1, 10_000]}, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
])
def test_bad_requests_get_4xx_json_and_the_engine_keeps_serving(server, client, body, status, param):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(server[0].url + route, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert client.completions.create(model=NAME, prompt="1", max_tokens=2).choices[0].token_ids
    assert server[1]._thread.is_alive()


def test_malformed_json_and_unknown_routes(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(server[0].url + "/v1/completions", content=b'{"model": ', headers=headers, timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert httpx.get(server[0].url + "/v2/nothing", headers=headers, timeout=30).status_code == 404


def test_an_episode_records_sampled_ids_and_reuses_them_when_the_agent_continues(server):
    thread, _, recorder, tokenizer = server
    recorder.open("ep-1")
    agent = openai.OpenAI(base_url=thread.url + "/episodes/ep-1/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "2+3"}]
    # greedy: the ids do not hang on the engine's generator, which the module's other tests move in any order (a
    # sampled special token mid-reply, absent from the text the agent sends back, rightly ends the reuse)
    first = agent.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0).choices[0]
    messages += [{"role": "assistant", "content": first.message.content}, {"role": "tool", "content": "5"}]
    second = agent.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0).choices[0]
    calls = recorder.close("ep-1")
    assert [c.response_ids for c in calls] == [first.token_ids, second.token_ids]
    # the second prompt starts with the first call's ids as sampled, not as re-tokenized from the reply text
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.token_ids)] == (
        first.prompt_token_ids + first.token_ids)
    row = episode_row(calls)
    assert row.prompt_ids + row.response_ids == second.prompt_token_ids + second.token_ids
    added = second.prompt_token_ids[len(first.prompt_token_ids) + len(first.token_ids):]
    assert row.loss_mask == [1] * len(first.token_ids) + [0] * len(added) + [1] * len(second.token_ids)
    assert [t for t, m in zip(row.response_ids, row.loss_mask) if m] == first.token_ids + second.token_ids
    assert row.dropped_calls == 0 and row.calls == 2
    if first.finish_reason == "length":  # the template closes the turn after the sampled ids
        assert tokenizer.decode(added).startswith("</s>")
    with pytest.raises(openai.NotFoundError):  # closed: later calls are refused
        agent.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        recorder.open("ep-2")
        openai.OpenAI(base_url=thread.url + "/episodes/ep-2/v1", api_key=KEY, max_retries=0).completions.create(
            model=NAME, prompt="x", n=2)
    recorder.close("ep-2")


def test_untokenizable_text_and_timeouts_are_4xx_and_504(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(server[0].url + "/v1/completions", json={"model": NAME, "prompt": "line\nbreak"},
                          headers=headers, timeout=30)
    assert response.status_code == 400 and "tokenized" in response.json()["error"]["message"]
    from asyncflow.serving.api import ServedModel, make_app

    service, tokenizer = server[1], server[3]
    model = service.engine.model
    impatient = make_app(ServedModel(NAME, tokenizer, service, 512, model.get_input_embeddings().num_embeddings),
                         api_key=KEY, request_timeout_s=0.001)
    thread = ServerThread(impatient).start()
    try:
        response = httpx.post(thread.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 200},
                              headers=headers, timeout=30)
    finally:
        thread.stop()
    assert response.status_code == 504 and response.json()["error"]["type"] == "timeout_error"


def test_metrics_count_requests_by_route_and_status_and_the_tokens_sampled(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server[0].url

    def series() -> dict[str, float]:
        response = httpx.get(url + "/metrics", headers=headers, timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
                if line and not line.startswith("#")}

    before = series()
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401  # the key, as every route but /health
    done = client.completions.create(model=NAME, prompt="12+34=", max_tokens=5, temperature=0)
    httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "n": 0}, headers=headers, timeout=30)
    after = series()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('asyncflow_serve_requests_total{route="/v1/completions",status="200"}') == 1
    assert grew('asyncflow_serve_requests_total{route="/v1/completions",status="400"}') == 1
    assert grew('asyncflow_serve_requests_total{route="/metrics",status="401"}') == 1
    assert grew("asyncflow_serve_completion_tokens_total") == len(done.choices[0].token_ids)
    assert grew('asyncflow_serve_request_seconds_count{route="/v1/completions"}') == 2
    assert after["asyncflow_serve_healthy"] == 1 and after["asyncflow_serve_weight_version"] == 0
    assert after["asyncflow_serve_requests_in_flight"] == 1  # the scrape itself
