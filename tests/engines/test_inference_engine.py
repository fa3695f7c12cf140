"""The built-in torch inference engine against transformers and the training-side log-probs."""

import random

import pytest
import torch

from asyncflow.engines.base import GenerationRequest, InferenceEngine, SamplingParams, make_inference_engine
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample, response_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread

STOP_MANY = tuple(range(40, 70))  # ~30% of the vocabulary: samples stop after a few tokens, at varied lengths


@pytest.fixture(scope="module")
def llama(tiny_llama_path):
    return load_model(tiny_llama_path).eval()


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_path):
    return load_model(tiny_qwen2_path).eval()


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return request.getfixturevalue(request.param)


def make_requests(n: int, seed: int = 0, lengths=(2, 30)) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(i, [1] + [rng.randrange(3, 98) for _ in range(rng.randrange(*lengths))]) for i in range(n)
    ]


def run(engine, requests, **params):
    return list(engine.generate(requests, SamplingParams(**params)))


def assert_logprobs_match_training_side(model, completions, temperature):
    samples = [TrainSample(c.prompt_ids, c.response_ids) for c in completions]
    with torch.no_grad():
        reference = response_logprobs(model, samples, temperature=temperature)
    for i, c in enumerate(completions):
        assert len(c.logprobs) == len(c.response_ids)
        torch.testing.assert_close(
            torch.tensor(c.logprobs), reference.logprobs[i, : len(c.response_ids)], rtol=0, atol=1e-4
        )


def test_greedy_equals_transformers_generate(model):
    requests = make_requests(6, seed=1)
    completions = run(
        TorchInferenceEngine(model, max_batch_size=4), requests, temperature=0.0, max_new_tokens=12, stop_token_ids=(2,)
    )
    by_id = {c.request_id: c for c in completions}
    assert sorted(by_id) == list(range(6))
    for r in requests:
        ids = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=2,
                pad_token_id=0,
            )
        assert by_id[r.request_id].response_ids == out[0, ids.shape[1] :].tolist()
    assert_logprobs_match_training_side(model, completions, temperature=1.0)  # greedy reports T=1 log-probs


def test_sampled_logprobs_match_training_side(model):
    """Temperature, top-k, top-p, stop tokens and slot reuse (10 requests, 3 slots) against `response_logprobs`."""
    requests = make_requests(10, seed=2)
    engine = TorchInferenceEngine(model, max_batch_size=3, seed=3)
    completions = run(
        engine, requests, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=24, stop_token_ids=(2, 50, 51, 52)
    )
    assert sorted(c.request_id for c in completions) == list(range(10))
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert_logprobs_match_training_side(model, completions, temperature=0.7)


def test_stop_tokens_and_max_new_tokens(llama):
    completions = run(
        TorchInferenceEngine(llama, seed=1), make_requests(16), max_new_tokens=6, stop_token_ids=STOP_MANY
    )
    for c in completions:
        stops = [i for i, t in enumerate(c.response_ids) if t in STOP_MANY]
        if c.finish_reason == "stop":
            assert stops == [len(c.response_ids) - 1]  # the first stop token ends the sample and is kept
        else:
            assert c.finish_reason == "length" and stops == [] and len(c.response_ids) == 6
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert all(len(c.response_ids) == 1 for c in run(TorchInferenceEngine(llama), make_requests(3), max_new_tokens=1))


def test_completions_come_back_in_completion_order(llama):
    """All requests start together, so a shorter response must be handed back no later than a longer one."""
    completions = run(
        TorchInferenceEngine(llama, max_batch_size=16, seed=4),
        make_requests(12),
        max_new_tokens=20,
        stop_token_ids=STOP_MANY,
    )
    lengths = [len(c.response_ids) for c in completions]
    assert lengths == sorted(lengths)
    by_request = [len(c.response_ids) for c in sorted(completions, key=lambda c: c.request_id)]
    assert by_request != sorted(by_request)  # the order differs from request order, so this test can fail


def test_continuous_batching_refills_slots_lazily(llama):
    greedy = dict(temperature=0.0, max_new_tokens=8)
    # Stop on the last token of two unconstrained greedy responses, so samples end at different steps.
    free = run(TorchInferenceEngine(llama), make_requests(5, seed=5), **greedy)
    stop = (free[0].response_ids[-1], free[3].response_ids[-1])
    alone = {
        c.request_id: c
        for c in run(
            TorchInferenceEngine(llama, max_batch_size=8), make_requests(5, seed=5), **greedy, stop_token_ids=stop
        )
    }
    pulled, completions, in_flight_at_yield = [], [], []

    def requests():
        for r in make_requests(5, seed=5):
            pulled.append(r.request_id)
            yield r

    for c in TorchInferenceEngine(llama, max_batch_size=2).generate(
        requests(), SamplingParams(**greedy, stop_token_ids=stop)
    ):
        in_flight_at_yield.append(len(pulled) - len(completions))
        completions.append(c)
    assert sorted(c.request_id for c in completions) == list(range(5))
    assert in_flight_at_yield[0] == 2  # nothing was pulled beyond the two slots before the first completion
    assert max(in_flight_at_yield) <= 2
    assert len({len(c.response_ids) for c in completions}) > 1
    # Greedy decoding does not depend on batching: reused, compacted slots give the one-batch result.
    for c in completions:
        assert c.response_ids == alone[c.request_id].response_ids
        torch.testing.assert_close(c.logprobs, alone[c.request_id].logprobs, rtol=0, atol=1e-5)


def test_a_groups_shared_prompt_is_prefilled_once(llama):
    prompts = make_requests(3, seed=7)
    group = [GenerationRequest((p.request_id, k), p.prompt_ids) for p in prompts for k in range(4)]
    rows = []
    hook = llama.register_forward_pre_hook(lambda _m, _a, kwargs: rows.append(len(kwargs["input_ids"])),
                                           with_kwargs=True)
    try:
        completions = run(TorchInferenceEngine(llama, seed=3), group, temperature=1.0, max_new_tokens=6,
                          stop_token_ids=STOP_MANY)
    finally:
        hook.remove()
    assert rows[0] == 3  # the prefill runs one row per distinct prompt
    assert len(completions) == 12
    assert len({tuple(c.response_ids) for c in completions}) > 3  # the copies sample on their own
    # every copy continues from its prompt's keys/values: its log-probs are the training side's
    assert_logprobs_match_training_side(llama, completions, 1.0)


def test_same_seed_same_completions(llama):
    requests = make_requests(8)
    params = dict(temperature=1.0, top_p=0.95, max_new_tokens=10, stop_token_ids=STOP_MANY)
    first = run(TorchInferenceEngine(llama, max_batch_size=3, seed=11), requests, **params)
    again = run(TorchInferenceEngine(llama, max_batch_size=3, seed=11), requests, **params)
    other = run(TorchInferenceEngine(llama, max_batch_size=3, seed=12), requests, **params)
    key = lambda cs: [(c.request_id, c.response_ids, c.logprobs) for c in cs]
    assert key(first) == key(again)
    assert key(first) != key(other)


def test_top_k_one_is_greedy(qwen2):
    requests = make_requests(5)
    greedy = run(TorchInferenceEngine(qwen2, seed=1), requests, temperature=0.0, max_new_tokens=10)
    top1 = run(TorchInferenceEngine(qwen2, seed=2), requests, temperature=1.0, top_k=1, max_new_tokens=10)
    assert [(c.request_id, c.response_ids, c.logprobs) for c in greedy] == [
        (c.request_id, c.response_ids, c.logprobs) for c in top1
    ]


def test_update_weights_changes_outputs_and_version(tiny_llama_path):
    model = load_model(tiny_llama_path)
    engine = TorchInferenceEngine(model, weight_version=3)
    requests = make_requests(4)
    before = run(engine, requests, temperature=0.0, max_new_tokens=8)
    assert {c.weight_version for c in before} == {3}
    perturbed = {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
        for k, v in model.state_dict().items()
    }
    engine.update_weights(perturbed, version=4)
    after = run(engine, requests, temperature=0.0, max_new_tokens=8)
    assert engine.weight_version == 4 and {c.weight_version for c in after} == {4}
    assert [c.response_ids for c in after] != [c.response_ids for c in before]
    torch.testing.assert_close(model.model.embed_tokens.weight, perturbed["model.embed_tokens.weight"])  # in place

    unfinished = engine.generate(requests, SamplingParams(max_new_tokens=8))
    next(unfinished)
    engine.update_weights(model.state_dict(), version=5)  # handed over: applied at the generation's next step
    assert engine.weight_version == 4
    unfinished.close()  # a generation that ends applies what is still pending
    assert engine.weight_version == 5


# ---------------------------------------------------------------- weight updates in flight (partial rollouts)
def perturbed_weights(model, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def assert_spans_follow_their_weights(old_model, new_model, completions, switch: int):
    """Every completion is `[old version]* + [new version]*`; the tokens of each version are that model's
    greedy choice on the full prefix before them (prompt + all earlier tokens), with that model's log-probs."""
    for c in completions:
        versions = c.token_versions or [c.weight_version] * len(c.response_ids)
        assert len(versions) == len(c.response_ids) and c.weight_version == versions[-1]
        assert versions == sorted(versions) and set(versions) <= {switch - 1, switch}, versions
        ids = torch.tensor([c.prompt_ids + c.response_ids])
        p = len(c.prompt_ids)
        for model, version in ((old_model, switch - 1), (new_model, switch)):
            at = [t for t, v in enumerate(versions) if v == version]
            if not at:
                continue
            with torch.no_grad():
                logprobs = model(ids).logits[0, p - 1 : -1].float().log_softmax(-1)  # row t predicts token t
            chosen = torch.tensor(c.response_ids)[at]
            assert logprobs[at].argmax(-1).tolist() == chosen.tolist(), (version, c.request_id)
            torch.testing.assert_close(
                torch.tensor(c.logprobs)[at], logprobs[at].gather(1, chosen[:, None])[:, 0], rtol=0, atol=1e-4
            )


def test_update_in_flight_continues_samples_on_the_new_weights(tiny_llama_path):
    """The update lands between two decode steps (the consumer makes it at the first completion): samples in
    flight keep their tokens and go on with the new weights' greedy continuation of their whole prefix,
    samples started later are all new-version, and the first completions are all old-version."""
    old_model, new_model = load_model(tiny_llama_path).eval(), load_model(tiny_llama_path).eval()
    new_model.load_state_dict(perturbed_weights(old_model))
    engine = TorchInferenceEngine(load_model(tiny_llama_path), max_batch_size=4, weight_version=2)
    completions = []
    for c in engine.generate(make_requests(10, seed=7), SamplingParams(temperature=0.0, max_new_tokens=16,
                                                                      stop_token_ids=STOP_MANY)):
        if not completions:
            engine.update_weights(new_model.state_dict(), version=3)
        completions.append(c)
    assert sorted(c.request_id for c in completions) == list(range(10))
    assert_spans_follow_their_weights(old_model, new_model, completions, switch=3)
    spanning = [c for c in completions if c.token_versions is not None]
    assert spanning, "some samples were in flight at the update"
    assert completions[0].weight_version == 2 and completions[-1].weight_version == 3
    assert engine.weight_version == 3


def test_update_from_another_thread_while_generating(tiny_llama_path):
    """The contract as the rollout loop uses it: a watcher thread calls `update_weights` during `generate`."""
    import threading

    old_model, new_model = load_model(tiny_llama_path).eval(), load_model(tiny_llama_path).eval()
    new_model.load_state_dict(perturbed_weights(old_model, seed=1))
    engine = TorchInferenceEngine(load_model(tiny_llama_path), max_batch_size=3, weight_version=0)
    pulled = threading.Event()

    def requests():
        for i, r in enumerate(make_requests(9, seed=8)):
            if i == 4:
                pulled.set()  # the second wave is being prefilled: the first is done, generation is under way
            yield r

    updater = threading.Thread(target=lambda: pulled.wait(30) and engine.update_weights(new_model.state_dict(), 1))
    updater.start()
    completions = list(engine.generate(requests(), SamplingParams(temperature=0.0, max_new_tokens=24)))
    updater.join(30)
    assert_spans_follow_their_weights(old_model, new_model, completions, switch=1)
    assert any(c.weight_version == 1 for c in completions), "the update was applied before generation ended"
    assert engine.weight_version == 1


def test_consumer_code_keeps_autograd(llama):
    """Inference mode is scoped to each forward, never left on while the consumer holds a completion."""
    for _ in TorchInferenceEngine(llama, max_batch_size=2).generate(make_requests(3), SamplingParams(max_new_tokens=3)):
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_registry_and_bad_input(llama):
    engine = make_inference_engine("torch", model_path="preset:tiny-llama", max_batch_size=2)
    assert isinstance(engine, InferenceEngine) and engine.max_batch_size == 2
    assert len(run(engine, make_requests(3), max_new_tokens=2)) == 3
    with pytest.raises(ValueError, match="exactly one of"):
        make_inference_engine("torch")
    engine = TorchInferenceEngine(llama)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(make_requests(1), SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(make_requests(1), SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="empty prompt"):
        run(engine, [GenerationRequest("x", [])])
    with pytest.raises(ValueError, match="outside"):
        run(engine, [GenerationRequest("x", [1, 10_000])])
    with pytest.raises(ValueError, match="max_batch_size"):
        TorchInferenceEngine(llama, max_batch_size=0)


def test_idle_request_source_does_not_stall_the_batch(llama):
    """A source that yields None (nothing ready) while the first request runs: that request finishes before the
    second is released, and both equal the greedy output of a plain run."""
    first, second = make_requests(2, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    finished: list = []

    def source():
        yield first
        while not finished:  # the engine must keep decoding `first` while we have nothing to give
            yield None
        yield second

    engine = TorchInferenceEngine(llama, max_batch_size=4)
    for completion in engine.generate(source(), params):
        finished.append(completion)
    assert [c.request_id for c in finished] == [first.request_id, second.request_id]
    plain = {c.request_id: c.response_ids for c in engine.generate([first, second], params)}
    assert {c.request_id: c.response_ids for c in finished} == plain


def test_per_request_sampling_params(llama):
    requests = make_requests(4, seed=6)
    requests[1].params = SamplingParams(temperature=0.0, max_new_tokens=3)
    requests[2].params = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=STOP_MANY)
    engine = TorchInferenceEngine(llama, max_batch_size=4)
    by_id = {c.request_id: c for c in run(engine, requests, temperature=1.0, max_new_tokens=10)}
    assert len(by_id[1].response_ids) == 3 and by_id[1].finish_reason == "length"
    assert len(by_id[2].response_ids) <= 5
    assert all(len(by_id[i].response_ids) == 10 for i in (0, 3))
    alone = run(engine, [GenerationRequest(1, requests[1].prompt_ids)], temperature=0.0, max_new_tokens=3)
    assert alone[0].response_ids == by_id[1].response_ids  # greedy rows are unaffected by their sampled neighbours
    with pytest.raises(ValueError, match="top_p"):
        run(engine, [GenerationRequest(9, [1, 5], SamplingParams(top_p=0.0))])


def test_vllm_engine_without_vllm_names_the_extra():
    """The adapter is registered in every environment; without vLLM, making it says what to install."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here (its tests: bash scripts/test_vllm.sh)")
    with pytest.raises(ImportError, match=r"asyncflow-rl\[vllm\].*setup_vllm.sh"):
        make_inference_engine("vllm", model_path="preset:tiny-llama")
