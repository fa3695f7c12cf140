"""The public Python interface: a stable set of names, and runs from Python equal to the same runs from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import asyncflow
from asyncflow.cli import main

PUBLIC = {"Config", "ConfigError", "load_config", "build_config", "train", "sft", "evaluate", "export", "serve",
          "TrainResult", "open_run", "RunStopped", "__version__"}


def test_public_names_are_stable_and_documented():
    assert set(asyncflow.__all__) == PUBLIC, "a public name appeared or disappeared: update PUBLIC and the docs"
    for name in PUBLIC - {"__version__"}:
        value = getattr(asyncflow, name)
        assert value.__doc__, f"asyncflow.{name} has no docstring"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        asyncflow.nope  # noqa: B018


def test_import_is_light():
    code = "import sys, asyncflow; print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_bad_key_is_named_from_python():
    with pytest.raises(asyncflow.ConfigError, match="train.nope"):
        asyncflow.build_config({}, ["train.nope=1"])


def run_args(out) -> list[str]:
    return [f"run.output_dir={out}", "run.progress=false", "model.path=preset:tiny-llama", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=3", "train.micro_batch_size=16",
            "eval.every=2", "data.test_size=8", "checkpoint.every=0", "observe.tensorboard=false",
            "export.at_end=false"]


def metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = ("time/", "throughput/", "memory/", "weights/update_")
    return [{k: v for k, v in row.items() if not k.startswith(measured) and k != "wall_s"} for row in rows]


@pytest.mark.slow
def test_a_run_from_python_equals_the_same_run_from_the_cli(tmp_path, one_torch_thread):
    seen = []
    result = asyncflow.train(asyncflow.build_config({}, run_args(tmp_path / "py")), on_step=seen.append)
    assert main(["train", *run_args(tmp_path / "cli")]) == 0
    assert result.step == 3 and [row["step"] for row in seen] == [0, 1, 2, 3]
    assert [row["step"] for row in result.history] == [0, 1, 2, 3]
    assert metrics(tmp_path / "py") == metrics(tmp_path / "cli"), "the same seed gives bit-identical metrics"
    evaluated = asyncflow.evaluate(asyncflow.build_config({}, run_args(tmp_path / "py")),
                                   tmp_path / "py" / "checkpoints" / "step_3")
    assert evaluated["eval/accuracy"] == seen[-1]["eval/accuracy"], "evaluating the checkpoint gives the run's figure"
    again = asyncflow.train(asyncflow.build_config({}, run_args(tmp_path / "py")), resume=True)
    assert again.finished_before and again.history == []


@pytest.mark.slow
def test_a_loop_of_ones_own_in_the_verbs_equals_sync(tmp_path, one_torch_thread):
    """Put prompts, generate, get experience, train a step, publish: the seed's verbs, driven by hand, give
    the built-in `sync` run's metrics bit for bit on the same seed."""
    args = [a for a in run_args(tmp_path / "builtin") if not a.startswith("eval.every")] + ["eval.every=0"]
    builtin = asyncflow.train(asyncflow.build_config({}, args)).history
    own = []
    with asyncflow.open_run(asyncflow.build_config({}, [*args, f"run.output_dir={tmp_path / 'own'}"])) as run:
        flow, trainer = run.workflow, run.trainer
        flow.start(step=0, version=0)
        for step in range(3):
            flow.put_prompts(step)
            flow.generate(step)
            rewards = []
            for rows in flow.experience(step, version=step):
                rewards += [r.reward for r in rows]
                trainer.accumulate(rows, policy_version=step)
            own.append({"reward/mean": sum(rewards) / len(rewards), **trainer.finish_step()})
            flow.publish(step + 1)
    for mine, theirs in zip(own, builtin[1:], strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12, abs=0), key
