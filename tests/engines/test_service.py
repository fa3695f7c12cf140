"""EngineService: many callers share one continuous-batching loop; weight updates between versions."""

import threading

import pytest
import torch

from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.service import EngineService, EngineServiceError
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPTS = [[1, 5 + i, 9, 11 + 2 * i] for i in range(6)]


@pytest.fixture(scope="module")
def llama(tiny_llama_path):
    return load_model(tiny_llama_path).eval()


@pytest.mark.slow
def test_callers_on_threads_get_the_plain_greedy_outputs(llama):
    engine = TorchInferenceEngine(llama, max_batch_size=4)
    plain = {c.request_id: c.response_ids for c in engine.generate(
        [GenerationRequest(i, p) for i, p in enumerate(PROMPTS)], GREEDY)}
    results: dict[int, list[int]] = {}
    with EngineService(engine, GREEDY) as service:
        def call(i):
            results[i] = service.generate(PROMPTS[i], timeout=60).response_ids

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        short = service.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=2), timeout=60)
    assert results == plain
    assert short.response_ids == plain[0][:2]


def test_weight_update_waits_for_in_flight_requests(tiny_llama_path, llama):
    engine = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=4)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in llama.state_dict().items()}
    with EngineService(engine, GREEDY) as service:
        before = service.submit(PROMPTS[0])
        service.update_weights(new_weights, version=3, timeout=60)
        after = service.generate(PROMPTS[0], timeout=60)
    assert before.result(0).weight_version == 0 and after.weight_version == 3
    assert after.response_ids != before.result(0).response_ids


def test_engine_error_fails_every_caller_and_later_submits(llama):
    service = EngineService(TorchInferenceEngine(llama, max_batch_size=2), GREEDY)
    bad = service.submit([1, 10_000])
    with pytest.raises(EngineServiceError, match="outside"):
        bad.result(timeout=60)
    with pytest.raises(EngineServiceError, match="stopped"):
        service.submit(PROMPTS[0])
    service.close()
