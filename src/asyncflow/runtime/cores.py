"""Idle-core lending between the processes that share one machine's CPU cores.

Owns `CoreLending`: every role (the trainer, each local rollout replica) announces whether it is
computing in a one-byte flag of a small memory-mapped file; a *borrowing* role runs torch on the
cores that the computing roles do not hold, and never on fewer than its own share:

    threads(role) = max(share(role), cores - sum(share(other) for other that is computing))

Only the trainer borrows: its backward passes run ~1.6x faster on two cores than on one, while the
decode steps of small models on CPU do not gain from a second thread once Ray's processes share
the cores (measured: 0.53 s on one thread vs 0.62 s on two for a step's 256 samples). On the 2-core default the trainer
so gets both cores while the replica waits for weights: `stream`'s training after the iteration's
generation ended, the `async` trainer when the replica is held back by the staleness bound.

torch's thread count belongs to the thread that computes (OpenMP), so a borrower sets its own at
its check points (`busy()`, `check()`). A change on the other side is seen at the next check point;
until then the machine may briefly run more threads than cores. The flags file lives in /dev/shm;
its creator unlinks it.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass

import torch

from asyncflow.weights.segments import segment_path


@dataclass(frozen=True)
class CoreLendingSpec:
    """Picklable description of the flags file: each role's name and share, and the machine's cores."""

    path: str
    shares: dict[str, int]
    total: int

    def open(self, role: str, *, borrow: bool = False) -> CoreLending:
        return CoreLending(self, role, borrow=borrow)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create_core_lending(shares: dict[str, int], total: int) -> tuple[CoreLendingSpec, weakref.finalize]:
    """Create the flags file (every role idle). Returns its spec and a finalizer that unlinks it."""
    if any(share < 1 for share in shares.values()):
        raise ValueError(f"every role needs a share of at least one core, got {shares}")
    path = segment_path("cores")
    with open(path, "wb") as f:
        f.write(bytes(len(shares)))
    spec = CoreLendingSpec(path, dict(shares), total)
    return spec, weakref.finalize(spec, _unlink_quietly, path)


class CoreLending:
    """One role's flag; a borrower also sets this thread's torch thread count (see the module docstring)."""

    def __init__(self, spec: CoreLendingSpec, role: str, *, borrow: bool = False):
        if role not in spec.shares:
            raise KeyError(f"core lending: unknown role {role!r}; roles are {sorted(spec.shares)}")
        self.spec = spec
        self.roles = list(spec.shares)
        self.index = self.roles.index(role)
        self.borrow = borrow
        with open(spec.path, "r+b") as f:
            self._flags = mmap.mmap(f.fileno(), len(self.roles))
        self.threads = torch.get_num_threads()

    def threads_for(self, flags: bytes) -> int:
        """This role's thread count given every role's busy flag."""
        held = sum(self.spec.shares[r] for i, r in enumerate(self.roles) if i != self.index and flags[i])
        return max(self.spec.shares[self.roles[self.index]], self.spec.total - held)

    def check(self) -> int:
        """A borrower: set torch's thread count for the others' current flags. Returns the thread count."""
        if not self.borrow:
            return self.threads
        threads = self.threads_for(self._flags[:])
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def busy(self) -> None:
        self._flags[self.index] = 1
        self.check()

    def idle(self) -> None:
        self._flags[self.index] = 0

    def close(self) -> None:
        self.idle()
        self._flags.close()
