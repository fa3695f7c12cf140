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
- Threads, not processes: each sample runs in a daemon thread. A thread that exceeds its
  timeout cannot be killed in Python; it is ABANDONED (its result, if any, is discarded), its
  worker slot is given to the next sample, and, being a daemon, it never blocks interpreter
  exit. An abandoned thread keeps its CPU and memory until its function returns. (A
  ThreadPoolExecutor is not used on purpose: its threads are joined at exit, so one hung
  reward would hang the process, and a hung thread would hold a pool slot forever.)
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
        done: queue.Queue = queue.Queue()  # (index, reward or None, exception or None)
        running: dict[int, float] = {}  # index -> start time (monotonic)
        next_index = 0

        def work(i: int) -> None:
            try:
                value = self.fn(completions[i], ground_truths[i], **(metadatas[i] or {}))
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"reward function returned a non-finite value {value}")
                done.put((i, value, None))
            except BaseException as e:  # noqa: BLE001 - any failure of user code is scored 0.0
                done.put((i, None, e))

        while next_index < n or running:
            while next_index < n and len(running) < self.max_workers:
                running[next_index] = time.monotonic()
                threading.Thread(target=work, args=(next_index,), name=f"reward-{next_index}", daemon=True).start()
                next_index += 1
            wait = min(running.values()) + self.timeout_s - time.monotonic()
            try:
                i, value, error = done.get(timeout=max(wait, 0.0))
            except queue.Empty:
                pass
            else:
                if i in running:  # else: it already timed out and was abandoned
                    del running[i]
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
                n_timeouts += 1
                self._warn_once("timeout", f"reward function exceeded {self.timeout_s}s on sample {i}; "
                                "its thread is abandoned")
        return RewardResult(rewards=rewards, n_errors=n_errors, n_timeouts=n_timeouts)
