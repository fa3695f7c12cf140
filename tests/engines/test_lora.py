"""LoRA on the built-in training engine (issue 17): only the adapters train and sit in the optimizer, the base
weights stay bit-identical, the merged weights a rollout engine loads reproduce the trainer's log-probs there,
and bad settings are named. Adapter sync (issue 43): a rollout engine holding the base weights and taking the adapter
per version samples as the merged weights do, in flight too, and refuses anything but adapter tensors."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

pytest.importorskip("peft")

from test_inference_engine import assert_logprobs_match_training_side, make_requests

from asyncflow.config import ConfigError, build_config
from asyncflow.engines import SamplingParams, make_inference_engine
from asyncflow.engines.peft_lora import LoRASettings, lora_layers
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.models.tri_model import TriLogProbs

SETTINGS = LoRASettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def push_up_sampled_tokens(out: TriLogProbs):
    """A loss whose gradient is never zero: raise the log-prob of every response token."""
    return -(out.policy.logprobs * out.policy.mask).sum(), {}


def train_steps(engine: TorchTrainEngine, steps: int = 3) -> None:
    requests = make_requests(4, seed=5, lengths=(2, 8))
    samples = [TrainSample(r.prompt_ids, [5 + i, 9, 11 + i], i) for i, r in enumerate(requests)]
    for _ in range(steps):
        engine.backward_micro_batch(samples, push_up_sampled_tokens)
        assert engine.optimizer_step()["skipped"] == 0.0


@pytest.fixture
def lora_engine(tiny_llama_path, one_torch_thread):
    torch.manual_seed(0)
    return TorchTrainEngine(load_model(tiny_llama_path), lr=1e-2, lora=SETTINGS)


def test_only_the_adapters_train_and_the_base_stays_bit_identical(tiny_llama_path, lora_engine):
    plain = load_model(tiny_llama_path)
    before = {k: v.clone() for k, v in lora_engine.model.state_dict().items()}
    train_steps(lora_engine)

    adapter = {n: p for n, p in lora_engine.model.named_parameters() if ".lora_" in n}
    assert len(adapter) == 2 * 3 * plain.config.num_hidden_layers  # A and B of 3 modules per layer
    optimized = {id(p) for group in lora_engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapter.values()}
    after = lora_engine.model.state_dict()
    for key, value in before.items():
        if ".lora_" in key:
            continue
        assert torch.equal(after[key], value), f"base weight {key} changed"
    assert all(not torch.equal(after[key], before[key]) for key in adapter if ".lora_B." in key)

    merged = lora_engine.state_dict()
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in plain.state_dict().items()}
    changed = {k for k in merged if not torch.equal(merged[k], plain.state_dict()[k])}
    assert changed == {f"{name}.weight" for name in lora_layers(lora_engine.model)}


def test_synced_merged_weights_reproduce_the_trainers_logprobs_in_the_rollout_engine(tiny_llama_path, lora_engine):
    train_steps(lora_engine)
    rollout = make_inference_engine("torch", model=load_model(tiny_llama_path).eval(), max_batch_size=4, seed=1)
    rollout.update_weights(lora_engine.state_dict(), 3)
    completions = list(rollout.generate(make_requests(6, seed=2), SamplingParams(temperature=1.0, max_new_tokens=8)))
    assert {c.weight_version for c in completions} == {3}
    lora_engine.model.eval()  # the trainer's own forward (with the adapter layers), no dropout
    assert_logprobs_match_training_side(lora_engine.model, completions, temperature=1.0)
    stale = TorchInferenceEngine(load_model(tiny_llama_path).eval(), seed=1)  # the base alone differs: a real check
    with pytest.raises(AssertionError):
        assert_logprobs_match_training_side(stale.model, completions, temperature=1.0)


def test_loading_full_weights_makes_them_the_base_with_a_fresh_adapter(tiny_llama_path, lora_engine):
    train_steps(lora_engine, steps=1)
    other = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-2, lora=SETTINGS)
    other.load_state_dict(lora_engine.state_dict())  # what `asyncflow eval` does with a checkpoint
    assert all(torch.equal(other.state_dict()[k], v) for k, v in lora_engine.state_dict().items())
    samples = [TrainSample([1, 20, 21], [30, 31, 32])]
    with torch.no_grad():
        torch.testing.assert_close(
            response_logprobs(other.model, samples).logprobs, response_logprobs(lora_engine.model, samples).logprobs,
            rtol=0, atol=1e-5,
        )  # fmt: skip


def test_lora_checkpoint_state_resumes_the_adapter_and_checks_the_base(tiny_llama_path, lora_engine):
    train_steps(lora_engine, steps=2)
    weights, state = lora_engine.state_dict(), copy.deepcopy(lora_engine.training_state())
    resumed = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-2, lora=SETTINGS)
    resumed.load_checkpoint(weights, state)
    train_steps(lora_engine, steps=1)
    train_steps(resumed, steps=1)
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in lora_engine.state_dict().items())

    with pytest.raises(ValueError, match="written with LoRA"):
        TorchTrainEngine(load_model(tiny_llama_path), lr=1e-2).load_checkpoint(weights, state)
    changed_base = load_model(tiny_llama_path)
    torch.nn.init.zeros_(changed_base.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="model.path changed"):
        TorchTrainEngine(changed_base, lr=1e-2, lora=SETTINGS).load_checkpoint(weights, state)


def test_bad_lora_settings_are_named(tiny_llama_path):
    with pytest.raises(ConfigError, match="train.lora.target_modules.*not supported"):
        build_config({}, ["train.lora.rank=4", "train.lora.target_modules=[q_proj,lm_head]"])
    with pytest.raises(ConfigError, match="train.lora.rank"):
        build_config({}, ["train.lora.rank=-1"])
    with pytest.raises(ValueError, match="train.lora.target_modules"):
        TorchTrainEngine(load_model(tiny_llama_path), lr=1e-2, lora=LoRASettings(rank=2, target_modules=("qkv",)))


def twin_engines(tiny_llama_path, lora_engine, adapter_slots=2) -> tuple[TorchInferenceEngine, TorchInferenceEngine]:
    """Rollout engines on the base weights with the same seed: one under adapter sync, one taking merged weights."""
    adapter = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=4, seed=3, adapter=SETTINGS,
                                   adapter_slots=adapter_slots)
    merged = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=4, seed=3)
    return adapter, merged


def update_both(adapter: TorchInferenceEngine, merged: TorchInferenceEngine, trainer: TorchTrainEngine, version: int):
    adapter.update_weights(trainer.adapter_weights(), version)
    merged.update_weights(trainer.state_dict(), version)


def assert_same_completions(ours, theirs) -> None:
    """Same tokens and versions; sampling log-probs equal to fp32 rounding (the adapter path sums in another order)."""
    assert [(c.response_ids, c.token_versions, c.weight_version) for c in ours] == \
        [(c.response_ids, c.token_versions, c.weight_version) for c in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_adapter_sync_samples_as_the_merged_weights_do_after_every_update(tiny_llama_path, lora_engine):
    adapter, merged = twin_engines(tiny_llama_path, lora_engine)
    published = lora_engine.adapter_weights()
    assert all(".lora_" in k for k in published) and len(published) == 2 * 3 * 4  # A, B x 3 modules x 4 layers
    for version in (1, 2):
        train_steps(lora_engine, steps=2)
        update_both(adapter, merged, lora_engine, version)
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_new_tokens=8)
            ours = list(adapter.generate(make_requests(6, seed=version), params))
            theirs = list(merged.generate(make_requests(6, seed=version), params))
            assert {c.weight_version for c in ours} == {version}
            assert_same_completions(ours, theirs)
        lora_engine.model.eval()
        assert_logprobs_match_training_side(lora_engine.model, ours, temperature=1.0)
        lora_engine.model.train()
    # the base weights of the engine never change: only the A/B matrices do
    base = load_model(tiny_llama_path).state_dict()
    held = {k.replace(".base_layer.", "."): v for k, v in adapter.model.state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(held[k], v) for k, v in base.items())


def test_adapter_update_during_generation_labels_each_token_with_its_version(tiny_llama_path, lora_engine):
    """With one adapter slot the requests in flight move to the new version, recomputed as with full weights."""
    adapter, merged = twin_engines(tiny_llama_path, lora_engine, adapter_slots=1)
    update_both(adapter, merged, lora_engine, 1)
    train_steps(lora_engine, steps=2)
    versions = {"adapter": (adapter, lora_engine.adapter_weights()), "merged": (merged, lora_engine.state_dict())}
    results = {}
    for name, (engine, weights) in versions.items():
        sampled = []

        def update_after_three(ids, logprobs, engine=engine, weights=weights, sampled=sampled):
            sampled.extend(ids)
            if len(sampled) == 3:  # on the generating thread: applied at the next step, slots recomputed
                engine.update_weights(weights, 2)

        requests = make_requests(4, seed=9)
        requests[0].on_tokens = update_after_three
        results[name] = list(engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=10)))
    assert any(c.token_versions is not None and set(c.token_versions) == {1, 2} for c in results["adapter"])
    assert_same_completions(results["adapter"], results["merged"])


def generate_through_two_updates(tiny_llama_path, lora_engine, adapter_slots: int):
    """Greedy requests (batch 2) on an engine under adapter sync that takes versions 2 and 3 while they run: request
    0 (14 tokens) starts on version 1 and runs through both updates, request 2 starts on version 2 and runs past
    the update to 3. -> (completions by request id, the requests, {version: (adapter, merged weights)})."""
    versions = {}
    for version in (1, 2, 3):
        train_steps(lora_engine, steps=1)
        versions[version] = (lora_engine.adapter_weights(), lora_engine.state_dict())
    engine = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=2, adapter=SETTINGS,
                                  adapter_slots=adapter_slots)
    engine.update_weights(versions[1][0], 1)
    sampled = []

    def count(ids, logprobs):  # on the generating thread: each update is taken at the next step
        sampled.extend(ids)
        if len(sampled) in (3, 14):
            version = 2 if len(sampled) == 3 else 3
            engine.update_weights(versions[version][0], version)

    requests = make_requests(6, seed=4)
    for request, tokens in zip(requests, (14, 4, 8, 6, 6, 6)):
        request.params, request.on_tokens = SamplingParams(temperature=0.0, max_new_tokens=tokens), count
    completions = {c.request_id: c for c in engine.generate(requests, SamplingParams(temperature=0.0))}
    return completions, requests, versions


def test_requests_finish_on_the_adapter_version_they_started_with(tiny_llama_path, lora_engine):
    """`workflow.max_staleness` 2 (3 adapter slots): each request keeps the version it started with to its end, in a
    batch mixing versions row by row, and its tokens and log-probs are those of the merged weights of that version."""
    completions, requests, versions = generate_through_two_updates(tiny_llama_path, lora_engine, adapter_slots=3)
    assert all(c.token_versions is None for c in completions.values())  # one version per request
    started = {i: c.weight_version for i, c in completions.items()}
    assert started[0] == 1 and started[1] == 1 and started[2] == 2 and set(started.values()) == {1, 2, 3}
    for version, (_, merged_weights) in versions.items():
        merged = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=2)
        merged.update_weights(merged_weights, version)
        ours = [completions[i] for i in sorted(completions) if started[i] == version]
        mine = [replace(r, on_tokens=None) for r in requests if started[r.request_id] == version]
        theirs = sorted(merged.generate(mine, SamplingParams(temperature=0.0)), key=lambda c: c.request_id)
        assert_same_completions(ours, theirs)


def test_with_every_adapter_in_use_the_oldest_versions_requests_move_to_the_new_one(tiny_llama_path, lora_engine):
    """2 slots, versions 1 and 2 in flight when 3 arrives: version 1's adapter takes 3, request 0 goes on with it."""
    completions, _, _ = generate_through_two_updates(tiny_llama_path, lora_engine, adapter_slots=2)
    moved = completions[0].token_versions
    assert moved is not None and moved[0] == 1 and moved[-1] == 3 and set(moved) == {1, 3}
    assert completions[2].weight_version == 2 and completions[2].token_versions is None


def test_adapter_sync_refuses_full_weights_and_other_adapters(tiny_llama_path, lora_engine):
    adapter, _ = twin_engines(tiny_llama_path, lora_engine)
    with pytest.raises(ValueError, match="train.lora.sync"):
        adapter.update_weights(lora_engine.state_dict(), 1)
    other_rank = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-2, lora=replace(SETTINGS, rank=2))
    with pytest.raises(ValueError, match="train.lora.rank or target_modules differ"):
        adapter.update_weights(other_rank.adapter_weights(), 1)
    fewer = {k: v for k, v in lora_engine.adapter_weights().items() if "v_proj" not in k}
    with pytest.raises(ValueError, match="missing"):
        adapter.update_weights(fewer, 1)
    assert adapter.weight_version == 0


def test_adapter_sync_config(tiny_llama_path):
    config = build_config({}, ["train.lora.rank=4"])
    assert config.train.lora.sync == "adapter"
    assert build_config({}, ["train.lora.rank=4", "rollout.engine=pkg.mod:factory", "train.lora.sync=merged"])
    with pytest.raises(ConfigError, match="train.lora.sync=adapter: rollout.engine 'pkg.mod:factory'"):
        build_config({}, ["train.lora.rank=4", "rollout.engine=pkg.mod:factory"])
    with pytest.raises(ConfigError, match="train.lora.sync"):
        build_config({}, ["train.lora.rank=4", "train.lora.sync=full"])


def test_vllm_adapter_sync_settings_are_checked_by_name():
    from asyncflow.engines.vllm_engine import adapter_modules, check_adapter_modules, vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 4, 16, 17)] == [1, 8, 16, 32]
    with pytest.raises(ValueError, match="train.lora.rank=600.*train.lora.sync=merged"):
        vllm_lora_rank(600)
    names = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
             "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert adapter_modules(names) == {"q_proj", "down_proj"}
    check_adapter_modules({"q_proj", "down_proj"}, {"q_proj", "k_proj", "down_proj"})
    check_adapter_modules({"anything"}, None)  # unknown: vLLM's own load decides
    with pytest.raises(ValueError, match=r"train.lora.target_modules.*\['down_proj'\].*train.lora.sync=merged"):
        check_adapter_modules({"q_proj", "down_proj"}, {"q_proj"})
