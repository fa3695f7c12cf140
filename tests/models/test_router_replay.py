"""Router replay (R3) on the `tiny-moe` preset: the gates and the token order against hand-computed cases, the built-in
engine's routing record, and the trainer's recomputed log-probs of the sampled tokens equal to the engine's to fp32
tolerance with replay (torch and FSDP2 trainers, packed and unpacked), where without it routing flips open a gap.

Routing flips need near-ties between experts. Here they are made, not waited for (`tie_experts`): one router row per
layer is a copy of another plus noise of relative size 1e-7, so the choice between those two experts is decided by
float rounding, which differs between the engine's cached decode and the trainer's full forward (as bf16 kernels
decide real ties)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import AlgoConfig, ConfigError, build_config
from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model, resolve_model_path
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.moe import RouterReplay, replay_order, replayed_gates, routers, routing_recorder, tie_experts
from asyncflow.models.tri_model import tri_model_logprobs
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.workers.trainer import PolicyLoss

FP32 = 2e-6  # |log-prob difference| of the same computation in another float summation order


@pytest.fixture(scope="module")
def tied_path(_isolated_cache, tmp_path_factory):
    """`preset:tiny-moe` (its tokenizer too) with near-tied routers."""
    preset = resolve_model_path("preset:tiny-moe")
    folder = tmp_path_factory.mktemp("tiny-moe-ties") / "model"
    shutil.copytree(preset, folder)
    tie_experts(load_model(preset)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rollouts(tied_path, one_torch_thread):
    """Completions of 8 prompts x 4 samples from the engine with its routing record, as `TrainSample`s with their
    records, and the engine's sampling log-probs `[N, L]`."""
    engine = TorchInferenceEngine(load_model(tied_path), max_batch_size=16, record_routing=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (3 + 2 * i,), generator=g).tolist() for i in range(8)]
    requests = [GenerationRequest((i, k), p) for i, p in enumerate(prompts) for k in range(4)]
    done = sorted(engine.generate(requests, SamplingParams(max_new_tokens=16)), key=lambda c: c.request_id)
    samples = [TrainSample(c.prompt_ids, c.response_ids, c.request_id[0], routed_experts=c.routed_experts)
               for c in done]
    logprobs = torch.nn.utils.rnn.pad_sequence([torch.tensor(c.logprobs) for c in done], batch_first=True)
    return samples, logprobs


def gap(logprobs: torch.Tensor, mask: torch.Tensor, rollout: torch.Tensor) -> float:
    return float((logprobs.detach() - rollout).abs()[mask].max())


def test_replayed_gates_hand_computed():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    experts = torch.tensor([[0, 2]])
    assert replayed_gates(logits, experts, normalise=False)[0].tolist() == pytest.approx([0.1, 0.3])
    assert replayed_gates(logits, experts, normalise=True)[0].tolist() == pytest.approx([0.25, 0.75])
    # the router's own top-k gives its own gates: replay of the router's choice changes nothing
    own = torch.topk(torch.softmax(logits, -1), 2).indices
    assert sorted(replayed_gates(logits, own, normalise=True)[0].tolist()) == pytest.approx([3 / 7, 4 / 7])


def test_replay_order_unpacked_and_packed():
    def record(*experts: int) -> torch.Tensor:  # one layer, top-1: position p routed to experts[p]
        return torch.tensor(experts, dtype=torch.uint8)[:, None, None]

    a = TrainSample([1, 2], [3, 4, 5], 0, routed_experts=record(10, 11, 12, 13))  # P + R - 1 = 4 positions
    b = TrainSample([1, 2], [6], 0, routed_experts=record(20, 21))
    experts, recorded = replay_order([a, b], packed=False, layers=1, k=1)
    assert experts[:, 0, 0].tolist() == [10, 11, 12, 13, 0, 20, 21, 0, 0, 0]  # rows of width 5
    assert recorded.tolist() == [True] * 4 + [False] + [True] * 2 + [False] * 3
    experts, recorded = replay_order([a, b], packed=True, layers=1, k=1)
    # the group's prompt (its first sample's record), then a's response positions 2..4, then b's position 2
    assert experts[:, 0, 0].tolist() == [10, 11, 12, 13, 0, 0]
    assert recorded.tolist() == [True, True, True, True, False, False]
    with pytest.raises(ValueError, match="algo.router_replay"):
        replay_order([a], packed=False, layers=2, k=1)


@pytest.mark.slow
def test_the_engine_records_the_routing_of_every_position_it_ran(tied_path, rollouts):
    samples, _ = rollouts
    model = load_model(tied_path)
    layers, k = len(routers(model)), routers(model)[0].top_k
    for s in samples:
        assert s.routed_experts.dtype == torch.uint8
        assert tuple(s.routed_experts.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, layers, k)
    # the prompt's record is what a plain forward of the prompt chooses (ties aside: compare as sets, most tokens)
    recorder = routing_recorder(model)
    s = samples[-1]
    with torch.no_grad(), recorder.capture() as routed:
        model(input_ids=torch.tensor([s.prompt_ids]))
    same = (routed[0].sort(-1).values == s.routed_experts[: len(s.prompt_ids)].sort(-1).values).all(-1).all(-1)
    assert float(same.float().mean()) >= 0.8
    with pytest.raises(ValueError, match="algo.router_replay"):
        TorchInferenceEngine(load_model(resolve_model_path("preset:tiny-llama")), record_routing=True)


@pytest.mark.parametrize("packing", ["on", "off"])
def test_replay_gives_the_rollout_log_probs_where_routing_flips(tied_path, rollouts, packing):
    samples, rollout = rollouts
    model = load_model(tied_path)
    with torch.no_grad():
        own = tri_model_logprobs(model, samples, packing=packing)
        replay = RouterReplay(model)
        replayed = tri_model_logprobs(model, samples, packing=packing, replay=replay)
        again = tri_model_logprobs(model, samples, packing=packing)  # a forward nobody arranged routes on its own
    assert gap(own.policy.logprobs, own.policy.mask, rollout) > 1e-3  # routing flips
    assert gap(replayed.policy.logprobs, replayed.policy.mask, rollout) < FP32
    assert torch.equal(again.policy.logprobs, own.policy.logprobs)


def test_the_torch_trainer_replays_and_still_trains_the_routers(tied_path, rollouts):
    samples, rollout = rollouts
    engine = TorchTrainEngine(load_model(tied_path), lr=1e-3, router_replay=True, router_aux_loss_coef=0.0)
    assert gap(engine.logprobs(samples), rollout != 0, rollout) < FP32
    captured = {}

    def loss(out):
        captured["gap"] = gap(out.policy.logprobs, out.policy.mask, rollout)
        return -out.policy.logprobs.sum(), {}

    engine.backward_micro_batch(samples, loss)
    assert captured["gap"] < FP32
    gate_grads = torch.cat([r.weight.grad.flatten() for r in routers(engine.model)])
    assert float(gate_grads.abs().max()) > 0  # the gates at the replayed experts carry the routers' gradient


def test_activation_checkpointing_recomputes_the_replayed_routing(tied_path, rollouts):
    samples, _ = rollouts

    def gate_grads(checkpointing: bool) -> torch.Tensor:
        engine = TorchTrainEngine(load_model(tied_path), lr=1e-3, router_replay=True, router_aux_loss_coef=0.0,
                                  activation_checkpointing=checkpointing)
        engine.backward_micro_batch(samples[:8], lambda out: (-out.policy.logprobs.sum(), {}))
        return torch.cat([r.weight.grad.flatten() for r in routers(engine.model)])

    assert torch.allclose(gate_grads(True), gate_grads(False), rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_two_fsdp2_ranks_replay_and_give_the_gradients_of_one_process(tied_path, rollouts):
    """Replayed, the ranks' log-probs are the engine's, and a backward's loss and gradient are one process's (without
    replay, float order alone flips the near-tied routing between the two; the load-balancing loss, a product of batch
    means, is of each rank's rows as of each micro-batch's, so it is left at its default weight of 0 here)."""
    samples, rollout = rollouts
    options = dict(lr=1e-3, router_replay=True, router_aux_loss_coef=0.0)
    engine = FSDP2TrainEngine(load_model(tied_path), model_path=tied_path, world_size=2, launcher=ProcessRanks,
                              **options)
    reference = TorchTrainEngine(load_model(tied_path), **options)
    try:
        assert gap(engine.logprobs(samples), rollout != 0, rollout) < FP32
        lengths = [len(s.response_ids) for s in samples]
        mask = rollout != 0
        advantages = torch.randn(rollout.shape, generator=torch.Generator().manual_seed(0)) * mask
        loss = PolicyLoss(advantages, rollout, mask & False, mask, lengths, AlgoConfig())
        got, want = engine.backward_micro_batch(samples, loss), reference.backward_micro_batch(samples, loss)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
        grads = engine.gradients()
        expected = {name: p.grad for name, p in reference.model.named_parameters() if p.grad is not None}
        assert grads.keys() == expected.keys()
        difference = sum(float((grads[k] - expected[k]).norm()) ** 2 for k in expected) ** 0.5
        assert difference / sum(float(g.norm()) ** 2 for g in expected.values()) ** 0.5 < 1e-6
    finally:
        engine.close()


def test_router_replay_is_refused_where_no_routing_is_recorded():
    base = ["model.path=preset:tiny-moe", "algo.router_replay=true"]
    build_config({}, base)  # the built-in engine records it
    with pytest.raises(ConfigError, match=r"algo.router_replay.*rollout.engine=vllm"):
        build_config({}, [*base, "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"algo.router_replay.*env.name=calculator"):
        build_config({}, [*base, "env.name=calculator"])


@pytest.mark.slow
def test_a_grpo_run_with_router_replay_trains_on_the_rollouts_routing(tmp_path, tied_path, one_torch_thread):
    """The whole path: the rollout worker's rows carry the record (a queue column), the trainer replays it. The gap
    is the run's `mismatch/abs_log_ratio` (mean |log pi_train - log pi_rollout| per token) of its 2 sync steps."""
    def mean_gap(replay: bool) -> float:
        out = tmp_path / f"replay-{replay}"
        code = main(["train", f"--output={out}", f"model.path={tied_path}", "train.steps=2", "eval.every=0",
                     "run.progress=false", "sft.before_rl=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
                     "train.micro_batch_size=16", "checkpoint.every=0", "export.at_end=false", "runtime.kind=inline",
                     f"algo.router_replay={str(replay).lower()}", "--threads=1"])
        assert code == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        gaps = [row["mismatch/abs_log_ratio"] for row in rows if "loss" in row]
        assert len(gaps) == 2
        return max(gaps)

    assert mean_gap(replay=True) < 1e-6 < 1e-5 < mean_gap(replay=False)
