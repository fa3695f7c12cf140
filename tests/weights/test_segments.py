"""Shared-memory segments carry their owner and are swept once it is dead (issue 15, item 3): a process
killed with SIGKILL leaves its weight file and core-lending flags in /dev/shm, and the next process that
creates a segment removes them, but never the segments of a live process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from asyncflow.runtime.cores import create_core_lending
from asyncflow.weights import make_weight_sync
from asyncflow.weights.segments import owner_is_dead, owner_tag, shared_memory_dir, sweep_dead_segments

SRC = Path(__file__).resolve().parents[2] / "src"
OWNER = textwrap.dedent("""
    import sys, time, torch
    from asyncflow.runtime.cores import create_core_lending
    from asyncflow.weights import make_weight_sync
    publisher = make_weight_sync("shared_memory")
    publisher.publish({"w": torch.zeros(1000)}, 0)
    spec, _ = create_core_lending({"trainer": 1, "rollout_0": 1}, 2)
    print(publisher.path, spec.path, flush=True)
    time.sleep(120)
""")


def start_owner() -> tuple[subprocess.Popen, list[str]]:
    """A process holding a weight file and a core-lending file; returns it and the two paths."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    paths = proc.stdout.readline().split()
    assert len(paths) == 2, "the owner process failed to create its segments"
    return proc, paths


@pytest.mark.slow
def test_segments_of_a_killed_process_are_removed_when_the_next_one_is_created():
    killed, dead_paths = start_owner()
    alive, live_paths = start_owner()
    try:
        assert all(os.path.exists(p) for p in dead_paths + live_paths)
        assert all(f"-{killed.pid}." in os.path.basename(p) for p in dead_paths), "the name carries the owner's pid"
        killed.send_signal(signal.SIGKILL)  # no finalizer runs
        killed.wait(30)
        assert all(os.path.exists(p) for p in dead_paths), "SIGKILL leaves the segments behind"

        publisher = make_weight_sync("shared_memory")  # the next start
        publisher.publish({"w": torch.ones(10)}, 0)
        spec, unlink = create_core_lending({"trainer": 1}, 1)
        assert not any(os.path.exists(p) for p in dead_paths), "the dead owner's segments are removed"
        assert all(os.path.exists(p) for p in live_paths), "a live owner's segments are kept"
        publisher.close()
        unlink()
        assert not os.path.exists(publisher.path) and not os.path.exists(spec.path)
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(30)
    sweep_dead_segments()
    assert not any(os.path.exists(p) for p in live_paths)


def test_owner_is_dead_tells_a_recycled_pid_and_other_namespaces_apart():
    pid, start, ns = owner_tag().split(".")
    assert owner_is_dead(f"asyncflow-weights-{pid}.{start}.{ns}-0123456789ab") is False  # this very process
    assert owner_is_dead(f"asyncflow-cores-{pid}.{int(start) + 1}.{ns}-0123456789ab.tmp") is True  # pid reused
    assert owner_is_dead(f"asyncflow-weights-{pid}.{int(start) + 1}.{int(ns) + 1}-0123456789ab") is False
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead = int(gone.stdout)
    assert owner_is_dead(f"asyncflow-weights-{dead}-0123456789ab") is True  # the older name form
    assert owner_is_dead(f"asyncflow-weights-{pid}-0123456789ab") is False
    assert owner_is_dead(f"other-weights-{dead}-0123456789ab") is False
    assert shared_memory_dir()
