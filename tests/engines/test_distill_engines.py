"""On-policy distillation in both training engines: the teacher (`teacher=` module for the torch engine,
`teacher_path=` for FSDP2's ranks) takes the reference's place, and two FSDP2 ranks give the one-process loss,
`distill/reverse_kl` and gradients."""

from __future__ import annotations

import pytest
import torch
from test_fsdp2_train import HP, groups, relative_difference

from asyncflow.config import AlgoConfig
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.workers.trainer import PolicyLoss


def distill_loss(samples) -> PolicyLoss:
    lengths = [len(s.response_ids) for s in samples]
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    zeros = torch.zeros(len(samples), width)
    return PolicyLoss(zeros, zeros.clone(), None, mask, lengths, AlgoConfig(teacher="any"))


def test_teacher_and_reference_are_exclusive(tiny_llama_path):
    with pytest.raises(ValueError, match="not both"):
        TorchTrainEngine(load_model(tiny_llama_path), use_reference=True, teacher=load_model(tiny_llama_path), **HP)


@pytest.mark.slow
def test_two_fsdp2_ranks_distil_like_one_process(tiny_llama_path, one_torch_thread):
    teacher_path = resolve_model_path("preset:tiny-llama", seed=7)
    reference = TorchTrainEngine(load_model(tiny_llama_path), teacher=load_model(teacher_path), **HP)
    engine = FSDP2TrainEngine(load_model(tiny_llama_path), model_path=tiny_llama_path, world_size=2,
                              launcher=ProcessRanks, teacher_path=str(teacher_path), **HP)
    try:
        samples = groups(3, 4)
        loss = distill_loss(samples)
        got, want = engine.backward_micro_batch(samples, loss), reference.backward_micro_batch(samples, loss)
        assert want["distill/reverse_kl"] > 0.1, "a different teacher gives a nonzero reverse KL"
        for key in ("loss", "distill/reverse_kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        grads = engine.gradients()
        expected = {name: p.grad for name, p in reference.model.named_parameters() if p.grad is not None}
        assert relative_difference(grads, expected) < 1e-5
    finally:
        engine.close()
