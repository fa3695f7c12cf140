"""Weights move bucket by bucket end to end: a `torch_distributed` publisher with `forward_streams` forwards a streamed
version (a multi-rank trainer's) one bucket at a time without staging it whole (without, it stages it), a
`torch_distributed` receiver hands a version out as a `BucketStream` and holds one received bucket at a time (never
the whole version), remote transports carry floating tensors in the engine's dtype when it is narrower (a bf16 engine
receives half the bytes of fp32), and a stream written to a safetensors file reads back as the state dict it
streams."""

from __future__ import annotations

import gc
import multiprocessing as mp
import socket
import threading
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

from asyncflow.observe.memory import peak_rss_mb, reset_peak_rss, return_freed_blocks, rss_mb
from asyncflow.weights import make_weight_sync
from asyncflow.weights.buckets import (
    BucketStream,
    bucket_contents,
    cast_manifest,
    materialize,
    plan_buckets,
    save_safetensors,
)

BUCKET_BYTES = 4096


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layer{i}.weight": torch.randn(16, 32, generator=g) for i in range(8)}  # 2 KiB each: 4 buckets of 2
    sd["steps"] = torch.arange(5)  # an integer tensor is never cast
    return sd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def publish_in_thread(sd, version: int, **options):
    """A `torch_distributed` publisher (built on a thread: it waits for the receiver to join) publishing `sd`."""
    box: dict = {}

    def publish():
        box["p"] = make_weight_sync("torch_distributed", num_receivers=1, port=options.pop("port"),
                                    bucket_bytes=options.pop("bucket_bytes", BUCKET_BYTES), timeout_s=30, **options)
        box["p"].publish(sd, version)

    thread = threading.Thread(target=publish)
    thread.start()
    deadline = time.monotonic() + 30
    while "p" not in box and time.monotonic() < deadline:
        time.sleep(0.01)
    return box, thread


@pytest.mark.slow
def test_a_torch_distributed_receiver_holds_one_bucket_at_a_time():
    sd = state_dict()
    box, thread = publish_in_thread(sd, 3, port=free_port())
    receiver = box["p"].receiver_spec.for_rank(1).open()
    try:
        version, stream = receiver.wait_for(3, timeout=30)
        assert version == 3 and isinstance(stream, BucketStream)
        assert len(stream.manifest.buckets) >= 4
        held: list[weakref.ref] = []
        most_alive = 0
        got: dict[str, torch.Tensor] = {}
        for index, members in enumerate(stream.buckets()):
            held.append(weakref.ref(members[0]._base))  # the bucket's buffer (each tensor is a view of it)
            gc.collect()
            most_alive = max(most_alive, sum(ref() is not None for ref in held))
            names = [e.name for e in stream.manifest.tensors if e.bucket == index]
            got.update({name: t.clone() for name, t in zip(names, members, strict=True)})
            del members
        assert most_alive == 1, "a received bucket is freed before the next one is received"
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
        box["p"].wait_published(30)
    finally:
        thread.join(30)
        receiver.close()
        box["p"].close()


@pytest.mark.slow
@pytest.mark.parametrize("forward", [True, False], ids=["forwarded", "staged"])
def test_a_streamed_version_is_forwarded_one_bucket_at_a_time_or_staged_whole(forward):
    """The driver of an FSDP2 run publishes the ranks' stream. Forwarded (`weights.stage_on_driver: false`), its peak
    grows by about a bucket while a version goes out (the stream's bucket, its bf16 copy, and here the receiver's
    bucket too); staged (the default), by the whole version in bf16, which `publish` returns before sending."""
    if not reset_peak_rss():
        pytest.skip("needs /proc/self/clear_refs to measure one phase's peak")
    # glibc keeps freed buckets resident and raises its mmap threshold as they are freed, which the peak would count
    # as held: a fixed threshold returns each freed bucket to the kernel
    return_freed_blocks(1 << 16)
    count, bucket_mib = 64, 4  # fp32: 256 MiB in all; in bf16: 128 MiB staged whole, 2 MiB a bucket
    side = 1024 * (bucket_mib >> 2)
    shapes = {f"layers.{i}.weight": torch.empty(side, 1024, device="meta") for i in range(count)}
    manifest = plan_buckets(shapes, bucket_mib << 20)
    assert len(manifest.buckets) == count

    def buckets():
        for i in range(count):
            yield [torch.full((side, 1024), float(i))]  # a fresh bucket each time, as the ranks gather them

    publisher = make_weight_sync("torch_distributed", num_receivers=1, port=free_port(), bucket_bytes=bucket_mib << 20,
                                 timeout_s=30, dtype=torch.bfloat16, forward_streams=forward)
    joined, sums = threading.Event(), []

    def receive():
        receiver = publisher.receiver_spec.for_rank(1).open()
        joined.set()
        try:
            _, stream = receiver.wait_for(1, timeout=30)
            sums.extend(float(members[0].float().mean()) for members in stream.buckets())
        finally:
            receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        assert joined.wait(30)
        gc.collect()
        reset_peak_rss()
        before = rss_mb()
        assert before is not None
        publisher.publish(BucketStream(manifest, buckets), 1)
        publisher.wait_published(30)
        thread.join(30)
        grown = peak_rss_mb() - before
        assert sums == [float(i) for i in range(count)], "every bucket arrived, in order"
        if forward:
            assert grown < 64, f"the driver grew {grown:.1f} MiB for a 128 MiB version: it staged the version whole"
        else:
            # a few pages of the version may land in memory that was resident before it (127.98 MiB was seen)
            assert grown >= 120, f"the driver grew {grown:.1f} MiB: a staged 128 MiB version was not held whole"
    finally:
        thread.join(30)
        publisher.close()


@pytest.mark.slow
def test_a_bf16_engine_receives_bf16_half_the_bytes():
    sd = state_dict()
    box, thread = publish_in_thread(sd, 1, port=free_port(), dtype=torch.bfloat16)
    receiver = box["p"].receiver_spec.for_rank(1).open()
    try:
        _, stream = receiver.wait_for(1, timeout=30)
        got = materialize(stream)
        fp32_bytes = plan_buckets(sd, BUCKET_BYTES).payload_bytes
        assert receiver.received_bytes < 0.6 * fp32_bytes
        assert got["layer0.weight"].dtype == torch.bfloat16 and got["steps"].dtype == torch.int64
        assert all(torch.equal(got[k], sd[k].to(got[k].dtype)) for k in sd)
    finally:
        thread.join(30)
        receiver.close()
        box["p"].close()


def test_a_skipped_or_unread_version_is_still_taken_whole():
    """The receiver drains what a consumer left of a stream before the next poll (the sender broadcasts every
    bucket of it), so the next version arrives intact."""
    port = free_port()
    first, second = state_dict(1), state_dict(2)
    box, thread = publish_in_thread(first, 1, port=port)
    receiver = box["p"].receiver_spec.for_rank(1).open()
    try:
        _, stream = receiver.wait_for(1, timeout=30)
        next(iter(stream.buckets()))  # one bucket read, the rest left unread
        box["p"].publish(second, 2)
        _, stream = receiver.wait_for(2, timeout=30)
        got = materialize(stream)
        assert all(torch.equal(got[k], second[k]) for k in second)
    finally:
        thread.join(30)
        receiver.close()
        box["p"].close()


def test_cast_manifest_keeps_the_layout_and_narrows_floats():
    manifest = plan_buckets(state_dict(), BUCKET_BYTES)
    narrow = cast_manifest(manifest, torch.bfloat16)
    assert [(e.name, e.bucket, e.offset) for e in narrow.tensors] == [(e.name, e.bucket, e.offset)
                                                                      for e in manifest.tensors]
    assert {e.dtype for e in narrow.tensors} == {torch.bfloat16, torch.int64}
    assert cast_manifest(manifest, torch.float32) is manifest and cast_manifest(manifest, None) is manifest


def test_a_stream_saved_as_safetensors_reads_back(tmp_path):
    sd = {**state_dict(), "half": torch.randn(3, 5).to(torch.bfloat16)}
    manifest = plan_buckets(sd, BUCKET_BYTES)

    def buckets():
        for members in bucket_contents(sd, manifest):
            yield [t.clone() for t in members]

    written = save_safetensors(BucketStream(manifest, buckets), tmp_path / "model.safetensors")
    assert written == (tmp_path / "model.safetensors").stat().st_size
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def _receive_means(spec, results) -> None:
    """A replica's side in its own process: each received bucket's mean, in order."""
    receiver = spec.for_rank(1).open()
    try:
        for version in (1, 2):  # a small warm-up version, then the measured one
            _, stream = receiver.wait_for(version, timeout=60)
            means = [float(members[0].float().mean()) for members in stream.buckets()]
        results.put(means)
    except BaseException as err:  # surfaced in the parent's assertion
        results.put(repr(err))
    finally:
        receiver.close()


@pytest.mark.slow
def test_a_tensor_four_buckets_large_costs_the_forwarding_driver_one_bucket():
    """A tensor larger than a bucket (Qwen2.5-0.5B's tied embedding: 519 MiB in fp32) travels as row slices, one
    bucket each: the driver forwarding the ranks' stream (`weights.stage_on_driver: false`) grows by about one bucket
    while the version goes out, not by the tensor. The replica receives in a process of its own, as on Ray."""
    if not reset_peak_rss():
        pytest.skip("needs /proc/self/clear_refs to measure one phase's peak")
    return_freed_blocks(1 << 16)  # freed buckets go back to the kernel
    bucket_mib = 32
    rows, cols = 16384, 4096  # bf16: 128 MiB, four buckets
    manifest = plan_buckets({"embed": torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")}, bucket_mib << 20)

    def buckets():  # as the ranks hand them over: one flat tensor per bucket, already in the engine's dtype
        for i, bucket in enumerate(manifest.buckets):
            yield [torch.full((bucket.numel,), float(i), dtype=bucket.dtype)]

    publisher = make_weight_sync("torch_distributed", num_receivers=1, port=free_port(), bucket_bytes=bucket_mib << 20,
                                 timeout_s=60, dtype=torch.bfloat16, forward_streams=True)
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    child = spawn.Process(target=_receive_means, args=(publisher.receiver_spec, results))
    child.start()
    try:
        small = plan_buckets({"embed": torch.empty(4, 4, dtype=torch.bfloat16, device="meta")})
        # the group's own buffers and threads come with the first broadcast
        publisher.publish(BucketStream(small, lambda: iter([[torch.zeros(16, dtype=torch.bfloat16)]])), 1)
        gc.collect()
        reset_peak_rss()
        before = rss_mb()
        assert before is not None
        publisher.publish(BucketStream(manifest, buckets), 2)
        grown = peak_rss_mb() - before
        assert grown < 1.5 * bucket_mib, f"the driver grew {grown:.1f} MiB forwarding a 128 MiB tensor in " \
                                         f"{bucket_mib} MiB buckets: it held more than a bucket of it"
        assert [e.rows for e in manifest.tensors] == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]
        assert results.get(timeout=60) == [0.0, 1.0, 2.0, 3.0], "every slice arrived, in order"
    finally:
        publisher.close()
        child.join(30)
    assert child.exitcode == 0


def split_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"norm": torch.randn(24, generator=g), "embed": torch.randn(64, 24, generator=g),  # 6 KiB: 4 slices
            "steps": torch.arange(5), "head": torch.randn(3, 24, generator=g)}


@pytest.mark.parametrize("kind", ["inprocess", "shared_memory", "torch_distributed", "forwarded"])
def test_a_tensor_larger_than_a_bucket_arrives_bit_exact(kind):
    sd = split_state_dict()
    manifest = plan_buckets(sd, 2048)
    assert sum(e.name == "embed" for e in manifest.tensors) == 4 and all(b.nbytes <= 2048 for b in manifest.buckets)
    if kind in ("inprocess", "shared_memory"):
        publisher = make_weight_sync(kind, bucket_bytes=2048)
        receiver = publisher.receiver_spec.open()
        try:
            publisher.publish(sd, 1)
            got = receiver.wait_for(1, timeout=10)[1]
            assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
        finally:
            receiver.close()
            publisher.close()
        return
    published = sd if kind == "torch_distributed" else \
        BucketStream(manifest, lambda: ([t.clone() for t in m] for m in bucket_contents(sd, manifest)))
    box, thread = publish_in_thread(published, 1, port=free_port(), bucket_bytes=2048,
                                    forward_streams=kind == "forwarded")
    receiver = box["p"].receiver_spec.for_rank(1).open()
    try:
        _, stream = receiver.wait_for(1, timeout=30)
        assert [e.rows for e in stream.manifest.tensors] == [e.rows for e in manifest.tensors]
        got = materialize(stream)
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    finally:
        thread.join(30)
        receiver.close()
        box["p"].close()


@pytest.mark.slow
def test_the_built_in_engine_loads_a_split_tensor_bit_exact(tiny_llama_path):
    """Through `torch_distributed` into the built-in engine (`hand_weights`, as a replica does), with buckets smaller
    than the embedding."""
    from asyncflow.engines.torch_inference import TorchInferenceEngine
    from asyncflow.models.loading import load_model
    from asyncflow.workers.loops import hand_weights

    engine = TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=2)
    g = torch.Generator().manual_seed(7)
    sent = {k: torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v.clone()
            for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}  # tied: sent once
    embed = sent["model.embed_tokens.weight"]
    box, thread = publish_in_thread(sent, 1, port=free_port(), bucket_bytes=embed.nbytes // 3)
    receiver = box["p"].receiver_spec.for_rank(1).open()
    try:
        _, stream = receiver.wait_for(1, timeout=30)
        assert sum(e.name == "model.embed_tokens.weight" for e in stream.manifest.tensors) >= 3
        hand_weights(engine, stream, 1)
        loaded = engine.model.state_dict()
        assert all(torch.equal(loaded[k], sent[k]) for k in sent) and torch.equal(loaded["lm_head.weight"], embed)
    finally:
        thread.join(30)
        receiver.close()
        box["p"].close()
