"""Fault-tolerant, parallel scoring of completions with reward functions, with bounded resources.

Owns: `RewardRunner`, `RewardResult` and `RewardStuckError`; the thread pool of the default
`isolation="thread"` (the process pool of `isolation="process"` is `processes.py`).
Invariants:
- `score` returns one finite float per sample. A sample whose reward function raises, returns
  something that is not a finite number (`contract.reward_value`: None, "1.0", NaN, inf, ...) or runs
  past `timeout_s` scores 0.0 and is counted (`n_errors` / `n_timeouts`); the first failure of each
  kind per function is logged with the function's name and the offending value or exception.
- `timeout_s` counts from the moment a sample starts running, not from submission. At most
  `max_workers` samples run at once.
- Resources stay bounded, whatever the reward function does:
  - `thread`: `max_workers` long-lived daemon threads take samples one at a time from the batch
    (no per-sample thread or queue round trip: the cheap built-in verifiers stay cheap). A Python
    thread cannot be killed: a call past its timeout is ABANDONED (its result discarded), its
    thread is counted as stuck and a new worker takes its place. A stuck thread that returns
    exits. When more than `max_stuck_calls` threads are stuck at once, `score` raises
    `RewardStuckError` instead of starting another thread, so the process never holds more than
    `max_workers + max_stuck_calls` reward threads, however many samples time out.
  - `process`: `max_workers` worker processes; a call past its timeout is ended by killing its
    process, which is replaced; nothing leaks and nothing is stuck. Costs a process start per
    kill and needs picklable (module-level) reward functions; see `processes.py` for its cost.
- `score` never raises because of one sample; it raises `RewardStuckError` (thread isolation, too
  many hung calls) or, with process isolation, `RewardSpecError` when the function cannot be loaded
  in a worker process at all. Whether a run survives a reward that fails on most samples is decided
  by the caller, with `health.RewardHealth`.
- math-verify's own timeouts use signal.alarm, which works only on the main thread; the
  built-in `math_verify` verifier disables them and relies on this runner's timeout.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncflow.rewards.contract import Failure, RewardFn, call_reward
from asyncflow.rewards.processes import ProcessPool
from asyncflow.rewards.registry import CompositeReward, check_picklable, check_reward_specs, display_name

logger = logging.getLogger(__name__)


class RewardStuckError(RuntimeError):
    """More reward calls are hung past their timeout than `max_stuck_calls` threads may hold."""


@dataclass
class RewardResult:
    rewards: list[float]  # one per sample, 0.0 for failed samples
    n_errors: int  # samples whose reward function raised or returned something that is not a finite number
    n_timeouts: int  # samples whose reward function ran past timeout_s
    failures: list[tuple[int, Failure]] = field(default_factory=list)  # (sample index, why), by index


class _Batch:
    """The samples of one `score` call; pool threads claim them one at a time."""

    def __init__(self, fn: RewardFn, name: str, completions: list[str], ground_truths: list[str],
                 metadatas: list[dict | None]):
        self.fn, self.name = fn, name
        self.completions, self.ground_truths, self.metadatas = completions, ground_truths, metadatas
        self.n = len(completions)
        self._next = itertools.count().__next__  # atomic under the GIL
        self.cancelled = False
        self.lock = threading.Lock()
        self.rewards = [0.0] * self.n
        self.settled = bytearray(self.n)
        self.failures: list[tuple[int, Failure]] = []
        self.remaining = self.n
        self.done = threading.Event()
        if self.n == 0:
            self.done.set()

    def claim(self) -> int:
        """The next sample to score, or -1 when there is none."""
        i = self._next()
        return i if i < self.n and not self.cancelled else -1

    def settle(self, i: int, value: float, failure: Failure | None) -> bool:
        """Record sample i's outcome; False if it was already settled (timed out while running)."""
        with self.lock:
            if self.settled[i]:
                return False
            self._settle_locked(i, value, failure)
            return True

    def _settle_locked(self, i: int, value: float, failure: Failure | None) -> None:
        self.settled[i] = 1
        if failure is None:
            self.rewards[i] = value
        else:
            self.failures.append((i, failure))
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()


class _Slot:
    """A live pool thread; `running` is (batch, sample index, monotonic start) while it is in a call."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running: tuple[_Batch, int, float] | None = None


class _ThreadPool:
    """`max_workers` threads; hung calls are abandoned and counted; see the module invariants."""

    def __init__(self, max_workers: int, timeout_s: float, max_stuck_calls: int):
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.max_stuck_calls = max_stuck_calls
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._slots: set[_Slot] = set()  # live threads not abandoned; changed under _lock
        self.stuck = 0  # abandoned threads still inside a reward call

    def _start_worker(self) -> None:
        slot = _Slot()
        self._slots.add(slot)
        threading.Thread(target=self._loop, args=(slot,), name="reward-worker", daemon=True).start()

    def _loop(self, slot: _Slot) -> None:
        while True:
            batch = self._jobs.get()
            if batch is None:  # close()
                return
            fn, name = batch.fn, batch.name
            completions, ground_truths, metadatas = batch.completions, batch.ground_truths, batch.metadatas
            while (i := batch.claim()) >= 0:
                slot.running = (batch, i, time.monotonic())
                value, failure = call_reward(fn, name, completions[i], ground_truths[i], metadatas[i])
                slot.running = None
                if not batch.settle(i, value, failure):  # timed out meanwhile: this thread was abandoned
                    with self._lock:
                        self.stuck -= 1
                    return

    def run(self, batch: _Batch) -> None:
        """Score every sample of `batch` (results land in the batch); see the module invariants."""
        with self._lock:  # `score` may be called from several threads at once (training and evaluation)
            while len(self._slots) < self.max_workers:
                self._start_worker()
        for _ in range(min(batch.n, self.max_workers)):
            self._jobs.put(batch)
        wait = self.timeout_s
        while not batch.done.wait(wait):
            now = time.monotonic()
            next_deadline = now + self.timeout_s
            for slot in list(self._slots):
                running = slot.running
                if running is None or running[0] is not batch:
                    continue
                _, i, start = running
                if now - start >= self.timeout_s:
                    self._time_out(batch, slot, i)
                else:
                    next_deadline = min(next_deadline, start + self.timeout_s)
            wait = max(next_deadline - time.monotonic(), 0.001)

    def _time_out(self, batch: _Batch, slot: _Slot, i: int) -> None:
        with batch.lock:
            if batch.settled[i]:  # it finished just now
                return
            batch._settle_locked(i, 0.0, Failure(batch.name, "timeout", f"ran past its {self.timeout_s:g} s timeout"))
            with self._lock:  # before the thread can see it lost: it decrements when its call returns
                self.stuck += 1
                stuck = self.stuck
        with self._lock:
            self._slots.discard(slot)
            if stuck <= self.max_stuck_calls:
                self._start_worker()
                self._jobs.put(batch)  # the new thread takes the stuck one's place in this batch
                return
        batch.cancelled = True
        raise RewardStuckError(
            f"{stuck} calls of reward {batch.name!r} are still running past their {self.timeout_s:g} s timeout "
            f"(reward.timeout_s), more than reward.max_stuck_calls={self.max_stuck_calls}: a Python thread "
            "cannot be stopped, so scoring stops here instead of leaking a thread per sample. Fix the hang in "
            "the reward function, raise reward.timeout_s, or set reward.isolation=process (hung calls are then "
            "killed)"
        )

    def close(self) -> None:
        with self._lock:
            for _ in range(len(self._slots)):
                self._jobs.put(None)
            self._slots.clear()


class RewardRunner:
    """Scores batches of completions in parallel with per-sample timeouts and bounded resources.

    fns: one reward (callable, registered name or "module:function" spec) or a sequence of
    rewards and/or (reward, weight) pairs, combined as a weighted sum (weight 1 if not given).
    isolation: "thread" (default, cheapest) or "process" (hung calls are killed); see the module
    docstring. max_stuck_calls: thread isolation only, hung threads tolerated at once.
    """

    def __init__(self, fns: str | RewardFn | Sequence, timeout_s: float = 10.0, max_workers: int = 4, *,
                 isolation: str = "thread", max_stuck_calls: int = 8):
        if isinstance(fns, str) or callable(fns):
            fns = [fns]
        if not fns:
            raise ValueError("RewardRunner needs at least one reward function")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        if not (isinstance(max_stuck_calls, int) and max_stuck_calls >= 0):
            raise ValueError(f"max_stuck_calls must be an integer >= 0, got {max_stuck_calls!r}")
        pairs = [item if isinstance(item, tuple) else (item, 1.0) for item in fns]
        resolved = check_reward_specs([spec for spec, _ in pairs], [w for _, w in pairs], isolation=isolation)
        if len(resolved) == 1 and resolved[0][1] == 1.0:
            self.fn: RewardFn = resolved[0][0]
            self.name = display_name(pairs[0][0])
        else:
            self.fn = CompositeReward(resolved)
            self.name = " + ".join(f"{w:g} * {display_name(spec)}" for spec, w in pairs)
        self.timeout_s = float(timeout_s)
        self.isolation = isolation
        self.last_failure: str | None = None  # the latest failing batch's first failure, in words
        self._warned: set[tuple[str, str]] = set()
        self._pool: ProcessPool | _ThreadPool
        if isolation == "process":
            check_picklable(self.fn, self.name)
            self._pool = ProcessPool(self.fn, self.name, max_workers, self.timeout_s)
        else:
            self._pool = _ThreadPool(max_workers, self.timeout_s, max_stuck_calls)

    @property
    def stuck_calls(self) -> int:
        """Thread isolation: abandoned threads still inside a reward call (0 with process isolation)."""
        return getattr(self._pool, "stuck", 0)

    def close(self) -> None:
        """Stop the worker threads or processes (they are daemons: closing is optional)."""
        self._pool.close()

    def _log_failure(self, i: int, failure: Failure) -> None:
        key = (failure.fn_name, failure.kind)
        if key in self._warned:
            return
        self._warned.add(key)
        counter = "reward/timeouts" if failure.kind == "timeout" else "reward/errors"
        logger.warning("reward function %r failed on sample %d: it %s (further %s failures of %r are counted in "
                       "%s, not logged)", failure.fn_name, i, failure.detail, failure.kind, failure.fn_name, counter)

    def score(
        self, completions: list[str], ground_truths: list[str], metadatas: list[dict] | None = None
    ) -> RewardResult:
        """Reward for each (completion, ground_truth, metadata) triple; see the module invariants."""
        n = len(completions)
        given: list[dict | None] = [None] * n if metadatas is None else list(metadatas)
        if len(ground_truths) != n or len(given) != n:
            raise ValueError(
                f"score needs equal lengths: {n} completions, {len(ground_truths)} ground truths, "
                f"{len(given)} metadatas"
            )
        if isinstance(self._pool, ProcessPool):
            rewards, failures = self._pool.score(completions, ground_truths, given)
        else:
            batch = _Batch(self.fn, self.name, completions, ground_truths, given)
            self._pool.run(batch)
            rewards, failures = batch.rewards, batch.failures
        failures.sort(key=lambda item: item[0])
        n_timeouts = sum(failure.kind == "timeout" for _, failure in failures)
        for i, failure in failures:
            self._log_failure(i, failure)
        if failures:
            i, failure = failures[0]
            self.last_failure = f"reward function {failure.fn_name!r} {failure.detail} (sample {i})"
        return RewardResult(rewards=rewards, n_errors=len(failures) - n_timeouts, n_timeouts=n_timeouts,
                            failures=failures)
