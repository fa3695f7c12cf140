"""The weight-sync contract: `WeightPublisher` / `WeightReceiver` protocols and their errors.

Owns: the protocols every transport implements, `WeightSyncError` / `WeightSyncTimeout`,
`PollingReceiver` (`wait_for` on top of `poll`) and the version-order check. The invariants every
transport keeps are listed in the package docstring (`asyncflow.weights`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Protocol

from asyncflow.weights.buckets import Weights

Received = tuple[int, Weights]
"""(version, its weights): a state dict, or (`torch_distributed`) a `BucketStream` received as it is read."""


class WeightSyncError(RuntimeError):
    """The transport is closed or broken (publisher gone, a failed send, a dead peer)."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A blocking weight-sync call ran out of time."""

    def __init__(self, transport: str, version: int | None, waited_for: str, timeout_s: float):
        self.transport, self.version, self.waited_for, self.timeout_s = transport, version, waited_for, timeout_s
        of_version = "" if version is None else f" (version {version})"
        super().__init__(
            f"{transport} weight sync timed out after {timeout_s:.3g}s waiting for {waited_for}{of_version}"
        )


class WeightReceiver(Protocol):
    def poll(self, have_version: int) -> Received | None:
        """The newest complete version if it is newer than `have_version`, else None; never waits
        for a version to appear."""
        ...

    def wait_for(self, min_version: int, timeout: float) -> Received:
        """The newest complete version once it is >= `min_version`; `WeightSyncTimeout` otherwise."""
        ...

    def close(self) -> None: ...


class ReceiverSpec(Protocol):
    def open(self) -> WeightReceiver: ...


class WeightPublisher(Protocol):
    transport: str

    @property
    def receiver_spec(self) -> ReceiverSpec:
        """What receivers open (a picklable spec of this transport); read-only, so a publisher may narrow it."""
        ...

    def publish(self, state_dict: Weights, version: int) -> None:
        """Snapshot `state_dict` (a state dict, or a `BucketStream` copied in bucket by bucket) as `version` and
        make it visible to receivers, without waiting for them."""
        ...

    def wait_published(self, timeout: float) -> None:
        """Block until the last published version is visible to receivers."""
        ...

    def close(self) -> None: ...


class PollingReceiver(ABC):
    """`wait_for` on top of `poll`: polls with a short, growing sleep until the deadline."""

    transport = ""
    collective = False
    """True where a publish is a collective every receiver must take part in (until the publisher closes)."""
    received_bytes = 0
    """Bytes of the last version `poll` returned that reached this receiver (its payload, or a delta's blob)."""
    received_kind = "full"
    """How the last version came: "full" or "delta" (`asyncflow.weights.delta`)."""

    @abstractmethod
    def poll(self, have_version: int) -> Received | None: ...

    def wait_for(self, min_version: int, timeout: float) -> Received:
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            received = self.poll(min_version - 1)
            if received is not None:
                return received
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(self.transport, min_version, f"a published version >= {min_version}", timeout)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.01)


def check_increasing(transport: str, last: int | None, version: int) -> None:
    if last is not None and version <= last:
        raise ValueError(f"{transport}: version {version} is not newer than the last published {last}")
