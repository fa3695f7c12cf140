"""Every CLI subcommand run through the entry point (`asyncflow.cli.main`), on tiny settings.

Covers the run-folder contract (config.yaml, metrics.jsonl keys, checkpoints, TensorBoard, PNG),
`--resume` continuing the step numbering (and matching an uninterrupted run), `asyncflow eval`
on a checkpoint, determinism under a fixed seed, and the clear errors for bad input.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import load_config

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
TIMING_KEYS = ("time/", "throughput/", "wall_s")


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
    assert last["data/skipped_long_prompts"] > 0

    code = train(tmp_path / "none", "sft.before_rl=false", "data.max_prompt_tokens=2", "train.steps=1")
    assert code == 1
    assert "every training prompt is longer than data.max_prompt_tokens=2" in capsys.readouterr().err


def test_eval_of_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    code = main(["eval", EXAMPLE, *TINY, "--output", str(tmp_path), "--checkpoint", str(tmp_path / "nope")])
    assert code == 1
    assert "does not exist" in capsys.readouterr().err


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


def test_a_reward_failing_on_every_sample_stops_the_run_after_max_error_steps(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = train(run_dir, "sft.before_rl=false", "train.steps=8", "eval.every=0", "reward.fns=[test_cli:broken_reward]")
    assert code == 1
    err = capsys.readouterr().err
    assert "broken verifier" in err and "reward.max_error_steps" in err
    assert [r["step"] for r in rows(run_dir) if "loss" in r] == [1, 2, 3]
