"""Several engine replicas behind one server: which replica serves each request.

Owns: `ReplicaRouter`, which the API uses like one `EngineService` (`submit`, `healthy`, `streams_tokens`,
`engine_failures`, `last_error`, `update_weights`, `close`) over `EngineService` replicas.

Invariants:
- A request of a session (an episode's id, or the request's `user` field) goes to the replica the session is
  pinned to while that replica is healthy, not draining and below `max_in_flight`; otherwise to the healthy,
  not draining replica with the fewest requests in flight (ties: the fewest served so far, then the lowest index),
  and the session is pinned there. So an episode's turns find the prefix they share on the replica that computed it, and a busy or lost
  replica does not hold its sessions hostage. A request without a session goes to the least-loaded replica.
- A draining replica (one being updated) gets no new request; those it has in flight finish on it.
  `update_weights` updates the replicas one at a time, so the others keep serving.
- Pins are bounded: the `max_sessions` most recently used are kept.
- No replica can take a request: `EngineServiceError` (the API answers 503).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch

from asyncflow.engines.base import Completion, SamplingParams, TokenCallback
from asyncflow.engines.service import EngineService, EngineServiceError


class ReplicaRouter:
    """See the module docstring. `replicas`: started services, each over its own engine."""

    def __init__(self, replicas: Sequence[EngineService], *, max_in_flight: int = 64, max_sessions: int = 10_000):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.max_in_flight, self.max_sessions = max_in_flight, max_sessions
        self.in_flight = [0] * len(self.replicas)
        self.served = [0] * len(self.replicas)  # requests each replica was given
        self.affinity_hits = 0  # requests that went to their session's replica
        self.affinity_moves = 0  # sessions moved to another replica (theirs was busy, draining or unhealthy)
        self._draining: set[int] = set()
        self._pins: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ EngineService's interface
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               on_tokens: TokenCallback | None = None, session: str | None = None) -> Future[Completion]:
        with self._lock:
            index = self._pick(session)
            self.in_flight[index] += 1
            self.served[index] += 1
        try:
            future = self.replicas[index].submit(prompt_ids, params, on_tokens=on_tokens)
        except BaseException:
            self._finished(index)
            raise
        future.add_done_callback(lambda _: self._finished(index))
        return future

    @property
    def healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas)

    @property
    def streams_tokens(self) -> bool:
        return all(replica.streams_tokens for replica in self.replicas)

    @property
    def engine_failures(self) -> int:
        return sum(replica.engine_failures for replica in self.replicas)

    @property
    def last_error(self) -> str | None:
        return next((r.last_error for r in self.replicas if r.last_error is not None), None)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, timeout: float) -> None:
        """Each replica in turn: drained, updated once its requests finished, serving again."""
        for index, replica in enumerate(self.replicas):
            self.drain(index)
            try:
                replica.update_weights(state_dict, version, timeout=timeout)
            finally:
                self.resume(index)

    def close(self, timeout: float = 30.0) -> None:
        for replica in self.replicas:
            replica.close(timeout)

    # ------------------------------------------------------------------ routing
    def drain(self, index: int) -> None:
        """Send no new request to replica `index` until `resume(index)`."""
        with self._lock:
            self._draining.add(index)

    def resume(self, index: int) -> None:
        with self._lock:
            self._draining.discard(index)

    def _available(self, index: int, *, below_cap: bool) -> bool:
        return (index not in self._draining and self.replicas[index].healthy
                and (not below_cap or self.in_flight[index] < self.max_in_flight))

    def _pick(self, session: str | None) -> int:
        pinned = self._pins.get(session) if session is not None else None
        if pinned is not None and self._available(pinned, below_cap=True):
            self._pins.move_to_end(session)  # type: ignore[arg-type]
            self.affinity_hits += 1
            return pinned
        candidates = [i for i in range(len(self.replicas)) if self._available(i, below_cap=False)]
        if not candidates:
            raise EngineServiceError("no replica can take a request: every one is draining or stopped")
        index = min(candidates, key=lambda i: (self.in_flight[i], self.served[i], i))
        if session is not None:
            self.affinity_moves += pinned is not None
            self._pins[session] = index
            self._pins.move_to_end(session)
            while len(self._pins) > self.max_sessions:
                self._pins.popitem(last=False)
        return index

    def _finished(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] -= 1
