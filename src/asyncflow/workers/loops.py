"""Worker loops: the long-running side of the rollout and reward workers, one partition per step.

Owns: `rollout_loop` (admission control by weight version, weight swaps between partitions),
`reward_loop`, and `BackgroundThread` (a thread whose failure is re-raised in the driver).

Invariant: the rollout loop starts partition `step` only with weights of version >= step - k,
and changes weights only between partitions.
"""

from __future__ import annotations

import threading
import time


def partition_name(step: int) -> str:
    return f"step_{step}"


def rollout_loop(worker, queue, receiver, steps: range, *, max_staleness: int, batch_size: int, timeout: float,
                 timeline=None, name: str = "rollout", consumer: str | None = None, scorer=None, cores=None) -> int:
    """Generate partitions `steps` in order, respecting the staleness bound (the rollout side of every
    workflow but `sync`). Weights change only between partitions. Returns rows generated. `consumer`
    names this replica to the queue, so its rows can be released if it dies; `scorer` scores the
    responses in place (see `RolloutWorker.run_partition`); `cores` (a `CoreLending`) is told when
    this replica waits for weights, so another role may use its cores meanwhile."""
    engine = worker.engine
    generated = 0
    for step in steps:
        t0 = time.time()
        newest = receiver.poll(engine.weight_version)
        if engine.weight_version < step - max_staleness:
            if cores is not None:
                cores.idle()
            newest = receiver.wait_for(step - max_staleness, timeout)
        if cores is not None:
            cores.busy()
        t1 = time.time()
        if newest is not None:
            engine.update_weights(newest[1], newest[0])
        t2 = time.time()
        generated += worker.run_partition(
            queue, partition_name(step), batch_size=batch_size, timeout=timeout, consumer=consumer, scorer=scorer
        )
        if timeline is not None:
            timeline.add_span(name, "wait_weights", t0, t1, step=step)
            timeline.add_span(name, "weight_swap", t1, t2, version=engine.weight_version)
            timeline.add_span(name, "generate", t2, time.time(), step=step)
    return generated


def reward_loop(worker, queue, steps: range, *, batch_size: int, timeout: float, timeline=None) -> None:
    for step in steps:
        t0 = time.time()
        worker.run_partition(queue, partition_name(step), batch_size=batch_size, timeout=timeout)
        if timeline is not None:
            timeline.add_span("reward", "score", t0, time.time(), step=step)


class BackgroundThread:
    """A daemon thread whose exception is re-raised by `join` (so a failing worker fails the run)."""

    def __init__(self, name: str, fn, *args, **kwargs):
        self.error: BaseException | None = None
        self.result = None

        def target():
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - surfaced in join()
                self.error = err

        self.thread = threading.Thread(target=target, name=name, daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"worker thread {self.thread.name!r} failed: {self.error!r}") from self.error

    def join(self, timeout: float):
        self.thread.join(timeout)
        self.check()
        if self.thread.is_alive():
            raise TimeoutError(f"worker thread {self.thread.name!r} did not finish within {timeout:.0f} s")
        return self.result
