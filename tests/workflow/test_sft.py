"""The SFT warm-up's stopping rule, on a tiny config (1-digit addition from files, batch 8).

Covers: SFT stops at the first validation check that reaches `sft.stop_accuracy` (a check step),
`sft.steps` bounds a run that never reaches it (with a warning), `sft_summary.json` records the
stop, `asyncflow train` reports it, and validation prompts are kept out of SFT training rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.data import make_task
from asyncflow.data.tasks import is_held_out, is_validation
from asyncflow.workflow import sft

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "arithmetic_grpo.yaml")
# 1-digit additions from small files (a built-in task draws a 50,000-row pool: seconds per run)
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
SMALL = ["sft.batch_size=8", "sft.warmup_steps=2", "rollout.max_new_tokens=3", "run.progress=false",
         "data.task=null", "reward.fns=[numeric_match]", "data.test_size=8"]


@pytest.fixture
def tiny(tmp_path):
    """Overrides for the main example shrunk to 1-digit addition read from files."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS if not is_held_out(r["prompt"])))
    test.write_text("".join(json.dumps(r) + "\n" for r in ROWS if is_held_out(r["prompt"])))
    return SMALL + [f"data.path={train}", f"data.test_path={test}"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scripted_accuracy(monkeypatch, values):
    """Make each validation check return the next of `values` (after really evaluating the model)."""
    real = sft.ValidationProbe.accuracy
    seen = iter(values)

    def accuracy(self, model):
        assert 0.0 <= real(self, model) <= 1.0
        return next(seen)

    monkeypatch.setattr(sft.ValidationProbe, "accuracy", accuracy)


def summary(folder: Path) -> dict:
    return json.loads((folder / "sft_summary.json").read_text())


def test_stops_at_the_first_check_reaching_the_target(tmp_path, tiny, monkeypatch, caplog):
    scripted_accuracy(monkeypatch, [0.1, 0.3, 0.55, 0.9, 0.95])
    config = load_config(EXAMPLE, tiny + ["sft.steps=50", "sft.check_every=3", "sft.stop_accuracy=0.5"])
    with caplog.at_level(logging.INFO, logger="asyncflow"):
        out = sft.run_sft(config, tmp_path / "sft")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    result = summary(out)
    assert result["steps"] == 9 and result["reached"] is True and result["val_accuracy"] == 0.55
    assert [c["step"] for c in result["checks"]] == [3, 6, 9]
    assert result["max_steps"] == 50 and result["stop_accuracy"] == 0.5 and result["validation_size"] > 0
    assert "SFT stopped at step 9" in caplog.text and not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_max_steps_bound_a_run_that_misses_the_target_with_a_warning(tmp_path, tiny, caplog):
    config = load_config(EXAMPLE, tiny + ["sft.steps=7", "sft.check_every=3", "sft.stop_accuracy=1.0"])
    with caplog.at_level(logging.INFO, logger="asyncflow"):
        out = sft.run_sft(config, tmp_path / "sft")
    result = summary(out)
    assert result["steps"] == 7 and result["reached"] is False
    assert [c["step"] for c in result["checks"]] == [3, 6, 7]  # every check_every steps, and at sft.steps
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without validation accuracy >= sft.stop_accuracy=1.0" in warnings[0]


def test_without_a_target_sft_runs_all_steps(tmp_path, tiny):
    config = load_config(EXAMPLE, tiny + ["sft.steps=4", "sft.stop_accuracy=null"])
    result = summary(sft.run_sft(config, tmp_path / "sft"))
    assert result["steps"] == 4 and result["checks"] == [] and result["reached"] is None


def test_train_reports_the_sft_stop(tmp_path, tiny, monkeypatch, capsys):
    scripted_accuracy(monkeypatch, [0.0, 0.8])
    code = main([
        "train", EXAMPLE, *tiny, "sft.steps=20", "sft.check_every=2", "sft.stop_accuracy=0.7",
        "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "--threads", "1", "--output", str(tmp_path / "run"),
    ])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sft/steps"] == 4 and result["sft/val_accuracy"] == 0.8
    assert summary(tmp_path / "run" / "sft")["steps"] == 4


def test_validation_rows_stay_out_of_sft_training(tmp_path, tiny):
    config = load_config(EXAMPLE, ["sft.stop_accuracy=0.5", "sft.validation_size=64"])  # the built-in task
    train, validation = sft.sft_pools(config)
    test = {e.prompt for e in make_task("arithmetic", difficulty=2).examples("test")}
    assert len(validation) == 64 and all(is_validation(e.prompt) for e in validation)
    assert not {e.prompt for e in validation} & ({e.prompt for e in train} | test)

    files = load_config(EXAMPLE, tiny + ["sft.stop_accuracy=0.5"])  # carved out of the training file
    train, validation = sft.sft_pools(files)
    assert validation and all(is_validation(e.prompt) for e in validation)
    rows = [r for r in ROWS if not is_held_out(r["prompt"])]
    assert len(train) + len(validation) == len(rows) and not any(is_validation(e.prompt) for e in train)

    too_few = tmp_path / "few.jsonl"
    too_few.write_text("".join(json.dumps(r) + "\n" for r in rows if not is_validation(r["prompt"])))
    with pytest.raises(ValueError, match="no validation prompts"):
        sft.sft_pools(load_config(EXAMPLE, tiny + ["sft.stop_accuracy=0.5", f"data.path={too_few}"]))
