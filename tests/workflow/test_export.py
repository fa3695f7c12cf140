"""HF-format export (issue 17): the final export of a run and `asyncflow export` write a folder that
transformers loads with the standard architecture class, whose log-probs are the trainer's bit for bit;
a chosen checkpoint is exported as saved; a used folder or a missing checkpoint is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncflow.api import open_run
from asyncflow.cli import main
from asyncflow.config import build_config
from asyncflow.models.loading import load_model, render_prompt
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.workflow.run import RLRun


def parity_reward(completion: str, ground_truth: str, **metadata) -> float:
    """Varies within a group even for an untrained model, so every step changes the weights."""
    return float(len(completion) % 2)


def tiny_run(run_dir, *overrides: str) -> RLRun:
    """Two GRPO steps of a tiny Llama with a checkpoint after each, trained in this process on 8 prompts of a
    file (quicker to set up than a built-in task's pool)."""
    data = Path(run_dir).parent / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a + 3}=", "answer": str(2 * a + 3)}) + "\n" for a in range(8)))
    config = build_config({}, [
        f"run.output_dir={run_dir}", "run.progress=false", "model.path=preset:tiny-llama", "data.task=null",
        f"data.path={data}",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2",
        "train.micro_batch_size=16", "train.lr=1e-3", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=5",
        "runtime.kind=inline", "observe.tensorboard=false", "reward.fns=[test_export:parity_reward]", *overrides,
    ])  # fmt: skip
    with open_run(config) as run:
        run.train()
    return run


def probe_samples(tokenizer) -> list[TrainSample]:
    """Prompts as the run renders them, with responses of varied lengths (token ids of printable characters)."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, prompt in enumerate(["12+34=", "7+8=", "99+1="]):
        response = torch.randint(3, len(tokenizer), (3 + 2 * i,), generator=generator).tolist()
        samples.append(TrainSample(render_prompt(tokenizer, prompt), response, i))
    return samples


@torch.no_grad()
def logprobs(model, samples) -> torch.Tensor:
    return response_logprobs(model, samples).logprobs


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_torch_thread):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    return run_dir, tiny_run(run_dir)


@pytest.mark.slow
def test_final_export_loads_in_transformers_and_gives_the_trainers_logprobs(trained):
    run_dir, run = trained
    out = run_dir / "export"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (out / "model.safetensors").exists() and not list(out.glob("*.bin"))  # safetensors only (vLLM reads it)
    assert json.loads((out / "asyncflow_export.json").read_text())["step"] == 2

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.get_vocab() == run.tokenizer.get_vocab()
    assert tokenizer.decode(tokenizer("12+34=", add_special_tokens=False)["input_ids"]) == "12+34="
    samples = probe_samples(tokenizer)
    exported = logprobs(model, samples)
    assert torch.equal(exported, logprobs(run.train_engine.model, samples))
    initial = load_model(run.spec.model_path)
    assert not torch.equal(exported, logprobs(initial, samples)), "training changed nothing: the test proves nothing"


def test_export_command_writes_the_chosen_checkpoint_and_refuses_a_used_folder(trained, tmp_path, capsys):
    run_dir, _ = trained
    out = tmp_path / "step1"
    assert main(["export", str(run_dir), str(out), "--checkpoint", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
    saved = load_file(str(run_dir / "checkpoints" / "step_1" / "model.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert all(torch.equal(exported[key], value) for key, value in saved.items())

    assert main(["export", str(run_dir), str(out)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), str(tmp_path / "other"), "--checkpoint", "7"]) == 1
    assert "step_7" in capsys.readouterr().err and not (tmp_path / "other").exists()
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 1
    assert "holds no run" in capsys.readouterr().err


RUNS = ("whole", "cut")


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_exports_the_adapter_and_the_merged_model(tmp_path, one_torch_thread):
    peft = pytest.importorskip("peft")
    lora = ["train.lora.rank=4", "train.lora.target_modules=all-linear", "export.merged=true"]
    whole = tiny_run(tmp_path / "whole", *lora)
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")  # as if it had stopped after step 1's checkpoint
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_2")
    shutil.rmtree(tmp_path / "cut" / "export")
    cut_run = whole.config.run.model_copy(update={"output_dir": str(tmp_path / "cut")})
    resumed_config = whole.config.model_copy(update={"run": cut_run})  # train.steps=2
    with open_run(resumed_config, resume=True) as resumed:
        resumed.train()
    final = {name: load_file(str(tmp_path / name / "checkpoints/step_2/model.safetensors")) for name in RUNS}
    assert final["whole"].keys() == final["cut"].keys()
    assert all(torch.equal(final["whole"][k], final["cut"][k]) for k in final["whole"])

    out = tmp_path / "whole" / "export"
    samples = probe_samples(whole.tokenizer)
    whole.train_engine.model.eval()
    trainer = logprobs(whole.train_engine.model, samples)
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    plain = load_model(whole.spec.model_path)
    plain.load_state_dict(final["whole"])
    assert torch.equal(logprobs(merged, samples), logprobs(plain, samples))  # the checkpoint's merged weights
    torch.testing.assert_close(logprobs(merged, samples), trainer, rtol=0, atol=1e-4)
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4
    assert adapter_config["base_model_name_or_path"] == str(Path(whole.spec.model_path).resolve())
    adapted = peft.PeftModel.from_pretrained(load_model(whole.spec.model_path), str(out / "adapter"))
    assert torch.equal(logprobs(adapted, samples), trainer)


@pytest.mark.parametrize("kind", ["head", "separate"])
@pytest.mark.slow
def test_a_ppo_run_exports_a_plain_policy_and_keeps_its_critic_in_the_checkpoint(tmp_path, kind, one_torch_thread):
    """With a critic (`algo.advantage=gae`) the export is the policy alone (transformers loads it with no unused
    weight, and it gives the trainer's log-probs); the critic's weights are in `training_state.pt` only."""
    run = tiny_run(tmp_path / "run", "algo.advantage=gae", f"algo.critic.kind={kind}")
    out = tmp_path / "run" / "export"
    exported = load_file(str(out / "model.safetensors"))
    assert not any("critic" in key for key in exported)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    samples = probe_samples(AutoTokenizer.from_pretrained(str(out)))
    assert torch.equal(logprobs(model, samples), logprobs(run.train_engine.model, samples))
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_2" / "training_state.pt", weights_only=False)
    critic = run.train_engine.critic.state_dict()
    assert state["critic"].keys() == critic.keys() and all(torch.equal(state["critic"][k], critic[k]) for k in critic)
