"""`asyncflow.weights.collective`: a real two-rank gloo group (two threads of this process), no mocks.

A version's buckets arrive exactly; a rank the other side never meets ends in `WeightSyncTimeout` naming the side
that did not show up, and a group that failed refuses further use."""

import threading

import pytest
import torch

from asyncflow.weights import WeightSyncError, WeightSyncTimeout
from asyncflow.weights.buckets import allocate_payload, bucket_views, pack, plan_buckets
from asyncflow.weights.collective import backend_for, host_store, join_group


def two_rank_group(timeout_s: float):
    """(sender, receiver) groups of one gloo group, joined concurrently as the vLLM adapter does."""
    store = host_store("127.0.0.1", timeout_s)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", join_group(
        "127.0.0.1", store.port, 1, 2, device="cpu", timeout_s=timeout_s, side="the worker side")))
    thread.start()
    sender = join_group("127.0.0.1", store.port, 0, 2, device="cpu", timeout_s=timeout_s, side="the trainer side",
                        store=store)
    thread.join(timeout_s)
    return sender, box["r"], store


def staged(state_dict, bucket_bytes):
    manifest = plan_buckets(state_dict, bucket_bytes)
    buckets = bucket_views(manifest, allocate_payload(manifest))
    pack(state_dict, manifest, buckets)
    return manifest, buckets


def test_a_version_arrives_exactly_bucket_by_bucket():
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.w": torch.randn(64, 33, generator=g) for i in range(6)}
    state["ids"] = torch.arange(10, dtype=torch.int64)
    sender, receiver, _store = two_rank_group(30)
    try:
        manifest, buckets = staged(state, bucket_bytes=3 * 64 * 33 * 4)
        assert len(buckets) == 3  # two fp32 buckets of three tensors, one int64 bucket
        thread = threading.Thread(target=sender.send, args=(buckets, 5))
        thread.start()
        got = {name: t.clone() for name, t in receiver.receive(manifest, 5)}
        thread.join(30)
    finally:
        sender.close()
        receiver.close()
    assert list(got) == [e.name for b in range(3) for e in manifest.tensors if e.bucket == b]
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype


@pytest.mark.slow
def test_timeouts_name_the_side_that_did_not_show_up():
    sender, receiver, _store = two_rank_group(1.0)
    try:
        manifest, buckets = staged({"w": torch.ones(1 << 23)}, bucket_bytes=1 << 30)  # 32 MB: beyond socket buffers
        with pytest.raises(WeightSyncTimeout, match=r"every receiver \(ranks 1..1\).*the trainer side \(rank 0"):
            sender.send(buckets, 3)  # nobody receives
        with pytest.raises(WeightSyncError, match="the trainer side.*broke in an earlier call"):
            sender.send(buckets, 4)
        both_sides = r"(?=.*the worker side \(receiver rank 1\))(?=.*rank 0 \(the sender\))"
        with pytest.raises(WeightSyncError, match=both_sides):
            list(receiver.receive(manifest, 3))  # the sender gave up: its connections time out or are closed
    finally:
        sender.close()
        receiver.close()
    sender, receiver, _store = two_rank_group(1.0)
    try:
        with pytest.raises(WeightSyncTimeout, match=r"rank 0 \(the sender\) to send bucket 1/1.*the worker side"):
            list(receiver.receive(manifest, 5))  # nobody sends
    finally:
        sender.close()
        receiver.close()


def test_a_missing_rank_is_named_at_join():
    store = host_store("127.0.0.1", 0.5)
    with pytest.raises(WeightSyncTimeout, match=r"ranks 1..2 \(the receivers\) to join.*the trainer side"):
        join_group("127.0.0.1", store.port, 0, 3, device="cpu", timeout_s=0.5, side="the trainer side", store=store)


def test_backend_follows_the_device():
    assert backend_for("cpu") == "gloo" and backend_for("cuda:1") == "nccl"
    with pytest.raises(ValueError, match="no backend for device 'meta'"):
        backend_for("meta")
