"""Hostile clients against the real `asyncflow serve` (its own process, small limits), while a second client is served:
each attack runs for a few seconds and meanwhile every valid completion of the bystander must get 200 and
`GET /health` must answer within 0.5 s (95% of probes; `assert_bystander_served`). The attacks: huge arrays of bad
items under the body limit (validation time and memory), partial request heads without the key and trickled bodies
with it on more connections than the server allows, oversized heads sent in one write, a chat whose `tool_calls` the
template renders at length. Also: the connection budget's bookkeeping, 503 beyond `max_connections`, and `--port 0
--port-file`."""

import json
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from server_fixture import KEY, NAME  # noqa: E402

MAX_CONNECTIONS, MAX_PENDING = 40, 16
ATTACKERS = 100  # connections an attacker holds: more than the server's whole limit
TIMEOUT_S = 2.0  # head and body deadlines
AUTH = {"Authorization": f"Bearer {KEY}"}
VALID = {"model": NAME, "prompt": "12+34=", "max_tokens": 2}
TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}{{ m.tool_calls or '' }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.fixture(scope="module")
def served(tiny_llama_path, tmp_path_factory):
    """(port, process, what it printed) of `asyncflow serve --port 0 --port-file F` with small limits."""
    import asyncflow

    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "template.jinja").write_text(TEMPLATE)
    port_file, printed = tmp / "port", tmp / "stdout"
    command = [sys.executable, "-m", "asyncflow.cli", "serve", str(tiny_llama_path), "--port", "0",
               "--port-file", str(port_file), "--name", NAME, "--chat-template", str(tmp / "template.jinja"),
               "--threads", "1", "--max-connections", str(MAX_CONNECTIONS), "--max-pending-connections",
               str(MAX_PENDING), "--max-pending-per-client", str(MAX_PENDING), "--header-timeout-s", str(TIMEOUT_S),
               "--body-timeout-s", str(TIMEOUT_S)]
    src = str(Path(asyncflow.__file__).resolve().parents[1])
    env = {**os.environ, "ASYNCFLOW_API_KEY": KEY, "PYTHONPATH": src}
    with open(printed, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert server.poll() is None and time.monotonic() < deadline, printed.read_text()[-3000:]
            time.sleep(0.2)
        yield int(port_file.read_text()), server, printed
    finally:
        server.terminate()
        server.wait(30)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def while_attacked(port: int, attack, seconds: float = 4.0) -> tuple[list, list[float]]:
    """Run `attack(stop_event)` on a thread; after 0.5 s, for `seconds`, a bystander sends valid completions one
    after another and probes `GET /health` every 50 ms (a new connection each). -> (completion statuses, probe
    latencies in seconds)."""
    stop, statuses, latencies = threading.Event(), [], []

    def completions():
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10) as http:
            while not stop.is_set():
                try:
                    statuses.append(http.post("/v1/completions", json=VALID).status_code)
                except httpx.HTTPError as err:
                    statuses.append(repr(err))

    def probes():
        while not stop.is_set():
            started = time.perf_counter()
            try:  # a plain socket: a new httpx client per probe spent ~0.5 s of a loaded machine on its own setup
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    ok = sock.recv(100).startswith(b"HTTP/1.1 200")
            except OSError:
                ok = False
            latencies.append(time.perf_counter() - started if ok else float("inf"))
            stop.wait(0.05)

    attacker = threading.Thread(target=attack, args=(stop,), daemon=True)
    attacker.start()
    time.sleep(0.5)
    bystanders = [threading.Thread(target=f, daemon=True) for f in (completions, probes)]
    for thread in bystanders:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in (attacker, *bystanders):
        thread.join(30)
    return statuses, latencies


def assert_bystander_served(statuses: list, latencies: list[float]) -> None:
    """Every valid completion answered 200; `/health` within 0.5 s for 95% of probes and within 2 s for every one.
    A request that held the event loop froze the old server for up to 27 s. Measured on the shared 2-core machine at
    load average 11-12 with a soak running beside: p95 0.03-0.14 s, slowest 0.07-0.29 s per attack; the slowest
    probe gets 2 s, for a loaded machine that deschedules the server for a moment, which no server change can help."""
    assert statuses and all(s == 200 for s in statuses), statuses
    slowest = sorted(latencies)
    assert slowest and slowest[int(0.95 * (len(slowest) - 1))] < 0.5 and slowest[-1] < 2.0, slowest[-5:]


def hold_connections(port: int, count: int, opening: bytes, trickle: bytes, stop: threading.Event) -> None:
    """`count` connections that each send `opening`, then one byte of `trickle` every 0.5 s; each one the server
    answers or closes is opened again at once, until `stop`."""
    selector = selectors.DefaultSelector()

    def open_one():
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(opening)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, 0)

    def reopen(key):
        selector.unregister(key.fileobj)
        key.fileobj.close()
        open_one()

    for _ in range(count):
        open_one()
    next_byte = time.monotonic() + 0.5
    while not stop.is_set():
        for key, _ in selector.select(0.05):
            reopen(key)
        if trickle and time.monotonic() > next_byte:
            next_byte += 0.5
            for key in list(selector.get_map().values()):
                try:
                    key.fileobj.send(trickle[key.data : key.data + 1])
                    selector.modify(key.fileobj, selectors.EVENT_READ, min(key.data + 1, len(trickle) - 1))
                except OSError:
                    reopen(key)
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()


# ---------------------------------------------------------------- V1: huge arrays of bad items
def huge_arrays() -> list[tuple[str, bytes]]:
    """(path, body) pairs under the 2 MiB body limit whose arrays would each cost one validation error per item."""
    def body(**fields):
        return json.dumps({"model": NAME, "max_tokens": 2, **fields}, separators=(",", ":")).encode()

    chat = "/v1/chat/completions"
    return [
        ("/v1/completions", body(prompt=[0.5] * 500_000)),
        ("/v1/completions", body(prompt=[None] * 400_000)),
        ("/v1/completions", body(prompt=[[[0]]] * 300_000)),
        ("/v1/completions", body(prompt="a", stop=[1] * 1_000_000)),
        (chat, body(messages=[{"role": "x"}] * 140_000)),
        ("/v1/completions", body(prompt=[0.5] * 150_000)),  # under max_json_items: named by validation
        ("/v1/completions", body(prompt="a", stop=[1] * 90_000)),
        (chat, body(messages=[{"role": "x"}] * 90_000)),
        (chat, body(messages=[{"role": "user", "content": [{"type": "image"}] * 90_000}])),
    ]


@pytest.mark.slow
def test_huge_arrays_of_bad_items_are_small_400s_and_nobody_waits(served):
    port, server, _ = served
    requests, refused = huge_arrays(), []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10) as http:
        for _ in range(3):
            assert http.post("/v1/completions", json=VALID).status_code == 200
        rss_before = rss_mib(server.pid)

        def attack(stop):
            while not stop.is_set():
                for path, body in requests:
                    started = time.perf_counter()
                    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
                    refused.append((response.status_code, response.json()["error"]["param"], len(response.content),
                                    time.perf_counter() - started))

        statuses, latencies = while_attacked(port, attack)
        rss_after = rss_mib(server.pid)
    assert_bystander_served(statuses, latencies)
    assert len(refused) >= len(requests), refused
    for status, param, size, seconds in refused:
        assert status == 400 and param.split(".")[0] in ("body", "prompt", "stop", "messages") and size < 1000, refused
        assert seconds < 2, refused
    assert {"prompt", "stop", "messages"} <= {param.split(".")[0] for _, param, _, _ in refused}, refused
    assert abs(rss_after - rss_before) < 0.1 * rss_before, (rss_before, rss_after)


# ---------------------------------------------------------------- V2, V3: more connections than the server allows
@pytest.mark.slow
def test_partial_heads_without_the_key_take_no_place_of_a_valid_request(served):
    port, _, _ = served
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    statuses, latencies = while_attacked(
        port, lambda stop: hold_connections(port, ATTACKERS, head, b"X-Pad: " + b"y" * 1000, stop))
    assert_bystander_served(statuses, latencies)


@pytest.mark.slow
def test_trickled_bodies_with_the_key_take_no_place_of_a_valid_request(served):
    port, _, _ = served
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    statuses, latencies = while_attacked(
        port, lambda stop: hold_connections(port, ATTACKERS, head, b'{"model": "' + b"y" * 999, stop))
    assert_bystander_served(statuses, latencies)


@pytest.mark.slow
def test_a_trickled_body_gets_408_at_its_deadline_however_steadily_it_trickles(served):
    port, _, _ = served
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Length: 100\r\n\r\n".encode())
        started, answer = time.monotonic(), b""
        sock.settimeout(0.3)
        while not answer and time.monotonic() - started < TIMEOUT_S + 4:
            try:
                sock.send(b" ")  # a byte every 0.3 s: a per-piece timeout would never fire
                answer = sock.recv(65536)
            except TimeoutError:
                pass
            except OSError:
                break
    finally:
        sock.close()
    assert b" 408 " in answer.split(b"\r\n")[0] and time.monotonic() - started < TIMEOUT_S + 2, answer


@pytest.mark.slow
def test_requests_beyond_max_connections_get_503_and_pending_connections_do_not_count(served):
    port, _, _ = served
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):  # kept alive after an authorised request: each holds a place
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            assert b" 200 " in sock.recv(65536).split(b"\r\n")[0]
            held.append(sock)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=VALID, headers=AUTH,
                          timeout=10).status_code == 503
        held.pop().close()
        time.sleep(0.5)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=VALID, headers=AUTH,
                          timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()


# ---------------------------------------------------------------- V4: oversized heads in one write
@pytest.mark.slow
def test_a_head_over_max_header_bytes_gets_431_in_one_write_too(served):
    port, _, _ = served
    answers = []

    def attack(stop):
        while not stop.is_set():
            for pad in (17 * 1024, 100 * 1024):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                                 f"X-Pad: {'y' * pad}\r\n\r\n".encode())
                    answers.append(sock.recv(65536).split(b"\r\n")[0])

    statuses, latencies = while_attacked(port, attack, seconds=2)
    assert_bystander_served(statuses, latencies)
    assert answers and all(b" 431 " in a for a in answers), set(answers)


# ---------------------------------------------------------------- V5: a prompt that is not in `content`
@pytest.mark.slow
def test_the_prompt_limit_counts_every_field_the_template_renders_before_tokenising(served):
    port, _, _ = served
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "x " * 900_000}}]
    chat = {"model": NAME, "max_tokens": 2, "messages": [{"role": "assistant", "content": "", "tool_calls": calls}]}
    refused = []

    def attack(stop):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10) as http:
            while not stop.is_set():
                started = time.perf_counter()
                response = http.post("/v1/chat/completions", json=chat)
                refused.append((response.status_code, response.json()["error"], time.perf_counter() - started))

    statuses, latencies = while_attacked(port, attack, seconds=2)
    assert_bystander_served(statuses, latencies)
    assert refused and all(status == 400 and error["param"] == "messages" and "max_prompt_chars" in error["message"]
                           and seconds < 3 for status, error, seconds in refused), refused


# ---------------------------------------------------------------- V6: --port 0
@pytest.mark.slow
def test_port_0_prints_and_writes_the_port_it_listens_on(served):
    port, _, printed = served
    announced = re.search(r"serving .* at http://127\.0\.0\.1:(\d+)/v1", printed.read_text())
    assert port != 0 and announced and int(announced.group(1)) == port, printed.read_text()[-2000:]


# ---------------------------------------------------------------- the budget's bookkeeping
def test_the_connection_budget_closes_the_oldest_pending_that_had_its_grace():
    from asyncflow.serving.limits import ServingLimits
    from asyncflow.serving.server import PENDING_GRACE_S, ConnectionBudget

    budget = ConnectionBudget(ServingLimits(max_connections=2, max_pending_connections=3, max_pending_per_client=2))
    late = PENDING_GRACE_S[1] + 0.15  # every connection below has had its grace by then
    for name in "abcde":
        budget.opened(name)
    assert budget.pending("a", "1.1.1.1", 0.0) == [] and budget.pending("b", "1.1.1.1", 0.1) == []
    assert PENDING_GRACE_S[0] > 0.2 and budget.pending("c", "1.1.1.1", 0.2) == []  # at its limit, "a" in its grace
    assert budget.pending("d", "2.2.2.2", late) == ["a"]  # all at theirs: the oldest, who had its grace
    assert budget.pending("e", "1.1.1.1", late) == ["b"]  # its address at its limit: its oldest
    assert not budget.full()  # pending connections never count against max_connections
    budget.admitted("c")
    budget.admitted("d")
    assert budget.full()
    budget.closed("d")
    assert not budget.full() and budget.pending("c", "1.1.1.1", 10.0) == []  # "c" sends its next request


@pytest.mark.slow
def test_a_closed_connection_leaves_no_garbage_for_the_collector():
    """A closed connection is freed by reference counting, whether it sent part of a head or a whole request: a flood
    of closed connections leaves no cycles for the collector, whose full passes hold the event loop (with 20 objects
    in cycles per connection, a flood's 40 000 connections made passes of ~50 000 objects, 0.3-0.7 s each)."""
    import gc

    from asyncflow.serving.server import ServerThread

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = ServerThread(app).start()
    heads = {"part of a head": b"GET /health HTTP/1.1\r\nHost: x",
             "a whole request": b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"}
    gc.disable()
    try:
        for what, head in heads.items():
            gc.collect()
            for _ in range(50):
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    sock.sendall(head)
                    if what == "a whole request":
                        assert sock.recv(1000).startswith(b"HTTP/1.1 200")
            deadline = time.monotonic() + 10
            while server._server.server_state.connections and time.monotonic() < deadline:
                time.sleep(0.05)  # the server closes its side
            assert gc.collect() < 50, what  # 1000 before: 20 per connection
    finally:
        gc.enable()
        server.stop()


def test_the_server_runs_on_uvloop_where_installed():
    """uvloop (the `serve` extra) is the server's event loop: under the soak's connection floods alone, `/health`
    answered 3-15x sooner at the p99 on it than on asyncio's loop (benchmarks/flood_server.py, BENCHMARKS.md)."""
    import asyncio

    from asyncflow.serving.server import ServerThread

    uvloop = pytest.importorskip("uvloop")
    loops = []

    async def app(scope, receive, send):
        loops.append(type(asyncio.get_running_loop()))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = ServerThread(app).start()
    try:
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        server.stop()
    assert loops == [uvloop.Loop], loops
