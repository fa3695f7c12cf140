"""Nothing is lost at the edges (issue 46): a checkpoint write failing with any library's error or a full disk,
damaged or missing run-folder files on resume, readers racing a writer's pruning, two exports into one folder,
and reward failures in evaluation. The SFT kill-and-resume case is in tests/workflow/test_crash_resume.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from asyncflow.cli import main
from asyncflow.workflow import checkpoint as ckpt
from asyncflow.workflow.checkpoint import CheckpointWriteError, list_checkpoints, save_checkpoint, verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "arithmetic_grpo.yaml")
TINY = [
    "sft.before_rl=false", "train.micro_batch_size=4", "rollout.prompts_per_step=4", "rollout.group_size=2",
    "rollout.max_new_tokens=4", "data.test_size=8", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=5",
    "run.progress=false",
]


@pytest.fixture(autouse=True)
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train(run_dir: Path, *extra: str) -> int:
    return main(["train", EXAMPLE, *TINY, *extra, "--output", str(run_dir), "--threads", "1"])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("asyncflow")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def save(run_dir: Path, step: int, keep: int = 5, **kwargs) -> Path:
    return save_checkpoint(run_dir, step, {"w": torch.full((4,), float(step))}, {"opt": step}, {"x": step}, keep=keep,
                           **kwargs)


# ---------------------------------------------------------------- a checkpoint write that fails
def _torch_zip_writer(obj, path, *args, **kwargs):
    Path(path).write_bytes(b"PK\0half")
    raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
                       "file write failed")


def _safetensors_full(tensors, path, *args, **kwargs):
    Path(path).write_bytes(b"\0" * 64)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


def _os_full(obj, path, *args, **kwargs):
    Path(path).write_bytes(b"\0" * 10)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _dcp_failed(folder: Path) -> None:
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"\0" * 10)
    raise CheckpointException("save_state_dict", {0: (ValueError("rank 0 could not write its shard"), None)})


WRITE_FAILURES = {  # what the library raises -> (where to inject it, what the one line names as cause)
    "torch.save": ("torch.save", _torch_zip_writer, "RuntimeError: [enforce fail at inline_container.cc:672]"),
    "safetensors": ("save_file", _safetensors_full, "no space left on device"),
    "os": ("torch.save", _os_full, "no space left on device"),
    "dcp": ("write_sharded", _dcp_failed, "CheckpointException (rank 0: ValueError: rank 0 could not write its shard)"),
}


@pytest.mark.parametrize("kind", list(WRITE_FAILURES))
def test_a_write_failing_with_any_error_type_leaves_no_temp_folder_and_names_path_cause_and_resume(
        tmp_path, monkeypatch, kind):
    previous = save(tmp_path, 1)
    where, failure, cause = WRITE_FAILURES[kind]
    extra = {}
    if where == "torch.save":
        monkeypatch.setattr(ckpt.torch, "save", failure)
    elif where == "save_file":
        monkeypatch.setattr(ckpt, "save_file", failure)
    else:
        extra["write_sharded"] = failure
    with pytest.raises(CheckpointWriteError) as raised:
        save(tmp_path, 2, **extra)
    monkeypatch.undo()
    message = str(raised.value)
    assert "\n" not in message
    assert cause in message, message
    assert f"while writing checkpoint {tmp_path / 'checkpoints' / 'step_2'}" in message
    assert f"the previous checkpoint {previous} is intact: continue from it with --resume" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"], "no temporary folder left"
    verify_checkpoint(previous)


def test_a_full_disk_names_the_space_a_checkpoint_needs(tmp_path, monkeypatch):
    save(tmp_path, 1)
    monkeypatch.setattr(ckpt, "save_file", _safetensors_full)
    with pytest.raises(CheckpointWriteError) as raised:
        save(tmp_path, 2)
    assert raised.value.errno == errno.ENOSPC
    needed = sum(entry["size"] for entry in json.loads(
        (tmp_path / "checkpoints" / "step_1" / "manifest.json").read_text())["files"].values())
    assert f"a checkpoint needs about {needed / 1e6:.1f} MB" in str(raised.value)


def test_ctrl_c_during_a_write_leaves_no_temp_folder(tmp_path, monkeypatch):
    def interrupted(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    save(tmp_path, 1)
    monkeypatch.setattr(ckpt.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


@pytest.mark.slow
def test_an_export_whose_write_fails_is_one_line_and_leaves_no_temp_folder(run_copy, tmp_path, capsys, monkeypatch):
    import asyncflow.workflow.export

    monkeypatch.setattr(asyncflow.workflow.export, "save_safetensors", _os_full)  # the weights, streamed to the file
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(run_copy), str(out)]) == 1
    err = one_line_error(capsys)
    assert "no space left on device" in err and f"while writing the export {out}" in err, err
    assert f"export again with asyncflow export {run_copy} {out}" in err
    assert not out.exists() and not (tmp_path / ".tmp_hf").exists()


def test_an_sft_whose_model_write_fails_is_one_line_and_finishes_from_its_checkpoint_when_run_again(
        tmp_path, capsys, monkeypatch, caplog):
    import transformers.modeling_utils

    argv = ["sft", EXAMPLE, "run.progress=false", "sft.steps=2", "sft.batch_size=4", "train.micro_batch_size=4",
            "sft.stop_accuracy=null", "checkpoint.every=0", "--output", str(tmp_path / "run"), "--threads", "1"]
    from asyncflow.models.loading import resolve_model_path

    resolve_model_path("preset:tiny-llama", seed=0)  # the preset's folder is built (saved) before the disk fills
    with monkeypatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "safe_save_file", _safetensors_full)
        assert main(argv) == 1
    err = one_line_error(capsys)
    assert "no space left on device" in err and "its checkpoint of step 2 is intact" in err, err
    caplog.set_level(logging.INFO)
    assert main(argv) == 0
    assert "SFT continues from" in caplog.text and (tmp_path / "run" / "sft" / "model.safetensors").is_file()


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MB tmpfs: one checkpoint of the tiny model (about 9.5 MB) fits, the second does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}); the injected library errors above cover the same code")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True, timeout=30)


@pytest.mark.slow
def test_a_really_full_disk_is_one_line_and_resume_works_once_space_is_freed(small_disk, capsys):
    run_dir = small_disk / "run"
    args = ("train.steps=2", "export.at_end=false", "observe.tensorboard=false")
    assert train(run_dir, *args) == 1
    err = one_line_error(capsys)
    step_1, step_2 = run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_2"
    assert "no space left on device" in err and f"while writing checkpoint {step_2}" in err, err
    assert "a checkpoint needs about" in err and f"the previous checkpoint {step_1} is intact" in err, err
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_1"], "no half-written folder is left"
    verify_checkpoint(step_1)
    shutil.move(str(run_dir), str(small_disk.parent / "run"))  # space freed: moved to a disk with room
    run_dir = small_disk.parent / "run"
    assert train(run_dir, *args, "--resume") == 0
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_1", "step_2"]


# ---------------------------------------------------------------- damaged or missing run-folder files on resume
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run (checkpoints step_1, step_2): each test resumes a copy to step 3."""
    run_dir = tmp_path_factory.mktemp("edges") / "run"
    threads = torch.get_num_threads()
    assert train(run_dir, "train.steps=2", "export.at_end=false") == 0
    torch.set_num_threads(threads)
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def resume(run_dir: Path, *extra: str) -> int:
    return train(run_dir, "train.steps=3", "export.at_end=false", *extra, "--resume")


@pytest.mark.parametrize("damage", ["cut in half", "garbage"])
@pytest.mark.slow
def test_a_damaged_timeline_is_set_aside_and_the_run_resumes(run_copy, caplog, damage):
    timeline = run_copy / "timeline.json"
    text = timeline.read_text()
    timeline.write_text(text[: len(text) // 2] if damage == "cut in half" else "\x00garbage{")
    before = timeline.read_bytes()
    assert resume(run_copy) == 0
    assert f"{timeline} is damaged" in caplog.text
    assert (run_copy / "damaged_timeline.json").read_bytes() == before
    assert "traceEvents" in json.loads(timeline.read_text()), "a new timeline was written"
    assert [r["step"] for r in rows(run_copy)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_without_manifest_is_set_aside_for_the_older_one(run_copy, caplog):
    newest = run_copy / "checkpoints" / "step_2"
    (newest / "manifest.json").unlink()
    state = newest / "training_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert resume(run_copy) == 0
    assert str(state) in caplog.text, "the warning names the damaged file"
    assert (run_copy / "checkpoints" / "damaged_step_2" / "training_state.pt").exists()
    assert [r["step"] for r in rows(run_copy)] == [0, 1, 2, 3], "steps 2 and 3 trained from step_1"


@pytest.mark.parametrize("config_yaml", ["missing", "garbage"])
def test_the_fixed_settings_check_reads_the_checkpoints_record_when_config_yaml_is_gone(run_copy, capsys,
                                                                                        config_yaml):
    path = run_copy / "config.yaml"
    path.unlink() if config_yaml == "missing" else path.write_text("model: [unclosed\n\x00")
    assert resume(run_copy, "train.lora.rank=4") == 2
    err = one_line_error(capsys)
    assert "--resume: train.lora.rank was" in err and "is 4 now" in err, err


@pytest.mark.slow
def test_a_damaged_config_yaml_is_set_aside_and_written_again(run_copy, caplog):
    path = run_copy / "config.yaml"
    path.write_text("model: [unclosed\n")
    assert resume(run_copy) == 0
    assert f"{path} is damaged" in caplog.text
    assert (run_copy / "damaged_config.yaml").read_text() == "model: [unclosed\n"
    from asyncflow.config import load_config

    assert load_config(path).train.steps == 3


@pytest.mark.slow
def test_a_deleted_metrics_file_resumes_with_a_warning_that_earlier_rows_are_gone(run_copy, caplog):
    (run_copy / "metrics.jsonl").unlink()
    assert resume(run_copy) == 0
    assert "metrics.jsonl is missing: the rows of steps 0..2 are gone" in caplog.text
    assert [r["step"] for r in rows(run_copy)] == [3]


def test_a_metrics_file_damaged_in_the_middle_is_set_aside_and_its_intact_rows_kept(tmp_path, caplog):
    from asyncflow.observe.metrics import MetricsLogger, read_metrics

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(4):
            logger.log(step, {"x": step})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    damaged = "\n".join([lines[0], '{"step": 1, "x"', *lines[2:]]) + "\n"
    (tmp_path / "metrics.jsonl").write_text(damaged)
    with MetricsLogger(tmp_path, tensorboard=False, resume_from_step=2) as logger:
        logger.log(3, {"x": 3})
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 2, 3]
    assert (tmp_path / "damaged_metrics.jsonl").read_text() == damaged
    assert "metrics.jsonl is damaged" in caplog.text and "damaged line(s): 2" in caplog.text


# ---------------------------------------------------------------- reward failures in evaluation
def no_reward(completion: str, ground_truth: str, **metadata):
    return None  # not a number: a failed call


def one_when_it_works(completion: str, ground_truth: str, **metadata):
    return None if sum(map(ord, ground_truth)) % 2 else 1.0  # fails on about half of the prompts, solves the rest


def test_evaluation_leaves_failed_calls_out_of_its_mean_and_counts_them_unsolved(tmp_path, capsys):
    capsys.readouterr()
    assert main(["eval", EXAMPLE, *TINY, "reward.fns=[test_edges:one_when_it_works]", "data.test_size=16",
                 "--output", str(tmp_path / "eval"), "--checkpoint", "preset:tiny-llama"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    failed = result["eval/reward_errors"]
    assert 0 < failed < 16, result
    assert result["eval/reward_mean"] == 1.0, "the mean is over the calls that returned a reward"
    assert result["eval/accuracy"] == (16 - failed) / 16, "a failed call is not a solved prompt"


def test_evaluation_counts_its_reward_failures_and_reports_no_score_over_them(tmp_path, capsys):
    capsys.readouterr()
    code = main(["eval", EXAMPLE, *TINY, "reward.fns=[test_edges:no_reward]", "--output", str(tmp_path / "eval"),
                 "--checkpoint", "preset:tiny-llama"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/reward_errors"] == 8 and result["eval/reward_timeouts"] == 0, result
    assert result["eval/accuracy"] is None and result["eval/reward_mean"] is None, "a mean over failed calls"


# ---------------------------------------------------------------- readers and writers
def _prune_while_loading(monkeypatch, run_dir: Path) -> list[str]:
    """Each first read of a checkpoint's weights first lets the training run write step 3 with checkpoint.keep=1
    (which prunes everything older): the moment `serve RUN_DIR` lost its checkpoint in issue 46."""
    real_load_file, pruned = ckpt.load_file, []

    def load_file(path, *args, **kwargs):
        if not pruned:
            pruned.append(path)
            save(run_dir, 3, keep=1)
        return real_load_file(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "load_file", load_file)
    return pruned


def test_serve_of_a_training_run_holds_its_checkpoint_against_pruning(run_copy, monkeypatch):
    from asyncflow.workflow.serve import load_served

    pruned = _prune_while_loading(monkeypatch, run_copy)
    served = load_served(str(run_copy))
    assert pruned and served.name.endswith("step_2")
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_2", "step_3"], "held, so not pruned"
    save(run_copy, 4, keep=1)
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_4"], "pruned by the next save once released"


def test_eval_of_a_training_run_holds_its_checkpoint_against_pruning(run_copy, monkeypatch, capsys):
    pruned = _prune_while_loading(monkeypatch, run_copy)
    assert main(["eval", EXAMPLE, *TINY, "--output", str(run_copy.parent / "eval"), "--checkpoint",
                 str(run_copy)]) == 0
    assert pruned and "eval/accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_checkpoint_pruned_before_it_is_pinned_is_picked_again(tmp_path):
    from asyncflow.workflow.checkpoint import latest_checkpoint, pinned

    save(tmp_path, 1)
    picks = []

    def pick():
        picks.append(latest_checkpoint(tmp_path))
        if len(picks) == 1:
            save(tmp_path, 2, keep=1)  # the newest pruned between picking and pinning
        return picks[-1]

    with pinned(pick) as checkpoint:
        assert checkpoint.name == "step_2" and checkpoint.is_dir()
    assert [p.name for p in picks] == ["step_1", "step_2"]


def test_an_export_into_a_folder_another_export_writes_is_refused(run_copy, tmp_path, capsys):
    from asyncflow.workflow.run_folder import claim_output

    out = tmp_path / "hf"
    with claim_output(out, "export"):
        assert main(["export", str(run_copy), str(out)]) == 2
        err = one_line_error(capsys)
        assert f"{out} is being written by pid {os.getpid()} (export" in err, err
        assert not out.exists()
    assert main(["export", str(run_copy), str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "no lock or temporary folder left"


def test_eval_of_a_run_whose_config_yaml_is_damaged_is_one_line_naming_it(run_copy, capsys):
    (run_copy / "config.yaml").write_text("model: [unclosed\n")
    capsys.readouterr()
    assert main(["eval", EXAMPLE, *TINY, "--output", str(run_copy.parent / "eval"), "--checkpoint",
                 str(run_copy)]) == 1
    err = one_line_error(capsys)
    assert f"{run_copy / 'config.yaml'}: damaged, not valid YAML" in err, err


# ---------------------------------------------------------------- an interrupted SFT's checkpoints
@pytest.mark.slow
def test_an_interrupted_sft_skips_a_damaged_checkpoint_and_starts_over_when_its_settings_changed(tmp_path, caplog):
    run_dir = tmp_path / "run"
    argv = ["sft", EXAMPLE, "run.progress=false", "sft.steps=3", "sft.batch_size=4", "train.micro_batch_size=4",
            "sft.stop_accuracy=null", "checkpoint.every=1", "checkpoint.keep=3", "--output", str(run_dir), "--threads",
            "1"]
    assert main(argv) == 0
    interrupted = run_dir / ".tmp_sft"
    (run_dir / "sft").rename(interrupted)  # as if killed after its last checkpoint
    (interrupted / "sft_summary.json").unlink()
    (interrupted / "checkpoints" / "step_3" / "rng.pt").write_bytes(b"cut")
    caplog.set_level(logging.INFO)
    assert main(argv) == 0
    assert f"SFT checkpoint {interrupted / 'checkpoints' / 'step_3'} is damaged" in caplog.text
    assert f"SFT continues from {interrupted / 'checkpoints' / 'step_2'} (step 2)" in caplog.text
    assert [r["step"] for r in rows(run_dir / "sft")] == [1, 2, 3]

    (run_dir / "sft").rename(interrupted)
    (interrupted / "sft_summary.json").unlink()
    caplog.clear()
    assert main([*argv, "sft.lr=3e-4"]) == 0
    assert "SFT changed since its checkpoint" in caplog.text and "(sft)" in caplog.text, caplog.text
    assert [r["step"] for r in rows(run_dir / "sft")] == [1, 2, 3], "trained again from step 0"
