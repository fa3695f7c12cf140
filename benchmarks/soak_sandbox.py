"""Soak the python tool's strict sandbox with hostile code, 8 calls at once as a rollout's ToolBox runs them, and
say whether the host held.

Owns nothing the library imports. Runs `--rounds` rounds of every attack in tests/envs/sandbox_cases.py (host
kernel settings, SysV / /dev/shm / memfd / scratch fills, thread bombs, CPU and memory exhaustion, output floods,
forged exit statuses) through one `ToolBox` with 8 workers, while a sampler reads the host every 20 ms: its task
count (/proc/loadavg) and MemAvailable. Prints one JSON object: calls, the tool's answers per attack (first words),
the host's task count and available memory before, at worst and after, SysV segments and the host sysctl before
and after, and call latency.

    .venv/bin/python benchmarks/soak_sandbox.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "envs"))
from sandbox_cases import CASES, HOST_SYSCTL, LIMITS  # noqa: E402

from asyncflow.envs.tools import ToolBox  # noqa: E402

WORKERS = 8


def host_tasks() -> int:
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def available_mb() -> float:
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tools = ToolBox(timeout_s=LIMITS.timeout_s, max_output_chars=200, workers=WORKERS, limits=LIMITS)
    sysctl, segments = Path(HOST_SYSCTL).read_text(), Path("/proc/sysvipc/shm").read_text()
    tasks_before, memory_before = host_tasks(), available_mb()
    samples: list[tuple[int, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            samples.append((host_tasks(), available_mb()))

    def call(name: str) -> tuple[str, str, float]:
        start = time.monotonic()
        result = tools.call("python", {"code": CASES[name]})
        return name, result.text, time.monotonic() - start

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        done = list(pool.map(call, [name for _ in range(args.rounds) for name in CASES]))
    wall = time.monotonic() - start
    stop.set()
    sampler.join()
    tools.close()
    time.sleep(0.5)
    answers: dict[str, Counter] = defaultdict(Counter)
    for name, text, _ in done:
        answers[name][" ".join(text.split()[:6])[:80]] += 1
    latencies = sorted(seconds for _, _, seconds in done)
    print(json.dumps({
        "calls": len(done), "wall_s": round(wall, 1), "concurrent_calls": WORKERS,
        "limits": {"memory_mb": LIMITS.memory_mb, "scratch_mb": LIMITS.scratch_mb, "max_threads": LIMITS.max_threads},
        "answers": {name: dict(counts) for name, counts in answers.items()},
        "host_tasks": {"before": tasks_before, "max": max(t for t, _ in samples), "after": host_tasks()},
        "host_available_mb": {"before": round(memory_before), "min": round(min(m for _, m in samples)),
                              "after": round(available_mb())},
        "host_sysctl_unchanged": Path(HOST_SYSCTL).read_text() == sysctl,
        "host_sysv_segments_unchanged": Path("/proc/sysvipc/shm").read_text() == segments,
        "latency_s": {"p50": round(statistics.median(latencies), 2), "max": round(latencies[-1], 2)},
    }, indent=1))


if __name__ == "__main__":
    main()
