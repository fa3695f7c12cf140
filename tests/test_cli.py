"""Every CLI subcommand run through the entry point (`asyncflow.cli.main`), on tiny settings.

Covers the run-folder contract (config.yaml, metrics.jsonl keys, checkpoints, TensorBoard, PNG),
`--resume` continuing the step numbering (and matching an uninterrupted run), `asyncflow eval`
on a checkpoint, determinism under a fixed seed, and the clear errors for bad input; and the
run-folder cases of issue 15 ("never lose a run"): a folder in use, a finished run resumed,
damaged checkpoints, a crash before the first checkpoint, a cut-off metrics line, a read-only
folder, a full disk, Ray not starting, long prompts caught before any model loads.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.workflow.run import RLRun
from asyncflow.workflow.run_folder import LOCK_FILE

# The main example, shrunk: a few SFT steps, then 2 GRPO steps on 4 prompts x 2 samples.
TINY = [
    "sft.steps=3", "sft.batch_size=8",
    "train.steps=2", "train.micro_batch_size=4",
    "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4",
    "data.test_size=8", "eval.every=1", "checkpoint.every=1", "checkpoint.keep=5",
    "run.progress=false", "--threads", "1",
]
EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic_grpo.yaml")
REQUIRED_TRAIN_KEYS = {
    "step", "reward/mean", "kl", "entropy", "loss", "time/step_s",
    "throughput/samples_per_s", "throughput/tokens_per_s",
}
TIMING_KEYS = ("time/", "throughput/", "wall_s", "memory/", "weights/update_")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """`--threads 1` (steady on a shared CPU) sets a process-wide torch setting: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train(run_dir: Path, *extra: str, resume: bool = False) -> int:
    argv = ["train", EXAMPLE, *TINY, *extra, "--output", str(run_dir)] + (["--resume"] if resume else [])
    return main(argv)


def without_timing(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in metrics]


@pytest.mark.slow
def test_train_resume_eval_and_run_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir) == 0

    # resolved config, loadable back
    config = load_config(run_dir / "config.yaml")
    assert config.train.steps == 2 and config.rollout.group_size == 2
    assert (run_dir / "sft" / "config.json").exists(), "SFT warm-up should have saved an HF folder"

    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert "eval/accuracy" in metrics[0]  # the SFT model, before any RL update
    for row in metrics[1:]:
        assert REQUIRED_TRAIN_KEYS <= row.keys(), REQUIRED_TRAIN_KEYS - row.keys()
        assert "eval/accuracy" in row  # eval.every=1
        assert row["kl"] is None  # kl_coef = 0: no reference model, logged as null
        assert math.isfinite(row["loss"]) and row["entropy"] >= 0 and row["time/step_s"] > 0
        assert row["throughput/samples_per_s"] > 0 and row["rollout/samples"] == 8

    for step in (1, 2):
        ckpt = run_dir / "checkpoints" / f"step_{step}"
        for name in ("model.safetensors", "training_state.pt", "rng.pt", "state.json"):
            assert (ckpt / name).exists(), f"{ckpt} lacks {name}"
        state = json.loads((ckpt / "state.json").read_text())
        assert state["step"] == step and state["data_position"] == 4 * step
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / "timeline.json").exists()
    assert (run_dir / "timeline.png").stat().st_size > 0 and (run_dir / "utilization.png").stat().st_size > 0

    # --resume continues from step 2 to step 4: numbering continues, nothing repeated
    assert train(run_dir, "train.steps=4", resume=True) == 0
    resumed = rows(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed[:3] == metrics
    assert json.loads((run_dir / "checkpoints" / "step_4" / "state.json").read_text())["data_position"] == 16

    # ... and matches a run that was never interrupted (same prompts, samples and updates)
    straight = tmp_path / "straight"
    assert train(straight, "train.steps=4") == 0
    assert without_timing(rows(straight))[3:] == without_timing(resumed)[3:]

    # eval of a checkpoint reproduces the accuracy logged for that step
    capsys.readouterr()
    ckpt = run_dir / "checkpoints" / "step_4"
    assert main(["eval", EXAMPLE, *TINY, "--output", str(run_dir), "--checkpoint", str(ckpt)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/accuracy"] == resumed[4]["eval/accuracy"]


@pytest.mark.slow
def test_identical_runs_write_identical_metrics(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(a, "sft.before_rl=false") == 0
    assert train(b, "sft.before_rl=false") == 0
    ma, mb = without_timing(rows(a)), without_timing(rows(b))
    assert len(ma) == 3 and ma == mb


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    code = train(tmp_path / "run", "sft.before_rl=false", "model.path=/no/such/model")
    err = capsys.readouterr().err
    assert code == 1
    assert "/no/such/model" in err and "does not exist" in err


def test_unknown_config_key_stops_before_any_work(tmp_path, capsys):
    code = train(tmp_path / "run", "train.lrr=0.1")
    err = capsys.readouterr().err
    assert code == 2
    assert "train.lrr: unknown key" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_long_prompts_error_or_skip_and_count(tmp_path, capsys):
    # "<s>12+34=" is 7 tokens; with max_prompt_tokens=6 only prompts with a 1-digit operand fit.
    code = train(tmp_path / "err", "sft.before_rl=false", "data.max_prompt_tokens=6", "data.on_long_prompt=error")
    err = capsys.readouterr().err
    assert code == 1
    assert "data.max_prompt_tokens=6" in err and "tokens" in err

    assert train(tmp_path / "skip", "sft.before_rl=false", "data.max_prompt_tokens=6", "train.steps=1") == 0
    last = rows(tmp_path / "skip")[-1]
    assert last["data/skipped_long_prompts_total"] > 0

    code = train(tmp_path / "none", "sft.before_rl=false", "data.max_prompt_tokens=2", "train.steps=1")
    assert code == 1
    assert "every training prompt is longer than data.max_prompt_tokens=2" in capsys.readouterr().err


def test_eval_of_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    code = main(["eval", EXAMPLE, *TINY, "--output", str(tmp_path), "--checkpoint", str(tmp_path / "nope")])
    assert code == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_writes_a_model_that_transformers_loads(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert main(["sft", EXAMPLE, *TINY, "--output", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert Path(out["sft_model"]) == tmp_path / "sft"
    model = AutoModelForCausalLM.from_pretrained(out["sft_model"])
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_bench_compares_modes_against_sync(tmp_path, capsys):
    args = [*TINY, "sft.before_rl=false", "runtime.kind=inline", "rollout.prompts_per_step=2"]
    code = main(["bench", EXAMPLE, *args, "--modes", "sync", "async:1", "--steps", "4", "--warmup", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"sync", "async:1"}
    assert result["sync"]["vs_sync"] == 1.0
    assert result["async:1"]["samples_per_s"] > 0


def test_bench_rejects_an_unknown_mode(capsys):
    assert main(["bench", EXAMPLE, *TINY, "--modes", "sync", "async:0"]) == 1
    assert "async:K" in capsys.readouterr().err


def broken_reward(completion: str, ground_truth: str, **metadata) -> float:
    raise ValueError("broken verifier")


@pytest.mark.slow
def test_a_reward_failing_on_every_sample_stops_the_run_after_max_error_steps(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = train(run_dir, "sft.before_rl=false", "train.steps=8", "eval.every=0", "reward.fns=[test_cli:broken_reward]")
    assert code == 1
    err = capsys.readouterr().err
    assert "broken verifier" in err and "reward.max_error_steps" in err
    assert [r["step"] for r in rows(run_dir) if "loss" in r] == [1, 2, 3]


# ---------------------------------------------------------------- the run folder (issue 15)
FAST = ("sft.before_rl=false",)  # the run-folder cases need no SFT model


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run (checkpoints step_1 and step_2): each test works on a copy."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    threads = torch.get_num_threads()
    assert train(run_dir, *FAST) == 0
    torch.set_num_threads(threads)
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, the run folder's lock aside (its holder's pid is rewritten by each command)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    # the driver's loaders: the training engine's options (setup), a rollout engine's (torch_inference)
    for module in ("asyncflow.workflow.setup", "asyncflow.engines.torch_inference"):
        monkeypatch.setattr(f"{module}.load_model", refuse)


def one_line_error(capsys) -> str:
    """The error line of stderr (progress bars of model loading aside), checked to be the only one."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("asyncflow")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow
def test_a_run_folder_in_use_is_refused_unless_resumed_or_overwritten(run_copy, capsys):
    """Issue 15 item 1: a new run into a finished run's folder appended a second step series, overwrote
    config.yaml and pruned its own checkpoints."""
    before = snapshot(run_copy)
    assert train(run_copy, *FAST, "run.seed=1") == 2
    err = one_line_error(capsys)
    assert str(run_copy) in err and "--resume" in err and "--overwrite" in err
    assert snapshot(run_copy) == before, "a refused run wrote into the folder"

    assert train(run_copy, *FAST, "run.seed=1", "--overwrite") == 0
    assert [r["step"] for r in rows(run_copy)] == [0, 1, 2]
    assert load_config(run_copy / "config.yaml").run.seed == 1
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert rows(run_copy) != [json.loads(x) for x in before["metrics.jsonl"].decode().splitlines()]


def test_a_folder_of_other_files_is_never_written_nor_cleared(tmp_path, capsys):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    for flag in ((), ("--overwrite",), ("--resume",)):
        assert train(folder, *FAST, *flag) == 2
        assert "holds no run" in one_line_error(capsys)
    assert snapshot(folder) == {"thesis.tex": b"precious"}


def test_resuming_a_finished_run_does_nothing_and_succeeds(run_copy, capsys, monkeypatch):
    """Issue 15 item 4: `--resume` of a finished run crashed with an IndexError."""
    before = snapshot(run_copy)
    no_model_loads(monkeypatch)
    capsys.readouterr()
    assert train(run_copy, *FAST, resume=True) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"run_dir": str(run_copy), "step": 2, "finished": True}
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("name", ["model.safetensors", "training_state.pt", "state.json"])
@pytest.mark.slow
def test_resume_falls_back_past_a_cut_off_checkpoint(run_copy, caplog, name):
    """Issue 15 item 6: a cut-off checkpoint file gave a raw traceback and no fallback."""
    finished = without_timing(rows(run_copy))
    bad = run_copy / "checkpoints" / "step_2" / name
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    assert train(run_copy, *FAST, resume=True) == 0
    assert str(bad) in caplog.text, "the warning names the damaged file"
    assert without_timing(rows(run_copy)) == finished, "step 2 trained again from step 1, exactly as before"
    assert (run_copy / "checkpoints" / "damaged_step_2" / name).exists()
    from asyncflow.workflow.checkpoint import verify_checkpoint

    verify_checkpoint(run_copy / "checkpoints" / "step_2")


def test_eval_of_a_cut_off_checkpoint_is_one_line_naming_the_file(run_copy, capsys):
    bad = run_copy / "checkpoints" / "step_2" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:1000])
    code = main(["eval", EXAMPLE, *TINY, "--output", str(run_copy), "--checkpoint", str(bad.parent)])
    assert code == 1
    assert str(bad) in one_line_error(capsys)


@pytest.mark.slow
def test_eval_scores_what_serve_serves_a_checkpoint_on_its_own_runs_model(run_copy, tmp_path, capsys):
    """A checkpoint is scored on its run's base model whatever `model.path` the config names; a run folder is
    its newest checkpoint; an exported Hugging Face folder and a preset are scored as they are."""
    from asyncflow.api import export

    def accuracy(ref, *extra: str) -> float:
        capsys.readouterr()
        argv = ["eval", EXAMPLE, *TINY, *extra, "--output", str(tmp_path / "eval"), "--checkpoint", str(ref)]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval/accuracy"]

    logged = {r["step"]: r["eval/accuracy"] for r in rows(run_copy) if "eval/accuracy" in r}
    assert accuracy(run_copy / "checkpoints" / "step_1", "model.path=preset:small-llama") == logged[1]
    assert accuracy(run_copy) == logged[2]
    assert accuracy(export(run_copy, tmp_path / "hf")) == logged[2]
    assert accuracy("preset:tiny-llama") == logged[0]  # the run trained the preset without SFT


@pytest.mark.slow
def test_resume_after_a_crash_before_the_first_checkpoint_logs_each_step_once(tmp_path, monkeypatch):
    """Issue 15 item 9: step 0 was logged twice."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(RLRun, "save", lambda self: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            train(run_dir, *FAST, "checkpoint.every=0")
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2]
    assert not (run_dir / "checkpoints").exists()
    assert train(run_dir, *FAST, "checkpoint.every=0", resume=True) == 0
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2]


@pytest.mark.slow
def test_a_cut_off_last_metrics_line_does_not_block_resume(run_copy, caplog):
    """Issue 15 item 10."""
    with (run_copy / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 3, "entropy": 0.4')  # the disk filled up in the middle of step 3's row
    assert train(run_copy, *FAST, "train.steps=3", resume=True) == 0
    assert "cut-off last line dropped" in caplog.text
    assert [r["step"] for r in rows(run_copy)] == [0, 1, 2, 3]


def test_a_read_only_run_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """Issue 15 item 11. The tests run as root, for whom chmod does not make a folder read-only: every way of
    creating or writing a file under `ro/` fails the way a read-only mount does."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir, real_open, real_os_open = os.mkdir, io.open, os.open

    def inside(path) -> bool:
        return str(ro) in os.fspath(path)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def mkdir(path, *args, **kwargs):
        return refuse(path) if inside(path) else real_mkdir(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        return refuse(file) if inside(file) and set(mode) & set("wax+") else real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        return refuse(path) if inside(path) and writes else real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    no_model_loads(monkeypatch)
    assert train(ro / "run", *FAST) == 1
    err = one_line_error(capsys)
    assert f"cannot write to run folder {ro / 'run'}" in err and "Read-only file system" in err


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    """Issue 15 item 11: the second checkpoint's model file hits a full disk part-way through."""
    from asyncflow.workflow import checkpoint

    real_save_file, calls = checkpoint.save_file, []

    def save_file(tensors, path):
        calls.append(path)
        if len(calls) == 1:
            return real_save_file(tensors, path)
        with open(path, "wb") as file:
            file.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_file", save_file)
        assert train(run_dir, *FAST) == 1
    err = one_line_error(capsys)
    step_1, step_2 = run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_2"
    assert err.startswith("asyncflow: error: no space left on device (") and f"while writing checkpoint {step_2}" in err
    assert f"the previous checkpoint {step_1} is intact" in err
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_1"], "no half-written folder is left"
    from asyncflow.workflow.checkpoint import verify_checkpoint

    verify_checkpoint(step_1)
    # space freed: the run resumes from step 1 and finishes
    assert train(run_dir, *FAST, resume=True) == 0
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2]


def test_ray_that_does_not_start_is_retried_then_one_line(tmp_path, capsys, monkeypatch):
    """Issue 15 item 11: a Ray start-up timeout was a raw traceback."""
    ray = pytest.importorskip("ray")
    from asyncflow.runtime import ray_runtime

    attempts = []

    def init(**kwargs):
        attempts.append(kwargs)
        raise TimeoutError("Timed out after 60 seconds while waiting for node to startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_runtime, "START_RETRY_PAUSE_S", 0.0)
    code = train(tmp_path / "run", *FAST, "workflow.mode=async", "runtime.kind=ray")
    assert code == 1 and len(attempts) == ray_runtime.START_ATTEMPTS == 3
    err = one_line_error(capsys)
    assert "could not start a local Ray cluster (3 attempts)" in err and "Timed out after 60 seconds" in err


@pytest.mark.slow
def test_long_prompts_stop_the_run_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Issue 15 item 7: `data.on_long_prompt=error` fired only when such a prompt was drawn, after SFT, after
    the model loaded and after the run folder was written."""
    no_model_loads(monkeypatch)
    code = train(tmp_path / "run", "data.max_prompt_tokens=6", "data.on_long_prompt=error")  # SFT first, as set
    assert code == 1
    err = one_line_error(capsys)
    assert "training prompts are longer than data.max_prompt_tokens=6" in err and "on_long_prompt=skip" in err
    assert not (tmp_path / "run").exists(), "the run folder was touched"
