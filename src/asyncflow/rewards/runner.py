"""Fault-tolerant, parallel scoring of completions with reward functions.

Owns: `RewardRunner` and `RewardResult`.
Invariants:
- `score` always returns one finite float per sample and never raises because of a reward
  function: a function that raises, returns something that is not a finite number, or runs
  longer than `timeout_s` gives that sample 0.0 and is counted (`n_errors` / `n_timeouts`).
  A warning (with the exception text) is logged once per runner for each kind of failure
  (timeout, or each exception type).
- At most `max_workers` samples are scored at once; `timeout_s` counts from the moment a
  sample starts running, not from submission.
- Threads, not processes: samples run on `max_workers` long-lived daemon threads (starting a
  thread per sample cost ~1 ms each on a 2-core machine, as much as the reward itself). A thread
  that exceeds its timeout cannot be killed in Python; it is ABANDONED (its result, if any, is
  discarded) and replaced by a new thread, and, being a daemon, it never blocks interpreter exit.
  An abandoned thread keeps its CPU and memory until its function returns. (A ThreadPoolExecutor
  is not used on purpose: its threads are joined at exit, so one hung reward would hang the
  process, and a hung thread would hold a pool slot forever.)
- math-verify's own timeouts use signal.alarm, which works only on the main thread; the
  built-in `math_verify` verifier disables them and relies on this runner's timeout.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncflow.rewards.registry import CompositeReward, RewardFn, resolve_reward

logger = logging.getLogger(__name__)


@dataclass
class RewardResult:
    rewards: list[float]  # one per sample, 0.0 for failed samples
    n_errors: int  # samples whose reward function raised or returned a non-finite/non-number
    n_timeouts: int  # samples whose reward function ran past timeout_s


class RewardRunner:
    """Scores batches of completions in parallel threads with per-sample timeouts.

    fns: one reward (callable, registered name or "module:function" spec) or a sequence of
    rewards and/or (reward, weight) pairs, combined as a weighted sum (weight 1 if not given).
    """

    def __init__(self, fns: str | RewardFn | Sequence, timeout_s: float = 10.0, max_workers: int = 4):
        if isinstance(fns, str) or callable(fns):
            fns = [fns]
        if not fns:
            raise ValueError("RewardRunner needs at least one reward function")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        pairs = [item if isinstance(item, tuple) else (item, 1.0) for item in fns]
        single = len(pairs) == 1 and pairs[0][1] == 1.0
        self.fn: RewardFn = resolve_reward(pairs[0][0]) if single else CompositeReward(pairs)
        self.timeout_s = float(timeout_s)
        self.max_workers = max_workers
        self._warned: set[str] = set()
        self._tasks: queue.Queue = queue.Queue()  # (work, index) for the worker threads
        self._workers_lock = threading.Lock()
        self._live_workers = 0  # threads started, not counting the replacements of stuck ones
        self._abandoned: set[tuple] = set()  # (work, index) calls past their timeout, still running

    def _submit(self, work, index: int) -> None:
        with self._workers_lock:
            while self._live_workers < self.max_workers:
                self._live_workers += 1
                threading.Thread(target=self._worker_loop, name="reward-worker", daemon=True).start()
        self._tasks.put((work, index))

    def _worker_loop(self) -> None:
        while True:
            work, index = self._tasks.get()
            work(index)
            with self._workers_lock:
                if (work, index) in self._abandoned:  # a replacement took this thread's place meanwhile
                    self._abandoned.discard((work, index))
                    return

    def _abandon(self, work, index: int) -> None:
        """The call (work, index) is past its timeout: start a worker in place of the one stuck in it."""
        with self._workers_lock:
            self._abandoned.add((work, index))
            threading.Thread(target=self._worker_loop, name="reward-worker", daemon=True).start()

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (further %s failures are counted, not logged)", message, kind)

    def score(
        self, completions: list[str], ground_truths: list[str], metadatas: list[dict] | None = None
    ) -> RewardResult:
        """Reward for each (completion, ground_truth, metadata) triple; see the module invariants."""
        n = len(completions)
        if metadatas is None:
            metadatas = [{} for _ in range(n)]
        if len(ground_truths) != n or len(metadatas) != n:
            raise ValueError(
                f"score needs equal lengths: {n} completions, {len(ground_truths)} ground truths, "
                f"{len(metadatas)} metadatas"
            )
        rewards = [0.0] * n
        n_errors = n_timeouts = 0
        done: queue.Queue = queue.Queue()  # ("start", index, time) or ("end", index, reward or None, error or None)
        running: dict[int, float] = {}  # index -> start time (monotonic)
        finished = 0

        def work(i: int) -> None:
            done.put(("start", i, time.monotonic()))
            try:
                value = self.fn(completions[i], ground_truths[i], **(metadatas[i] or {}))
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"reward function returned a non-finite value {value}")
                done.put(("end", i, value, None))
            except BaseException as e:  # noqa: BLE001 - any failure of user code is scored 0.0
                done.put(("end", i, None, e))

        for i in range(n):
            self._submit(work, i)
        while finished < n:
            wait = min(running.values()) + self.timeout_s - time.monotonic() if running else self.timeout_s
            try:
                message = done.get(timeout=max(wait, 0.0))
            except queue.Empty:
                message = None
            if message is not None and message[0] == "start":
                running[message[1]] = message[2]
            elif message is not None and message[1] in running:  # else: it timed out and was abandoned
                _, i, value, error = message
                del running[i]
                finished += 1
                if error is None:
                    rewards[i] = value
                else:
                    n_errors += 1
                    self._warn_once(
                        f"error:{type(error).__name__}",
                        f"reward function failed on sample {i}: {type(error).__name__}: {error}",
                    )
            now = time.monotonic()
            for i in [i for i, start in running.items() if now - start >= self.timeout_s]:
                del running[i]
                finished += 1
                n_timeouts += 1
                self._abandon(work, i)
                self._warn_once("timeout", f"reward function exceeded {self.timeout_s}s on sample {i}; "
                                "its thread is abandoned")
        return RewardResult(rewards=rewards, n_errors=n_errors, n_timeouts=n_timeouts)
