"""The connection floods of `soak_server.py` alone against `asyncflow serve`, on uvloop and on asyncio's event loop
side by side: the server's CPU per flood connection it closes and the latency of `GET /health` meanwhile.

For each of `--rounds` rounds, for each loop, starts the real command (`asyncflow serve preset:tiny-llama`, its own
process, the soak's flags: `--header-timeout-s 5 --body-timeout-s 5`), lets the floods (`--flood-heads` partial heads
without the key, `--flood-bodies` trickled bodies with it, each reopened once the server closes it) run for
`--seconds` after a 3 s start, and meanwhile asks `GET /health` every 50 ms, each time on a new connection (which
waits in the listen queue behind the floods' reopened connections). Prints one JSON line per run: server CPU seconds
(user + system, from /proc) over the floods, connections the server closed, milliseconds of CPU per closed
connection, probe latency (median, p99, max) and the load average at the end. Run the loops in one invocation: the
machine's load moves the absolute numbers, the side-by-side ratio is the measurement.

    .venv/bin/python benchmarks/flood_server.py --seconds 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from soak_server import KEY, event_loop, health_latency, run_floods, without_uvloop  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def probe(port: int, stop: threading.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        latencies.append(health_latency(port))
        stop.wait(0.05)


def run(args, loop: str, tmp: Path) -> dict:
    port_file = tmp / f"port-{time.monotonic_ns()}"
    env = {**os.environ, "ASYNCFLOW_API_KEY": KEY}
    if loop == "asyncio":
        env = without_uvloop(env, tmp)
    cli = [sys.executable, "-m", "asyncflow.cli", "serve", args.model, "--port", "0", "--port-file", str(port_file),
           "--threads", "1", "--header-timeout-s", "5", "--body-timeout-s", "5"]
    server = subprocess.Popen(cli, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "server.log", "a"))
    try:
        deadline = time.monotonic() + 180
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        port = int(port_file.read_text())
        spawn = multiprocessing.get_context("spawn")
        stop_floods, results = spawn.Event(), spawn.Queue()
        cpu_before = cpu_seconds(server.pid)
        flooder = spawn.Process(target=run_floods, args=(port, args.flood_heads, args.flood_bodies, stop_floods,
                                                         results), daemon=True)
        flooder.start()
        time.sleep(3)
        latencies: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(target=probe, args=(port, stop, latencies))
        prober.start()
        time.sleep(args.seconds)
        stop.set()
        prober.join(120)
        stop_floods.set()
        floods = results.get(timeout=120)
        cpu = cpu_seconds(server.pid) - cpu_before
        served_on = event_loop(server.pid)
        flooder.join(30)
    finally:
        server.terminate()
        server.wait(30)
    closed = sum(outcomes.get("closed", 0) for outcomes in floods.values())
    ordered = sorted(latencies)
    return {"event_loop": served_on, "server_cpu_s": round(cpu, 2), "flood_connections_closed": closed,
            "cpu_ms_per_closed_connection": round(1000 * cpu / max(closed, 1), 3), "floods": floods,
            "probe_health_latency_s": {"median": round(statistics.median(ordered), 3),
                                       "p99": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
                                       "max": round(ordered[-1], 3), "samples": len(ordered)},
            "load_average_1m": round(os.getloadavg()[0], 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the probe runs under the floods")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (uvloop, asyncio)")
    parser.add_argument("--model", default="preset:tiny-llama")
    parser.add_argument("--flood-heads", type=int, default=1100, help="connections sending part of a head, no key")
    parser.add_argument("--flood-bodies", type=int, default=1100, help="connections trickling a body, with the key")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for loop in ("uvloop", "asyncio"):
                print(json.dumps(run(args, loop, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
