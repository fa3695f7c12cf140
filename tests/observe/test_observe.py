"""Tests for asyncflow.observe: metrics log, plots, worker timeline and progress reporting."""

import io
import json
import logging
import math
import pickle
import struct
import threading
import time

import pytest
from rich.console import Console

from asyncflow.observe import (
    MetricsLogger,
    Timeline,
    TrainProgress,
    format_metrics,
    plot_curves,
    plot_metrics,
    read_metrics,
)
from asyncflow.observe.timeline import span_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ---------------------------------------------------------------- metrics


def _scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_metrics_jsonl_format_and_roundtrip(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"reward/mean": 0.5, "loss": 2, "kl": float("nan")})
        logger.log(1, {"loss": float("inf"), "reward/mean": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == '{"step": 0, "kl": null, "loss": 2.0, "reward/mean": 0.5}'
    assert lines[1] == '{"step": 1, "loss": null, "reward/mean": 0.75}'
    rows = read_metrics(tmp_path)
    assert rows[0]["step"] == 0 and rows[0]["loss"] == 2.0 and math.isnan(rows[0]["kl"])
    assert rows[1]["reward/mean"] == 0.75
    assert _scalars(tmp_path, "reward/mean") == [(0, 0.5), (1, 0.75)]


def test_metrics_accept_numpy_and_tensor_scalars(tmp_path):
    import numpy as np
    import torch

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(3, {"a": np.float32(1.5), "b": torch.tensor(2.0), "c": np.int64(4)})
    assert read_metrics(tmp_path) == [{"step": 3, "a": 1.5, "b": 2.0, "c": 4.0}]
    assert not (tmp_path / "tensorboard").exists()


def test_metrics_resume_truncates_later_steps(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(5):
            logger.log(step, {"x": step})
    # TensorBoard reads event files in name order: `...tfevents.{second}.{host}.{pid}.{writer number}`. A resumed
    # run is a later process; in one process within one second, writer 10 would sort before writer 9.
    time.sleep(1.1)
    with MetricsLogger(tmp_path, resume_from_step=2) as logger:
        assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1, 2]
        logger.log(3, {"x": 30})
    assert [(row["step"], row["x"]) for row in read_metrics(tmp_path)] == [(0, 0), (1, 1), (2, 2), (3, 30)]
    # TensorBoard discards the abandoned steps 3 and 4 of the first attempt
    assert _scalars(tmp_path, "x") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


def test_metrics_bad_input_errors(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            logger.log(-1, {"x": 1})
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            logger.log(1.0, {"x": 1})
        with pytest.raises(TypeError, match="metric 'x' must be a number, got str"):
            logger.log(1, {"x": "0.5"})
        with pytest.raises(ValueError, match="other than 'step'"):
            logger.log(1, {"step": 3})
    with pytest.raises(RuntimeError, match="is closed"):
        logger.log(2, {"x": 1})
    assert read_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": 1, "x"\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
        read_metrics(tmp_path)


# ---------------------------------------------------------------- Weights & Biases


def _wandb_records(path):
    """Records of a W&B run file (`run-ID.wandb`, a LevelDB-style log of protobuf `Record`s), parsed with
    wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 or position + 7 + length > len(data):  # the end, or a chunk still being written
            break
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_history(path):
    """[(step, {metric: value})] of the history records of a W&B run file, W&B's own `_...` keys left out."""
    history = []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            history.append((record.history.step.num, {k: v for k, v in values.items() if not k.startswith("_")}))
    return history


def _finished_wandb_run_file(folder, timeout_s=60.0):
    """The W&B run file under `folder` once it holds the run's `exit` record: W&B's core process writes
    the file, and may still be writing its last records when `finish()` has returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
        if len(files) == 1 and any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(files[0])):
            return files[0]
        assert time.monotonic() < deadline, f"no finished W&B run file under {folder} after {timeout_s}s: {files}"
        time.sleep(0.1)


@pytest.mark.slow
def test_metrics_go_to_an_offline_wandb_run_with_the_same_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_dir"
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(wandb_dir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    options = {"project": "asyncflow-test", "name": "observe-test", "mode": "online", "config": {"train": {"lr": 0.1}}}
    with MetricsLogger(tmp_path / "run", tensorboard=False, wandb=options) as logger:
        logger.log(0, {"eval/accuracy": 0.25})
        logger.log(1, {"reward/mean": 0.5, "loss": 2, "kl": float("nan")})
        logger.log(2, {"reward/mean": 0.75, "loss": 1.5, "kl": 0.01})
    run_file = _finished_wandb_run_file(wandb_dir)  # WANDB_DIR and WANDB_MODE win over the given options
    history = _wandb_history(run_file)
    assert [step for step, _ in history] == [0, 1, 2]
    assert history[0][1] == {"eval/accuracy": 0.25}
    assert history[2][1] == {"reward/mean": 0.75, "loss": 1.5, "kl": 0.01}
    assert history[1][1]["reward/mean"] == 0.5 and math.isnan(history[1][1]["kl"])
    for step, values in history:  # the same names and values as metrics.jsonl
        row = next(row for row in read_metrics(tmp_path / "run") if row["step"] == step)
        assert values.keys() == row.keys() - {"step"}
    (run_record,) = [r.run for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert (run_record.project, run_record.display_name) == ("asyncflow-test", "observe-test")
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["train"] == {"lr": 0.1}


def test_wandb_run_options_folder_mode_and_resume(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    calls = []

    class FakeRun:
        dir = str(tmp_path / "wandb" / "offline-run-x" / "files")

        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    monkeypatch.setattr(wandb, "init", lambda **options: calls.append(("init", options)) or FakeRun())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    with MetricsLogger(tmp_path, tensorboard=False, resume_from_step=4, wandb={"project": "p", "config": {"a": 1}}):
        pass
    assert calls[0] == ("init", {"project": "p", "entity": None, "name": None, "mode": "offline",
                                 "dir": str(tmp_path), "config": {"a": 1, "resumed_from_step": 4}})
    assert calls[-1] == ("finish",)


def test_only_the_wandb_module_imports_wandb_and_a_missing_wandb_is_a_config_error(monkeypatch):
    import importlib.util
    import re
    from pathlib import Path

    import asyncflow
    from asyncflow.config import ConfigError, load_config

    source = Path(asyncflow.__file__).parent
    importers = {str(path.relative_to(source)) for path in source.rglob("*.py")
                 if re.search(r"^\s*(import wandb|from wandb\b)", path.read_text(), re.MULTILINE)}
    assert importers == {"observe/wandb_logger.py"}
    config = load_config(None, ["run.name=demo"])
    assert config.observe.wandb is False and config.observe.wandb_run(config) is None
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "wandb" else real_find_spec(name, *rest))
    with pytest.raises(ConfigError, match=r"observe\.wandb: .*pip install 'asyncflow-rl\[wandb\]'"):
        load_config(None, ["observe.wandb=true"])


# ---------------------------------------------------------------- plots


def _is_png(path):
    return path.read_bytes()[:8] == PNG_MAGIC


def test_plot_metrics_from_run_dir_skips_absent_keys(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(6):
            logger.log(step, {"reward/mean": step / 5, "loss": 1.0 / (step + 1)})
    out = plot_metrics(tmp_path, keys=("reward/mean", "eval/accuracy", "loss"))
    assert out == tmp_path / "metrics.png" and _is_png(out)
    assert plot_metrics(tmp_path, keys=("eval/accuracy",), out_png=tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_metrics_from_rows_needs_out_png(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "eval/accuracy": math.nan}, {"step": 2}]
    assert _is_png(plot_metrics(rows, out_png=tmp_path / "sub" / "p.png"))
    with pytest.raises(ValueError, match="out_png is required"):
        plot_metrics(rows)


def test_plot_curves_compares_runs_and_rejects_unknown_keys(tmp_path):
    runs = {
        "sync": [{"samples": 64 * i, "reward/mean": i / 10} for i in range(5)],
        "async": [{"samples": 64 * i, "reward/mean": i / 8} for i in range(5)],
        "empty": [],
    }
    assert _is_png(plot_curves(runs, "samples", "reward/mean", tmp_path / "cmp.png", title="reward vs samples"))
    with pytest.raises(ValueError, match=r"no run has both 'time/wall_s' and 'reward/mean'; keys present: \["):
        plot_curves(runs, "time/wall_s", "reward/mean", tmp_path / "x.png")


# ---------------------------------------------------------------- timeline


def test_span_measures_block_and_records_on_error():
    timeline = Timeline()
    with timeline.span("rollout/0", "generate", batch=4):
        time.sleep(0.02)
    with pytest.raises(KeyError), timeline.span("trainer", "step"):
        raise KeyError("boom")
    timeline.instant("trainer", "weights_published", version=1)
    generate, step, instant = timeline.events
    assert generate["worker"] == "rollout/0" and generate["args"] == {"batch": 4}
    assert 0.015 <= generate["end_s"] - generate["start_s"] < 1.0
    assert abs(generate["start_s"] - time.time()) < 5  # wall-clock seconds
    assert step["name"] == "step" and step["end_s"] >= step["start_s"]
    assert instant["kind"] == "instant" and instant["start_s"] == instant["end_s"]


def test_recording_is_thread_safe():
    timeline = Timeline()

    def record(worker):
        for index in range(200):
            timeline.add_span(worker, "work", index, index + 0.5)

    threads = [threading.Thread(target=record, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(timeline.events) == 800
    assert sorted(timeline.workers()) == ["w0", "w1", "w2", "w3"]


def test_events_ship_between_processes_and_merge():
    remote = Timeline()
    remote.add_span("reward", "score", 10.0, 11.0, rows=8)
    shipped = pickle.loads(pickle.dumps(remote.events))
    shipped = json.loads(json.dumps(shipped))
    local = Timeline()
    local.add_span("trainer", "step", 10.5, 12.0)
    local.merge(shipped)
    local.merge(Timeline([{"kind": "span", "worker": "ref", "name": "logp", "start_s": 1, "end_s": 2}]))
    assert [(e["worker"], e["name"]) for e in local.events] == [("trainer", "step"), ("reward", "score"),
                                                               ("ref", "logp")]
    assert local.events[1]["args"] == {"rows": 8}


def test_bad_events_are_rejected():
    timeline = Timeline()
    with pytest.raises(ValueError, match="ends .* before it starts"):
        timeline.add_span("w", "x", 2.0, 1.0)
    with pytest.raises(ValueError, match="worker must be a non-empty string"):
        timeline.add_span("", "x", 1.0, 2.0)
    with pytest.raises(ValueError, match=r"timeline event 1 must be a dict with keys"):
        timeline.merge([{"kind": "span", "worker": "w", "name": "a", "start_s": 0, "end_s": 1}, {"worker": "w"}])
    with pytest.raises(ValueError, match="timeline event 0: kind must be 'span' or 'instant'"):
        timeline.merge([{"kind": "flow", "worker": "w", "name": "a", "start_s": 0, "end_s": 1}])
    assert timeline.events == []


def test_chrome_trace_layout(tmp_path):
    timeline = Timeline()
    timeline.add_span("rollout", "generate", 100.0, 100.5, version=3)
    timeline.add_span("trainer", "step", 100.25, 101.0)
    timeline.instant("trainer", "publish")
    path = timeline.to_chrome_trace(tmp_path / "timeline.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(1, 1): "rollout", (2, 2): "trainer"}
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["generate"]["ts"] == 0 and spans["generate"]["dur"] == pytest.approx(500_000)
    assert spans["step"]["ts"] == pytest.approx(250_000) and (spans["step"]["pid"], spans["step"]["tid"]) == (2, 2)
    assert spans["generate"]["args"] == {"version": 3}
    assert [e["name"] for e in events if e["ph"] == "i"] == ["publish"]
    assert trace["otherData"]["origin_unix_s"] == 100.0


def test_idle_fractions_union_wait_and_window():
    timeline = Timeline()
    timeline.add_span("rollout", "generate", 0.0, 6.0)
    timeline.add_span("rollout", "generate", 4.0, 8.0)  # overlaps: busy 0..8, not 10 s
    timeline.add_span("trainer", "wait_batch", 0.0, 4.0)  # waiting is idle
    timeline.add_span("trainer", "step", 4.0, 9.0)
    timeline.add_span("ref", "wait_weights", 2.0, 10.0)
    timeline.instant("logger", "tick")
    idle = timeline.idle_fractions()  # window 0..10
    assert idle == pytest.approx({"rollout": 0.2, "trainer": 0.5, "ref": 1.0})
    assert timeline.idle_fractions(window=(4.0, 8.0)) == pytest.approx({"rollout": 0.0, "trainer": 0.0, "ref": 1.0})
    with pytest.raises(ValueError, match="has no length"):
        timeline.idle_fractions(window=(5.0, 5.0))
    assert Timeline().idle_fractions() == {}


def _png_size(path):
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def _pipeline(steps, step_s=1.0, slow=None):
    """A sync-like run: per step, rollout generates for half the step, the trainer waits for the rows
    then trains; `slow` = {step: extra seconds of evaluation before it}."""
    timeline, t = Timeline(), 100.0
    for step in range(steps):
        extra = (slow or {}).get(step, 0.0)
        if extra:
            timeline.add_span("trainer", "evaluate", t, t + extra, step=step)
            t += extra
        timeline.add_span("rollout", "generate", t, t + step_s / 2, step=step)
        timeline.add_span("trainer", "wait_rows", t, t + step_s / 2, partition=f"step_{step}")
        timeline.add_span("trainer", "train_micro_batch", t + step_s / 2, t + step_s * 0.9, rows=8)
        timeline.add_span("trainer", "optimizer_step", t + step_s * 0.9, t + step_s, step=step)
        t += step_s
    return timeline


def test_span_step_reads_step_or_partition():
    assert span_step({"args": {"step": 7}}) == 7
    assert span_step({"args": {"partition": "step_12"}}) == 12
    assert span_step({"args": {"step": True, "partition": "eval"}}) is None
    assert span_step({"args": {"version": 3}}) is None and span_step({}) is None


def test_zoom_picks_consecutive_typical_steps_from_the_middle():
    steps, window = _pipeline(10).zoom_window()
    assert steps == [3, 4, 5]  # 8 stretches of 3 (first steps 0..7); the middle ones start at 3 and 4: the earlier wins
    assert window == pytest.approx((103.0, 106.0))
    # an evaluation before step 4 slows every stretch holding step 4: the nearest typical stretch is taken
    steps, window = _pipeline(10, slow={4: 5.0}).zoom_window()
    assert steps == [5, 6, 7] and window == pytest.approx((110.0, 113.0))
    # a stretch with an evaluation is passed over even when the evaluation is too short to slow it
    assert _pipeline(10, slow={4: 0.01}).zoom_window()[0] == [5, 6, 7]
    assert _pipeline(2).zoom_window() == ([0, 1], pytest.approx((100.0, 102.0)))  # fewer steps than asked
    assert _pipeline(9).zoom_window(steps=1)[0] == [4]
    with pytest.raises(ValueError, match="no spans recorded"):
        Timeline().zoom_window()


def test_zoom_without_step_args_is_a_time_window_in_the_middle():
    timeline = Timeline()
    for index in range(100):
        timeline.add_span("trainer", "train", index, index + 0.5)
        timeline.add_span("rollout", "generate", index, index + 0.25)
    timeline.add_span("reward", "score", 0.0, 99.5)
    # about a dozen spans of the busiest worker (100 spans over 99.5 s), centred on the middle of the run
    assert timeline.zoom_window() == ([], pytest.approx((49.75 - 5.97, 49.75 + 5.97)))


def test_utilization_is_busy_share_per_bin_as_idle_fractions_define_it():
    timeline = Timeline()
    timeline.add_span("rollout", "generate", 0.0, 3.0)
    timeline.add_span("rollout", "generate", 1.0, 2.0)  # inside the first: counted once
    timeline.add_span("rollout", "wait_weights", 3.0, 8.0)  # waiting is idle
    timeline.add_span("trainer", "wait_rows", 0.0, 5.0)
    timeline.add_span("trainer", "train_micro_batch", 5.0, 7.0)
    timeline.add_span("trainer", "optimizer_step", 6.5, 7.5)  # overlaps the micro-batch: busy 5..7.5
    timeline.instant("trainer", "publish")
    edges, busy = timeline.utilization(bins=4)  # bins of 2 s over 0..8
    assert edges == pytest.approx([0.0, 2.0, 4.0, 6.0, 8.0])
    assert busy == {"rollout": pytest.approx([1.0, 0.5, 0.0, 0.0]), "trainer": pytest.approx([0.0, 0.0, 0.5, 0.75])}
    for index in range(4):
        idle = timeline.idle_fractions(window=(edges[index], edges[index + 1]))
        assert {worker: 1 - fraction for worker, fraction in idle.items()} == pytest.approx(
            {worker: fractions[index] for worker, fractions in busy.items()})
    edges, busy = timeline.utilization(bins=1, window=(2.0, 6.0))
    assert busy == {"rollout": pytest.approx([0.25]), "trainer": pytest.approx([0.25])}
    assert len(_pipeline(40).utilization()[1]["trainer"]) == 20  # about two steps a bin
    assert len(timeline.utilization()[0]) == 101  # no step args: 100 bins
    with pytest.raises(ValueError, match="no spans recorded"):
        Timeline().utilization()


def test_gantt_png_shows_overview_and_zoom(tmp_path):
    long_run = _pipeline(60, slow={20: 3.0, 40: 3.0})
    long_run.instant("rollout", "restart", released=4)
    both = long_run.gantt_png(tmp_path / "long.png", title="sync workers")
    short = _pipeline(3).gantt_png(tmp_path / "short.png")  # the zoom would show the whole run: overview only
    assert _is_png(both) and _is_png(short)
    assert _png_size(both)[1] > 1.6 * _png_size(short)[1]
    assert _is_png(Timeline().gantt_png(tmp_path / "empty.png"))
    untagged = Timeline()
    for index in range(50):
        untagged.add_span("trainer", "step", index, index + 0.5)
    assert _png_size(untagged.gantt_png(tmp_path / "untagged.png"))[1] > _png_size(short)[1]


def test_utilization_png(tmp_path):
    assert _is_png(_pipeline(60).utilization_png(tmp_path / "utilization.png", title="sync workers"))
    assert _is_png(Timeline().utilization_png(tmp_path / "empty.png"))


# ---------------------------------------------------------------- progress


def test_format_metrics():
    metrics = {"reward/mean": 0.4213, "eval/accuracy": 0.3, "loss": 12345.6}
    assert format_metrics(metrics, {"reward": "reward/mean", "acc": "eval/accuracy", "kl": "kl"}) == \
        "reward 0.421  acc 0.3"
    assert format_metrics(metrics) == "eval/accuracy 0.3  loss 1.235e+04  reward/mean 0.421"


def test_progress_logs_every_n_steps_without_a_terminal(caplog):
    console = Console(file=io.StringIO(), force_terminal=False)
    with caplog.at_level(logging.INFO, logger="asyncflow.progress"):
        with TrainProgress(25, initial=5, log_every=10, console=console, show={"reward": "reward/mean"}) as bar:
            assert not bar.live
            for step in range(6, 26):
                bar.update(step, {"reward/mean": step / 100})
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split("  ")[0] for line in lines] == ["train step 15/25", "train step 25/25"]
    assert "reward 0.15" in lines[0] and "step/s" in lines[0]
    assert console.file.getvalue() == ""


def test_progress_draws_bar_with_metrics_on_a_terminal():
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    with TrainProgress(10, console=console) as bar:
        assert bar.live
        bar.update(1, {"eval/accuracy": 0.31})
        bar.update(2, {"reward/mean": 0.42})  # accuracy stays shown from the earlier step
    output = console.file.getvalue()
    assert "2/10" in output and "reward/mean 0.42" in output and "eval/accuracy 0.31" in output


def test_progress_disabled_on_a_terminal_and_bad_arguments():
    console = Console(file=io.StringIO(), force_terminal=True)
    with TrainProgress(3, enabled=False, console=console) as bar:
        bar.update(3)
    assert not bar.live and console.file.getvalue() == ""
    with pytest.raises(ValueError, match="need 0 <= initial <= total_steps"):
        TrainProgress(3, initial=4)
    with pytest.raises(ValueError, match="log_every must be >= 1"):
        TrainProgress(3, log_every=0)
