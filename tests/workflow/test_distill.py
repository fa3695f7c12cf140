"""On-policy distillation end to end (`algo.teacher`): a tiny student trained on a teacher's log-probs alone moves
toward it (the reverse KL on its own samples falls) in sync, stream and async mode, and the teacher is loaded
through the normal model-loading path (a run's checkpoint folder included)."""

from __future__ import annotations

import pytest
import torch

from asyncflow.api import train
from asyncflow.config import build_config
from asyncflow.models.loading import load_model, load_tokenizer, resolve_model_path
from asyncflow.workflow.setup import teacher_engine_options
from asyncflow.workflow.sft import run_sft


@pytest.fixture(scope="module")
def sft_teacher(tmp_path_factory) -> str:
    """A tiny Llama after 40 supervised steps on the task: it already answers in the task's format (digits, then
    end of sequence), a low-entropy distribution far from the random-init student's. Trained once for the module
    (every mode distils from the same teacher)."""
    folder = tmp_path_factory.mktemp("teacher_model")
    config = build_config({}, [f"run.output_dir={folder}", "run.progress=false", "model.path=preset:tiny-llama",
                               "run.seed=3", "sft.steps=40", "sft.lr=3e-3", "sft.warmup_steps=0", "data.test_size=4"])
    return str(run_sft(config, folder / "sft"))


def distill_config(tmp_path, teacher: str, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", f"algo.teacher={teacher}",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.max_batch_size=8",
        "train.micro_batch_size=16", "train.lr=1e-3", "train.warmup_steps=0", "eval.every=0", "data.test_size=4",
        "checkpoint.every=0", "export.at_end=false", "runtime.call_timeout_s=60", "runtime.kind=inline", *overrides,
    ])  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first mode also trains the module's teacher (170 s of the 300 s default, loaded)
@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
def test_student_moves_toward_the_teacher(tmp_path, mode, sft_teacher):
    config = distill_config(tmp_path / "run", sft_teacher, "train.steps=15", f"workflow.mode={mode}",
                            "rollout.prompts_per_step=8", "rollout.group_size=8", "train.micro_batch_size=64")
    history = [h for h in train(config).history if "distill/reverse_kl" in h]
    kl = [h["distill/reverse_kl"] for h in history]
    assert len(kl) == 15
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.6 * first, f"reverse KL did not fall: {kl}"
    if mode == "async":
        assert max(h["staleness/max"] for h in history) >= 1, "rollout never ran ahead of training"


@pytest.mark.slow
def test_identical_teacher_leaves_the_student_unchanged(tmp_path):
    """A teacher equal to the student gives a zero signal: zero loss, zero gradient."""
    config = distill_config(tmp_path, "preset:tiny-llama", "train.steps=2")
    history = [h for h in train(config).history if "distill/reverse_kl" in h]
    assert all(abs(h["distill/reverse_kl"]) < 1e-5 and h["grad_norm"] < 1e-5 for h in history), history


@pytest.mark.slow
def test_a_run_checkpoint_is_a_teacher(tmp_path):
    teacher_run = tmp_path / "teacher"
    train(distill_config(teacher_run, "preset:tiny-llama", "algo.teacher=null", "train.steps=1",
                         "checkpoint.every=1"))
    config = distill_config(tmp_path / "student", str(teacher_run), "train.steps=1")
    history = [h for h in train(config).history if "distill/reverse_kl" in h]
    assert len(history) == 1
    with pytest.raises(ValueError, match="export the checkpoint first"):  # FSDP2's ranks load a folder by path
        train(distill_config(tmp_path / "sharded", str(teacher_run), "train.engine=fsdp2", "train.world_size=2"))


def test_both_engines_take_the_same_teacher(tmp_path):
    """`algo.teacher` names one model whatever the engine or the run's seed (as `asyncflow serve`/`eval` load it):
    the torch engine's module holds the weights of the folder FSDP2's ranks load."""
    tokenizer = load_tokenizer(resolve_model_path("preset:tiny-llama"))
    torch_options = teacher_engine_options(distill_config(tmp_path, "preset:tiny-llama", "run.seed=5"), tokenizer)
    fsdp2_options = teacher_engine_options(
        distill_config(tmp_path, "preset:tiny-llama", "run.seed=5", "train.engine=fsdp2"), tokenizer)
    on_disk = load_model(fsdp2_options["teacher_path"]).state_dict()
    assert all(torch.equal(on_disk[name], t) for name, t in torch_options["teacher"].state_dict().items())
