"""Soak `asyncflow serve` on localhost with thousands of mixed valid and hostile requests, and say whether it held.

Starts the real command (`asyncflow serve preset:tiny-llama`, its own process) on a free loopback port and sends
`--requests` requests from `--concurrency` clients: valid completions and chats (plain, streamed to the end, and
streamed then dropped after the first chunk, extreme but valid sampling settings, stop strings at the limits) and
hostile ones (NaN / underflowing settings, token ids outside the vocabulary, bodies / prompts / stop strings /
prompts x n over the limits, deep JSON, garbage bytes, half-open connections, a stalled body, a body trickled a
byte at a time, heads over the size limit in one write, arrays of 10^5-10^6 bad items just under the body limit,
a chat whose `tool_calls` the template renders to 1.8 million characters).
Throughout, from another process, two floods hold more connections than the server's whole limit, each
reopened as soon as the server closes it: `--flood-heads` connections sending part of a request head without
the key, and `--flood-bodies` sending a request with the key whose body trickles a byte a second.
Meanwhile a probe on a thread of its own asks `GET /health` every 50 ms on a new connection: its slowest answer
bounds how long any request held the event loop (and so every other client); the slowest three are listed with the
kinds of request in flight then.
Prints one JSON object: status counts per kind ("closed": closed by the server without an answer), valid requests
answered 5xx or failed (must be 0), hostile requests answered other than 4xx or closed (must be 0), what the
server did to the flood connections, probe latency (max, p99), resident memory of the server process after
warm-up, by quarter of the run and at the end. A head trickled a byte at a time is not in the mix of requests (it
is slow by design): the partial-head flood trickles one on each of its connections.

    .venv/bin/python benchmarks/soak_server.py --requests 3000 --concurrency 16 --flood-heads 1100 --flood-bodies 1100

`--asyncio-loop` serves on asyncio's event loop instead of uvloop (the server as installed without the `serve` extra's
uvloop): the two side by side, with the same seed, measure what uvloop does under the floods.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

KEY = "soak-key"
NAME = "tiny"
TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}{{ m.tool_calls or '' }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
WORDS = "the a one two three four five plus minus equals is of and".split()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def event_loop(pid: int) -> str:
    """The server's event loop: uvloop if its extension module is mapped in the process, else asyncio's."""
    return "uvloop" if "/uvloop/loop." in Path(f"/proc/{pid}/maps").read_text() else "asyncio"


def health_latency(port: int) -> float:
    """Seconds from connecting to the answer of one `GET /health` on a new connection (which waits in the listen
    queue behind any connections a flood reopened); raises unless it is a 200."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        if not sock.recv(100).startswith(b"HTTP/1.1 200"):
            raise AssertionError("/health did not answer 200")
    return time.perf_counter() - started


def without_uvloop(env: dict[str, str], tmp: Path) -> dict[str, str]:
    """`env` with a module `uvloop` first on PYTHONPATH whose import fails (written under `tmp`): uvicorn's "auto"
    loop then falls back to asyncio's, as on a server installed without the `serve` extra's uvloop."""
    (tmp / "no_uvloop").mkdir(exist_ok=True)
    (tmp / "no_uvloop" / "uvloop.py").write_text("raise ImportError('uvloop hidden: the asyncio loop')\n")
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "no_uvloop"), env.get("PYTHONPATH")]))}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# ---------------------------------------------------------------- the request mix: (kind, valid, coroutine)
async def post(http, path, **kwargs) -> int:
    return (await http.post(path, **kwargs)).status_code


async def streamed(http, body, *, drop_after_first: bool) -> int:
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_lines():
            if drop_after_first:
                break  # leaving the block closes the connection mid-stream
        return response.status_code


async def raw_socket(port: int, payload: bytes, hold_s: float, trickle: bytes = b"", every_s: float = 1.0):
    """Send `payload`, then a byte of `trickle` every `every_s`, for up to `hold_s`: the status the server answered
    with, "closed" if it closed the connection without an answer, 599 if it was still open at the end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    deadline = time.monotonic() + hold_s
    try:
        writer.write(payload)
        await writer.drain()
        for byte in trickle or b" ":
            try:
                answer = await asyncio.wait_for(reader.read(), min(every_s if trickle else hold_s,
                                                                   max(deadline - time.monotonic(), 0)))
                return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else "closed"
            except asyncio.TimeoutError:
                if time.monotonic() >= deadline:
                    return 599  # still open: the server did not enforce its deadlines
                writer.write(bytes([byte]))
        return 599
    except ConnectionError:
        return "closed"
    finally:
        writer.close()


def huge_arrays() -> dict[str, tuple[str, bytes]]:
    """Bodies just under the 2 MiB limit whose arrays would each cost one validation error per item (built once:
    building them is the client's CPU, not the server's)."""
    def body(**fields) -> bytes:
        return json.dumps({"model": NAME, "max_tokens": 2, **fields}, separators=(",", ":")).encode()

    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "x " * 900_000}}]
    return {
        "bad_floats_prompt": ("/v1/completions", body(prompt=[0.5] * 500_000)),
        "bad_nulls_prompt": ("/v1/completions", body(prompt=[None] * 400_000)),
        "bad_nested_prompt": ("/v1/completions", body(prompt=[[[0]]] * 300_000)),
        "bad_int_stops": ("/v1/completions", body(prompt="a", stop=[1] * 1_000_000)),
        "bad_role_messages": ("/v1/chat/completions", body(messages=[{"role": "x"}] * 140_000)),
        "bad_floats_under_item_limit": ("/v1/completions", body(prompt=[0.5] * 150_000)),
        "long_tool_calls": ("/v1/chat/completions", body(messages=[{"role": "assistant", "tool_calls": calls}])),
    }



def make_request(rng: random.Random, http, port: int, huge: dict[str, tuple[str, bytes]]):
    base = {"model": NAME, "max_tokens": rng.randint(1, 8)}
    valid = [
        ("completion", lambda: post(http, "/v1/completions", json={**base, "prompt": text(rng, rng.randint(1, 40))})),
        ("chat", lambda: post(http, "/v1/chat/completions", json={
            **base, "messages": [{"role": "user", "content": text(rng, rng.randint(1, 30))}]})),
        ("stream", lambda: streamed(http, {**base, "prompt": text(rng, 10), "stream": True}, drop_after_first=False)),
        ("stream_dropped", lambda: streamed(http, {**base, "max_tokens": 24, "prompt": text(rng, 10), "stream": True},
                                            drop_after_first=True)),
        ("tiny_top_p", lambda: post(http, "/v1/completions", json={**base, "prompt": "one", "top_p": 1e-300})),
        ("stops_at_limit", lambda: post(http, "/v1/completions", json={
            **base, "prompt": text(rng, 20), "stop": ["x" * 127 + str(i) for i in range(8)], "logprobs": 1})),
        ("n_batch", lambda: post(http, "/v1/completions", json={**base, "prompt": [text(rng, 5)] * 4, "n": 4})),
    ]
    hostile = [
        ("nan_temperature", lambda: post(http, "/v1/completions", content=(
            '{"model": "tiny", "prompt": "a", "temperature": NaN}'))),
        ("tiny_temperature", lambda: post(http, "/v1/completions", json={**base, "prompt": "a", "temperature": 1e-45})),
        ("bad_token_ids", lambda: post(http, "/v1/completions", json={**base, "prompt": [rng.choice([-1, 10**30])]})),
        ("long_stop", lambda: post(http, "/v1/completions", json={**base, "prompt": "a", "stop": "ab" * 50_000})),
        ("many_stops", lambda: post(http, "/v1/completions", json={**base, "prompt": "a", "stop": list("abcdefghij")})),
        ("long_prompt", lambda: post(http, "/v1/completions", json={**base, "prompt": "one " * 60_000})),
        ("huge_body", lambda: post(http, "/v1/completions", json={**base, "prompt": "a", "user": "x" * 3_000_000})),
        ("prompts_x_n", lambda: post(http, "/v1/completions", json={**base, "prompt": ["a"] * 16, "n": 16})),
        ("deep_json", lambda: post(http, "/v1/completions", content="[" * 100_000)),
        ("garbage", lambda: post(http, "/v1/chat/completions", content=rng.randbytes(200))),
        ("half_open", lambda: raw_socket(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 15)),
        ("stalled_body", lambda: raw_socket(port, (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Length: 500\r\n\r\n{\"model\"").encode(), 15)),
        ("trickled_body", lambda: raw_socket(port, (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Length: 500\r\n\r\n").encode(), 15, b'{"model": ' + b" " * 400, every_s=0.5)),
        ("big_head", lambda: raw_socket(port, (
            f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"X-Pad: {'y' * rng.choice([17 * 1024, 100 * 1024])}\r\n\r\n").encode(), 15)),
        *((kind, lambda path=path, body=body: post(http, path, content=body, headers={
            "Content-Type": "application/json"})) for kind, (path, body) in huge.items()),
    ]
    is_valid = rng.random() < 0.6
    kind, make = rng.choice(valid if is_valid else hostile)
    return kind, is_valid, make


# ---------------------------------------------------------------- the floods, in their own process
FLOOD_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
FLOOD_BODY_HEAD = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()


def run_floods(port: int, heads: int, bodies: int, stop, results) -> None:
    """`heads` connections sending part of a head without the key and `bodies` sending a request with the key whose
    body trickles, a byte a second each, every one reopened once the server answers or closes it, until `stop`
    (a multiprocessing Event) is set; then puts {flood: {what the server did: count}} on `results`."""
    asyncio.run(_floods(port, heads, bodies, stop, results))


async def _floods(port: int, heads: int, bodies: int, stop, results) -> None:
    outcomes: dict[str, Counter] = defaultdict(Counter)

    async def hold(flood: str, opening: bytes, trickle: bytes) -> None:
        while not stop.is_set():
            try:
                outcome = await raw_socket(port, opening, 3600, trickle)
            except OSError as err:  # refused or out of file descriptors: try again shortly
                outcome = type(err).__name__
                await asyncio.sleep(0.1)
            outcomes[flood][outcome] += 1

    tasks = [asyncio.create_task(hold("partial_head_no_key", FLOOD_HEAD, b"X-Pad: " + b"y" * 100_000))
             for _ in range(heads)]
    tasks += [asyncio.create_task(hold("trickled_body_with_key", FLOOD_BODY_HEAD, b'{"model": ' + b" " * 100_000))
              for _ in range(bodies)]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()  # (`wait_for` may swallow a cancellation: then the loop's `stop` check ends the task)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    results.put({flood: dict(counts) for flood, counts in outcomes.items()})


async def soak(args, port: int, pid: int) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=120, limits=limits) as http:
        for _ in range(20):  # warm-up before the first memory reading
            await post(http, "/v1/completions", json={"model": NAME, "prompt": "one two", "max_tokens": 4})
        rss_start = rss_kib(pid)
        statuses: dict[str, Counter] = defaultdict(Counter)
        valid_5xx, errors, hostile_not_refused = 0, Counter(), Counter()
        probe_latencies: list[float] = []
        slowest: list[tuple[float, list[str]]] = []  # the slowest probes and the kinds in flight when they began
        in_flight: Counter = Counter()
        rss_samples: list[int] = []
        done = threading.Event()

        def probe():  # on a thread of its own: the clients' event loop, busy with their bodies, does not delay it
            while not done.is_set():
                kinds = sorted(k for k, v in dict(in_flight).items() if v)
                latency = health_latency(port)
                probe_latencies.append(latency)
                slowest.append((round(latency, 3), kinds))
                slowest.sort(key=lambda item: -item[0])
                del slowest[3:]
                if len(probe_latencies) % 20 == 0:
                    rss_samples.append(rss_kib(pid))
                done.wait(0.05)

        queue: asyncio.Queue = asyncio.Queue()
        huge = huge_arrays()
        for _ in range(args.requests):
            queue.put_nowait(make_request(rng, http, port, huge))

        async def client():
            nonlocal valid_5xx
            while not queue.empty():
                kind, is_valid, make = queue.get_nowait()
                in_flight[kind] += 1
                try:
                    status = await make()
                except (httpx.HTTPError, OSError) as err:  # e.g. the server closing a refused upload
                    status = "timeout" if isinstance(err, httpx.TimeoutException) else "closed"
                    errors[f"{kind}: {type(err).__name__}"] += 1
                finally:
                    in_flight[kind] -= 1
                statuses[kind][status] += 1
                if is_valid and (not isinstance(status, int) or status >= 500):
                    valid_5xx += 1
                if not is_valid and status != "closed" and not (isinstance(status, int) and 400 <= status < 500):
                    hostile_not_refused[kind] += 1

        spawn = multiprocessing.get_context("spawn")
        stop_floods, flood_results = spawn.Event(), spawn.Queue()
        flooder = spawn.Process(target=run_floods, args=(port, args.flood_heads, args.flood_bodies, stop_floods,
                                                          flood_results), daemon=True)
        flooder.start()
        await asyncio.sleep(5)  # the floods open their connections (and the server closes the first of them)
        started = time.monotonic()
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
        done.set()
        await asyncio.to_thread(prober.join, 120)
        stop_floods.set()
        floods = await asyncio.to_thread(flood_results.get, timeout=120)
        flooder.join(30)
        health = (await http.get("/health")).json()
        final = await post(http, "/v1/completions", json={"model": NAME, "prompt": "one two", "max_tokens": 4})
    probe_sorted = sorted(probe_latencies)
    return {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": round(elapsed, 1),
        "valid_requests_5xx_or_failed": valid_5xx,
        "hostile_requests_not_4xx_or_closed": dict(hostile_not_refused),
        "statuses": {kind: dict(counter) for kind, counter in sorted(statuses.items())},
        "transport_errors": dict(errors),
        "floods": {"connections": {"partial_head_no_key": args.flood_heads,
                                   "trickled_body_with_key": args.flood_bodies}, "what_the_server_did": floods},
        "probe_health_latency_s": {"max": round(probe_sorted[-1], 3),
                                   "p99": round(probe_sorted[int(0.99 * (len(probe_sorted) - 1))], 3),
                                   "median": round(statistics.median(probe_sorted), 3), "samples": len(probe_sorted),
                                   "slowest_with_kinds_in_flight": slowest},
        "rss_mib": {"after_warmup": round(rss_start / 1024, 1), "end": round(rss_kib(pid) / 1024, 1),
                    "growth": round((rss_kib(pid) - rss_start) / 1024, 1),
                    "by_quarter_of_the_run": [round(rss_samples[min(len(rss_samples) - 1, q * len(rss_samples) // 4)]
                                                    / 1024, 1) for q in (1, 2, 3, 4)] if rss_samples else []},
        "health_at_end": health, "normal_request_at_end": final, "server_event_loop": event_loop(pid),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="preset:tiny-llama")
    parser.add_argument("--flood-heads", type=int, default=1100, help="connections sending part of a head, no key")
    parser.add_argument("--flood-bodies", type=int, default=1100, help="connections trickling a body, with the key")
    parser.add_argument("--asyncio-loop", action="store_true", help="hide uvloop from the server: asyncio's loop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        template, port_file = Path(tmp) / "template.jinja", Path(tmp) / "port"
        template.write_text(TEMPLATE)
        cli = [sys.executable, "-m", "asyncflow.cli", "serve", args.model, "--port", "0", "--port-file", str(port_file),
               "--name", NAME, "--chat-template", str(template), "--threads", "1", "--header-timeout-s", "5",
               "--body-timeout-s", "5"]
        env = {**os.environ, "ASYNCFLOW_API_KEY": KEY}
        if args.asyncio_loop:
            env = without_uvloop(env, Path(tmp))
        server = subprocess.Popen(cli, env=env, stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "server.log", "w"))
        try:
            deadline = time.monotonic() + 180
            while not port_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start: {(Path(tmp) / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
            result = asyncio.run(soak(args, int(port_file.read_text()), server.pid))
        finally:
            server.terminate()
            server.wait(30)
    print(json.dumps(result, indent=1))
    held = (result["valid_requests_5xx_or_failed"] == 0 and not result["hostile_requests_not_4xx_or_closed"]
            and result["normal_request_at_end"] == 200)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
