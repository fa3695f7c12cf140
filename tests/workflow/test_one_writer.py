"""One run, one writer (issue 25): the run folder's lock, stopping on SIGINT / SIGTERM, data changed under a
resume, settings a resume cannot change, a finished run completed after a crash, a cut-off SFT, an export past a
damaged checkpoint. Real `asyncflow train` processes and real signals."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.workflow.checkpoint import verify_checkpoint
from asyncflow.workflow.run_folder import LOCK_FILE, RunFolder, RunFolderInUse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "arithmetic_grpo.yaml")
TINY = [
    "sft.before_rl=false", "train.micro_batch_size=4", "rollout.prompts_per_step=4", "rollout.group_size=2",
    "rollout.max_new_tokens=4", "data.test_size=8", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=3",
    "run.progress=false",
]


def train(run_dir: Path, *extra: str) -> int:
    return main(["train", EXAMPLE, *TINY, *extra, "--output", str(run_dir), "--threads", "1"])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("asyncflow")]
    assert len(lines) == 1, lines
    return lines[0]


def start_training(run_dir: Path, *extra: str) -> subprocess.Popen:
    """`asyncflow train` for many steps in a process group of its own (so a group SIGINT is a terminal's Ctrl-C)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "asyncflow.cli", "train", EXAMPLE, *TINY, "train.steps=500", *extra,
         "--output", str(run_dir), "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        if (run_dir / "metrics.jsonl").is_file() and any(r["step"] >= step for r in rows(run_dir)):
            return
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"no step {step} within {timeout_s} s")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ---------------------------------------------------------------- the lock
@pytest.mark.slow
def test_a_live_run_refuses_a_second_writer_and_sigterm_stops_it_with_a_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    process = start_training(run_dir)
    try:
        wait_for_step(process, run_dir, 2)
        for flags in ((), ("--resume",), ("--overwrite",)):
            assert train(run_dir, "train.steps=500", *flags) == 2
            err = error_line(capsys)
            assert f"in use by pid {process.pid} (train" in err, err
        assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints").is_dir(), "--overwrite cleared it"
        assert sorted({r["step"] for r in rows(run_dir)}) == [r["step"] for r in rows(run_dir)], "steps interleaved"
        workers = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, err[-2000:]
    last = rows(run_dir)[-1]["step"]
    assert f"stopped by SIGTERM after step {last}" in err and "--resume" in err
    checkpoint = run_dir / "checkpoints" / f"step_{last}"
    verify_checkpoint(checkpoint)
    assert (run_dir / "curves.png").is_file() and (run_dir / "timeline.json").is_file()
    assert not [pid for pid in workers if alive(pid)], "a worker outlived the run"
    assert train(run_dir, f"train.steps={last + 1}", "--resume") == 0, "the lock died with its holder"
    assert [r["step"] for r in rows(run_dir)][-2:] == [last, last + 1]


@pytest.mark.slow
def test_ctrl_c_stops_at_the_next_step_and_a_second_one_at_once(tmp_path):
    run_dir = tmp_path / "run"
    process = start_training(run_dir)
    try:
        wait_for_step(process, run_dir, 1)
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = rows(run_dir)[-1]["step"]
    verify_checkpoint(run_dir / "checkpoints" / f"step_{last}")

    process = start_training(run_dir, "--resume", "rollout.prompts_per_step=32", "rollout.max_new_tokens=48")
    try:  # steps of seconds: the second signal comes while the first waits for the step to end
        wait_for_step(process, run_dir, last + 1)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # two signals sent at once are one pending signal
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143 and "SIGTERM again: stopped at once" in err, err[-2000:]


@pytest.mark.slow
def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from asyncflow.workflow.run_folder import RunFolder\n"
         f"with RunFolder({str(run_dir)!r}).claim('train'):\n print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderInUse, match=f"pid {holder.pid}"), RunFolder(run_dir).claim("sft"):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert (run_dir / LOCK_FILE).is_file(), "the killed holder left its lock file"
    with RunFolder(run_dir).claim("train"):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_refused_claim_leaves_no_folder_behind(tmp_path):
    new = tmp_path / "new"
    with pytest.raises(RuntimeError), RunFolder(new).claim("train"):
        raise RuntimeError("preflight failed")
    assert not new.exists()


# ---------------------------------------------------------------- resumes that would train the wrong thing
@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """A 2-step run on a JSONL data file: (run folder, data file); each test works on copies."""
    root = tmp_path_factory.mktemp("file_run")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(6)))
    assert train(root / "run", *on_file(data), "train.steps=2") == 0
    return root / "run", data


@pytest.fixture
def copies(file_run, tmp_path):
    run_dir, data = file_run
    shutil.copytree(run_dir, tmp_path / "run")
    shutil.copy(data, tmp_path / "train.jsonl")
    return tmp_path / "run", tmp_path / "train.jsonl"


def on_file(data: Path) -> list[str]:
    return [f"data.path={data}", "data.task=null", "data.test_size=0", "reward.fns=[numeric_match]"]


def resume_on(run_dir: Path, data: Path, *extra: str) -> int:
    return train(run_dir, *on_file(data), "train.steps=3", "--resume", *extra)


@pytest.mark.parametrize("change", ["appended", "shortened", "replaced"])
@pytest.mark.slow
def test_a_resume_refuses_changed_data_unless_told_to_continue(copies, capsys, change):
    run_dir, data = copies
    lines = data.read_text().splitlines(keepends=True)
    edited = {"appended": lines + lines[:3], "shortened": lines[:-5],
              "replaced": [line.replace("+", " + ") for line in lines]}[change]
    data.write_text("".join(edited))
    before = rows(run_dir)
    assert resume_on(run_dir, data) == 2
    err = error_line(capsys)
    assert "training data changed since step_2" in err and "--accept-data-change" in err, err
    expected = "different content" if change == "replaced" else f"36 training examples then, {len(edited)} now"
    assert expected in err
    assert rows(run_dir) == before, "a refused resume wrote into the run"
    assert resume_on(run_dir, data, "--accept-data-change") == 0
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_the_same_data_resumes_without_a_word(copies, capsys):
    run_dir, data = copies
    assert resume_on(run_dir, data) == 0
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2, 3]


@pytest.mark.parametrize("setting", ["train.lora.rank=4", "model.path=preset:small-llama"])
def test_a_setting_the_checkpoints_depend_on_cannot_change_on_resume(copies, capsys, setting):
    run_dir, data = copies
    assert resume_on(run_dir, data, setting) == 2
    key = setting.split("=")[0]
    assert f"--resume: {key} was" in error_line(capsys)


@pytest.mark.slow
def test_resuming_a_run_killed_after_its_last_checkpoint_writes_the_missing_outputs(copies, caplog):
    """kill -9 between the final checkpoint and the outputs: export, plots and timeline charts were never written."""
    run_dir, data = copies
    caplog.set_level(logging.INFO)
    for name in ("export", "curves.png", "timeline.png", "utilization.png"):
        target = run_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    assert train(run_dir, *on_file(data), "train.steps=2", "--resume") == 0
    assert "wrote what was missing (plots, export)" in caplog.text
    for name in ("export/model.safetensors", "curves.png", "timeline.png", "utilization.png"):
        assert (run_dir / name).is_file(), name


def test_export_names_the_checkpoint_it_used_and_the_damaged_one_it_skipped(copies, capsys, caplog):
    run_dir, _ = copies
    caplog.set_level(logging.INFO)
    damaged = run_dir / "checkpoints" / "step_2"
    (damaged / "model.safetensors").write_bytes(b"cut off")
    assert main(["export", str(run_dir), str(run_dir.parent / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert f"skipping the damaged checkpoint {damaged}" in caplog.text
    assert "exported" in caplog.text and "step_1" in caplog.text


# ---------------------------------------------------------------- SFT
@pytest.mark.slow
def test_a_cut_off_sft_folder_is_redone_not_taken_as_finished(tmp_path, caplog):
    run_dir = tmp_path / "run"
    cut_off = run_dir / "sft"
    cut_off.mkdir(parents=True)
    (cut_off / "config.json").write_text("{}")  # SFT was killed while `save_pretrained` wrote the model
    assert train(run_dir, "sft.before_rl=true", "sft.steps=2", "sft.batch_size=4", "train.steps=1") == 0
    assert "holds no sft_summary.json (an SFT that was cut off): SFT runs again" in caplog.text
    assert json.loads((cut_off / "sft_summary.json").read_text())["steps"] == 2
    assert not (run_dir / ".tmp_sft").exists()


def test_sft_never_replaces_a_folder_of_other_files(tmp_path, capsys):
    out = tmp_path / "models"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    assert main(["sft", EXAMPLE, *TINY, "sft.steps=1", "--output", str(tmp_path / "run"),
                 f"sft.output={out}"]) == 2
    assert str(out) in error_line(capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.slow
@pytest.mark.ray
def test_sigterm_of_a_ray_run_leaves_no_ray_process_behind(tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    process = start_training(run_dir, "workflow.mode=async", "runtime.kind=ray", "runtime.num_cpus=2")
    try:
        wait_for_step(process, run_dir, 2, timeout_s=400)
        workers = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 143, err[-2000:]
    verify_checkpoint(run_dir / "checkpoints" / f"step_{rows(run_dir)[-1]['step']}")
    assert len(workers) >= 3, f"the local Ray cluster's processes: {workers}"
    deadline = time.monotonic() + 30
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in workers if alive(pid)}
    assert not left, f"processes outlived the run: {left}"
