"""Named shared-memory segments (files in /dev/shm) that a crash leaves behind only until the next start.

Owns: the naming of asyncflow's segments and `sweep_dead_segments`. A segment's name says who owns it:

    asyncflow-<kind>-<pid>.<start>.<pidns>-<random>[.tmp]

`<start>` is the owner's start time (clock ticks since boot, field 22 of /proc/<pid>/stat) and `<pidns>`
the inode of its pid namespace, so a recycled pid, or a pid of another container sharing /dev/shm, is
told apart from the owner (both are 0 where /proc is missing). An owner unlinks its segments when it
closes them or exits; a process killed by SIGKILL or the OOM killer runs no finalizer, so every
process that creates a segment first sweeps the segments of dead owners (the weight transport's
2-slot file is twice the model's size).

Invariants:
- A segment is removed only when its owner is dead: no process has its pid, or the process that has
  it started at another time. Segments of another pid namespace, of live owners, of other users (not
  removable) and files not named by this scheme are left alone.
- Names of the older form `asyncflow-<kind>-<pid>-<random>` (no start time) are swept once no process
  has their pid.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import uuid

log = logging.getLogger(__name__)

PREFIX = "asyncflow-"
_NAME = re.compile(
    r"^asyncflow-(?P<kind>[a-z]+)-(?P<pid>\d+)(?:\.(?P<start>\d+)\.(?P<ns>\d+))?-[0-9a-f]+(?:\.tmp)?$"
)


def shared_memory_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _start_time(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot; None if unknown (no /proc, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields after the last ')' are plain
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _pid_namespace() -> int:
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return 0
    return int(link[link.index("[") + 1 : -1])


def owner_tag() -> str:
    """`<pid>.<start>.<pidns>` of this process."""
    pid = os.getpid()
    return f"{pid}.{_start_time(pid) or 0}.{_pid_namespace()}"


def segment_path(kind: str) -> str:
    """A fresh segment path of this process, after sweeping the segments whose owner died."""
    if not kind.isalpha() or not kind.islower():
        raise ValueError(f"segment kind must be lowercase letters, got {kind!r}")
    sweep_dead_segments()
    return os.path.join(shared_memory_dir(), f"{PREFIX}{kind}-{owner_tag()}-{uuid.uuid4().hex[:12]}")


def owner_is_dead(name: str) -> bool:
    """Whether the owner named in segment file name `name` is known to be dead (False for other names)."""
    match = _NAME.match(name)
    if match is None:
        return False
    pid = int(match["pid"])
    if match["ns"] is not None and int(match["ns"]) != _pid_namespace():
        return False  # another pid namespace: its pids mean nothing here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, owned by another user
    if match["start"] is None or int(match["start"]) == 0:
        return False
    started = _start_time(pid)
    return started is not None and started != int(match["start"])  # the pid was given to another process


def sweep_dead_segments(directory: str | None = None) -> list[str]:
    """Remove the asyncflow segments in `directory` (default: /dev/shm) whose owner is dead; returns their paths."""
    directory = directory or shared_memory_dir()
    removed, freed = [], 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return []
    for name in names:
        if not owner_is_dead(name):
            continue
        path = os.path.join(directory, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:  # gone already (another sweeper), or not ours to remove
            continue
        removed.append(path)
        freed += size
    if removed:
        log.warning(
            "removed %d shared-memory segment(s) (%.1f MB) left in %s by processes that died without cleaning up",
            len(removed), freed / 2**20, directory,
        )
    return removed
