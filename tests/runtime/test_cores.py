"""Idle-core lending: the thread-count formula, flags seen across processes, and the trainer of a
separated `stream` run training on both cores once the replica waits for weights."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from asyncflow.runtime.cores import create_core_lending


@pytest.mark.parametrize(("shares", "total", "busy", "expected"), [
    ({"trainer": 1, "rollout_0": 1}, 2, [], 2),  # the replica waits: the trainer takes its core
    ({"trainer": 1, "rollout_0": 1}, 2, ["rollout_0"], 1),
    ({"trainer": 2, "rollout_0": 2}, 4, [], 4),
    ({"trainer": 1, "rollout_0": 1, "rollout_1": 1}, 2, ["rollout_1"], 1),  # more shares than cores
    ({"trainer": 1, "rollout_0": 1, "rollout_1": 1}, 2, ["rollout_0", "rollout_1"], 1),  # never below its share
    ({"trainer": 1, "rollout_0": 1, "rollout_1": 1}, 4, ["rollout_0"], 3),
])  # fmt: skip
def test_borrower_threads_follow_the_formula(shares, total, busy, expected):
    spec, unlink = create_core_lending(shares, total)
    try:
        trainer = spec.open("trainer", borrow=True)
        flags = bytes(1 if role in busy or role == "trainer" else 0 for role in shares)
        assert trainer.threads_for(flags) == expected
    finally:
        unlink()
    assert not os.path.exists(spec.path), "the creator's finalizer unlinks the flags file"


def _replica(spec, go, done):
    replica = spec.open("rollout_0")
    replica.busy()
    done.set()
    go.wait(30)
    replica.idle()
    done.set()
    replica.close()


@pytest.mark.slow
def test_flags_cross_processes_and_only_borrowers_change_threads(one_torch_thread):
    spec, unlink = create_core_lending({"trainer": 1, "rollout_0": 1}, 2)
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_replica, args=(spec, go, done))
    try:
        lender = spec.open("rollout_0")  # a second, non-borrowing view never touches torch's threads
        lender.check()
        assert torch.get_num_threads() == 1
        trainer = spec.open("trainer", borrow=True)
        trainer.busy()
        assert trainer.threads == torch.get_num_threads() == 2, "the replica is idle: both cores"
        child.start()
        assert done.wait(60)
        done.clear()
        assert trainer.check() == torch.get_num_threads() == 1, "the replica in another process computes"
        go.set()
        assert done.wait(60)
        assert trainer.check() == 2
        with pytest.raises(KeyError, match="unknown role 'critic'"):
            spec.open("critic")
    finally:
        child.join(30)
        unlink()
    assert child.exitcode == 0
