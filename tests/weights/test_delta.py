"""Lossless delta weight updates (`asyncflow.weights.delta`): bit-exact with full updates through the built-in
engine, never applied to the wrong base, full where a delta does not pay or cannot apply.

Real optimizer steps on a real tiny model, real transports (in-process, shared memory, Ray); no mocks.
"""

import hashlib
import multiprocessing as mp
import time

import pytest
import torch

from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model
from asyncflow.weights import WeightSyncError, make_weight_sync, unpack
from asyncflow.weights.delta import (
    BITMASK,
    DELTA_KEY,
    SPARSE,
    apply_delta,
    delta_sections,
    encode_delta,
    engine_weights,
    patch,
)

SPAWN = mp.get_context("spawn")


def trained_versions(model_path, steps: int, lr: float, seed: int = 0):
    """The fp32 state dict after each of `steps` AdamW steps on random gradients (a real optimizer's updates:
    every element moves by about `lr`, few of them across a bf16 rounding boundary)."""
    torch.manual_seed(seed)
    model = load_model(model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_state(engine: TorchInferenceEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("kind", ["inprocess", "shared_memory"])
def test_fifty_delta_updates_are_bit_exact_with_fifty_full_ones(tiny_llama_path, kind, one_torch_thread):
    full_engine = TorchInferenceEngine.from_pretrained(tiny_llama_path, dtype="bfloat16")
    delta_engine = TorchInferenceEngine.from_pretrained(tiny_llama_path, dtype="bfloat16")
    publisher = make_weight_sync(kind, delta=True, dtype=torch.bfloat16, bucket_bytes=1 << 16)
    receiver = publisher.receiver_spec.open()
    kinds = []
    try:
        for version, weights in enumerate(trained_versions(tiny_llama_path, 50, lr=1e-5), start=1):
            full_engine.update_weights(weights, version)
            publisher.publish(weights, version)
            publisher.wait_published(60)  # the sender thread encodes and sends it
            got = receiver.poll(delta_engine.weight_version)
            assert got is not None and got[0] == version
            delta_engine.update_weights(got[1], version)
            kinds.append(receiver.received_kind)
            if version % 10 == 0:
                expected, actual = engine_state(full_engine), engine_state(delta_engine)
                assert all(torch.equal(expected[k].view(torch.int16), actual[k].view(torch.int16))
                           for k in expected if expected[k].dtype == torch.bfloat16)
                assert all(torch.equal(expected[k], actual[k]) for k in expected)
    finally:
        receiver.close()
        publisher.close()
    assert kinds[0] == "full" and kinds.count("delta") >= 40, kinds  # AdamW's first steps may move too much


def test_a_delta_never_applies_to_another_base(tiny_llama_path):
    versions = list(trained_versions(tiny_llama_path, 3, lr=1e-5))
    packed = [engine_weights(w, v, torch.bfloat16) for v, w in enumerate(versions, start=1)]
    blob = encode_delta(packed[1], packed[2], max_bytes=packed[2].nbytes)
    assert blob is not None
    with pytest.raises(WeightSyncError, match="taken against version 2.*holds version 1.*full update"):
        apply_delta(blob, packed[0])
    patched = apply_delta(blob, packed[1])
    assert all(torch.equal(a, b) for a, b in zip(patched.buckets, packed[2].buckets, strict=True))


def changed_copy(packed, version: int, fractions: list[float], seed: int = 0):
    """A copy of `packed` as `version` with about `fractions[i]` of bucket i's elements changed (one bit flipped
    in their bit patterns)."""
    generator = torch.Generator().manual_seed(seed)
    fresh = packed.copy()
    fresh.version = version
    for bucket, fraction in zip(fresh.buckets, fractions, strict=True):
        bits = bucket.view(torch.int16)
        bits ^= (torch.rand(bits.shape, generator=generator) < fraction).to(torch.int16)
    return fresh


def test_each_bucket_takes_the_smaller_encoding_and_is_patched_in_place(tiny_llama_path):
    """Few changes go as positions, many as a bitmask (1 bit per element); either is applied in place, bit for
    bit, and a blob with many changes is smaller than positions would make it."""
    weights = next(trained_versions(tiny_llama_path, 1, lr=1e-5))
    base = engine_weights(weights, 1, torch.bfloat16, bucket_bytes=1 << 18)
    assert len(base.buckets) >= 3 and all(b.dtype == torch.bfloat16 for b in base.buckets)
    fractions = [0.005, 0.3, 0.0] + [0.1] * (len(base.buckets) - 3)
    new = changed_copy(base, 2, fractions)
    blob = encode_delta(base, new, max_bytes=new.nbytes)
    assert blob is not None
    sections = delta_sections(blob)
    assert [encoding for _, encoding in sections[:3]] == [SPARSE, BITMASK, SPARSE]
    assert all(encoding == BITMASK for _, encoding in sections[3:])  # 10% > 1/32 of a bf16 bucket
    changed = sum(count for count, _ in sections)
    assert changed == sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                          for a, b in zip(base.buckets, new.buckets, strict=True))
    assert blob.numel() < 6 * changed  # what int32 positions + bf16 values would take
    held = base.copy()
    pointers = [b.data_ptr() for b in held.buckets]
    patch(blob, held)
    assert [b.data_ptr() for b in held.buckets] == pointers and held.version == 2
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(held.buckets, new.buckets, strict=True))


def test_a_bitmask_delta_refuses_another_base_and_a_limit_it_exceeds(tiny_llama_path):
    weights = next(trained_versions(tiny_llama_path, 1, lr=1e-5))
    base = engine_weights(weights, 1, torch.bfloat16, bucket_bytes=1 << 18)
    middle = changed_copy(base, 2, [0.2] * len(base.buckets), seed=1)
    new = changed_copy(middle, 3, [0.2] * len(base.buckets), seed=2)
    blob = encode_delta(middle, new, max_bytes=new.nbytes)
    assert blob is not None and {encoding for _, encoding in delta_sections(blob)} == {BITMASK}
    held = base.copy()
    with pytest.raises(WeightSyncError, match="taken against version 2.*holds version 1"):
        patch(blob, held)
    assert held.version == 1 and all(torch.equal(a, b) for a, b in zip(held.buckets, base.buckets, strict=True))
    # 20% changed: values (0.2 of the bytes) + bitmask (1/16 of them) exceed a limit of a fifth
    assert encode_delta(middle, new, max_bytes=new.nbytes // 5) is None


def test_a_receiver_that_skipped_a_version_or_joined_late_takes_the_full_one(tiny_llama_path):
    publisher = make_weight_sync("inprocess", delta=True, dtype=torch.bfloat16)
    early = publisher.receiver_spec.open()
    versions = trained_versions(tiny_llama_path, 4, lr=1e-5)
    publisher.publish(next(versions), 1)
    publisher.wait_published(60)
    assert early.poll(0)[0] == 1 and early.received_kind == "full"
    with early._lock:  # `early` cannot follow the delta channel meanwhile: it never took 2
        publisher.publish(next(versions), 2)
        publisher.wait_published(60)
        publisher.publish(next(versions), 3)  # the delta 2 -> 3 is not for a replica holding 1
        publisher.wait_published(60)
    # the full channel holds an older version: each asks for a full one, which the publisher's thread sends
    assert publisher.full_version < 3
    assert early.wait_for(3, 60)[0] == 3 and early.received_kind == "full"
    late = publisher.receiver_spec.open()  # a replica that joins (or restarts) holds no base
    assert late.wait_for(3, 60)[0] == 3 and late.received_kind == "full"
    publisher.publish(next(versions), 4)
    publisher.wait_published(60)
    for receiver in (early, late):
        got = receiver.poll(3)
        assert got[0] == 4 and receiver.received_kind == "delta"
        assert receiver.received_bytes < 0.5 * sum(t.nbytes for t in got[1].values())
    publisher.close()


def test_a_replica_that_takes_versions_now_and_then_still_gets_deltas(tiny_llama_path):
    publisher = make_weight_sync("shared_memory", delta=True, dtype=torch.bfloat16)
    receiver = publisher.receiver_spec.open()
    versions = trained_versions(tiny_llama_path, 4, lr=1e-6)
    publisher.publish(next(versions), 1)
    publisher.wait_published(60)
    receiver.poll(0)
    for version in (2, 3, 4):  # the engine takes none of them: the receiver follows the deltas on its own
        publisher.publish(next(versions), version)
        publisher.wait_published(60)
        time.sleep(5 * receiver.FOLLOW_S)
    got = receiver.poll(1)
    assert got[0] == 4 and receiver.received_kind == "delta"
    full_bytes = sum(t.nbytes for t in got[1].values())
    assert 0 < receiver.received_bytes < 0.5 * full_bytes  # the three deltas together
    receiver.close()
    publisher.close()


def test_a_delta_larger_than_the_limit_is_sent_as_a_full_version(tiny_llama_path):
    publisher = make_weight_sync("inprocess", delta=True, dtype=torch.float32)
    receiver = publisher.receiver_spec.open()
    weights = load_model(tiny_llama_path).state_dict()
    publisher.publish(weights, 1)
    publisher.wait_published(60)
    receiver.poll(0)
    publisher.publish({k: v + 1 for k, v in weights.items()}, 2)  # every element changes
    publisher.wait_published(60)
    got = receiver.poll(1)
    assert publisher.last_kind == "full" and receiver.received_kind == "full"
    assert receiver.received_bytes == sum(t.nbytes for t in got[1].values())
    publisher.close()


@pytest.mark.slow
def test_delta_updates_through_ray(tiny_llama_path, ray_cluster):
    publisher = make_weight_sync("ray", delta=True, dtype=torch.bfloat16, timeout_s=60)
    receiver = publisher.receiver_spec.open()
    try:
        for version, weights in enumerate(trained_versions(tiny_llama_path, 3, lr=1e-6), start=1):
            publisher.publish(weights, version)
            publisher.wait_published(60)
            got = receiver.wait_for(version, 60)
            assert got[0] == version
            assert all(torch.equal(got[1][k], v.to(torch.bfloat16)) for k, v in weights.items())
            assert receiver.received_kind == ("full" if version == 1 else "delta")
    finally:
        receiver.close()
        publisher.close()


def _digests(state_dict) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in state_dict.items()}


def _collective_delta_child(spec, last, results):
    """Rank 1: takes every version (the engine's loop: poll, load, let go) and reports its bits and how it came."""
    try:
        receiver = spec.for_rank(1).open()
        have = 0
        while have < last:
            version, weights = receiver.wait_for(have + 1, timeout=60)
            results.put((version, receiver.received_kind, receiver.received_bytes, _digests(weights)))
            have = version
            del weights
        receiver.close()
    except BaseException as err:  # surface the child's failure in the parent's assertion
        results.put(("error", repr(err), 0, {}))


@pytest.mark.slow
def test_deltas_over_torch_distributed_are_bit_exact_on_two_gloo_processes(tiny_llama_path):
    publisher = make_weight_sync("torch_distributed", delta=True, dtype=torch.bfloat16, num_receivers=1,
                                 bucket_bytes=1 << 16, timeout_s=60)
    results = SPAWN.Queue()
    child = SPAWN.Process(target=_collective_delta_child, args=(publisher.receiver_spec, 20, results))
    child.start()
    try:
        for version, weights in enumerate(trained_versions(tiny_llama_path, 20, lr=1e-5), start=1):
            publisher.publish(weights, version)
            publisher.wait_published(60)
            expected = engine_weights(weights, version, torch.bfloat16)
            got, kind, nbytes, digests = results.get(timeout=60)
            assert got == version, kind
            assert digests == _digests(unpack(expected.manifest, expected.buckets)), version
            assert kind == ("delta" if publisher.last_kind == "delta" else "full")
            assert kind == "full" or nbytes < 0.5 * expected.nbytes
            if version == 1:
                assert kind == "full"
    finally:
        publisher.close()
    child.join(30)
    assert child.exitcode == 0
    assert publisher.last_kind == "delta"  # AdamW's later steps move few bf16 values


def test_blob_marks_itself(tiny_llama_path):
    packed = [engine_weights(w, v, torch.bfloat16) for v, w in enumerate(trained_versions(tiny_llama_path, 2, 1e-6))]
    blob = encode_delta(packed[0], packed[1], max_bytes=packed[1].nbytes)
    assert blob is not None and DELTA_KEY == "__delta__"
    assert blob.numel() < 0.15 * packed[1].nbytes  # lr 1e-6: few bf16 values change


def test_handed_out_versions_are_never_written_and_superseded_ones_keep_the_base(tiny_llama_path):
    """The receiver patches its held version in place only until `poll` hands it out; the publisher's base is
    the last version it sent, so a version superseded before it was sent breaks no delta."""
    publisher = make_weight_sync("inprocess", delta=True, dtype=torch.bfloat16, bucket_bytes=1 << 16)
    receiver = publisher.receiver_spec.open()
    versions = list(trained_versions(tiny_llama_path, 6, lr=1e-6))
    expected = [engine_weights(w, v, torch.bfloat16) for v, w in enumerate(versions, start=1)]
    handed_out, kinds = {}, []
    try:
        for version, weights in enumerate(versions, start=1):
            publisher.publish(weights, version)
            if version in (3, 5):  # 3 and 5 may be superseded by 4 and 6 before they are sent
                continue
            publisher.wait_published(60)
            got = receiver.wait_for(version, 60)
            assert got[0] == version
            handed_out[version] = got[1]
            kinds.append(receiver.received_kind)
        assert "delta" in kinds, kinds  # (a receiver that missed a superseded version's delta takes the full one)
        for version, state_dict in handed_out.items():
            packed = expected[version - 1]
            assert all(torch.equal(state_dict[k].view(torch.int16), t.view(torch.int16))
                       for k, t in unpack(packed.manifest, packed.buckets).items() if t.dtype == torch.bfloat16)
    finally:
        receiver.close()
        publisher.close()


def test_a_released_version_is_patched_in_place_and_a_held_one_is_never_written(tiny_llama_path):
    """No copy per version on the receiver: once the consumer lets a handed-out version go, the next delta patches
    its buffer; while the consumer holds it, the delta goes into another buffer and the held tensors keep their bits."""
    publisher = make_weight_sync("shared_memory", delta=True, dtype=torch.bfloat16)
    receiver = publisher.receiver_spec.open()
    versions = list(trained_versions(tiny_llama_path, 4, lr=1e-6))
    expected = [engine_weights(w, v, torch.bfloat16) for v, w in enumerate(versions, start=1)]

    def take(version):
        publisher.publish(versions[version - 1], version)
        publisher.wait_published(60)
        got = receiver.wait_for(version, 60)
        assert got[0] == version
        return got[1]

    def bits(state_dict):
        return {k: v.view(torch.int16).clone() for k, v in state_dict.items() if v.dtype == torch.bfloat16}

    try:
        kept = take(1)
        kept_bits = bits(kept)
        second = take(2)  # `kept` is still held: the delta went elsewhere
        assert receiver.received_kind == "delta"
        assert all(torch.equal(kept[k].view(torch.int16), v) for k, v in kept_bits.items())
        address = next(iter(second.values())).data_ptr()
        del second
        third = take(3)  # released: patched in place
        assert receiver.received_kind == "delta" and next(iter(third.values())).data_ptr() == address
        want = unpack(expected[2].manifest, expected[2].buckets)
        assert all(torch.equal(third[k].view(torch.int16), want[k].view(torch.int16)) for k in bits(want))
    finally:
        receiver.close()
        publisher.close()
