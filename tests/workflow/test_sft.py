"""The SFT warm-up on a tiny config (1-digit addition from files, batch 8).

Covers: SFT stops at the first validation check that reaches `sft.stop_accuracy` (a check step),
`sft.steps` bounds a run that never reaches it (with a warning), `sft_summary.json` records the
stop, `asyncflow train` reports it, and validation prompts are kept out of SFT training rows.
On the training engine: the torch engine gives the plain AdamW loop's weights bit for bit, LoRA saves
the merged model as a plain folder, FSDP2 on two ranks trains like one process and checkpoints its
shards; `metrics.jsonl` and checkpoints are written beside the model.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.data import make_task
from asyncflow.data.tasks import is_held_out, is_validation
from asyncflow.engines.torch_train import lr_lambda
from asyncflow.models.loading import load_model, load_tokenizer, resolve_model_path
from asyncflow.models.logprobs import response_logprobs
from asyncflow.observe.metrics import read_metrics
from asyncflow.workflow import sft
from asyncflow.workflow.checkpoint import SHARDED_DIR, list_checkpoints, load_training_state, load_weights

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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_sft_on_the_engine_is_the_single_process_adamw_loop_bit_for_bit(tmp_path, tiny):
    """The engine path (tri-model forward, `sft_loss`, engine AdamW) gives exactly the weights of a plain loop with
    SFT's optimizer settings: the main job's stop steps do not move."""
    config = load_config(EXAMPLE, tiny + ["sft.steps=3", "sft.stop_accuracy=null", "train.micro_batch_size=64"])
    out = sft.run_sft(config, tmp_path / "sft")

    cfg = config.sft
    sft.seed_everything(config.run.seed)
    path = resolve_model_path(config.model.path, seed=config.run.seed)
    model = load_model(path).train()
    to_sample, (train, _) = sft.sft_samples(config, load_tokenizer(path)), sft.sft_pools(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps))
    rng = random.Random(config.run.seed)
    for _ in range(cfg.steps):
        result = response_logprobs(model, [to_sample(train[rng.randrange(len(train))]) for _ in range(cfg.batch_size)])
        (-(result.logprobs * result.mask).sum() / result.mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    saved = load_model(out).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["sft/loss"] > 0 and "sft/grad_norm" in r for r in rows)
    assert [c.name for c in list_checkpoints(out)] == ["step_3"]  # checkpoint.every=100: only the last step


def test_sft_with_lora_saves_the_merged_model_as_a_plain_folder(tmp_path, tiny):
    config = load_config(EXAMPLE, tiny + ["sft.steps=2", "sft.stop_accuracy=null", "train.lora.rank=4",
                                          "checkpoint.every=1"])
    out = sft.run_sft(config, tmp_path / "sft")
    base = load_model(resolve_model_path(config.model.path, seed=config.run.seed)).state_dict()
    model = load_model(out)  # a plain model: no adapter keys, every weight of the architecture
    tuned = model.state_dict()
    assert tuned.keys() == base.keys()
    changed = [k for k in base if not torch.equal(base[k], tuned[k])]
    assert changed and all("proj" in k for k in changed)  # LoRA targets only: embeddings and norms stay frozen
    checkpoint = list_checkpoints(out)[-1]
    assert [c.name for c in list_checkpoints(out)] == ["step_1", "step_2"]
    assert "adapter" in load_training_state(checkpoint)
    assert all(torch.equal(v, tuned[k]) for k, v in load_weights(checkpoint).items())
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_sft_on_fsdp2_two_ranks_trains_like_one_process_and_checkpoints_shards(tmp_path, tiny):
    settings = tiny + ["sft.steps=2", "sft.stop_accuracy=null", "checkpoint.every=1", "runtime.call_timeout_s=120"]
    one = load_model(sft.run_sft(load_config(EXAMPLE, settings), tmp_path / "one")).state_dict()
    two_ranks = load_config(EXAMPLE, settings + ["train.engine=fsdp2", "train.world_size=2"])
    out = sft.run_sft(two_ranks, tmp_path / "fsdp2")
    sharded = load_model(out).state_dict()
    for key, value in one.items():  # the ranks' gradient sums add up in another float order
        torch.testing.assert_close(sharded[key], value, rtol=1e-4, atol=1e-5)
    assert [c.name for c in list_checkpoints(out)] == ["step_1", "step_2"]
    assert len(list((list_checkpoints(out)[-1] / SHARDED_DIR).glob("*.distcp"))) == 2  # one file per rank
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
