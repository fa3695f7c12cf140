"""Weight transports: the trainer publishes versioned state dicts, inference engines receive them.

This package sits below the engines and workers and imports nothing else of asyncflow, so an
engine adapter can use a transport without importing workflow code. One module per concern:
`buckets` (bucketing), `base` (protocols, errors), `background` (the remote transports' sender
thread), `segments` (naming /dev/shm files after their owner, sweeping those of dead owners), one
module per transport, `delta` (lossless delta updates over two channels of a transport), `deadlines`
(the deadline of each phase of a version's way) and `factory` (`make_weight_sync`):

| kind                | reaches               | publish                                  |
|---------------------|-----------------------|------------------------------------------|
| `inprocess`         | the same process      | packs into a fresh buffer, swaps a reference |
| `shared_memory`     | processes, one host   | packs into the idle slot of a 2-slot file in /dev/shm, flips |
| `ray`               | a Ray cluster         | packs, then `ray.put`s buckets on a background thread |
| `torch_distributed` | a process group       | packs, then broadcasts buckets (gloo / NCCL) on a background thread |

Receivers are built in any process from `publisher.receiver_spec` (a small picklable dataclass;
`spec.open()`), except `inprocess`, whose spec only works inside the publishing process.

Invariants:
- A receiver returns whole versions only: every tensor of one published version, never a mix.
- Weights travel as a few large buckets: same-dtype tensors flattened into contiguous buffers of
  at most `bucket_bytes` (a larger tensor is split into row slices over consecutive buckets), plus a `Manifest`
  (names, shapes, dtypes, offsets, slices) that rebuilds the state dict. No transport makes a call per tensor.
- `publish` never waits for receivers. It costs one local copy of the weights (the snapshot: the
  trainer may step as soon as it returns). It takes a state dict or a `BucketStream` (a multi-rank
  trainer's weights gathered one bucket at a time), copied in bucket by bucket: the publishing side then
  holds the snapshot plus one bucket, never a second full copy; the remote part (`ray`, `torch_distributed`) runs on a
  background thread, and stages floating tensors in the engine's dtype when it is narrower (`dtype`). A
  `torch_distributed` receiver hands a version out as a `BucketStream` received as it is read (one bucket held).
  A publish while an earlier version is still waiting to be sent **supersedes**
  it: that version is never sent and receivers skip it; the version already being sent completes.
  Receivers therefore converge to the newest version but may skip intermediate ones.
- Versions published by one publisher strictly increase.
- Every blocking call takes a timeout and ends in `WeightSyncTimeout` (transport, version, what was
  awaited); a closed or broken transport raises `WeightSyncError`. Nothing hangs silently.
- Received tensors are read-only snapshots: the transport never writes them while anything outside it
  references them (a delta receiver reuses a version's memory once its consumer let it go); callers copy them
  into their model (`load_state_dict`) and must not modify them in place.
- `publish` and `wait_published` are called from one thread (the trainer's).
"""

from asyncflow.weights.base import (
    Received,
    ReceiverSpec,
    WeightPublisher,
    WeightReceiver,
    WeightSyncError,
    WeightSyncTimeout,
)
from asyncflow.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketStream,
    Manifest,
    StateDict,
    Weights,
    pack,
    plan_buckets,
    unpack,
)
from asyncflow.weights.factory import TransportKind, make_weight_sync

__all__ = [
    "DEFAULT_BUCKET_BYTES", "BucketStream", "Manifest", "ReceiverSpec", "Received", "StateDict", "TransportKind",
    "WeightPublisher", "WeightReceiver", "WeightSyncError", "WeightSyncTimeout", "Weights", "make_weight_sync", "pack",
    "plan_buckets", "unpack",
]
