"""A checkpoint's `model.safetensors` is written from the weights' own memory: no second copy of the weights, only
the tensors safetensors cannot write as they are (tied embeddings: one tensor under two names) are copied, and the
file is byte for byte what saving contiguous copies of every tensor gives. Measured at ~120M parameters by
`benchmarks/bench_checkpoint_memory.py`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from asyncflow.weights.buckets import allocate_payload, bucket_contents, bucket_views, pack, plan_buckets, unpack
from asyncflow.workflow.checkpoint import _as_saved, load_checkpoint, save_checkpoint


def test_only_tensors_sharing_bytes_are_copied():
    embed = torch.randn(10, 4)
    weights = {"embed": embed, "norm": torch.randn(4), "head": embed, "t": torch.randn(4, 3).t()}
    saved = _as_saved(weights)
    assert saved["embed"].data_ptr() == embed.data_ptr(), "the first name of a tied tensor is written as it is"
    assert saved["head"].data_ptr() != embed.data_ptr() and torch.equal(saved["head"], embed)
    assert saved["norm"] is weights["norm"] or saved["norm"].data_ptr() == weights["norm"].data_ptr()
    assert saved["t"].is_contiguous() and torch.equal(saved["t"], weights["t"])


def test_views_of_one_buffer_are_written_without_a_copy_and_the_file_is_unchanged(tmp_path):
    sd = {"a": torch.randn(6, 5), "b": torch.randn(7), "c": torch.randn(3, 3).to(torch.bfloat16)}
    manifest = plan_buckets(sd)
    payload = allocate_payload(manifest)
    views = unpack(manifest, bucket_views(manifest, payload))  # as an FSDP2 engine's gathered weights lie
    pack(sd, manifest, bucket_views(manifest, payload))
    assert all(_as_saved(views)[k].data_ptr() == views[k].data_ptr() for k in views)
    checkpoint = save_checkpoint(tmp_path, 1, views, {}, {"cursor": 0})
    save_file({k: v.contiguous().clone() for k, v in views.items()}, str(tmp_path / "copies.safetensors"))
    assert (checkpoint / "model.safetensors").read_bytes() == (tmp_path / "copies.safetensors").read_bytes()
    weights, *_ = load_checkpoint(checkpoint)
    assert all(torch.equal(weights[k], sd[k]) for k in sd)
    assert load_checkpoint(checkpoint, with_weights=False)[0] == {}, "a sharded resume reads no full weights"


@pytest.mark.slow
def test_a_streamed_version_is_written_one_bucket_at_a_time(tmp_path):
    """A multi-rank engine's weights (a `BucketStream`) go into `model.safetensors` as they arrive: the writer holds one
    bucket at a time, never the whole version, and the file reads back as the weights."""
    import gc
    import weakref

    from asyncflow.weights.buckets import BucketStream

    sd = {f"w{i}": torch.randn(32, 32) for i in range(6)} | {"half": torch.randn(5).to(torch.bfloat16)}
    manifest = plan_buckets(sd, bucket_bytes=8192)
    produced: list[weakref.ref] = []
    most_alive = 0

    def buckets():
        nonlocal most_alive
        for index in range(len(manifest.buckets)):
            members = [t.clone() for t in bucket_contents(sd, manifest)[index]]
            gc.collect()
            most_alive = max(most_alive, 1 + sum(ref() is not None for ref in produced))
            produced.extend(weakref.ref(t) for t in members[:1])
            yield members
            del members

    checkpoint = save_checkpoint(tmp_path, 1, BucketStream(manifest, buckets), {}, {"cursor": 0})
    assert len(manifest.buckets) >= 4 and most_alive == 1
    weights, *_ = load_checkpoint(checkpoint)
    assert weights.keys() == sd.keys() and all(torch.equal(weights[k], sd[k]) for k in sd)
