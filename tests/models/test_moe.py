"""Mixture-of-experts: the `tiny-moe` preset (Qwen3-MoE's shape), the load-balancing loss against hand-computed
cases, its gradient reaching the routers, and 3-step GRPO runs in `sync` and `async` on the built-in engine and on 2
FSDP2 ranks (which log it), and with vLLM rollouts (marker `vllm`)."""

import json
import math

import pytest
import torch

from asyncflow.cli import main
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.moe import load_balancing_loss, router_loss, routers


@pytest.fixture(scope="module")
def moe_path(_isolated_cache):
    return resolve_model_path("preset:tiny-moe")


def test_load_balancing_loss_hand_computed():
    balanced = [torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])]
    assert float(load_balancing_loss(balanced, top_k=1)) == pytest.approx(1.0)  # top_k when balanced
    assert float(load_balancing_loss([torch.zeros(6, 4)], top_k=2)) == pytest.approx(2.0)
    # 2 tokens, 2 experts, top-1, both to expert 1: f = [0, 1], P = [0.25, 0.75] -> 2 * 0.75
    both_to_one = [torch.tensor([[0.0, math.log(3)], [0.0, math.log(3)]])]
    assert float(load_balancing_loss(both_to_one, top_k=1)) == pytest.approx(1.5)
    collapsed = [torch.tensor([[20.0, 0, 0, 0]] * 5)]  # every token to expert 0 with probability ~1
    assert float(load_balancing_loss(collapsed, top_k=1)) == pytest.approx(4.0, rel=1e-6)
    # layers are concatenated: two layers of the same logits give the loss of one
    assert float(load_balancing_loss(both_to_one * 2, top_k=1)) == pytest.approx(1.5)


@pytest.mark.slow
def test_the_preset_is_qwen3_moe_and_its_routers_are_found(moe_path):
    model = load_model(moe_path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_local_experts == 8 and model.config.num_experts_per_tok == 2
    found = routers(model)
    assert len(found) == model.config.num_hidden_layers and all(r.top_k == 2 for r in found)
    loss = router_loss(model, None)
    assert loss is not None and loss.coef == model.config.router_aux_loss_coef
    with loss.capture() as captured:
        model(input_ids=torch.tensor([[1, 5, 9, 12]]))
    assert [tuple(x.shape) for x in captured] == [(4, 8)] * len(found)
    assert router_loss(load_model(resolve_model_path("preset:tiny-llama")), 1.0) is None  # dense: nothing


@pytest.mark.slow
def test_the_load_balancing_loss_is_logged_and_trains_the_routers(moe_path):
    samples = [TrainSample([1, 5, 9], [12, 14, 3]), TrainSample([1, 7], [8, 8, 8, 2])]

    def gate_grads(coef: float) -> tuple[dict, torch.Tensor]:
        torch.manual_seed(0)
        engine = TorchTrainEngine(load_model(moe_path), lr=1e-3, router_aux_loss_coef=coef)
        stats = engine.backward_micro_batch(samples, lambda out: (-out.policy.logprobs.sum(), {}))
        return stats, torch.cat([r.weight.grad.flatten() for r in routers(engine.model)])

    logged, without = gate_grads(0.0)
    weighted, with_aux = gate_grads(10.0)
    tokens = sum(len(s.response_ids) for s in samples)
    aux = logged["moe/load_balancing_loss"] / tokens
    assert 1.0 <= aux <= 8.0  # between uniform routing and all on one expert
    assert weighted["moe/load_balancing_loss"] == pytest.approx(logged["moe/load_balancing_loss"])
    assert weighted["loss"] == pytest.approx(logged["loss"] + 10.0 * aux * tokens, rel=1e-5)
    assert not torch.allclose(without, with_aux)  # the auxiliary loss reaches the gates


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("engine", ["torch", "fsdp2"])
@pytest.mark.slow
def test_grpo_on_the_moe_preset_logs_its_load_balancing_loss(tmp_path, engine, mode, one_torch_thread):
    ranks = ["train.engine=fsdp2", "train.world_size=2"] if engine == "fsdp2" else []
    code = main(["train", f"--output={tmp_path}", "model.path=preset:tiny-moe", "train.steps=3", "eval.every=0",
                 f"workflow.mode={mode}",
                 "run.progress=false", "sft.before_rl=false", "rollout.prompts_per_step=2", "rollout.group_size=4",
                 "train.micro_batch_size=8", "checkpoint.every=0", "export.at_end=false", "runtime.kind=inline",
                 "train.router_aux_loss_coef=0.01", "--threads=1", *ranks])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "loss" in row]
    assert len(trained) == 3
    assert all(1.0 <= row["moe/load_balancing_loss"] <= 8.0 for row in trained)


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_on_the_moe_preset_with_vllm_rollouts(tmp_path, mode, one_torch_thread):
    code = main(["train", f"--output={tmp_path}", "model.path=preset:tiny-moe", "train.steps=3", "eval.every=0",
                 f"workflow.mode={mode}", "rollout.engine=vllm", "run.progress=false", "sft.before_rl=false",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "train.micro_batch_size=8", "checkpoint.every=0",
                 "export.at_end=false", "runtime.kind=inline", "rollout.vllm.executor=uni", "--threads=1"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "loss" in row]
    assert len(trained) == 3 and all(row["mismatch/abs_log_ratio"] < 0.5 for row in trained)
