"""`/metrics` and the watchdog on their own: names, values, a failing probe, a stall reported once per stall."""

import threading
import time
import urllib.request

from asyncflow.observe.live import LiveMetrics, Watchdog, prometheus_name


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_prometheus_names():
    assert prometheus_name("throughput/tokens_per_s") == "asyncflow_throughput_tokens_per_s"
    assert prometheus_name("memory/peak_rss_mb/rank-0") == "asyncflow_memory_peak_rss_mb_rank_0"


def test_the_last_row_and_the_probes_are_served_and_a_failing_probe_only_drops_its_series():
    calls = []

    def queue() -> dict:
        calls.append(1)
        return {"queue_rows_ready": {(("partition", "step_1"), ("column", "reward")): 12.0 + len(calls)}}

    def broken() -> dict:
        raise RuntimeError("the queue actor is gone")

    live = LiveMetrics(0, {"queue": queue, "broken": broken})
    try:
        live.record({"step": 3, "throughput/tokens_per_s": 250.0, "kl": float("nan"), "note": "text is left out"})
        first = scrape(live.port)
        assert first["asyncflow_step"] == 3 and first["asyncflow_throughput_tokens_per_s"] == 250.0
        assert 'asyncflow_queue_rows_ready{column="reward",partition="step_1"}' in first
        assert not any("note" in name for name in first)
        live.record({"step": 4, "throughput/tokens_per_s": 300.0})
        second = scrape(live.port)
        assert second["asyncflow_step"] == 4
        key = 'asyncflow_queue_rows_ready{column="reward",partition="step_1"}'
        assert second[key] == first[key] + 1  # probes are read at each scrape
    finally:
        live.close()


def test_the_watchdog_names_a_stall_once_and_calls_on_stall():
    stalls = []
    watchdog = Watchdog(0.4, progress=lambda: 7, explain=lambda: "the reward stage has 3 rows to write 'reward'",
                        on_stall=stalls.append)
    try:
        deadline = time.monotonic() + 10
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert len(stalls) == 1 and watchdog.stalls == 1  # once per stall, not every check
        assert "no progress for" in stalls[0] and "reward stage" in stalls[0] and "stall_s=0.4" in stalls[0]
    finally:
        watchdog.close()


def test_the_watchdog_is_quiet_while_the_run_moves():
    counter = iter(range(10**9))
    lock = threading.Lock()

    def progress() -> int:
        with lock:
            return next(counter)

    stalls = []
    watchdog = Watchdog(0.3, progress=progress, explain=lambda: "", on_stall=stalls.append)
    time.sleep(1.2)
    watchdog.close()
    assert stalls == [] and watchdog.stalls == 0
