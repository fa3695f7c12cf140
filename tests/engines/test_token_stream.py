"""Token streaming at the engine level: `GenerationRequest.on_tokens` in the torch engine (stop tokens, a weight
update in flight) and `EngineService.submit(on_tokens=...)`, also over an engine that cannot stream."""

import threading

import pytest
import torch

from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.service import EngineService
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread

PROMPTS = [[1, 5 + i, 9, 11 + 2 * i] for i in range(5)]


@pytest.fixture(scope="module")
def llama(tiny_llama_path):
    return load_model(tiny_llama_path).eval()


def test_torch_engine_delivers_each_completions_tokens_once_in_order_before_it(tiny_llama_path, llama):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=2, seed=3)
    even = tuple(range(0, engine.vocab_size, 2))
    stop = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=even)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in llama.state_dict().items()}
    events: list[tuple] = []  # ("tokens", request, ids, logprobs) and ("done", request), in the order they happened

    def on_tokens(request_id, ids, logprobs):
        events.append(("tokens", request_id, list(ids), list(logprobs)))
        if request_id == 1 and sum(len(e[2]) for e in events if e[:2] == ("tokens", 1)) == 4:
            engine.update_weights(new_weights, 1)  # taken at the next step, while every request is in flight

    requests = [GenerationRequest(i, p, stop if i == 0 else SamplingParams(temperature=1.0, max_new_tokens=10),
                                  lambda ids, lps, i=i: on_tokens(i, ids, lps)) for i, p in enumerate(PROMPTS)]
    requests.append(GenerationRequest("silent", PROMPTS[0], greedy))  # no callback: generated as usual
    completions = {}
    for completion in engine.generate(requests, greedy):
        completions[completion.request_id] = completion
        events.append(("done", completion.request_id))
    assert completions[0].finish_reason == "stop" and completions[0].response_ids[-1] in even
    assert any(c.token_versions for c in completions.values())  # the update landed in the middle of samples
    for i in range(len(PROMPTS)):
        mine = [e for e in events if e[1] == i]
        assert mine[-1] == ("done", i) and all(e[0] == "tokens" for e in mine[:-1])
        assert [t for e in mine[:-1] for t in e[2]] == completions[i].response_ids
        assert [lp for e in mine[:-1] for lp in e[3]] == completions[i].logprobs
        assert all(len(e[2]) == 1 for e in mine[:-1])  # one call per sampled token
    assert completions["silent"].weight_version == 1


@pytest.mark.parametrize("streams", [True, False])
def test_service_hands_tokens_to_callers_and_survives_a_raising_callback(llama, streams):
    engine = TorchInferenceEngine(llama, max_batch_size=4)
    engine.streams_tokens = streams  # False: an engine that cannot stream (the service delivers at the end)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    received: dict[int, list[tuple[list[int], list[float]]]] = {0: [], 1: []}
    resolved_before_last_tokens = threading.Event()

    def collect(i, ids, lps, future_box):
        if future_box and future_box[0].done():
            resolved_before_last_tokens.set()
        received[i].append((ids, lps))

    def broken(ids, lps):
        raise ValueError("a consumer's bug")

    with EngineService(engine, params) as service:
        assert service.streams_tokens is streams
        boxes = [[], []]
        futures = [service.submit(PROMPTS[i], on_tokens=lambda ids, lps, i=i: collect(i, ids, lps, boxes[i]))
                   for i in range(2)]
        for box, future in zip(boxes, futures):
            box.append(future)
        spoiled = service.submit(PROMPTS[2], on_tokens=broken)
        done = [f.result(timeout=60) for f in futures]
        assert spoiled.result(timeout=60).response_ids  # its request completed; the loop goes on
        assert service.generate(PROMPTS[3], timeout=60).response_ids
    for i, completion in enumerate(done):
        assert [t for ids, _ in received[i] for t in ids] == completion.response_ids
        assert [lp for _, lps in received[i] for lp in lps] == completion.logprobs
        assert len(received[i]) == (len(completion.response_ids) if streams else 1)
    assert not resolved_before_last_tokens.is_set()
