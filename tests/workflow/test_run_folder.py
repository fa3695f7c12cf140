"""The run folder and its checkpoints without training (issue 15, "never lose a run"): what `RunFolder.plan`
decides for each state of a folder and what `prepare` does about it; atomic, verified checkpoints and their
pruning; a cut-off metrics line on resume; Ray's start-up retry; the preflight prompt-length check. The same
cases through `asyncflow train` / `eval` are in tests/test_cli.py."""

from __future__ import annotations

import errno
import json
import logging

import pytest
import torch

from asyncflow.config import ConfigError, build_config
from asyncflow.models.loading import load_tokenizer, prompt_lengths, render_prompt
from asyncflow.observe.metrics import MetricsLogger, read_metrics
from asyncflow.workflow import checkpoint as ckpt
from asyncflow.workflow.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from asyncflow.workflow.run_folder import RunFolder, RunFolderInUse
from asyncflow.workflow.setup import preflight


def save(run_dir, step, keep=5):
    return save_checkpoint(run_dir, step, {"w": torch.full((4,), float(step))}, {"opt": step}, {"x": step}, keep=keep)


def names(run_dir):
    return [p.name for p in list_checkpoints(run_dir)]


# ---------------------------------------------------------------- checkpoints
def test_a_checkpoint_has_a_manifest_and_loads_back(tmp_path):
    path = save(tmp_path, 3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "training_state.pt", "rng.pt", "state.json"}
    assert all(len(entry["sha256"]) == 64 and entry["size"] > 0 for entry in manifest["files"].values())
    verify_checkpoint(path)
    weights, training_state, state, _ = load_checkpoint(path)
    assert weights["w"].tolist() == [3.0] * 4 and training_state == {"opt": 3} and state == {"step": 3, "x": 3}
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


@pytest.mark.parametrize("name", ["model.safetensors", "training_state.pt", "rng.pt", "state.json"])
@pytest.mark.parametrize("damage", ["cut", "flip", "remove"])
def test_damage_to_any_file_is_named(tmp_path, name, damage):
    path = save(tmp_path, 1)
    target = path / name
    data = target.read_bytes()
    if damage == "cut":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match=str(target)):
        load_checkpoint(path)


def test_a_checkpoint_without_manifest_is_checked_by_reading_it(tmp_path):
    """Checkpoints written before manifests: a cut-off file is named by the error of reading it."""
    path = save(tmp_path, 1)
    (path / "manifest.json").unlink()
    load_checkpoint(path)
    target = path / "training_state.pt"
    target.write_bytes(target.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=f"{target}: cannot be read"):
        load_checkpoint(path)


def test_pruning_keeps_the_newest_and_never_the_checkpoint_just_written(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=2)
    assert names(tmp_path) == ["step_2", "step_3"]
    # An older run's higher steps (issue 15 item 1: they pruned the new run's own checkpoints at once)
    other = tmp_path / "other"
    for step in (5, 6):
        save(other, step, keep=2)
    save(other, 1, keep=2)
    assert names(other) == ["step_1", "step_5", "step_6"]


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_half_folder(tmp_path, monkeypatch):
    previous = save(tmp_path, 1)

    def full_disk(obj, path, *args, **kwargs):
        with open(path, "wb") as file:
            file.write(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as failure:
        save(tmp_path, 2)
    message = str(failure.value)
    assert message.startswith("no space left on device (") and "free, a checkpoint needs about" in message
    assert message.endswith(
        f"while writing checkpoint {tmp_path / 'checkpoints' / 'step_2'} (training_state.pt); "
        f"the previous checkpoint {previous} is intact: continue from it with --resume"
    )
    assert failure.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    verify_checkpoint(previous)


# ---------------------------------------------------------------- what the run folder decides
def plan(path, steps=4, **flags):
    return RunFolder(path).plan(steps=steps, **flags)


def make_run(path, steps=(1, 2)):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text("run: {}\n")
    last = max(steps, default=0)
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(last + 1)))
    (path / "sft").mkdir()
    (path / "sft" / "config.json").write_text("{}")
    for step in steps:
        save(path, step)
    return path


def test_an_empty_or_missing_folder_or_one_with_only_the_sft_model_starts_fresh(tmp_path, caplog):
    assert plan(tmp_path / "missing").action == "fresh"
    assert plan(tmp_path).action == "fresh"
    (tmp_path / "sft").mkdir()
    assert plan(tmp_path) == RunFolder(tmp_path).plan(steps=4)
    assert plan(tmp_path).clear == ()
    assert plan(tmp_path / "missing", resume=True).action == "fresh"
    assert "no run in" in caplog.text and "starting from scratch" in caplog.text


def test_a_run_is_continued_only_when_asked(tmp_path):
    run = make_run(tmp_path / "run")
    in_use = r"already holds a run \(checkpoints up to step 2\).*--resume.*--overwrite"
    with pytest.raises(RunFolderInUse, match=in_use):
        plan(run)
    resume = plan(run, resume=True)
    assert (resume.action, resume.step, resume.checkpoint) == ("resume", 2, run / "checkpoints" / "step_2")
    with pytest.raises(ConfigError, match="exclude each other"):
        plan(run, resume=True, overwrite=True)


def test_overwrite_deletes_the_whole_run_sft_model_included(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "tensorboard").mkdir()
    folder = RunFolder(run)
    folder.prepare(folder.plan(steps=4, overwrite=True))
    assert list(run.iterdir()) == []


def test_a_finished_run_resumed_is_finished(tmp_path):
    run = make_run(tmp_path / "run", steps=(3, 4))
    finished = plan(run, resume=True)
    assert (finished.action, finished.step) == ("finished", 4)
    assert plan(run, steps=6, resume=True).action == "resume"


def test_resume_without_a_checkpoint_starts_over_and_drops_the_attempts_outputs(tmp_path, caplog):
    """Issue 15 item 9: the crashed attempt's step 0 stayed in metrics.jsonl and was logged again."""
    run = make_run(tmp_path / "run", steps=())
    (run / "tensorboard").mkdir()
    folder = RunFolder(run)
    start = folder.plan(steps=4, resume=True)
    assert start.action == "fresh" and "no checkpoint" in caplog.text
    folder.prepare(start)
    assert sorted(p.name for p in run.iterdir()) == ["sft"], "the SFT model is kept, the rest is the failed attempt"


def test_resume_falls_back_past_damaged_checkpoints_and_sets_them_aside(tmp_path, caplog):
    run = make_run(tmp_path / "run", steps=(1, 2, 3))
    bad = run / "checkpoints" / "step_3" / "rng.pt"
    bad.write_bytes(b"")
    folder = RunFolder(run)
    start = folder.plan(steps=4, resume=True)
    assert (start.action, start.step) == ("resume", 2)
    assert str(bad) in caplog.text
    (run / "checkpoints" / ".tmp_step_3").mkdir()  # a write cut off by a crash
    folder.prepare(start)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["damaged_step_3", "step_1", "step_2"]


def test_resume_with_every_checkpoint_damaged_stops_naming_them(tmp_path):
    run = make_run(tmp_path / "run", steps=(1, 2))
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint.*step_2/model.safetensors.*step_1/model.s"):
        plan(run, resume=True)


def test_a_folder_holding_no_run_is_refused_whatever_the_flags(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for flags in ({}, {"resume": True}, {"overwrite": True}):
        with pytest.raises(RunFolderInUse, match="holds no run"):
            plan(tmp_path, **flags)


def test_config_yaml_is_replaced_whole_and_changes_are_logged(tmp_path, caplog):
    folder = RunFolder(tmp_path)
    config = build_config({}, ["train.steps=2"])
    folder.write_config(config)
    caplog.set_level(logging.INFO)
    folder.write_config(build_config({}, ["train.steps=4"]))
    assert "train.steps: 2 -> 4" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# ---------------------------------------------------------------- metrics.jsonl on resume
def test_a_cut_off_last_metrics_line_is_dropped_on_resume(tmp_path, caplog):
    """Issue 15 item 10; a damaged line elsewhere is an error of `read_metrics` naming its line number (a resume
    sets such a file aside: tests/workflow/test_edges.py)."""
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(3):
            logger.log(step, {"x": step})
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 3, "x"')
    with MetricsLogger(tmp_path, tensorboard=False, resume_from_step=2) as logger:
        logger.log(3, {"x": 3})
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert "metrics.jsonl:4: cut-off last line dropped" in caplog.text

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], '{"step": 1, "x"', *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(tmp_path)


# ---------------------------------------------------------------- Ray start-up
def test_ray_start_is_retried_once(monkeypatch):
    ray = pytest.importorskip("ray")
    from asyncflow.runtime import ray_runtime

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise RuntimeError("Failed to start GCS.\n(ten lines of logs)")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_runtime, "START_RETRY_PAUSE_S", 0.0)
    ray_runtime.start_ray(address=None, num_cpus=2)
    assert len(calls) == 2 and calls[1]["num_cpus"] == 2


def test_ray_start_timeout_ends_in_one_clear_error(monkeypatch):
    ray = pytest.importorskip("ray")
    from asyncflow.runtime import ray_runtime

    def init(**kwargs):  # what Ray raises when a local node does not come up in time: a plain Exception
        raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_runtime, "START_RETRY_PAUSE_S", 0.0)
    with pytest.raises(ray_runtime.RayStartError, match=r"start a local Ray cluster .*timed out during startup"):
        ray_runtime.start_ray(address=None, num_cpus=2)


# ---------------------------------------------------------------- preflight
def test_prompt_lengths_match_the_rollout_rendering(tiny_llama_path):
    tokenizer = load_tokenizer(tiny_llama_path)
    prompts = ["12+34=", "7+5=", "", "99+99="]
    for chat in (False, True):
        if chat:
            tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}={% endfor %}"
        expected = [len(render_prompt(tokenizer, p, chat)) for p in prompts]
        assert prompt_lengths(tokenizer, prompts, chat, batch=3) == expected
        assert expected[0] != expected[1]


def test_preflight_checks_held_out_prompts_and_reward_spec(tiny_llama_path):
    config = build_config(
        {}, [f"model.path={tiny_llama_path}", "data.max_prompt_tokens=6", "data.on_long_prompt=error"]
    )
    with pytest.raises(ValueError, match=r"held-out prompts are longer than data.max_prompt_tokens=6"):
        preflight(config, training=False)
    with pytest.raises(ValueError, match="no_such_module"):
        preflight(build_config({}, ["reward.fns=[no_such_module:fn]"]))
