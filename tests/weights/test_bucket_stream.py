"""A `BucketStream` (a version produced one bucket at a time) is written into a transport's buckets bit-identically
to the state dict it streams, by every publish path: `write_weights` itself and the background sender of the `ray`
and `torch_distributed` transports. A stream that does not match its layout is an error, never a torn version."""

from __future__ import annotations

import pytest
import torch

from asyncflow.weights.background import BackgroundSender
from asyncflow.weights.buckets import (
    BucketStream,
    allocate_payload,
    bucket_contents,
    bucket_views,
    pack,
    plan_buckets,
    write_weights,
)

BUCKET_BYTES = 256


def mixed_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(16, 8, generator=g),  # 512 bytes: a bucket of its own
        "norm": torch.randn(8, generator=g),
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "proj": torch.randn(6, 8, generator=g),
        "bias": torch.randn(3, generator=g).to(torch.bfloat16),
    }


def stream_of(sd: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> BucketStream:
    manifest = plan_buckets(sd, bucket_bytes)

    def buckets():
        for members in bucket_contents(sd, manifest):
            yield [t.clone() for t in members]

    return BucketStream(manifest, buckets)


def zeroed(manifest) -> torch.Tensor:
    return allocate_payload(manifest).zero_()  # the alignment gaps between buckets are never written


def packed(weights, manifest) -> bytes:
    payload = zeroed(manifest)
    write_weights(weights, manifest, bucket_views(manifest, payload))
    return payload.numpy().tobytes()


def test_a_stream_writes_the_bytes_pack_writes():
    sd = mixed_state_dict()
    manifest = plan_buckets(sd, BUCKET_BYTES)
    assert len(manifest.buckets) >= 3
    payload = zeroed(manifest)
    pack(sd, manifest, bucket_views(manifest, payload))
    assert packed(stream_of(sd), manifest) == payload.numpy().tobytes()


def test_a_stream_that_does_not_match_its_layout_is_an_error():
    sd = mixed_state_dict()
    manifest = plan_buckets(sd, BUCKET_BYTES)
    with pytest.raises(ValueError, match="manifest differs"):
        packed(stream_of(sd, bucket_bytes=4096), manifest)
    short = BucketStream(manifest, lambda: iter(bucket_contents(sd, manifest)[:1]))
    with pytest.raises(ValueError, match="ended after 1 of"):
        packed(short, manifest)


def test_the_background_sender_sends_a_stream_as_the_state_dict():
    sent = []

    def send(version, manifest, buckets):
        sent.append((version, [b.clone() for b in buckets]))

    sender = BackgroundSender("test", send, bucket_bytes=BUCKET_BYTES)
    try:
        sd = mixed_state_dict()
        sender.publish(sd, 1)
        sender.wait_published(timeout=5)
        sender.publish(stream_of(sd), 2)
        sender.wait_published(timeout=5)
    finally:
        sender.close(5)
    (_, from_dict), (_, from_stream) = sent
    assert len(from_dict) == len(from_stream)
    assert all(torch.equal(a, b) for a, b in zip(from_dict, from_stream, strict=True))
