"""Buckets: how a state dict travels as a few large contiguous buffers plus a `Manifest`.

Owns: `plan_buckets` (same-dtype tensors flattened into buffers of at most `bucket_bytes`; a larger
tensor is split along its first dimension into row slices over consecutive buckets), `allocate_payload` /
`bucket_views` (one aligned byte buffer per version, viewed as typed buckets), `pack` (copy a state dict in) and
`unpack` (views back out), and
`BucketStream`: a version whose tensors are produced one bucket at a time (a multi-rank trainer gathers
them so), which `write_weights` copies in bucket by bucket wherever a state dict could go, `save_safetensors`
writes to a file, `filled_buckets` forwards one buffer at a time and `materialize` makes a state dict of;
`cast_manifest`: the same layout in a narrower dtype (what a bf16 engine receives).

Invariants:
- No bucket holds more than `bucket_bytes`, but for a single row wider than that (then one row). The slices of a
  split tensor are consecutive entries under its name, in consecutive buckets, and lie end to end in a payload
  (a bucket that continues a tensor starts right where the previous one ends, `Bucket.joined`): a split tensor is
  still one contiguous run of bytes, in a payload, in a stream's order and in a safetensors file.
- `unpack(manifest, buckets)` after `pack(sd, manifest, buckets)` gives tensors equal to `sd` (names,
  shapes, dtypes, values), as views of the buckets: no copy on the way out.
- `write_weights` of a `BucketStream` writes the same bytes as `pack` of the state dict it streams, and
  holds no more than the bucket it is copying (plus what the stream's producer holds).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

DEFAULT_BUCKET_BYTES = 64 << 20
ALIGN = 64  # byte alignment of buckets inside a payload, so any dtype view of them is legal

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's place in a bucket: the whole tensor, or (`rows`) the slice [start, stop) of its first dimension."""

    name: str
    shape: tuple[int, ...]  # the whole tensor's
    dtype: torch.dtype
    bucket: int
    offset: int  # in elements, inside its bucket
    rows: tuple[int, int] | None = None

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """The shape of what this entry holds: `shape`, or its `rows` of it."""
        return self.shape if self.rows is None else (self.rows[1] - self.rows[0], *self.shape[1:])

    @property
    def numel(self) -> int:
        """Elements this entry holds in its bucket."""
        return math.prod(self.piece_shape)

    def piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """This entry's part of the whole `tensor` (a view)."""
        return tensor if self.rows is None else tensor[self.rows[0] : self.rows[1]]


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    byte_offset: int  # inside the flat payload; a multiple of ALIGN unless `joined`
    joined: bool = False  # continues the previous bucket's last tensor: laid out right after it, without a gap

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """How a state dict lies in a flat byte payload: buckets, and each tensor's place in them."""

    tensors: tuple[TensorEntry, ...]
    buckets: tuple[Bucket, ...]
    payload_bytes: int

    def with_payload_bytes(self) -> Manifest:
        """This manifest with `payload_bytes` the end of its last bucket, rounded up to ALIGN."""
        end = self.buckets[-1].byte_offset + self.buckets[-1].nbytes if self.buckets else 0
        return replace(self, payload_bytes=align(end))


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 split: bool = True) -> Manifest:
    """Group same-dtype tensors, in state-dict order, into buckets of at most `bucket_bytes`. A tensor larger than
    that starts a bucket and is split along its first dimension into slices of as many rows as a bucket takes (at
    least one), one bucket each; the last slice's bucket stays open for the tensors after it. `split=False`: such a
    tensor gets a bucket of its own instead."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket_numels: list[int] = []
    bucket_dtypes: list[torch.dtype] = []
    joined: list[bool] = []
    open_bucket: dict[torch.dtype, int] = {}
    entries = []

    def start(dtype: torch.dtype, continues: bool = False) -> int:
        bucket_numels.append(0)
        bucket_dtypes.append(dtype)
        joined.append(continues)
        open_bucket[dtype] = len(bucket_numels) - 1
        return open_bucket[dtype]

    for name, tensor in state_dict.items():
        dtype, numel, shape = tensor.dtype, tensor.numel(), tuple(tensor.shape)
        capacity = bucket_bytes // dtype.itemsize
        if split and numel > capacity and shape and shape[0] > 1:
            row = numel // shape[0]
            step = max(1, capacity // row)
            for first in range(0, shape[0], step):
                index = start(dtype, continues=first > 0)
                rows = (first, min(first + step, shape[0]))
                entries.append(TensorEntry(name, shape, dtype, index, 0, rows))
                bucket_numels[index] = (rows[1] - rows[0]) * row
            continue
        opened = open_bucket.get(dtype)
        index = start(dtype) if opened is None or (
            bucket_numels[opened] > 0 and bucket_numels[opened] + numel > capacity) else opened
        entries.append(TensorEntry(name, shape, dtype, index, bucket_numels[index]))
        bucket_numels[index] += numel
    return Manifest(tuple(entries), _lay_out(bucket_dtypes, bucket_numels, joined), 0).with_payload_bytes()


def _lay_out(dtypes: Sequence[torch.dtype], numels: Sequence[int], joined: Sequence[bool]) -> tuple[Bucket, ...]:
    """Buckets end to end in a payload: each at the next multiple of ALIGN, a `joined` one right after the previous."""
    buckets: list[Bucket] = []
    offset = 0
    for dtype, numel, continues in zip(dtypes, numels, joined, strict=True):
        if continues:
            offset = buckets[-1].byte_offset + buckets[-1].nbytes
        buckets.append(Bucket(dtype, numel, offset, continues))
        offset = align(offset + numel * dtype.itemsize)
    return tuple(buckets)


def allocate_payload(manifest: Manifest, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(manifest.payload_bytes, dtype=torch.uint8, device=device)


def bucket_views(manifest: Manifest, payload: torch.Tensor) -> list[torch.Tensor]:
    """Typed 1-D views of each bucket inside a uint8 `payload` of `manifest.payload_bytes`."""
    return [payload[b.byte_offset : b.byte_offset + b.nbytes].view(b.dtype) for b in manifest.buckets]


def _fill(bucket: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """Copy the flat `sources` into `bucket` end to end (cast to its dtype where they differ)."""
    if all(s.device == bucket.device and s.dtype == bucket.dtype for s in sources):
        torch.cat(list(sources), out=bucket)
        return
    offset = 0
    for s in sources:
        bucket[offset : offset + s.numel()].copy_(s)
        offset += s.numel()


def bucket_contents(state_dict: Mapping[str, torch.Tensor], manifest: Manifest) -> list[list[torch.Tensor]]:
    """Each bucket's entries as views of `state_dict` (a split tensor's slice as its rows), in manifest order: what a
    `BucketStream` of the state dict yields."""
    members: list[list[torch.Tensor]] = [[] for _ in manifest.buckets]
    for entry in manifest.tensors:
        members[entry.bucket].append(entry.piece(state_dict[entry.name].detach()))
    return members


def pack(state_dict: Mapping[str, torch.Tensor], manifest: Manifest, buckets: list[torch.Tensor]) -> None:
    """Copy every tensor into its bucket: one concatenation per bucket (a cast where the manifest's dtype differs)."""
    for bucket, sources in zip(buckets, bucket_contents(state_dict, manifest), strict=True):
        _fill(bucket, [s.reshape(-1) for s in sources])


def cast_manifest(manifest: Manifest, dtype: torch.dtype | None) -> Manifest:
    """`manifest` with every floating tensor wider than `dtype` carried in `dtype` (a bf16 engine receives bf16: half
    the bytes of fp32): the same buckets and entries, each bucket's bytes recomputed. `manifest` itself when `dtype`
    is None or nothing is wider."""

    def target(d: torch.dtype) -> torch.dtype:
        wider = dtype is not None and d.is_floating_point and dtype.is_floating_point and d.itemsize > dtype.itemsize
        return dtype if wider and dtype is not None else d

    if all(target(b.dtype) == b.dtype for b in manifest.buckets):
        return manifest
    buckets = _lay_out([target(b.dtype) for b in manifest.buckets], [b.numel for b in manifest.buckets],
                       [b.joined for b in manifest.buckets])
    tensors = tuple(replace(e, dtype=target(e.dtype)) for e in manifest.tensors)
    return Manifest(tensors, buckets, 0).with_payload_bytes()


def same_layout(a: Manifest, b: Manifest) -> bool:
    """The same tensors in the same places, whatever their dtypes (`cast_manifest` keeps the layout)."""
    return [(e.name, e.shape, e.bucket, e.offset, e.rows) for e in a.tensors] == \
        [(e.name, e.shape, e.bucket, e.offset, e.rows) for e in b.tensors] and \
        [bk.numel for bk in a.buckets] == [bk.numel for bk in b.buckets]


def unpack(manifest: Manifest, buckets: list[torch.Tensor]) -> StateDict:
    """The state dict as views into `buckets` (no copy); a split tensor is one view over its buckets, which must be
    `bucket_views` of one payload (its slices lie end to end there)."""
    out: StateDict = {}
    for e in manifest.tensors:
        if e.rows is None:
            out[e.name] = buckets[e.bucket][e.offset : e.offset + e.numel].view(e.shape)
        elif e.rows[0] == 0:
            first = buckets[e.bucket]
            last = [x for x in manifest.tensors if x.name == e.name][-1]
            end = buckets[last.bucket].data_ptr() + last.numel * e.dtype.itemsize
            if end != first.data_ptr() + math.prod(e.shape) * e.dtype.itemsize:
                raise ValueError(f"unpack: the buckets holding {e.name}'s slices do not lie end to end in one payload")
            out[e.name] = first.as_strided(e.shape, torch.empty(e.shape, device="meta").stride(),
                                            first.storage_offset())
    return out


@dataclass(frozen=True)
class BucketStream:
    """A version's weights as their `manifest` and `buckets()`: an iterator that yields, for each bucket of the
    manifest in order, the bucket's contents as tensors whose elements, end to end, are the bucket's: its entries'
    tensors (`TensorEntry.piece` of a split one) in manifest order, or the bucket as one flat tensor (what the FSDP2
    ranks hand over). Each may be freed once copied. One pass: `buckets()` is called once per use."""

    manifest: Manifest
    buckets: Callable[[], Iterator[Sequence[torch.Tensor]]]


Weights = Mapping[str, torch.Tensor] | BucketStream
"""What a publisher takes: a whole state dict, or one streamed bucket by bucket."""


def manifest_of(weights: Weights, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """The layout `weights` travel in: a stream's own, or `plan_buckets` of a state dict."""
    return weights.manifest if isinstance(weights, BucketStream) else plan_buckets(weights, bucket_bytes)


def write_weights(weights: Weights, manifest: Manifest, buckets: list[torch.Tensor]) -> None:
    """Copy `weights` into `buckets` (typed views laid out by `manifest`, which may be `cast_manifest` of the weights'
    own): `pack` for a state dict; for a stream, each bucket's tensors as they arrive."""
    if not isinstance(weights, BucketStream):
        pack(weights, manifest, buckets)
        return
    if not same_layout(weights.manifest, manifest):
        raise ValueError("a weight stream's manifest differs from the layout it is written into")
    written = 0
    for members in weights.buckets():  # not enumerate: its cached tuple would keep a bucket alive into the next
        sources = [t.detach().reshape(-1) for t in members]
        bucket = buckets[written]
        if sum(s.numel() for s in sources) != bucket.numel():
            raise ValueError(f"bucket {written} of a weight stream has {sum(s.numel() for s in sources)} elements, "
                             f"its manifest {bucket.numel()}")
        _fill(bucket, sources)
        del sources, members
        written += 1
    if written != len(buckets):
        raise ValueError(f"a weight stream ended after {written} of {len(buckets)} buckets")


def filled_buckets(stream: BucketStream, manifest: Manifest, device: torch.device | str = "cpu"
                   ) -> Iterator[torch.Tensor]:
    """Each bucket of `stream` as a fresh 1-D buffer laid out by `manifest` (the stream's own or `cast_manifest` of
    it), one at a time: what forwards a version without staging it whole (the consumer drops each buffer before
    asking for the next)."""
    if not same_layout(stream.manifest, manifest):
        raise ValueError("a weight stream's manifest differs from the layout it is forwarded in")
    index = -1
    for members in stream.buckets():  # not enumerate: its cached tuple would keep a bucket alive into the next
        index += 1
        layout = manifest.buckets[index]
        if len(members) == 1 and members[0].dtype == layout.dtype and members[0].numel() == layout.numel \
                and members[0].device == torch.device(device) and members[0].is_contiguous():
            bucket = members[0].detach().reshape(-1)  # already the bucket: no copy
        else:
            bucket = torch.empty(layout.numel, dtype=layout.dtype, device=device)
            _fill(bucket, [t.detach().reshape(-1) for t in members])
        del members
        yield bucket
        del bucket


def materialize(weights: Weights) -> Mapping[str, torch.Tensor]:
    """`weights` as a state dict: itself, or a stream written into one fresh payload (for a consumer that needs every
    tensor at once; a streaming consumer iterates `BucketStream.buckets()` instead)."""
    if not isinstance(weights, BucketStream):
        return weights
    buckets = bucket_views(weights.manifest, allocate_payload(weights.manifest))
    write_weights(weights, weights.manifest, buckets)
    return unpack(weights.manifest, buckets)


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def save_safetensors(stream: BucketStream, path: str | os.PathLike[str]) -> int:
    """Write `stream` as a safetensors file (readable by `safetensors.safe_open` / `load_file`), each bucket's tensors
    as they arrive: the header from the manifest, the data in bucket order. Holds one bucket at a time; -> bytes
    written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in sorted(stream.manifest.tensors, key=lambda e: (e.bucket, e.offset)):
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors cannot hold {entry.name} of dtype {entry.dtype}")
        size = entry.numel * entry.dtype.itemsize
        if entry.rows is not None and entry.rows[0] > 0:  # a later slice: its bytes follow the one before
            header[entry.name]["data_offsets"][1] += size
        else:
            header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(blob)) + blob)
        for members in stream.buckets():
            _write_tensors(file, members)
            del members  # before the next bucket arrives
    return 8 + len(blob) + offset


def _write_tensors(file: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Append each tensor's bytes to `file` (its own function: no reference to them outlives the call)."""
    for tensor in tensors:
        file.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)


class SafetensorsReader:
    """A safetensors file read one tensor at a time into fresh memory (`get_tensor`), without mapping the file: a
    process reading it whole holds one tensor, where `safe_open`'s mapping would count every page read in its
    resident size. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str]):
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close() / __exit__
        (length,) = struct.unpack("<Q", self._file.read(8))
        header = json.loads(self._file.read(length))
        header.pop("__metadata__", None)
        dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
        self._data = 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {
            name: (dtypes[e["dtype"]], tuple(e["shape"]), *e["data_offsets"]) for name, e in header.items()
        }

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype, shape, start, end = self.entries[name]
        tensor = torch.empty(shape, dtype=dtype)
        self._file.seek(self._data + start)
        if end > start and self._file.readinto(tensor.reshape(-1).view(torch.uint8).numpy().data) != end - start:
            raise ValueError(f"{self._file.name}: {name} is cut short")
        return tensor

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
