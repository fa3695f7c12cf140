"""Peak memory of a process, as a run reports it: `peak_rss_mb` (this process's peak resident set size since it
started) and `memory_metrics` (the same as a metric named after the process's role).

Each kind of worker reports its own under `memory/peak_rss_mb/ROLE` (`driver`, `rank_R` for a training rank,
`rollout_R` for a rollout replica), so a benchmark reads the driver's, each rank's and each replica's peak from a
run's metrics.jsonl.

Invariant: a peak never decreases over a process's life (the kernel's high-water mark); a process made by fork
starts from its parent's resident size at the fork.
"""

from __future__ import annotations

import resource
import sys

METRIC_PREFIX = "memory/peak_rss_mb/"


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (`getrusage`: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def memory_metrics(role: str) -> dict[str, float]:
    """`{"memory/peak_rss_mb/<role>": peak_rss_mb()}`."""
    return {METRIC_PREFIX + role: peak_rss_mb()}
