"""The CUDA paths of the built-in engines and the in-process weight transport (marker `gpu`: not in the
default run; `pytest -m gpu` on a machine with a CUDA device)."""

import pytest
import torch

from asyncflow.engines.base import GenerationRequest, SamplingParams
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample
from asyncflow.models.tri_model import tri_model_logprobs
from asyncflow.weights import make_weight_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_sampling_logprobs_on_cuda_match_the_training_forward_packed_and_not(tiny_llama_path):
    model = load_model(tiny_llama_path, device="cuda").eval()
    engine = TorchInferenceEngine(model, max_batch_size=8, device="cuda", seed=0)
    requests = [GenerationRequest(i, [1, 5 + i, 7, 9]) for i in range(4) for _ in range(4)]
    completions = list(engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=12)))
    samples = [TrainSample(c.prompt_ids, c.response_ids, c.request_id) for c in completions]
    for packing in ("on", "off"):
        with torch.no_grad():
            out = tri_model_logprobs(model, samples, reference=None, old_policy=None, packing=packing)
        for i, c in enumerate(completions):
            torch.testing.assert_close(
                torch.tensor(c.logprobs), out.policy.logprobs[i, : len(c.response_ids)].cpu(), rtol=0, atol=1e-4
            )


def test_inprocess_transport_round_trips_cuda_tensors(tiny_llama_path):
    state = {k: v.cuda() for k, v in load_model(tiny_llama_path).state_dict().items()}
    publisher = make_weight_sync("inprocess", device="cuda")
    receiver = publisher.receiver_spec.open()
    publisher.publish(state, 1)
    version, received = receiver.wait_for(1, timeout=10)
    assert version == 1 and received.keys() == state.keys()
    for name, tensor in state.items():
        assert received[name].is_cuda and torch.equal(received[name], tensor)
