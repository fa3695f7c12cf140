"""bf16 mixed precision and activation checkpointing in both training engines, on CPU (tiny Llama, one thread).

Tolerances (the same rows, the same initial weights, one micro-batch of GRPO groups):
- bf16 vs fp32: loss within 1e-2 absolute (measured ~5e-5), the gradient as one vector within 5% relative
  (measured ~0.7%); parameters, gradients and log-probs stay float32.
- activation checkpointing vs none: gradients within 1e-6 relative (measured: bit-identical), and the layers do
  run twice (forward + recompute).
"""

from __future__ import annotations

import math

import pytest
import torch
from engines.test_fsdp2_train import groups, policy_loss, relative_difference

from asyncflow.api import open_run
from asyncflow.config import ConfigError, build_config
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import response_logprobs
from asyncflow.runtime.inline import ProcessRanks

BF16_LOSS_ATOL = 1e-2
BF16_GRAD_RTOL = 5e-2
CHECKPOINTING_GRAD_RTOL = 1e-6


def gradients(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}


def torch_step(path, samples, **options) -> tuple[float, dict[str, torch.Tensor], TorchTrainEngine]:
    engine = TorchTrainEngine(load_model(path), lr=1e-3, **options)
    loss = engine.backward_micro_batch(samples, policy_loss(samples, seed=0))["loss"]
    return loss, gradients(engine), engine


@pytest.mark.parametrize("packing", ["on", "off"])
def test_bf16_loss_and_gradients_are_within_tolerance_of_fp32(tiny_llama_path, one_torch_thread, packing):
    samples = groups(1, 4)
    loss32, grads32, _ = torch_step(tiny_llama_path, samples, packing=packing)
    loss16, grads16, engine = torch_step(tiny_llama_path, samples, packing=packing, precision="bf16")
    assert abs(loss16 - loss32) < BF16_LOSS_ATOL
    difference = relative_difference(grads16, grads32)
    assert 0 < difference < BF16_GRAD_RTOL, "bf16 compute must differ from fp32 a little, not a lot"
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}, "master weights stay float32"
    assert {g.dtype for g in grads16.values()} == {torch.float32}
    assert engine.logprobs(samples).dtype == torch.float32
    assert engine.optimizer_step(1e-2)["skipped"] == 0.0


def count_layer_calls(model: torch.nn.Module) -> list[int]:
    """Calls of the first decoder layer's first projection (inside the checkpointed `forward`)."""
    calls = [0]
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("packing", ["on", "off"])
def test_activation_checkpointing_gives_the_same_gradients(tiny_llama_path, one_torch_thread, packing):
    samples = groups(2, 4)
    loss, grads, plain = torch_step(tiny_llama_path, samples, packing=packing)
    engine = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-3, packing=packing, activation_checkpointing=True)
    calls = count_layer_calls(engine.model)
    stats = engine.backward_micro_batch(samples, policy_loss(samples, seed=0))
    assert calls[0] == 2, "a checkpointed layer runs in the forward and again in the backward"
    assert stats["loss"] == pytest.approx(loss, rel=1e-6)
    assert relative_difference(gradients(engine), grads) < CHECKPOINTING_GRAD_RTOL
    # Packed and unpacked forwards both still run on the model (its attention stays pinned between calls).
    assert torch.allclose(engine.logprobs(samples), plain.logprobs(samples), atol=1e-5)
    unpacked = response_logprobs(engine.model, samples).logprobs
    assert torch.allclose(unpacked, response_logprobs(plain.model, samples).logprobs, atol=1e-5)


@pytest.mark.slow
def test_fsdp2_bf16_with_checkpointing_matches_one_fp32_process(tiny_llama_path, one_torch_thread):
    """2 ranks, `MixedPrecisionPolicy` (bf16 compute, fp32 reduce) plus activation checkpointing, against the
    single-process fp32 engine on the same rows; then fp32 with checkpointing, which must be exact."""
    samples = groups(3, 4)
    loss32, grads32, _ = torch_step(tiny_llama_path, samples)
    for precision, tolerance in (("bf16", BF16_GRAD_RTOL), ("fp32", 1e-6)):
        engine = FSDP2TrainEngine(load_model(tiny_llama_path), model_path=tiny_llama_path, world_size=2, lr=1e-3,
                                  precision=precision, activation_checkpointing=True, launcher=ProcessRanks)
        try:
            stats = engine.backward_micro_batch(samples, policy_loss(samples, seed=0))
            grads = engine.gradients()
            assert {g.dtype for g in grads.values()} == {torch.float32}
            assert abs(stats["loss"] - loss32) < (BF16_LOSS_ATOL if precision == "bf16" else 1e-5)
            assert relative_difference(grads, grads32) < tolerance, precision
            engine.optimizer_step(1e-2)
            assert {w.dtype for w in engine.state_dict().values()} == {torch.float32}, "fp32 master weights"
        finally:
            engine.close()


def test_bf16_needs_float32_master_weights(tiny_llama_path):
    with pytest.raises(ConfigError, match="train.precision=bf16 keeps float32 master weights"):
        build_config({}, ["train.precision=bf16", "model.dtype=bfloat16"])
    with pytest.raises(ValueError, match="train.precision=bf16 keeps float32 master weights"):
        TorchTrainEngine(load_model(tiny_llama_path, dtype="bfloat16"), lr=1e-3, precision="bf16")
    with pytest.raises(ValueError, match="train.precision must be one of"):
        TorchTrainEngine(load_model(tiny_llama_path), lr=1e-3, precision="fp16")


def test_rollout_dtype_follows_the_training_precision():
    assert build_config({}, []).rollout_dtype() == "float32"
    assert build_config({}, ["train.precision=bf16"]).rollout_dtype() == "bfloat16"
    assert build_config({}, ["train.precision=bf16", "rollout.dtype=float32"]).rollout_dtype() == "float32"
    assert build_config({}, ["model.dtype=bfloat16"]).rollout_dtype() == "bfloat16"


@pytest.mark.slow
def test_a_bf16_run_rolls_out_in_bf16_and_trains_fp32_weights(tmp_path, one_torch_thread):
    config = build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "data.test_size=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=2",
        "train.micro_batch_size=4", "eval.every=0", "checkpoint.every=0", "runtime.kind=inline",
        "train.precision=bf16", "train.activation_checkpointing=true", "export.at_end=false",
    ])  # fmt: skip
    with open_run(config) as run:
        rollout_engine = run.runtime.local_rollout.engine
        assert rollout_engine.model.dtype == torch.bfloat16
        assert run.train_engine.model.dtype == torch.float32
        rows = [row for row in run.train() if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["grad_norm"]) for row in rows)
    trained = run.train_engine.state_dict()
    rolled = rollout_engine.model.state_dict()
    for name, weight in trained.items():  # the rollout engine holds the trained weights, rounded to bf16
        assert torch.equal(rolled[name], weight.to(torch.bfloat16)), name


@pytest.mark.slow
def test_fsdp2_logprobs_equal_the_single_process_ones(tiny_llama_path, one_torch_thread):
    samples = groups(4, 3)
    want = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-3).logprobs(samples)
    engine = FSDP2TrainEngine(load_model(tiny_llama_path), model_path=tiny_llama_path, world_size=2, lr=1e-3,
                              launcher=ProcessRanks)
    try:
        got = engine.logprobs(samples)
    finally:
        engine.close()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
