"""One test per way a request or a connection could hurt `asyncflow serve` or the other callers: extreme sampling
settings, an engine error, token ids outside the vocabulary, oversized bodies / prompts / stop strings / prompts x n,
deep JSON, tokenising on the event loop, slow or half-open clients, and the `serve` command's host/key/port checks.
Each hostile request must get a clean 4xx naming the field, and a normal request must succeed afterwards."""

import json
import re
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from server_fixture import KEY, NAME, TEMPLATE, running_server  # noqa: E402

from asyncflow.cli import main  # noqa: E402
from asyncflow.engines.base import SamplingParams  # noqa: E402

HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0  # a 4 MiB chunked upload must reach its 413 before this under load
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def short_timeouts():
    try:
        from asyncflow.serving.limits import ServingLimits
    except ImportError:
        return None
    return ServingLimits(header_timeout_s=HEAD_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(tiny_llama_path, one_torch_thread):
    with running_server(tiny_llama_path, TEMPLATE, limits=short_timeouts()) as (thread, service, _):
        with httpx.Client(base_url=thread.url, headers=AUTH, timeout=60) as http:
            yield thread, service, http


def completion(http, **fields):
    return http.post("/v1/completions", json={"model": NAME, "prompt": "12+34=", "max_tokens": 3, **fields})


def assert_refused(response, status: int, param: str, *words: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
    for word in words:
        assert word in error["message"], error


def assert_serving(http):
    assert completion(http).status_code == 200
    assert http.get("/health").json()["status"] == "ok"


def test_tiny_top_p_is_served_and_the_next_request_too(server):
    _, _, http = server
    for top_p in (1e-50, 5e-324, 1e-8):
        out = completion(http, top_p=top_p, temperature=1.0)
        assert out.status_code == 200, out.text
    assert_serving(http)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e-45"])
def test_non_finite_or_underflowing_temperature_is_400(server, raw):
    _, _, http = server
    body = f'{{"model": "{NAME}", "prompt": "hi", "max_tokens": 2, "temperature": {raw}}}'
    assert_refused(http.post("/v1/completions", content=body), 400, "temperature")
    body = f'{{"model": "{NAME}", "prompt": "hi", "max_tokens": 2, "top_p": {raw if raw != "1e-45" else "NaN"}}}'
    assert_refused(http.post("/v1/completions", content=body), 400, "top_p")
    assert_serving(http)


def test_an_engine_error_fails_its_batch_only_and_health_says_so(server):
    _, service, http = server
    failures_before = http.get("/health").json().get("engine_failures", 0)
    broken = service.submit([1, 2, 3], SamplingParams(top_p=2.0))  # the engine itself refuses it mid-loop
    with pytest.raises(Exception):  # noqa: B017 - whatever the engine raises, the batch fails alone
        broken.result(timeout=30)
    assert_serving(http)
    health = http.get("/health").json()
    assert health["engine_failures"] == failures_before + 1 and "top_p" in health["last_engine_error"]
    assert http.get("/v1/models").json()["data"][0]["status"] == "ok"


def test_an_engine_error_fails_only_the_request_that_causes_it(server, caplog):
    """The requests sharing a batch with one the engine fails on run again alone and complete."""
    _, service, http = server
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    good = [service.submit(ids, SamplingParams(max_new_tokens=4)) for ids in prompts]
    broken = service.submit([1, 2, 3], SamplingParams(top_p=2.0, max_new_tokens=4))
    good += [service.submit([3, 4], SamplingParams(max_new_tokens=4))]
    with pytest.raises(Exception, match="the engine failed on this request"):
        broken.result(timeout=60)
    for future in good:
        assert len(future.result(timeout=60).response_ids) > 0
    shared = [int(n) for n in re.findall(r"the engine failed with (\d+) request\(s\) in flight", caplog.text)]
    assert shared and max(shared) >= 2, "the broken request ran alone: nothing was isolated"
    assert_serving(http)


@pytest.mark.parametrize("ids", [[-1], [10**30], [1, 2**63], [32000 * 1000]])
def test_token_ids_outside_the_vocabulary_are_400_before_decoding(server, ids):
    _, _, http = server
    assert_refused(completion(http, prompt=ids), 400, "prompt", "token ids")
    assert_refused(completion(http, prompt=[ids]), 400, "prompt", "token ids")
    assert_serving(http)


def test_a_body_over_the_limit_is_413_by_length_and_by_stream(server):
    _, _, http = server
    big = {"model": NAME, "prompt": "hi", "max_tokens": 1, "user": "x" * (3 * 1024 * 1024)}
    assert_refused(http.post("/v1/completions", json=big), 413, "body", "max_body_bytes")
    chunks = (json.dumps(big).encode()[i : i + 65536] for i in range(0, 4 * 1024 * 1024, 65536))
    assert_refused(http.post("/v1/completions", content=chunks), 413, "body", "max_body_bytes")  # chunked, no length
    assert_serving(http)


def test_a_prompt_over_the_character_limit_is_400_before_tokenising(server):
    _, _, http = server
    assert_refused(completion(http, prompt="a " * 100_001), 400, "prompt", "max_prompt_chars")
    messages = [{"role": "user", "content": "a " * 50_001}] * 2
    response = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 2})
    assert_refused(response, 400, "messages", "max_prompt_chars")
    assert_serving(http)


def test_stop_strings_are_bounded_in_count_and_length(server):
    _, _, http = server
    assert_refused(completion(http, stop=[str(i) for i in range(9)]), 400, "stop", "max_stop_strings")
    assert_refused(completion(http, stop="ab" * 100), 400, "stop", "max_stop_chars")
    assert completion(http, stop=["x" * 128, "=", "1"]).status_code == 200
    assert_serving(http)


def test_prompts_times_n_is_capped(server):
    _, _, http = server
    assert_refused(completion(http, prompt=["a", "b", "c", "d", "e", "f", "g", "h"], n=16, max_tokens=1), 400, "n",
                   "max_choices")
    assert_serving(http)


def test_deeply_nested_json_is_a_4xx(server):
    _, _, http = server
    for body in ("[" * 200_000, '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"prompt": "\\ud800"}'):
        response = http.post("/v1/completions", content=body)
        assert 400 <= response.status_code < 500, response.text
    assert_serving(http)


def test_health_answers_without_the_key(server):
    thread, _, _ = server
    response = httpx.get(thread.url + "/health", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "ok"
    assert httpx.get(thread.url + "/v1/models", timeout=30).status_code == 401


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it was still open after `seconds`."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    return received


def test_a_half_open_or_trickling_request_head_is_disconnected(server):
    thread, _, http = server
    idle = socket.create_connection(("127.0.0.1", thread.port))  # connects, sends nothing
    trickle = socket.create_connection(("127.0.0.1", thread.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nX-Pad: ".encode()
    stop = threading.Event()

    def drip():  # a byte every 0.2 s: uvicorn's keep-alive timer alone would restart on each
        for byte in head + b"y" * 1000:
            if stop.wait(0.2):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:
                return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        assert closed_within(idle, HEAD_TIMEOUT_S + 4) is not None
        assert closed_within(trickle, HEAD_TIMEOUT_S + 4) is not None
    finally:
        stop.set()
        idle.close()
        trickle.close()
    assert_serving(http)


def test_a_kept_alive_connection_that_trickles_its_next_head_is_disconnected(server):
    thread, _, http = server
    sock = socket.create_connection(("127.0.0.1", thread.port))
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert b" 200 " in sock.recv(65536).split(b"\r\n")[0]
        time.sleep(HEAD_TIMEOUT_S * 1.5)  # idle longer than the head timeout: still open (keep-alive)
        sock.sendall(b"G")
        started = time.monotonic()
        for byte in b"ET /health HTTP/1.1\r\nX-Pad: " + b"y" * 100:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - started > HEAD_TIMEOUT_S + 4:
                break
            time.sleep(0.2)
        assert closed_within(sock, 1) is not None and time.monotonic() - started < HEAD_TIMEOUT_S + 4
    finally:
        sock.close()
    assert_serving(http)


@pytest.mark.slow
def test_a_stalled_body_gets_408(server):
    thread, _, http = server
    sock = socket.create_connection(("127.0.0.1", thread.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"".encode())
    try:
        answer = closed_within(sock, BODY_TIMEOUT_S + 4)
    finally:
        sock.close()
    assert answer is not None and b" 408 " in answer.split(b"\r\n")[0], answer
    sock = socket.create_connection(("127.0.0.1", thread.port))  # without the key: refused before any body is read
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    try:
        sock.settimeout(BODY_TIMEOUT_S / 2)
        first = sock.recv(65536)
    finally:
        sock.close()
    assert b" 401 " in first.split(b"\r\n")[0], first
    assert_serving(http)


def test_tokenising_and_decoding_run_off_the_event_loop(tiny_llama_path, one_torch_thread):
    threads = set()

    class Recording:
        def __init__(self, tokenizer):
            self.__dict__["_tokenizer"] = tokenizer

        def __getattr__(self, name):
            attr = getattr(self._tokenizer, name)
            if name in ("decode", "apply_chat_template", "__call__"):
                def recorded(*args, **kwargs):
                    threads.add(threading.current_thread().name)
                    return attr(*args, **kwargs)
                return recorded
            return attr

        def __call__(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return self._tokenizer(*args, **kwargs)

    with running_server(tiny_llama_path, TEMPLATE, tokenizer_wrapper=Recording) as (thread, _, _):
        with httpx.Client(base_url=thread.url, headers=AUTH, timeout=60) as http:
            response = completion(http, stop=["\n"])
            assert response.status_code == 200, response.text
            chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert threads and "openai-server" not in threads, threads


# ---------------------------------------------------------------- the serve command
def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_bad_port_is_a_one_line_error(port, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "preset:tiny-llama", "--port", port])
    assert exit_.value.code == 2 and "--port" in one_line(capsys)


def test_a_port_in_use_fails_before_loading_the_model(capsys, monkeypatch):
    monkeypatch.setenv("ASYNCFLOW_API_KEY", "k")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "preset:no-such-model", "--port", str(port)]) != 0
    assert "cannot listen on 127.0.0.1" in one_line(capsys) and time.monotonic() - started < 10


def test_a_non_loopback_host_needs_a_key_and_warns(tmp_path, capsys, monkeypatch, caplog):
    monkeypatch.delenv("ASYNCFLOW_API_KEY", raising=False)
    assert main(["serve", "preset:no-such-model", "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0" in one_line(capsys) and "--api-key-file" in capsys.readouterr().err + "--api-key-file"
    key_file = tmp_path / "key"
    key_file.write_text("secret\n")
    with socket.create_server(("0.0.0.0", 0)) as taken:  # stops it at the port check, after the key checks
        port = taken.getsockname()[1]
        assert main(["serve", "preset:no-such-model", "--host", "0.0.0.0", "--port", str(port),
                     "--api-key-file", str(key_file)]) != 0
    assert "cannot listen" in one_line(capsys)
    assert any("reachable from other machines" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the engine's root cause
@pytest.mark.parametrize("top_p", [1e-50, 5e-324, 1e-8])
def test_sampling_keeps_the_most_likely_token_for_any_top_p(top_p):
    import torch

    from asyncflow.engines.torch_inference import sample_tokens

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample_tokens(logits, SamplingParams(top_p=top_p), torch.Generator().manual_seed(1))
    assert tokens.tolist() == logits.argmax(-1).tolist() and torch.isfinite(logprobs).all()


def test_the_engine_refuses_an_underflowing_temperature():
    from asyncflow.engines.torch_inference import check_sampling_params

    with pytest.raises(ValueError, match="temperature"):
        check_sampling_params(SamplingParams(temperature=1e-45))
    check_sampling_params(SamplingParams(temperature=0.0))
    check_sampling_params(SamplingParams(temperature=1e-6))
