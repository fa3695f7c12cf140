"""FSDP2 weights leave the ranks one bucket at a time: the ranks all-gather one parameter (or send rank 0 their rows
of a slice of one larger than a bucket) at a time and rank 0 hands over one flat bucket, in the engine's dtype when it
is narrower (`FSDP2TrainEngine.weight_stream`), so no rank holds more than a bucket and the part being copied into it
(the engine's `weights/gather_peak_bytes`), and what every transport publishes from the stream is
bit-identical to what it publishes from the whole state dict. The engine also reports each rank's peak memory."""

from __future__ import annotations

import pytest
import torch

from asyncflow.engines.fsdp2_train import FSDP2TrainEngine
from asyncflow.engines.torch_inference import load_tied_once
from asyncflow.models.loading import load_model
from asyncflow.models.logprobs import TrainSample
from asyncflow.runtime.inline import ProcessRanks
from asyncflow.weights import BucketStream, make_weight_sync
from asyncflow.weights.buckets import allocate_payload, bucket_views, materialize, unpack

BUCKET_BYTES = 64 << 10  # several buckets even for the tiny model


@pytest.fixture(scope="module")
def engine(tiny_llama_path, one_torch_thread):
    engine = FSDP2TrainEngine(model_path=tiny_llama_path, ranks_device="cpu", world_size=2, lr=1e-3,
                              launcher=ProcessRanks, bucket_bytes=BUCKET_BYTES)
    yield engine
    engine.close()


def train_one_step(engine: FSDP2TrainEngine) -> None:
    from tests.engines.test_fsdp2_train import policy_loss

    samples = [TrainSample([3, 4, 5, 6], [7, 8, 9], 0), TrainSample([5, 6], [7, 8, 9, 10, 11], 1)]
    engine.backward_micro_batch(samples, policy_loss(samples, seed=0))
    engine.optimizer_step(grad_scale=1 / 8)


@pytest.mark.slow
def test_the_stream_is_the_state_dict_and_no_rank_holds_more_than_a_bucket(engine, tiny_llama_path):
    stream = engine.weight_stream()
    assert isinstance(stream, BucketStream), "nothing cached: streamed from the ranks"
    manifest = stream.manifest
    assert len(manifest.buckets) > 3
    assert any(e.rows is not None for e in manifest.tensors), "tensors larger than a bucket travel as row slices"
    initial = load_model(tiny_llama_path).state_dict()
    views = bucket_views(manifest, allocate_payload(manifest))
    for index, members in enumerate(stream.buckets()):
        assert [m.numel() for m in members] == [manifest.buckets[index].numel], "each bucket one flat tensor"
        views[index].copy_(members[0])
    streamed = unpack(manifest, views)
    assert streamed.keys() == initial.keys()
    assert all(torch.equal(streamed[k], initial[k]) for k in initial), "the ranks' weights, bit for bit"
    largest_bucket = max(b.nbytes for b in manifest.buckets)
    assert largest_bucket <= BUCKET_BYTES
    total = sum(t.nbytes for t in initial.values())
    # the bucket being filled and the tensor or slice being copied into it
    assert 0 < engine.metrics()["weights/gather_peak_bytes"] <= 2 * largest_bucket < total / 3


@pytest.mark.slow
def test_the_ranks_cast_each_bucket_to_the_engines_dtype(engine):
    """A bf16 engine's stream leaves the ranks in bf16 (the driver never holds an fp32 bucket), equal to the state
    dict cast as a publisher would cast it."""
    stream = engine.weight_stream(dtype=torch.bfloat16)
    assert isinstance(stream, BucketStream)
    assert {b.dtype for b in stream.manifest.buckets} == {torch.bfloat16}
    sent = materialize(stream)
    whole = engine.state_dict()
    assert all(torch.equal(sent[k], whole[k].to(torch.bfloat16)) for k in whole)


@pytest.mark.parametrize("kind", ["inprocess", "shared_memory"])
@pytest.mark.slow
def test_a_transport_publishes_the_stream_bit_identically(engine, kind):
    train_one_step(engine)
    stream = engine.weight_stream()
    assert isinstance(stream, BucketStream)
    whole = engine.state_dict()  # the same version, gathered into this process
    received = {}
    for source in (stream, whole):
        publisher = make_weight_sync(kind, bucket_bytes=BUCKET_BYTES)
        receiver = publisher.receiver_spec.open()
        try:
            publisher.publish(source, 1)
            version, weights = receiver.wait_for(1, timeout=10.0)
            received[type(source).__name__] = {k: v.clone() for k, v in weights.items()}
        finally:
            receiver.close()
            publisher.close()
    from_stream, from_dict = received["BucketStream"], received["dict"]
    assert from_stream.keys() == whole.keys()
    assert all(torch.equal(from_stream[k], from_dict[k]) for k in whole)
    assert all(torch.equal(from_stream[k], whole[k]) for k in whole)


@pytest.mark.slow
def test_each_rank_reports_its_peak_memory(engine):
    metrics = engine.metrics()
    for rank in (0, 1):
        assert metrics[f"memory/peak_rss_mb/rank_{rank}"] > 50, "a rank with torch and a model loaded"


@pytest.mark.slow
def test_ranks_load_one_tensor_at_a_time_and_tied_embeddings_stay_tied(tiny_qwen2_path, one_torch_thread):
    """Each rank builds the model on the meta device and receives its weights one tensor at a time: no rank holds more
    than the largest tensor whole (never the whole model), the weights are the folder's, and a tied embedding is
    still one parameter after a training step, sent to a weight channel once (the receiving engine ties it again)."""
    initial = load_model(tiny_qwen2_path).state_dict()
    engine = FSDP2TrainEngine(model_path=tiny_qwen2_path, ranks_device="cpu", world_size=2, lr=1e-2,
                              launcher=ProcessRanks, bucket_bytes=BUCKET_BYTES)
    try:
        largest = max(t.nbytes for t in initial.values())
        total = sum(t.nbytes for name, t in initial.items() if name != "lm_head.weight")
        assert all(0 < peak <= largest < total / 3 for peak in engine._all("loaded_peak_bytes"))
        loaded = {k: v.clone() for k, v in engine.state_dict().items()}
        assert all(torch.equal(loaded[k], initial[k]) for k in initial), "the folder's weights, bit for bit"
        train_one_step(engine)
        sent = materialize(engine.weight_stream(distinct=True))  # what a weight channel sends
        trained = engine.state_dict()
        embed = trained["model.embed_tokens.weight"]
        assert not torch.equal(embed, initial["model.embed_tokens.weight"])
        assert torch.equal(trained["lm_head.weight"], embed), "the tie holds after a step"
        assert sent.keys() == trained.keys() - {"lm_head.weight"}, "the tied embedding is sent once"
        receiving = load_model(tiny_qwen2_path)
        load_tied_once(receiving, sent)
        assert torch.equal(receiving.lm_head.weight, embed), "and the receiving engine ties it again"
    finally:
        engine.close()


def shared_resident_mib() -> float:
    """This process's resident pages of shared memory (`RssShmem`): Ray's object store is mapped here."""
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.mark.slow
def test_buckets_from_ray_ranks_bypass_the_object_store(ray_cluster, one_torch_thread):
    """Ray ranks send each bucket to the driver over the bucket pipe: through Ray's object store, the pages of every
    bucket that passed stayed mapped in the driver (its resident size grew by most of a version at 0.5B)."""
    from asyncflow.models.loading import resolve_model_path
    from asyncflow.runtime.ray_runtime import RayRanks

    def launch(world: int, spec, timeout: float) -> RayRanks:
        return RayRanks(world, spec, timeout, num_cpus=0.5, num_gpus=0, local=True)

    engine = FSDP2TrainEngine(model_path=resolve_model_path("preset:small-llama"), ranks_device="cpu",
                              world_size=2, launcher=launch, bucket_bytes=1 << 20)
    try:
        first = materialize(engine.weight_stream(dtype=torch.bfloat16))  # the pipe opened, its buffers warm
        before = shared_resident_mib()
        version_mib = sum(t.nbytes for t in first.values()) / 2**20
        del first
        for _ in range(4):
            for members in engine.weight_stream(dtype=torch.bfloat16).buckets():
                assert members[0].dtype == torch.bfloat16
                del members
        grown = shared_resident_mib() - before
    finally:
        engine.close()
    assert version_mib > 8, "enough buckets that the object store would have placed them apart"
    assert grown < 0.5, f"the driver mapped {grown:.1f} MiB of shared memory for 4 versions of {version_mib:.1f} MiB"
