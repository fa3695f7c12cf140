"""Checkpoints: `RUN_DIR/checkpoints/step_N/` with everything needed to resume exactly.

Owns: writing, verifying and reading a checkpoint folder:
- `model.safetensors`: policy weights;
- `training_state.pt`: optimizer and LR schedule state (and the LoRA adapter, under LoRA);
- `rng.pt`: python, numpy and torch RNG states (and the inference engine's generator);
- `state.json`: step, data position, weight version, counters;
- `sharded/` (multi-rank engines only): every rank's shards of weights and optimizer state, written by
  `torch.distributed.checkpoint` (`.metadata` and one `.distcp` per rank);
- `manifest.json`: the size and sha256 of each file above, written last.

Invariants:
- A checkpoint is written under a temporary name (`.tmp_step_N`), every file fsynced, the manifest
  written last, then renamed to `step_N`: a `step_N` folder is complete or was damaged afterwards.
- `verify_checkpoint` checks each file against the manifest; `load_checkpoint` verifies first and
  reports any damage as `CheckpointError` naming the file (a folder without a manifest, written before
  manifests existed or with its manifest lost, is checked by reading every file). Nothing is restored
  from a checkpoint that fails.
- A write that fails for any reason (an `OSError`, torch's `RuntimeError` from its zip writer,
  `SafetensorError`, a `torch.distributed.checkpoint` error, Ctrl-C) removes its temporary folder;
  earlier checkpoints are untouched. Any error becomes one `CheckpointWriteError` naming the folder,
  the file, the cause (a full disk as such, with the free space and the size of the previous checkpoint)
  and the checkpoint to resume from; an interruption (Ctrl-C, a second signal) goes on as it is.
- Only the newest `keep` checkpoints up to the one just written are kept; a higher step is never pruned
  by a lower one, nor a checkpoint a reader holds (`pinned`: `serve`, `eval` and `export` hold what they
  load; it is pruned by a later save).
- `model.safetensors` is written from the weights' own memory (only tensors sharing bytes with another, e.g.
  tied embeddings, are copied), so a checkpoint holds no second copy of the weights; a multi-rank engine's
  weights are written as they stream from its ranks, one bucket at a time (`save_safetensors`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from asyncflow.weights.buckets import BucketStream, save_safetensors

log = logging.getLogger(__name__)
T = TypeVar("T")

STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "training_state.pt", "rng.pt", "state.json")
SHARDED_DIR = "sharded"
_STEP_NAME = re.compile(rf"{STEP_PREFIX}(\d+)")
_PIN_WAIT_S = 60.0  # longest wait for a pruner to finish deleting a checkpoint a reader wants
_NEARLY_FULL_BYTES = 1 << 20  # a write that failed with less free than this ran out of space


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or damaged; the message names the file."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. no space left); the message says which and what is intact."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def save_checkpoint(
    run_dir: Path, step: int, weights: dict[str, torch.Tensor] | BucketStream, training_state: dict, state: dict,
    generator_state: torch.Tensor | None = None, keep: int = 2, write_sharded: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step_N` (see the module docstring); `write_sharded(folder)` writes a multi-rank engine's
    shards into `sharded/` (every file of it goes into the manifest). `weights` may be a multi-rank engine's
    `BucketStream`, written to `model.safetensors` one bucket at a time."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp_{STEP_PREFIX}{step}"
    previous = [c for c in list_checkpoints(run_dir) if checkpoint_step(c) != step]
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator_state,
    }
    if isinstance(weights, BucketStream):
        stream = weights

        def write_weights(path: Path) -> object:
            return save_safetensors(stream, path)
    else:
        tensors = _as_saved(weights)

        def write_weights(path: Path) -> object:
            return save_file(tensors, str(path))

    writers: dict[str, Callable[[Path], object]] = {
        "model.safetensors": write_weights,
        "training_state.pt": lambda path: torch.save(training_state, path),
        "rng.pt": lambda path: torch.save(rng, path),
        "state.json": lambda path: path.write_text(json.dumps({"step": step, **state}, indent=2)),
    }
    current = tmp
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        manifest = {}
        for name, write in writers.items():
            current = tmp / name
            write(current)
            manifest[name] = _fsync_and_describe(current)
        if write_sharded is not None:
            current = tmp / SHARDED_DIR
            write_sharded(current)
            for path in sorted(current.iterdir()):
                manifest[f"{SHARDED_DIR}/{path.name}"] = _fsync_and_describe(path)
            _fsync(current)
        current = tmp / MANIFEST
        current.write_text(json.dumps({"step": step, "files": manifest}, indent=2))
        _fsync_and_describe(current)
        _fsync(tmp)
        current = final
        if final.exists():  # a damaged folder of the same step: replaced, never merged
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except BaseException as err:
        disk_full = _disk_full(err, root)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise  # the half-written folder is gone; the interruption goes on (DCP's errors are BaseException too)
        raise _write_error(err, final, current, previous, disk_full, needed=_checkpoint_bytes(previous)) from err
    older = [c for c in list_checkpoints(run_dir) if checkpoint_step(c) < step]
    for old in older[: max(0, len(older) - (keep - 1))]:
        _prune(old)
    return final


def checkpoint_weights(engine: Any) -> dict[str, torch.Tensor] | BucketStream:
    """What a checkpoint of `engine` writes: its `weight_stream()`, which a multi-rank engine streams from its ranks
    bucket by bucket (this process then builds no full copy of the weights); else its state dict."""
    weights = engine.weight_stream() if hasattr(engine, "weight_stream") else engine.state_dict()
    return weights if isinstance(weights, BucketStream) else dict(weights)


def _prune(checkpoint: Path) -> None:
    """Delete `checkpoint` unless a reader holds it (`pinned`): then it is left for a later save to prune."""
    try:
        fd = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("checkpoint %s is being read by another process: pruned at a later checkpoint", checkpoint)
            return
        shutil.rmtree(checkpoint, ignore_errors=True)
    finally:
        os.close(fd)


@contextmanager
def pinned(pick: Callable[[], T], checkpoint_of: Callable[[Any], Path | None] = lambda picked: picked,
           attempts: int = 5) -> Iterator[T]:
    """`pick()` (what to read: a checkpoint, or something naming one) with its checkpoint held against pruning for
    the block: a shared `flock` on the checkpoint's folder, which `save_checkpoint` does not prune (a writer never
    waits on a reader). A checkpoint pruned between `pick()` and the lock (a run folder's newest, while it trains) is
    picked again. A checkpoint folder that does not exist: `FileNotFoundError` naming it."""
    for attempt in range(attempts):
        try:
            picked = pick()
            checkpoint = checkpoint_of(picked)
            fd = None if checkpoint is None else _pin(Path(checkpoint))
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield picked
        finally:
            if fd is not None:
                os.close(fd)
        return


def _pin(checkpoint: Path) -> int:
    """A shared lock on `checkpoint`'s folder (its descriptor: closing it releases the pin)."""
    missing = FileNotFoundError(
        f"checkpoint folder {str(checkpoint)!r} does not exist (expected RUN_DIR/checkpoints/step_N)")
    try:
        fd = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        raise missing from None
    deadline = time.monotonic() + _PIN_WAIT_S
    while True:  # a pruner holds the folder only while it deletes it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise CheckpointError(f"{checkpoint}: held by a process deleting it for over {_PIN_WAIT_S:g} s"
                                      ) from None
            time.sleep(0.02)
    try:
        same = os.stat(checkpoint).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        raise missing
    return fd


def _disk_full(err: BaseException, root: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC / EDQUOT anywhere in the exception's chain, or a library's
    message saying so (safetensors: "os error 28"; torch's zip writer says only "file write failed", so then the
    folder's free space, looked at before the half-written files are removed, decides)."""
    todo: list[BaseException] = [err]
    while todo:
        seen = todo.pop()
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = _first_line(seen)
        if "os error 28" in text or "No space left" in text or "Disk quota exceeded" in text:
            return True
        todo += [e for e in (seen.__cause__, seen.__context__, *_rank_errors(seen).values()) if e is not None]
    try:
        return shutil.disk_usage(root).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _checkpoint_bytes(checkpoints: list[Path]) -> int | None:
    """The size of the newest of `checkpoints` that has a manifest: what the next one needs, near enough."""
    for checkpoint in reversed(checkpoints):
        try:
            files = json.loads((checkpoint / MANIFEST).read_text())["files"]
            return sum(int(entry["size"]) for entry in files.values())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _write_error(err: BaseException, final: Path, current: Path, previous: list[Path], disk_full: bool,
                 needed: int | None) -> CheckpointWriteError:
    """The one-line `CheckpointWriteError` of a failed write: the folder and file, the cause, what is intact."""
    code, cause = write_failure(err, final.parent, disk_full, needed, "a checkpoint")
    if previous:
        intact = f"the previous checkpoint {previous[-1]} is intact: continue from it with --resume"
    else:
        intact = "there is no earlier checkpoint"
    return CheckpointWriteError(code, f"{cause} while writing checkpoint {final} ({current.name}); {intact}")


def write_failure(err: BaseException, folder: Path, disk_full: bool | None = None, needed: int | None = None,
                  what: str = "it") -> tuple[int, str]:
    """-> (errno, cause in words) of a write into `folder` that raised `err`, whatever raised it: "no space left
    on device (N MB free, WHAT needs about M MB)" when the disk is full (`disk_full`, or found out from `err` and
    the folder's free space when None), else the error's type and first line."""
    if disk_full is None:
        disk_full = _disk_full(err, folder)
    if disk_full:
        cause = "no space left on device"
        try:
            free = shutil.disk_usage(folder).free
            cause += f" ({_mb(free)} free" + (f", {what} needs about {_mb(needed)}" if needed else "") + ")"
        except OSError:
            pass
        return errno.ENOSPC, cause
    code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
    ranks = _rank_errors(err)
    if ranks:
        rank, inner = next(iter(ranks.items()))
        return code, f"{type(err).__name__} (rank {rank}: {type(inner).__name__}: {_first_line(inner)})"
    return code, f"{type(err).__name__}: {(err.strerror if isinstance(err, OSError) else None) or _first_line(err)}"


def _rank_errors(err: BaseException) -> dict[int, BaseException]:
    """A `torch.distributed.checkpoint` `CheckpointException`'s errors by rank ({} for any other error)."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        return {}
    found = {}
    for rank, failure in failures.items():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, BaseException):
            found[rank] = inner
    return found


def _first_line(err: BaseException) -> str:
    try:
        text = str(err).strip()
    except Exception:  # an exception whose own __str__ fails
        text = ""
    return text.splitlines()[0] if text else "no message"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
def _as_saved(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as safetensors can write them, copying only what it cannot: a tensor whose bytes overlap one
    listed before it (tied embeddings are one tensor under two names; safetensors refuses overlapping tensors)
    and a non-contiguous one. Disjoint views of one buffer (a multi-rank engine's gathered weights) are written
    as they are, so a checkpoint costs no second copy of the weights; safetensors writes from their memory."""
    out: dict[str, torch.Tensor] = {}
    spans: dict[tuple[torch.device, int], list[tuple[int, int]]] = {}  # storage -> byte ranges already listed
    for name, tensor in weights.items():
        tensor = tensor.detach()
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        listed = spans.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), [])
        if not tensor.is_contiguous() or any(start < e and s < end for s, e in listed):
            tensor = tensor.contiguous().clone()
        else:
            listed.append((start, end))
        out[name] = tensor
    return out


def checkpoint_step(checkpoint: Path) -> int:
    match = _STEP_NAME.fullmatch(Path(checkpoint).name)
    if match is None:
        raise CheckpointError(f"{checkpoint}: not a checkpoint folder (expected RUN_DIR/checkpoints/step_N)")
    return int(match.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every `step_N` folder of the run, oldest first (intact or not: see `verify_checkpoint`)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_NAME.fullmatch(p.name)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def verify_checkpoint(checkpoint: Path, files: tuple[str, ...] = FILES) -> None:
    """Raise `CheckpointError` naming the first of `files` that is missing, cut off or altered (with the default
    `files`, the `sharded/` files its manifest lists too)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {str(checkpoint)!r} does not exist (expected RUN_DIR/checkpoints/step_N)"
        )
    manifest_path = checkpoint / MANIFEST
    manifest = None
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())["files"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CheckpointError(f"{manifest_path}: damaged (not a checkpoint manifest)") from None
    if files == FILES and manifest is not None:
        files = files + tuple(name for name in manifest if name.startswith(f"{SHARDED_DIR}/"))
    for name in files:
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if manifest is None:  # written before manifests, or its manifest lost: checked by reading it
            if name in _READERS:
                _read(checkpoint, name)
            continue
        expected = manifest.get(name)
        if not isinstance(expected, dict):
            raise CheckpointError(f"{path}: not listed in {MANIFEST}")
        size = path.stat().st_size
        if size != expected.get("size"):
            raise CheckpointError(f"{path}: cut off or altered ({size} bytes, {expected.get('size')} written)")
        if _sha256(path) != expected.get("sha256"):
            raise CheckpointError(f"{path}: damaged (sha256 differs from {MANIFEST})")


def load_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    verify_checkpoint(checkpoint, files=("model.safetensors",))
    return _read(checkpoint, "model.safetensors")


def load_training_state(checkpoint: Path) -> dict:
    verify_checkpoint(checkpoint, files=("training_state.pt",))
    return _read(checkpoint, "training_state.pt")


def load_checkpoint(checkpoint: Path, *, with_weights: bool = True) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    """-> (weights, training_state, state, rng); restores the global RNGs as a side effect, once every file
    has been verified and read. `with_weights=False`: the weights are verified but not read ({}), for an engine
    that resumes from its `sharded/` files."""
    verify_checkpoint(checkpoint)
    training_state, state, rng = (_read(checkpoint, name) for name in ("training_state.pt", "state.json", "rng.pt"))
    weights = _read(checkpoint, "model.safetensors") if with_weights else {}
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return weights, training_state, state, rng


_READERS: dict[str, Callable[[Path], object]] = {
    "model.safetensors": lambda path: load_file(str(path)),
    "training_state.pt": lambda path: torch.load(path, weights_only=False),
    "rng.pt": lambda path: torch.load(path, weights_only=False),
    "state.json": lambda path: json.loads(path.read_text()),
}


def _read(checkpoint: Path, name: str):
    path = Path(checkpoint) / name
    try:
        return _READERS[name](path)
    except Exception as err:  # safetensors, pickle, zip and JSON each raise their own kind
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot be read ({reason})") from err


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_and_describe(path: Path) -> dict:
    """Flush `path` to disk; -> its size and sha256 for the manifest."""
    _fsync(path)
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
