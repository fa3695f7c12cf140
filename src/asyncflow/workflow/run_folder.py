"""The run folder (`run.output_dir`): what it holds, what state the run in it is in, and whether a
command may write into it.

Owns: the folder's lock (`RunFolder.claim`: one writing process at a time; `claim_output` the same for an
output folder outside a run, an export's), the decision taken before
anything is written (`RunFolder.plan`: start fresh, resume from a checkpoint, or nothing to do), what may
not change on a resume (`check_resumable`), carrying the plan out (`RunFolder.prepare`: create and probe
the folder, clear it for `--overwrite`, set damaged checkpoints aside), and writing `config.yaml`
atomically. What the files themselves hold is owned by `checkpoint.py` and `asyncflow.observe`.

Invariants:
- One writer: a command that writes into a run folder holds its lock (`flock` on `.lock`, with the
  holder's pid and command in it) from before `plan` until it ends; a second one is refused at once
  with a message naming the holder. The OS drops the lock when its process dies, so a lock left by a
  killed run never blocks.
- A new run starts only in an empty folder: missing, empty, or holding only the SFT warm-up model
  `sft/`. A folder holding a run (config.yaml, metrics.jsonl or checkpoints/) is written into only
  with `--resume` (continue it) or `--overwrite` (delete its contents first); a non-empty folder
  that holds no run is never written into nor cleared. So one folder never mixes two runs' steps,
  config or checkpoints.
- `--resume` continues from the newest checkpoint that verifies; newer damaged ones are set aside
  as `checkpoints/damaged_step_N` with a warning naming the bad file. The other files a resume reads
  (`RESUME_READ_FILES`: config.yaml, timeline.json) are checked too: a damaged one is named, set aside
  as `damaged_NAME`, and the run goes on without it. What a resume may not change is checked against
  the checkpoint's own record (`fixed_settings` in its state.json), config.yaml only for older ones.
  A run whose newest intact checkpoint is at or past `train.steps` is finished: resuming it changes nothing.
- `--resume` of a run that stopped before its first checkpoint starts again from step 0 and drops
  that attempt's outputs (no step is logged twice); `--resume` of a run whose checkpoints are all
  damaged stops with an error naming them.
- `plan` only reads; `prepare` is the first write, and it probes that the folder is writable.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncflow.config import Config, ConfigError, dump_config
from asyncflow.observe.metrics import METRICS_FILE
from asyncflow.workflow.checkpoint import (
    STEP_PREFIX,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
SFT_DIR = "sft"  # the SFT warm-up model: written before the RL run, kept when a run starts over
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR)  # a folder holding one of these holds a run
DAMAGED_PREFIX = "damaged_"
LOCK_FILE = ".lock"


def _check_timeline(path: Path) -> None:
    document = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError("not a Chrome trace (no traceEvents list)")


def _check_config(path: Path) -> None:
    if not isinstance(yaml.safe_load(path.read_text(encoding="utf-8")), dict):
        raise ValueError("not a mapping of config sections")


TIMELINE_FILE = "timeline.json"
RESUME_READ_FILES = {CONFIG_FILE: _check_config, TIMELINE_FILE: _check_timeline}
"""Run-folder files a resume reads besides checkpoints and metrics.jsonl (whose damage `MetricsLogger` handles),
each with the check that it can be read; a damaged one is set aside as `damaged_NAME` and the run goes on:
config.yaml is written again from the command's config, the timeline starts anew."""
RESUME_FIXED_KEYS = ("model.path", "train.lora.rank", "train.lora.alpha", "train.lora.target_modules")
"""Settings a resume cannot change: the checkpoint's weights, adapter and optimizer state are shaped by them."""


class RunFolderInUse(ConfigError):
    """The run folder holds a run (or other files) and the command did not say what to do with it."""


class RunFolderNotWritable(OSError):
    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass(frozen=True)
class Plan:
    """What a command does with its run folder, decided before anything is written.

    action: `fresh` (step 0), `resume` (from `checkpoint`, at `step`) or `finished` (nothing to do).
    clear: entries of the folder deleted before a fresh start. damaged: (checkpoint, why) set aside.
    damaged_files: (run-folder file, why) set aside, the run going on without them (`RESUME_READ_FILES`)."""

    path: Path
    action: Literal["fresh", "resume", "finished"]
    checkpoint: Path | None = None
    step: int = 0
    clear: tuple[str, ...] = ()
    damaged: tuple[tuple[Path, str], ...] = ()
    damaged_files: tuple[tuple[Path, str], ...] = ()


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @contextmanager
    def claim(self, command: str) -> Iterator[None]:
        """Hold the folder's lock for the block (creating the folder); `RunFolderInUse` naming the holder when
        another process has it. A folder created here that is still empty at the end is removed again; a folder
        of other files (no run) is refused before anything is written into it."""
        self._refuse_foreign()
        created = not self.path.exists()
        lock = self.path / LOCK_FILE
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunFolderNotWritable(err.errno, f"cannot write to run folder {self.path}: {err.strerror}") from err
        fd = _take_lock(lock, command, lambda holder: RunFolderInUse(
            f"run folder {self.path} is in use by {holder}: wait for it to end, stop it (Ctrl-C, or kill PID: it "
            "checkpoints and exits), or choose another folder with --output"))
        try:
            yield
        finally:
            if created and [p.name for p in self.path.iterdir()] == [LOCK_FILE]:
                lock.unlink()
                self.path.rmdir()
            os.close(fd)  # releases the lock

    def entries(self) -> list[str]:
        """Names in the folder, SFT model and hidden files aside; [] when it does not exist."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.name != SFT_DIR and not p.name.startswith("."))

    def plan(self, *, steps: int, resume: bool = False, overwrite: bool = False) -> Plan:
        """Decide (reading only) what a `train` of `steps` steps does here; raises `RunFolderInUse` when the
        folder holds something the flags do not cover, `CheckpointError` when no checkpoint is intact."""
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite exclude each other: continue the run, or delete it")
        entries = self.entries()
        if not entries:
            if resume:
                log.warning("--resume: no run in %s, starting from scratch", self.path)
            return Plan(self.path, "fresh")
        self._refuse_foreign()
        checkpoints = list_checkpoints(self.path)
        if overwrite:
            log.warning("--overwrite: deleting the run in %s", self.path)
            sft = (SFT_DIR,) if (self.path / SFT_DIR).exists() else ()
            return Plan(self.path, "fresh", clear=tuple(entries) + sft)
        if not resume:
            where = f"checkpoints up to step {checkpoint_step(checkpoints[-1])}" if checkpoints else "no checkpoint"
            raise RunFolderInUse(
                f"run folder {self.path} already holds a run ({where}): pass --resume to continue it, --overwrite "
                "to delete it and start again, or choose another folder with --output"
            )
        if not checkpoints:
            log.warning("--resume: %s has no checkpoint (the run stopped before its first): starting from step 0",
                        self.path)
            return Plan(self.path, "fresh", clear=tuple(entries))
        damaged: list[tuple[Path, str]] = []
        for checkpoint in reversed(checkpoints):
            try:
                verify_checkpoint(checkpoint)
            except CheckpointError as err:
                log.warning("checkpoint %s is damaged (%s): falling back to an earlier one", checkpoint, err)
                damaged.append((checkpoint, str(err)))
                continue
            step = checkpoint_step(checkpoint)
            action: Literal["resume", "finished"] = "finished" if step >= steps else "resume"
            return Plan(self.path, action, checkpoint, step, damaged=tuple(damaged),
                        damaged_files=tuple(self._damaged_files()))
        raise CheckpointError(
            f"--resume: no intact checkpoint in {self.path / CHECKPOINTS_DIR}: "
            + "; ".join(why for _, why in damaged)
            + " (pass --overwrite to start the run again)"
        )

    def _damaged_files(self) -> list[tuple[Path, str]]:
        """The files a resume reads besides checkpoints and metrics (`RESUME_READ_FILES`) that cannot be read."""
        found = []
        for name, check in RESUME_READ_FILES.items():
            path = self.path / name
            if not path.is_file():
                continue
            try:
                check(path)
            except (OSError, ValueError, yaml.YAMLError, UnicodeDecodeError) as err:
                why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                log.warning("%s is damaged (%s): it is set aside, the run goes on without it", path, why)
                found.append((path, why))
        return found

    def set_aside(self, plan: Plan) -> None:
        """Rename the damaged run-folder files of `plan` to `damaged_NAME` (an older one of that name replaced)."""
        for path, _ in plan.damaged_files:
            aside = path.with_name(DAMAGED_PREFIX + path.name)
            if path.exists():
                os.replace(path, aside)
                log.warning("damaged %s set aside as %s", path.name, aside)

    def _refuse_foreign(self) -> None:
        """`RunFolderInUse` when the folder holds files but no run: it is neither written into nor cleared."""
        entries = self.entries()
        if entries and not any(name in entries for name in RUN_MARKERS):
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise RunFolderInUse(
                f"run folder {self.path} is not empty and holds no run ({shown}): choose an empty or new folder "
                "with --output (it is neither resumed nor cleared)"
            )

    def prepare(self, plan: Plan) -> None:
        """Carry out `plan`: create the folder and check it is writable, delete what a fresh start clears,
        set damaged checkpoints aside and remove half-written ones. The first write of a command."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise RunFolderNotWritable(
                err.errno, f"cannot write to run folder {self.path}: {err.strerror or err}"
            ) from err
        for name in plan.clear:
            target = self.path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
        self.set_aside(plan)
        for checkpoint, _ in plan.damaged:
            aside = checkpoint.with_name(DAMAGED_PREFIX + checkpoint.name)
            shutil.rmtree(aside, ignore_errors=True)
            checkpoint.rename(aside)
            log.warning("damaged checkpoint set aside as %s", aside)
        root = self.path / CHECKPOINTS_DIR
        if root.is_dir():
            for half_written in root.glob(f".tmp_{STEP_PREFIX}*"):
                shutil.rmtree(half_written, ignore_errors=True)

    def write_config(self, config: Config) -> None:
        """`config.yaml` (written whole, then renamed into place); on a resume, logs what changed."""
        path = self.path / CONFIG_FILE
        before = _saved_config(self.path)
        if before is not None:
            after = _flatten(config.model_dump(mode="json"))
            changed = [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in after if before.get(k) != after[k]]
            if changed:
                log.info("config changed since this run was started: %s", "; ".join(changed))
        tmp = path.with_name(f".{CONFIG_FILE}.tmp")
        dump_config(config, tmp)
        os.replace(tmp, path)


def fixed_settings(config: Config) -> dict[str, Any]:
    """The `RESUME_FIXED_KEYS` of `config`: what a checkpoint records of the settings that shape it."""
    flat = _flatten(config.model_dump(mode="json"))
    return {key: flat.get(key) for key in RESUME_FIXED_KEYS}


def check_resumable(run_dir: Path, config: Config, checkpoint: Path | None = None) -> None:
    """`ConfigError` naming the key when `config` changes a setting the run's checkpoints depend on
    (`RESUME_FIXED_KEYS`): against `checkpoint`'s own record (`fixed_settings` in its state.json) and, for keys
    it does not record (checkpoints written before it did), the run's `config.yaml`."""
    before = _saved_config(run_dir) or {}
    if checkpoint is not None:
        try:
            recorded = json.loads((Path(checkpoint) / "state.json").read_text()).get("fixed_settings") or {}
        except (OSError, ValueError, AttributeError):
            recorded = {}  # the plan verified it; a state.json without a record is an older checkpoint's
        before = {**before, **recorded}
    after = _flatten(config.model_dump(mode="json"))
    for key in RESUME_FIXED_KEYS:
        if key in before and before[key] != after.get(key):
            raise ConfigError(
                f"--resume: {key} was {before[key]!r} in this run and is {after.get(key)!r} now; it cannot change "
                f"on a resume (the checkpoints were trained with it): set {key}={before[key]!r}, or start again "
                "with --overwrite"
            )


@contextmanager
def claim_output(out: Path, command: str) -> Iterator[None]:
    """Hold the lock of an output folder that is not a run folder (an export's OUT) for the block: `.OUT.lock`
    beside it (OUT itself is replaced whole), removed at the end. `RunFolderInUse` naming the holder when another
    process has it."""
    out = Path(out)
    lock = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderNotWritable(err.errno, f"cannot write to {out.parent}: {err.strerror}") from err
    fd = _take_lock(lock, command, lambda holder: RunFolderInUse(
        f"{out} is being written by {holder}: wait for it to end, or choose another folder"))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # while still held: a waiter that opened it takes the next one (`_take_lock`)
        os.close(fd)


def _take_lock(lock: Path, command: str, refusal) -> int:
    """Take the `flock` on `lock` (created if needed) without waiting and write this process's pid and command into
    it; -> its descriptor (closing it releases the lock). `refusal(holder)` is raised when another process holds
    it. A lock file removed by its last holder while it was taken is taken again under its new inode."""
    while True:
        try:  # the folder too: its last holder may have removed it, empty, in between
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunFolderNotWritable(err.errno, f"cannot write to {lock.parent}: {err.strerror}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise refusal(_holder(lock)) from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    holder = {"pid": os.getpid(), "command": command, "argv": sys.argv, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(holder).encode())
    return fd


def _holder(lock: Path) -> str:
    try:
        info: dict[str, Any] = json.loads(lock.read_text())
        return f"pid {info['pid']} ({info['command']}, since {info['since']})"
    except (OSError, ValueError, KeyError):
        return "another process"


def _saved_config(run_dir: Path) -> dict | None:
    """The run's `config.yaml` flattened to `section.key` names; None when it is missing or unreadable."""
    try:
        return _flatten(yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text()) or {})
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
