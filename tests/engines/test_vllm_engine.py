"""The vLLM adapter against the built-in torch engine and the training-side log-probs, on vLLM's CPU build.

Marker `vllm`: run with `bash scripts/test_vllm.sh` (the .venv-vllm environment). One vLLM engine serves the
whole module (starting one costs ~25-40 CPU-s); every test that changes its weights puts the preset's back.
"""

import random
import threading
import time

import pytest
import torch

from asyncflow.engines.base import (
    GenerationRequest,
    InferenceEngine,
    LoRASettings,
    SamplingParams,
    make_inference_engine,
)
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.vllm_engine import check_adapter_modules
from asyncflow.models.loading import ModelLoadError, load_model
from asyncflow.models.logprobs import TrainSample, response_logprobs
from asyncflow.weights import WeightSyncError, make_weight_sync
from asyncflow.weights.buckets import materialize

# the module's engine starts in the first test's setup (hence the timeout); tiny models run on one torch thread
# one xdist worker runs the whole module, the one of the session's Ray cluster (one test uses it): its engines are
# built once (module fixtures, ~20 s each), not once a worker
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.xdist_group("ray")]
vllm = pytest.importorskip("vllm", reason="needs vLLM: bash scripts/test_vllm.sh")

EOS = 2
STOP_MANY = tuple(range(40, 70))
BLOCK = 128  # vLLM's KV block on CPU: only prompts longer than this reach the prefix cache


@pytest.fixture(scope="module")
def llama(tiny_llama_path):
    return load_model(tiny_llama_path).eval()


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    engine = make_inference_engine(
        "vllm", model_path=str(tiny_llama_path), max_batch_size=8, seed=0, weight_transfer="collective"
    )
    yield engine
    engine.shutdown()


@pytest.fixture(params=["collective", "file"])
def weight_transfer(engine, request):
    """Each path of `update_weights` into vLLM's workers, on the module's engine."""
    engine.weight_transfer = request.param
    yield request.param
    engine.weight_transfer = "collective"


@pytest.fixture
def restore_weights(engine, llama):
    """Put the preset's weights back after a test that updates them."""
    yield
    engine.update_weights(llama.state_dict(), version=0)


def make_requests(n: int, seed: int = 0, lengths=(2, 30)) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(i, [1] + [rng.randrange(3, 98) for _ in range(rng.randrange(*lengths))]) for i in range(n)
    ]


def long_requests(n: int, seed: int = 7) -> list[GenerationRequest]:
    """Prompts of 2-3 KV blocks sharing their first two blocks: the second and later hit the prefix cache."""
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 98) for _ in range(2 * BLOCK + 5)]
    return [GenerationRequest(i, shared + [rng.randrange(3, 98) for _ in range(1 + i)]) for i in range(n)]


def run(engine, requests, **params) -> dict:
    return {c.request_id: c for c in engine.generate(requests, SamplingParams(**params))}


def torch_greedy(model, requests, **params) -> dict:
    return run(TorchInferenceEngine(model, max_batch_size=8), requests, temperature=0.0, **params)


def logprob_gap(model, completions, temperature: float) -> tuple[float, float]:
    """max and mean |vLLM log-prob - trainer's recomputed log-prob| over every response token (fp32)."""
    samples = [TrainSample(c.prompt_ids, c.response_ids) for c in completions]
    with torch.no_grad():
        ref = response_logprobs(model, samples, temperature=temperature)
    gaps = torch.cat([
        (torch.tensor(c.logprobs) - ref.logprobs[i, : len(c.response_ids)]).abs() for i, c in enumerate(completions)
    ])
    return gaps.max().item(), gaps.mean().item()


def perturbed(model, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_greedy_equals_the_torch_engine(engine, llama):
    requests = make_requests(12, seed=1) + long_requests(3)
    assert isinstance(engine, InferenceEngine)
    assert engine._llm.vllm_config.parallel_config.distributed_executor_backend == "mp"  # vLLM's own on a CPU
    got = run(engine, requests, temperature=0.0, max_new_tokens=16, stop_token_ids=(EOS,))
    want = torch_greedy(llama, requests, max_new_tokens=16, stop_token_ids=(EOS,))
    assert sorted(got) == sorted(want)
    for key, c in got.items():
        assert (c.response_ids, c.finish_reason) == (want[key].response_ids, want[key].finish_reason)
        assert c.weight_version == 0 and c.token_versions is None
    max_gap, _ = logprob_gap(llama, list(got.values()), temperature=1.0)  # greedy reports T = 1 log-probs
    assert max_gap < 1e-3


def test_stop_tokens_and_max_new_tokens(engine):
    stop = STOP_MANY[:10]
    completions = run(engine, make_requests(16), max_new_tokens=6, stop_token_ids=stop).values()
    for c in completions:
        stops = [i for i, t in enumerate(c.response_ids) if t in stop]
        if c.finish_reason == "stop":
            assert stops == [len(c.response_ids) - 1]  # the first stop token ends the sample and is kept
        else:
            assert c.finish_reason == "length" and stops == [] and len(c.response_ids) == 6
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped and all(c.response_ids[-1] in STOP_MANY for c in stopped)  # the stop token was delivered too


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampling_logprobs_match_the_trainer(engine, llama, temperature, top_k, top_p):
    """vLLM's sampling log-probs against `response_logprobs` (the trainer's recomputation), fp32 on CPU."""
    completions = list(
        run(engine, make_requests(24, seed=2), temperature=temperature, top_k=top_k, top_p=top_p,
            max_new_tokens=24, stop_token_ids=(EOS, 50, 51)).values()
    )
    max_gap, mean_gap = logprob_gap(llama, completions, temperature)
    print(f"\nT={temperature} top_k={top_k} top_p={top_p}: |vLLM - trainer| log-prob max {max_gap:.2e} "
          f"mean {mean_gap:.2e} over {sum(len(c.response_ids) for c in completions)} tokens")
    assert max_gap < 1e-3 and mean_gap < 1e-4


def test_completions_stream_in_completion_order_and_requests_are_pulled_lazily(engine):
    pulled, at_yield = [], []

    def requests():
        for r in make_requests(12, seed=3):
            pulled.append(r.request_id)
            yield r
            if r.request_id == 5:
                yield None  # "nothing ready now": the engine keeps decoding and asks again

    engine.max_batch_size = 4
    try:
        completions = []
        for c in engine.generate(requests(), SamplingParams(max_new_tokens=20, stop_token_ids=STOP_MANY)):
            at_yield.append(len(pulled) - len(completions))
            completions.append(c)
    finally:
        engine.max_batch_size = 8
    assert sorted(c.request_id for c in completions) == list(range(12))
    assert max(at_yield) <= 4  # never more requests in flight than slots
    by_request = [len(c.response_ids) for c in sorted(completions, key=lambda c: c.request_id)]
    assert [len(c.response_ids) for c in completions] != by_request  # not request order


@pytest.mark.parametrize("transport", ["inprocess", "shared_memory", "ray", "torch_distributed"])
def test_weight_update_through_each_transport(engine, llama, restore_weights, transport, request):
    """After an update the engine is the new weights' greedy policy, prompts longer than a KV block included
    (their prefix-cached blocks from the old weights are gone)."""
    requests = long_requests(3) + make_requests(5, seed=4)
    before = run(engine, requests, temperature=0.0, max_new_tokens=12)
    new_weights = perturbed(llama, seed=len(transport))
    received = receive_through(transport, new_weights, version=7, request=request)
    engine.update_weights(received, version=7)
    assert engine.weight_version == 7
    new_model = load_model(request.getfixturevalue("tiny_llama_path"))
    new_model.load_state_dict(new_weights)
    want = torch_greedy(new_model, requests, max_new_tokens=12)
    after = run(engine, requests, temperature=0.0, max_new_tokens=12)
    assert {k: c.response_ids for k, c in after.items()} == {k: c.response_ids for k, c in want.items()}
    assert {c.weight_version for c in after.values()} == {7}
    assert {k: c.response_ids for k, c in after.items()} != {k: c.response_ids for k, c in before.items()}


def receive_through(transport: str, state_dict, version: int, request) -> dict[str, torch.Tensor]:
    """Publish `state_dict` through `transport` and return what a rollout-side receiver gets."""
    if transport == "ray":
        request.getfixturevalue("ray_cluster")
    if transport == "torch_distributed":
        return _receive_gloo(state_dict, version)
    publisher = make_weight_sync(transport)
    try:
        publisher.publish(state_dict, version)
        publisher.wait_published(30)
        receiver = publisher.receiver_spec.open()
        try:
            got_version, received = receiver.wait_for(version, timeout=30)
        finally:
            receiver.close()
    finally:
        publisher.close()
    assert got_version == version
    return received


def _collective_pair(publish, **options):
    """(publisher, its thread, receiver) of the `torch_distributed` transport on a free port: rank 0 (the trainer)
    joins the group in its constructor, on a thread that then runs `publish(publisher)`, as rank 1 does in open()."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box = {}

    def start():
        box["p"] = make_weight_sync("torch_distributed", num_receivers=1, port=port, timeout_s=60, **options)
        publish(box["p"])

    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 60
    while "p" not in box and time.monotonic() < deadline:
        time.sleep(0.01)
    return box["p"], thread, box["p"].receiver_spec.for_rank(1).open()


def _receive_gloo(state_dict, version):
    def publish(publisher):
        publisher.publish(state_dict, version)
        publisher.wait_published(60)

    publisher, thread, receiver = _collective_pair(publish)
    try:
        got_version, stream = receiver.wait_for(version, timeout=60)
        received = {k: v.clone() for k, v in materialize(stream).items()}
    finally:
        thread.join(60)
        receiver.close()
        publisher.close()
    assert got_version == version
    return received


def test_a_received_stream_loads_one_bucket_at_a_time(engine, llama, weight_transfer, restore_weights,
                                                     tiny_llama_path):
    """A version the `torch_distributed` transport receives reaches vLLM's workers bucket by bucket as it arrives (the
    collective path forwards each; the file path writes each into the file): never more than one received bucket
    alive at once, no staging copy of the version, and vLLM is then the new weights' greedy policy."""
    import gc
    import weakref

    from asyncflow.weights.buckets import BucketStream

    new_weights = perturbed(llama, seed=11)
    publisher, thread, receiver = _collective_pair(lambda p: p.publish(new_weights, 9), bucket_bytes=256 << 10)
    held: list[weakref.ref] = []
    most_alive = 0
    try:
        _, stream = receiver.wait_for(9, timeout=60)
        assert isinstance(stream, BucketStream) and len(stream.manifest.buckets) > 3

        def watched():
            nonlocal most_alive
            for members in stream.buckets():
                held.append(weakref.ref(members[0]._base))
                gc.collect()  # a full collection per bucket (~0.4 s beside vLLM): 256 KiB buckets keep them few
                most_alive = max(most_alive, sum(ref() is not None for ref in held))
                yield members
                del members

        engine.update_weights(BucketStream(stream.manifest, watched), version=9)
        publisher.wait_published(60)
    finally:
        thread.join(60)
        receiver.close()
        publisher.close()
    assert most_alive == 1 and len(held) == len(stream.manifest.buckets)
    if weight_transfer == "collective":
        assert engine._staged is None, "no staging copy of the version in the engine's process"
    new_model = load_model(tiny_llama_path)
    new_model.load_state_dict(new_weights)
    requests = make_requests(6, seed=12)
    got = run(engine, requests, temperature=0.0, max_new_tokens=12)
    want = torch_greedy(new_model, requests, max_new_tokens=12)
    assert {k: c.response_ids for k, c in got.items()} == {k: c.response_ids for k, c in want.items()}
    assert {c.weight_version for c in got.values()} == {9}


def test_update_matches_the_trainer_by_each_path(engine, llama, weight_transfer, restore_weights, tiny_llama_path):
    """After an update by `weight_transfer`, vLLM's greedy output is the trainer model's, and its sampling
    log-probs are the trainer's recomputation of the same tokens to fp32 tolerance."""
    new_weights = perturbed(llama, seed=3)
    engine.update_weights(new_weights, version=4)
    new_model = load_model(tiny_llama_path).eval()
    new_model.load_state_dict(new_weights)
    requests = make_requests(8, seed=6) + long_requests(2)
    got = run(engine, requests, temperature=0.0, max_new_tokens=16)
    want = torch_greedy(new_model, requests, max_new_tokens=16)
    assert {k: c.response_ids for k, c in got.items()} == {k: c.response_ids for k, c in want.items()}
    assert {c.weight_version for c in got.values()} == {4}
    sampled = list(run(engine, make_requests(16, seed=8), temperature=1.0, max_new_tokens=24).values())
    max_gap, mean_gap = logprob_gap(new_model, sampled, temperature=1.0)
    assert max_gap < 1e-3 and mean_gap < 1e-4


def test_a_failed_collective_names_the_vllm_worker_side(engine, llama, restore_weights, tiny_llama_path):
    """A version the workers cannot load fails with an error naming their side; the next update makes a new
    group and puts the engine back to a whole, correct version."""
    bad = dict(llama.state_dict())
    bad["model.layers.0.no_such_projection.weight"] = torch.zeros(4, 4)
    with pytest.raises(WeightSyncError, match="failed on the vLLM worker side.*no_such_projection"):
        engine.update_weights(bad, version=5)
    assert engine.weight_version == 0
    engine.update_weights(llama.state_dict(), version=6)
    requests = make_requests(6, seed=10)
    got = run(engine, requests, temperature=0.0, max_new_tokens=12)
    want = torch_greedy(llama, requests, max_new_tokens=12)
    assert {k: c.response_ids for k, c in got.items()} == {k: c.response_ids for k, c in want.items()}


def test_update_while_generating_labels_each_token_with_its_version(
    engine, llama, weight_transfer, restore_weights, tiny_llama_path
):
    """An update from another thread during generate(): kept requests go on with the new weights (their KV
    recomputed), and each token carries the version that sampled it."""
    requests = make_requests(6, seed=5, lengths=(5, 20))
    requests[0].params = SamplingParams(temperature=0.0, max_new_tokens=2)  # a per-request override: back first
    streamed = StreamedTokens(requests[1:4])
    new_weights = perturbed(llama, seed=9)
    updater = None
    completions = []
    for c in engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=200)):
        completions.append(c)
        streamed.finished(c)
        if updater is None:  # the others are mid-way through their 200 tokens
            assert c.request_id == 0 and len(c.response_ids) == 2
            updater = threading.Thread(target=engine.update_weights, args=(new_weights, 1))
            updater.start()
    updater.join(60)
    assert engine.weight_version == 1
    mixed = [c for c in completions if c.token_versions is not None]
    assert mixed, "no completion spanned the update"
    new_model = load_model(tiny_llama_path)
    new_model.load_state_dict(new_weights)
    switches = {}
    for c in mixed:
        assert c.weight_version == 1 and len(c.token_versions) == len(c.response_ids)
        switches[c.request_id] = switch = c.token_versions.index(1)
        assert set(c.token_versions[:switch]) == {0} and set(c.token_versions[switch:]) == {1}
    # the first tokens after the switch are the new weights' greedy continuation of everything before
    prefixes = [GenerationRequest(c.request_id, c.prompt_ids + c.response_ids[: switches[c.request_id]]) for c in mixed]
    continued = torch_greedy(new_model, prefixes, max_new_tokens=16)
    for c in mixed:
        switch = switches[c.request_id]
        assert continued[c.request_id].response_ids == c.response_ids[switch : switch + 16]
    streamed.check(long=True)


class StreamedTokens:
    """Sets `on_tokens` on `requests`; `finished(c)` after each completion; `check()`: each request's callbacks
    delivered exactly its completion's tokens and log-probs, in order, none after its completion."""

    def __init__(self, requests: list[GenerationRequest]):
        self.events: list[tuple] = []  # (request id, ids, logprobs) and (request id, completion)
        self.completions = {}
        for r in requests:
            r.on_tokens = lambda ids, lps, i=r.request_id: self.events.append((i, list(ids), list(lps)))

    def finished(self, completion) -> None:
        self.events.append((completion.request_id, completion))

    def check(self, *, long: bool) -> None:
        """`long`: the completions are long enough to have come in several calls."""
        streamed = {e[0] for e in self.events if len(e) == 3}
        assert streamed
        for i in streamed:
            mine = [e for e in self.events if e[0] == i]
            completion = mine[-1][1]
            assert all(len(e) == 3 for e in mine[:-1]) and (len(mine) > 2 or not long)  # tokens, then done
            assert [t for e in mine[:-1] for t in e[1]] == completion.response_ids
            assert [lp for e in mine[:-1] for lp in e[2]] == completion.logprobs


def test_token_callbacks_deliver_each_completions_tokens_with_stop_tokens(engine):
    requests = make_requests(8, seed=11)
    streamed = StreamedTokens(requests[::2])
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=STOP_MANY)
    completions = []
    for c in engine.generate(requests, params):
        completions.append(c)
        streamed.finished(c)
    streamed.check(long=False)
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped and all(c.response_ids[-1] in STOP_MANY for c in stopped)  # the stop token was delivered too


def test_bad_input_is_refused_before_work(engine, tmp_path, tiny_llama_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"]}')
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="NoSuchModelForCausalLM"):
        make_inference_engine("vllm", model_path=str(tmp_path))
    with pytest.raises(ValueError, match="does not match the installed vLLM build"):
        make_inference_engine("vllm", model_path=str(tiny_llama_path), device="cuda")
    assert time.monotonic() - t0 < 10  # no engine was started
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(make_requests(1), SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="outside"):
        run(engine, [GenerationRequest("x", [1, 10_000])])
    with pytest.raises(ValueError, match="max_model_len"):
        run(engine, [GenerationRequest("x", [1] * 600)])


def test_the_openai_server_streams_vllms_tokens(engine, tiny_llama_path):
    """End to end: streamed pieces from the vLLM engine concatenate to the non-streamed response (n=2)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from asyncflow.engines.service import EngineService
    from asyncflow.models.loading import load_tokenizer
    from asyncflow.serving.api import ServedModel, make_app
    from asyncflow.serving.server import ServerThread

    service = EngineService(engine, SamplingParams())
    served = ServedModel("tiny", load_tokenizer(tiny_llama_path), service, engine.max_model_len, engine.vocab_size)
    thread = ServerThread(make_app(served, api_key="key", request_timeout_s=120)).start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="key", max_retries=0, timeout=120)
        assert client.models.list().data[0].streaming == "token"
        ask = dict(model="tiny", prompt="ab", max_tokens=24, temperature=0, n=2, stop=["bW"])
        plain = client.completions.create(**ask).choices
        chunks = [c for chunk in client.completions.create(**ask, stream=True) for c in chunk.choices]
    finally:
        thread.stop()
        service.close()
    for choice in plain:
        mine = [c for c in chunks if c.index == choice.index]
        assert mine[-1].finish_reason == choice.finish_reason and not any(c.finish_reason for c in mine[:-1])
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.token_ids] == choice.token_ids
        assert [lp for c in mine for lp in c.token_logprobs] == choice.token_logprobs


# ---------------------------------------------------------------- LoRA adapter sync (train.lora.sync: adapter)
LORA = LoRASettings(rank=4, alpha=8.0, target_modules="all-linear")


@pytest.fixture(scope="module")
def adapter_engine(tiny_llama_path):
    """An engine under adapter sync with 3 adapter slots (`workflow.max_staleness` 2), the model in vLLM's engine
    core (`uni`; the module's other engine runs vLLM's default on a CPU, a worker process: `mp`)."""
    engine = make_inference_engine("vllm", model_path=str(tiny_llama_path), max_batch_size=9, seed=0, adapter=LORA,
                                   adapter_slots=3, distributed_executor_backend="uni")
    yield engine
    engine.shutdown()


def random_adapter(model, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA adapter on every linear layer but the head, in peft's naming, and the merged weights it gives
    (`W + alpha/r * B @ A`, computed here without peft)."""
    g = torch.Generator().manual_seed(seed)
    adapter, merged = {}, {k: v.clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            a = 0.1 * torch.randn(LORA.rank, module.in_features, generator=g)
            b = 0.1 * torch.randn(module.out_features, LORA.rank, generator=g)
            adapter |= {f"base_model.model.{name}.lora_A.weight": a, f"base_model.model.{name}.lora_B.weight": b}
            merged[f"{name}.weight"] = merged[f"{name}.weight"] + LORA.alpha / LORA.rank * b @ a
    return adapter, merged


def merged_model(tiny_llama_path, merged: dict[str, torch.Tensor]):
    model = load_model(tiny_llama_path).eval()
    model.load_state_dict(merged)
    return model


def test_adapter_sync_samples_as_the_merged_weights(adapter_engine, llama, tiny_llama_path):
    """After each adapter-only update: greedy outputs equal the merged weights' (torch engine), and sampled
    log-probs equal the trainer's recomputation on the merged weights (fp32 tolerance)."""
    for version in (1, 2):
        adapter, merged = random_adapter(llama, seed=version)
        adapter_engine.update_weights(adapter, version)
        model = merged_model(tiny_llama_path, merged)
        requests = make_requests(8, seed=version)
        got = run(adapter_engine, requests, temperature=0.0, max_new_tokens=16)
        want = torch_greedy(model, requests, max_new_tokens=16)
        assert {k: c.response_ids for k, c in got.items()} == {k: c.response_ids for k, c in want.items()}
        assert {(c.weight_version, c.token_versions) for c in got.values()} == {(version, None)}
        sampled = list(run(adapter_engine, make_requests(12, seed=3), temperature=1.0, max_new_tokens=16).values())
        max_gap, mean_gap = logprob_gap(model, sampled, temperature=1.0)
        assert max_gap < 1e-3 and mean_gap < 1e-4
        base_gap, _ = logprob_gap(llama, sampled, temperature=1.0)
        assert base_gap > 1e-2  # the adapter is applied: the base weights alone give other log-probs
    assert adapter_engine.loaded_adapter_versions() == [2]  # version 1's adapter was unloaded


def test_adapter_updates_in_flight_leave_each_request_on_its_version(adapter_engine, llama, tiny_llama_path):
    """With `max_staleness` 2 (3 adapter slots), two updates land while requests run: a request started on v
    finishes on v (every token labelled v, the output of v's merged weights), and each adapter is unloaded once
    no request uses it."""
    versions = {v: random_adapter(llama, seed=10 + v) for v in (3, 4, 5)}
    adapter_engine.update_weights(versions[3][0], 3)
    started: dict[int, int] = {}  # request id -> the engine's version when it was handed over
    held_during: list[list[int]] = []

    def requests():
        for batch, version in enumerate((3, 4, 5)):
            if version != 3:  # requests of the versions before are in flight (64 tokens each)
                adapter_engine.update_weights(versions[version][0], version)
                held_during.append(adapter_engine.loaded_adapter_versions())
            for r in make_requests(3, seed=20 + batch):
                r.request_id = 3 * batch + r.request_id
                started[r.request_id] = adapter_engine.weight_version
                yield r

    got = run(adapter_engine, requests(), temperature=0.0, max_new_tokens=64)
    assert held_during == [[3, 4], [3, 4, 5]]
    assert sorted(got) == list(range(9))
    for version in (3, 4, 5):
        mine = {k: c for k, c in got.items() if started[k] == version}
        assert mine and all(c.weight_version == version and c.token_versions is None for c in mine.values())
        model = merged_model(tiny_llama_path, versions[version][1])
        want = torch_greedy(model, [GenerationRequest(k, c.prompt_ids) for k, c in mine.items()], max_new_tokens=64)
        assert {k: c.response_ids for k, c in mine.items()} == {k: c.response_ids for k, c in want.items()}
    assert adapter_engine.loaded_adapter_versions() == [5]


def test_adapter_sync_refuses_full_weights_and_unknown_modules(adapter_engine, llama, tiny_llama_path):
    with pytest.raises(ValueError, match="train.lora.sync"):
        adapter_engine.update_weights(llama.state_dict(), 9)
    adapter, _ = random_adapter(llama, seed=1)
    renamed = {k.replace("mlp.down_proj", "mlp.down_proj.unknown"): v for k, v in adapter.items()}
    with pytest.raises(ValueError, match=r"train.lora.target_modules.*\['unknown'\].*train.lora.sync=merged"):
        adapter_engine.update_weights(renamed, 9)
    assert adapter_engine.weight_version != 9
    # what an engine started with these target modules refuses, against the modules this vLLM's LoRA takes
    with pytest.raises(ValueError, match=r"train.lora.target_modules.*\['rotary_emb'\]"):
        check_adapter_modules(("q_proj", "rotary_emb"), adapter_engine._lora_modules)
