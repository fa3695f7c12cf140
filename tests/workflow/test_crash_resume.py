"""Crash and resume in every workflow mode (issue 15, item 2): `asyncflow train` runs as a subprocess, is
killed with SIGKILL at a random step after at least one checkpoint, and `--resume` finishes the run. Then
every prompt was trained exactly once (each step's metrics name the group ids it trained: group ids are
handed out in data order, so the steps must tile 0..N-1 in order), each step trained the same prompts with
the same staleness, and the final weights are bit-identical to a run that was never interrupted.

The runs use one rollout replica, one micro-batch per step and no core lending: that makes `stream` and
`async` (k=1) deterministic (docs/reliability.md). The workers run inline (threads of the driver) to
keep the tests short; `test_async_ray_driver_killed` does the same with Ray replicas and shared-memory
weights, and checks that the killed driver's /dev/shm segments are gone once the resumed run starts.
`test_killed_sft_resumes_exactly` kills `asyncflow sft` the same way: run again, it continues from its
checkpoint and saves, bit for bit, the model an uninterrupted SFT saves.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncflow.cli import main
from asyncflow.runtime import inline
from asyncflow.workers.loops import rollout_loop

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
STEPS, PROMPTS, GROUP = 8, 4, 4
MODES = {
    "sync": ["workflow.mode=sync"],
    "stream": ["workflow.mode=stream"],
    "async": ["workflow.mode=async", "workflow.max_staleness=1"],
}
TIMING_KEYS = ("time/", "throughput/", "wall_s", "memory/", "weights/update_")  # when a replica took a version


def parity_reward(completion: str, ground_truth: str, **metadata) -> float:
    """Varies within a group even for an untrained model, so every step changes the weights."""
    return float(len(completion) % 2)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(40)]  # fewer than the run needs: two epochs
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    return path


def argv(run_dir: Path, data: Path, mode: str, *extra: str) -> list[str]:
    return [
        "train", "run.progress=false", "model.path=preset:tiny-llama", "data.task=null", f"data.path={data}",
        "reward.fns=[test_crash_resume:parity_reward]", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}", "rollout.max_new_tokens=4", "rollout.max_batch_size=16",
        f"train.steps={STEPS}", f"train.micro_batch_size={PROMPTS * GROUP}", "train.lr=1e-3", "eval.every=0",
        "checkpoint.every=1", f"checkpoint.keep={STEPS}", "runtime.lend_idle_cores=false",
        "runtime.call_timeout_s=60", "runtime.kind=inline", *MODES[mode], *extra,
        "--output", str(run_dir), "--threads", "1",
    ]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in rows]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))


def kill_at_random_step(run_dir: Path, args: list[str], seed: int, started: dict | None = None) -> int:
    """Run `asyncflow train` in a subprocess and SIGKILL it at a random point after checkpoint `step_k`
    (k random in 1..STEPS-2) and at the latest when checkpoint `step_k+1` is written; returns k.
    `started["pid"]` gets the process id."""
    rng = random.Random(seed)
    after = rng.randint(1, STEPS - 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncflow.cli", *args], env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    if started is not None:
        started["pid"] = proc.pid
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / f"step_{after}" / "state.json").exists():
            assert proc.poll() is None, f"the run ended before checkpoint {after}: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.01)
        kill_at = time.monotonic() + rng.random() * 0.5  # anywhere in the next step
        while time.monotonic() < kill_at and not (run_dir / "checkpoints" / f"step_{after + 1}").exists():
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the driver started (a local Ray cluster)
        except ProcessLookupError:
            pass
        proc.wait(30)
    assert not (run_dir / "checkpoints" / f"step_{STEPS}").exists(), "killed after the run had finished"
    return after


def check_exactly_once(rows: list[dict]) -> None:
    """Steps 0..STEPS logged once each; step s trained the PROMPTS prompts with group ids
    (s-1)*PROMPTS .. s*PROMPTS-1, all GROUP samples of each."""
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for r in rows[1:]:
        first = (r["step"] - 1) * PROMPTS
        assert (r["data/group_id_min"], r["data/group_id_max"]) == (first, first + PROMPTS - 1), r
        assert r["data/groups"] == PROMPTS and r["rollout/samples"] == PROMPTS * GROUP, r


def crash_and_resume(tmp_path, data_file, mode: str, *extra: str, seed: int) -> tuple[Path, int]:
    run_dir = tmp_path / "crashed"
    after = kill_at_random_step(run_dir, argv(run_dir, data_file, mode, *extra), seed)
    assert main([*argv(run_dir, data_file, mode, *extra), "--resume"]) == 0
    return run_dir, after


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_killed_run_resumes_exactly(tmp_path, data_file, mode):
    seed = random.randrange(1 << 30)
    straight = tmp_path / "straight"
    assert main(argv(straight, data_file, mode)) == 0
    crashed, after = crash_and_resume(tmp_path, data_file, mode, seed=seed)
    note = f"(killed after checkpoint {after}, seed {seed})"
    resumed = metrics(crashed)
    check_exactly_once(resumed)
    if mode == "async":
        schedules = [[r["staleness/max"] for r in rows[2:]] for rows in (metrics(straight), resumed)]
        assert all(s <= 1 for schedule in schedules for s in schedule), f"the staleness bound is kept {note}"
        if schedules != [[1.0] * (STEPS - 1)] * 2:
            # a replica that lost its race against the trainer (a rollout thread descheduled for a training step,
            # docs/reliability.md) sampled a partition with the newer version: a run of another schedule, not
            # comparable bit for bit. Seen with two `yes` processes and two test workers on two cores.
            warnings.warn(f"async lost its race {note}: staleness {schedules}", stacklevel=1)
            return
    expected = without_timing(metrics(straight))
    assert expected == without_timing(resumed), f"the resumed run trained otherwise {note}"
    a, b = final_weights(straight), final_weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a), f"final weights differ from the uninterrupted run {note}"


@pytest.mark.slow
def test_resumed_async_run_keeps_its_schedule_when_the_replica_starts_late(tmp_path, data_file, monkeypatch):
    """The resumed run trains the rows its checkpoint carried while the replica may still be starting (a Ray
    actor, a loaded machine). The partition after them must still be generated by the weights the
    uninterrupted run used, not by whatever training reached meanwhile: same metrics, same final weights."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(argv(straight, data_file, "async")) == 0
    shutil.copytree(straight, resumed)
    at = 4
    for s in range(at + 1, STEPS + 1):
        shutil.rmtree(resumed / "checkpoints" / f"step_{s}")
    carried = json.loads((resumed / "checkpoints" / f"step_{at}" / "state.json").read_text())
    assert carried["workflow"]["rollouts_ahead"], "the checkpoint carries rows generated ahead"

    def late_rollout_loop(*args, **kwargs):
        time.sleep(3.0)  # several training steps of this run
        return rollout_loop(*args, **kwargs)

    monkeypatch.setattr(inline, "rollout_loop", late_rollout_loop)
    assert main([*argv(resumed, data_file, "async"), "--resume"]) == 0
    rows = metrics(resumed)
    assert [r["staleness/max"] for r in rows[2:]] == [1.0] * (STEPS - 1)
    assert without_timing(rows) == without_timing(metrics(straight))
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith("asyncflow-") and f"-{pid}." in name]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_async_ray_driver_killed(tmp_path, data_file, ray_cluster):
    """The default deployment of `async`: a driver that started its own local Ray cluster, a rollout actor,
    weights through /dev/shm, the trainer borrowing the replica's idle core. kill -9 leaves the driver's
    weight file and core-lending flags in /dev/shm; the resumed run (on the test session's cluster) removes
    them, trains every prompt once and keeps the staleness schedule (1 from the second step on). Core
    lending makes the float summation order depend on timing, so the weights are not compared here."""
    ray_args = ["runtime.kind=ray", "runtime.num_cpus=2", "runtime.lend_idle_cores=true"]
    seed = random.randrange(1 << 30)
    run_dir = tmp_path / "crashed"
    args = argv(run_dir, data_file, "async", *ray_args)
    driver: dict = {}
    after = kill_at_random_step(run_dir, args, seed, started=driver)
    left = segments_of(driver["pid"])
    assert {name.split("-")[1] for name in left} == {"weights", "cores"}, f"kill -9 leaves both segments: {left}"
    assert main([*args, "--resume"]) == 0
    assert segments_of(driver["pid"]) == [], "the resumed run removed the killed driver's segments"
    resumed = metrics(run_dir)
    check_exactly_once(resumed)
    assert [r["staleness/max"] for r in resumed[2:]] == [1.0] * (STEPS - 1), f"killed after {after}, seed {seed}"


@pytest.mark.slow
def test_async_ray_collective_weights_resume(tmp_path, data_file, ray_cluster):
    """kill -9 and `--resume` of `async` on Ray with weights by `torch_distributed`, whose receiver's poll consumes
    the version it returns: the resumed replica takes the checkpoint's version from its first poll and must count
    it for the staleness bound (it used to wait for a newer one the trainer never published)."""
    run_dir, ray_args = tmp_path / "crashed", ["runtime.kind=ray", "runtime.weight_sync=torch_distributed",
                                               "runtime.lend_idle_cores=false"]
    args = argv(run_dir, data_file, "async", *ray_args)
    # the killed driver joins the session's cluster (a driver that starts its own Ray: test_async_ray_driver_killed)
    address = ray_cluster.get_runtime_context().gcs_address
    joined = argv(run_dir, data_file, "async", *ray_args, f"runtime.address={address}")
    after = kill_at_random_step(run_dir, joined, seed=0)  # after checkpoint 4: resumes at step >= 4
    assert after == 4 and main([*args, "--resume"]) == 0
    check_exactly_once(metrics(run_dir))


PPO = {  # PPO with a critic (issue 27): a value head in sync and async, a separate value model in stream
    "sync": ["algo.advantage=gae"],
    "stream": ["algo.advantage=gae", "algo.critic.kind=separate", "algo.critic.lr=3e-3"],
    "async": ["algo.advantage=gae", "algo.lam=0.9"],
}


def critic_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / f"step_{STEPS}" / "training_state.pt", weights_only=False)
    return state["critic"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_killed_ppo_run_resumes_exactly(tmp_path, data_file, mode):
    """kill -9 and `--resume` of a PPO run with a critic: every prompt trained once, the same metrics (value loss
    and explained variance included) and bit-identical final policy AND critic weights."""
    seed = random.randrange(1 << 30)
    straight = tmp_path / "straight"
    assert main(argv(straight, data_file, mode, *PPO[mode])) == 0
    crashed, after = crash_and_resume(tmp_path, data_file, mode, *PPO[mode], seed=seed)
    note = f"(killed after checkpoint {after}, seed {seed})"
    resumed = metrics(crashed)
    check_exactly_once(resumed)
    assert all("value/loss" in r and "value/explained_variance" in r for r in resumed[1:])
    assert without_timing(metrics(straight)) == without_timing(resumed), f"the resumed run trained otherwise {note}"
    a, b = final_weights(straight), final_weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a), f"final policy weights differ {note}"
    a, b = critic_weights(straight), critic_weights(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"final critic weights differ {note}"


SFT_STEPS = 10
EXAMPLE = str(HERE.parents[1] / "examples" / "arithmetic_grpo.yaml")


def sft_argv(run_dir: Path) -> list[str]:
    return [
        "sft", EXAMPLE, "run.progress=false", f"sft.steps={SFT_STEPS}", "sft.batch_size=8", "sft.warmup_steps=2",
        "sft.stop_accuracy=0.99", "sft.check_every=4", "sft.validation_size=8", "rollout.max_new_tokens=3",
        "train.micro_batch_size=4", "checkpoint.every=1", f"checkpoint.keep={SFT_STEPS}",
        "--output", str(run_dir), "--threads", "1",
    ]  # fmt: skip


@pytest.mark.slow
def test_killed_sft_resumes_exactly(tmp_path, caplog):
    """kill -9 of `asyncflow sft` at a random step after a checkpoint; run again, SFT continues from its newest
    checkpoint: the same rows in metrics.jsonl (each step once, validation checks included) and the saved model
    bit for bit that of an SFT never interrupted."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    after = rng.randint(1, SFT_STEPS - 2)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(sft_argv(straight)) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", *sft_argv(crashed)], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoints = crashed / ".tmp_sft" / "checkpoints"
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / f"step_{after}" / "state.json").exists():
            assert proc.poll() is None, f"SFT ended before checkpoint {after}: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        kill_at = time.monotonic() + rng.random() * 0.3
        while time.monotonic() < kill_at and not (checkpoints / f"step_{after + 1}").exists():
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not (crashed / "sft").exists(), "killed after SFT had finished"
    newest = max(int(p.name.split("_")[1]) for p in checkpoints.glob("step_*"))
    caplog.set_level(logging.INFO)
    assert main(sft_argv(crashed)) == 0
    note = f"(killed after SFT checkpoint {after}, seed {seed})"
    assert f"SFT continues from {checkpoints / f'step_{newest}'} (step {newest})" in caplog.text, note
    resumed = metrics(crashed / "sft")
    assert [r["step"] for r in resumed] == list(range(1, SFT_STEPS + 1)), note
    assert without_timing(resumed) == without_timing(metrics(straight / "sft")), f"SFT trained otherwise {note}"
    a, b = (load_file(str(run / "sft" / "model.safetensors")) for run in (straight, crashed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"the SFT models differ {note}"
