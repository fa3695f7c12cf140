"""A run seen while it runs: `/metrics` scraped between steps shows its series moving, and a run whose reward
blocks is ended by the watchdog with the reward stage named."""

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from asyncflow import open_run
from asyncflow.config import build_config
from asyncflow.workflow.run import METRICS_PORT_FILE, RunStalled

UNBLOCK = threading.Event()  # set at the end of the stall test, so the blocked reward call returns
CALLS = {"n": 0}


def parity_reward(completion: str, ground_truth: str, **metadata) -> float:
    return float(len(completion) % 2)


def reward_that_blocks_after_one_step(completion: str, ground_truth: str, **metadata) -> float:
    CALLS["n"] += 1
    if CALLS["n"] > 16:  # the first step's 4 prompts x 4 samples score; then the reward hangs
        UNBLOCK.wait(120)
    return float(len(completion) % 2)


def tiny_config(run_dir: Path, *overrides: str):
    data = run_dir.parent / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a + 3}=", "answer": str(2 * a + 3)}) + "\n" for a in range(8)))
    return build_config({}, [
        f"run.output_dir={run_dir}", "run.progress=false", "model.path=preset:tiny-llama", "data.task=null",
        f"data.path={data}", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "train.micro_batch_size=16", "eval.every=0", "checkpoint.every=0", "runtime.kind=inline",
        "observe.tensorboard=false", "export.at_end=false", *overrides,
    ])  # fmt: skip


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.slow
def test_metrics_scraped_during_a_run_move(tmp_path, one_torch_thread):
    run_dir = tmp_path / "run"
    scrapes = []

    def on_step(row: dict) -> None:
        if "loss" in row:
            scrapes.append(scrape(int((run_dir / METRICS_PORT_FILE).read_text())))

    config = tiny_config(run_dir, "train.steps=3", "workflow.mode=async", "workflow.max_staleness=1",
                         "reward.fns=[test_watch:parity_reward]", "observe.metrics_port=0")
    with open_run(config, on_step=on_step) as run:
        run.train()
    first, last = scrapes[0], scrapes[-1]
    assert len(scrapes) == 3
    assert (first["asyncflow_step"], last["asyncflow_step"]) == (1, 3)
    assert last["asyncflow_weight_version"] == 3
    for series in ('asyncflow_queue_rows_produced{column="reward"}', 'asyncflow_queue_rows_consumed{task="train"}',
                   "asyncflow_samples", "asyncflow_wall_s"):
        assert last[series] > first[series], series
    assert last["asyncflow_rollout_tokens"] > 0 and last["asyncflow_throughput_tokens_per_s"] > 0
    assert "asyncflow_staleness_mean" in last
    assert "asyncflow_reward_errors_total" in last
    assert any(name.startswith('asyncflow_idle_fraction{worker="trainer"}') for name in last)
    # after step 1 the next partition is in flight (the last step leaves none)
    assert first['asyncflow_queue_rows{partition="step_1"}'] == 16
    assert 'asyncflow_queue_rows_ready{column="prompt_ids",partition="step_1"}' in first
    assert any(name.startswith("asyncflow_replica_weight_version{") for name in last)


@pytest.mark.slow
def test_a_blocked_reward_is_named_by_the_watchdog_and_ends_the_run(tmp_path, one_torch_thread):
    stall_s = 3.0
    config = tiny_config(tmp_path / "run", "train.steps=3", "workflow.mode=stream",
                         "reward.fns=[test_watch:reward_that_blocks_after_one_step]", "reward.timeout_s=300",
                         f"observe.stall_s={stall_s}", "observe.stall_action=stop")
    steps = []
    try:
        with open_run(config, on_step=lambda row: steps.append(time.monotonic())) as run:
            with pytest.raises(RunStalled, match="the reward stage has .* rows to write 'reward'.*train waits") as err:
                run.train()
    finally:
        UNBLOCK.set()
    assert len(steps) == 2  # step 0's row and the first step's; then the reward blocked
    assert time.monotonic() - steps[-1] < stall_s + 10
    assert "step 1: no progress for" in str(err.value)
