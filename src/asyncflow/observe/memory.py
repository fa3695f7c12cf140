"""Peak memory of a process, as a run reports it: `peak_rss_mb` (this process's peak resident set size),
`memory_metrics` (the same as a metric named after the process's role) and `reset_peak_rss` (start a new peak,
for measuring one phase); `return_freed_blocks`, which makes freed tensors of a MiB or more leave the resident size.

Each kind of worker reports its own under `memory/peak_rss_mb/ROLE` (`driver`, `rank_R` for a training rank,
`rollout_R` for a rollout replica, `rollout_R_engine` for the largest process its engine started: vLLM's worker),
so a benchmark reads the driver's, each rank's and each replica's peak from a
run's metrics.jsonl.

Invariants: the peak is the kernel's high-water mark (`VmHWM` of /proc/self/status; `getrusage` where there is
no /proc), so it never decreases except by `reset_peak_rss`; a forked process starts from its parent's resident
size at the fork.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from pathlib import Path

METRIC_PREFIX = "memory/peak_rss_mb/"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20
_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def rss_mb() -> float | None:
    """This process's resident set size now in MiB (None without /proc)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib / 1024


def reset_peak_rss() -> bool:
    """Make the peak the current resident size (Linux: /proc/self/clear_refs), so `peak_rss_mb` then measures what
    follows; False where that is not possible (the peak then covers the process's whole life)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def descendants_peak_rss_mb(pid: int | None = None) -> float:
    """The largest peak resident size (MiB) among the live processes descended from `pid` (default: this one), e.g.
    the processes an inference engine started (vLLM's engine core and workers, where its weights and KV cache live);
    0 without /proc or without such processes."""
    parents: dict[int, int] = {}
    peaks: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            parents[int(status.parent.name)] = int(fields["PPid"])
            peaks[int(status.parent.name)] = int(fields.get("VmHWM", "0 kB").split()[0])
        except (OSError, ValueError, KeyError):
            continue  # a process that ended meanwhile, or a kernel thread
    mine, found = set(), {os.getpid() if pid is None else pid}
    while found:
        mine |= found
        found = {child for child, parent in parents.items() if parent in found} - mine
    mine.discard(os.getpid() if pid is None else pid)
    return max((peaks.get(p, 0) for p in mine), default=0) / 1024


def memory_metrics(role: str) -> dict[str, float]:
    """`{"memory/peak_rss_mb/<role>": peak_rss_mb()}`."""
    return {METRIC_PREFIX + role: peak_rss_mb()}


def return_freed_blocks(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of `threshold_bytes` or more with a mapping of its own, unmapped when it is freed
    (glibc's `mallopt(M_MMAP_THRESHOLD)`). By default glibc raises that threshold, up to 32 MiB, each time such a
    block is freed, so tensors of a few MiB (a layer's all-gathered parameters or gradients) then come from the heap,
    where freed memory stays resident: a 0.5B-parameter FSDP2 rank grew so by 1.3 to 1.8 GiB in one step
    (docs/rehearsal.md). Setting the threshold also stops that raising. -> False where nothing was set: another C
    library than glibc, or `MALLOC_MMAP_THRESHOLD_` already in the environment (the user's choice is kept)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):  # musl and others: no libc.so.6 or no mallopt
        return False
