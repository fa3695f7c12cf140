"""Worker loops: the long-running side of the rollout and reward workers, one partition per step.

Owns: `rollout_loop` (admission control by weight version, weight swaps between partitions),
`InFlightUpdates` (partial rollouts: new versions handed to the engine while a partition generates),
`reward_loop`, `SamplerHistory` (the engine's sampling-generator state after each partition, which a
checkpoint takes so a resumed replica samples as the uninterrupted one would), `WeightUpdateLog` (each
version the engine took: its bytes and when, which the step metrics `weights/update_*` read), and
`BackgroundThread` (a thread whose failure is re-raised in the driver).

Invariants: the rollout loop starts partition `step` only with weights of version >= step - k, and
changes weights only between partitions, except with `on_weight_update="resume"`, where a version
published while a partition generates reaches the engine's next decode step (each token then records
its version; the oldest is still >= step - k, so the bound holds for every token); the generator state
recorded for `step` is the one partition `step + 1` starts from.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from asyncflow.weights.buckets import materialize
from asyncflow.weights.deadlines import WeightDeadlines, within_deadline


def partition_name(step: int) -> str:
    return f"step_{step}"


def oldest_admissible_version(step: int, max_staleness: int) -> int:
    """Admission control: the oldest weight version partition `step` may start generating with (`async` k:
    `step - k`; `stream`: `step`). The rollout loop waits for it; `asyncflow.plan` simulates the same rule."""
    return step - max_staleness


class SamplerHistory:
    """The sampling generator's state of an engine after each of its last `keep` partitions (thread-safe).
    Engines whose `generator` is None record None."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._states: OrderedDict[int, object] = OrderedDict()
        self._changed = threading.Condition()
        self._ended = False

    def end(self) -> None:
        """The loop stopped (finished or failed): a wait for a partition it did not record fails at once."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def record(self, step: int, engine) -> None:
        with self._changed:
            self._states[step] = sampler_state(engine)
            while len(self._states) > self.keep:
                self._states.popitem(last=False)
            self._changed.notify_all()

    def after(self, step: int, timeout: float, alive=None):
        """The state recorded after partition `step`, waiting up to `timeout` s for the loop to finish it;
        `alive` is called every 0.1 s meanwhile and may raise (the loop failed)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while step not in self._states:
                if self._ended:
                    raise RuntimeError(f"the rollout loop stopped before it finished partition {step}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the rollout loop did not finish partition {step} within {timeout:.0f} s")
                self._changed.wait(min(remaining, 0.1))
                if alive is not None:
                    alive()
            return self._states[step]


@dataclass(frozen=True)
class WeightUpdate:
    """A version an engine took: `nbytes` that reached the replica for it (`WeightReceiver.received_bytes`),
    `kind` ("full" / "delta") and `held_at` (wall-clock `time.time()` once the engine has it: compared with the
    trainer's publish start, so replicas on other hosts need synchronized clocks)."""

    version: int
    nbytes: int
    kind: str
    held_at: float


class WeightUpdateLog:
    """The versions a replica's engine took since the driver last asked (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._updates: list[WeightUpdate] = []

    def record(self, version: int, receiver) -> None:
        update = WeightUpdate(version, receiver.received_bytes, receiver.received_kind, time.time())
        with self._lock:
            self._updates.append(update)

    def drain(self) -> list[WeightUpdate]:
        with self._lock:
            updates, self._updates = self._updates, []
        return updates


def hand_weights(engine, weights, version: int) -> None:
    """`engine.update_weights` of a received version: a `BucketStream` as it is to an engine that loads one bucket at a
    time (`streams_weights`), as a state dict to any other."""
    engine.update_weights(weights if getattr(engine, "streams_weights", False) else materialize(weights), version)


def sampler_state(engine):
    """The state of the engine's sampling generator now (None: it has none)."""
    return engine.generator.get_state() if engine.generator is not None else None


def restore_sampler(engine, state) -> None:
    """Set the engine's sampling generator to `state` (from `SamplerHistory`); no-op for None."""
    if state is not None and engine.generator is not None:
        engine.generator.set_state(state)


def check_updates_in_flight(engine) -> None:
    """`rollout.on_weight_update=resume` needs an engine that takes `update_weights` during a `generate`."""
    if not engine.updates_in_flight:
        raise ValueError(
            "rollout.on_weight_update=resume needs an inference engine that takes weight updates in flight "
            f"(updates_in_flight = True); {type(engine).__name__} does not: use rollout.on_weight_update=finish"
        )


class InFlightUpdates:
    """While a partition generates (`with InFlightUpdates(...):`), a thread polls the weight receiver every
    `POLL_S` seconds and hands each newer version to `engine.update_weights`, which an engine with
    `updates_in_flight` applies at its next decode step. Leaving the block stops the thread (joined within
    `timeout`) and re-raises its failure (a broken transport)."""

    POLL_S = 0.05

    def __init__(self, engine, receiver, *, timeout: float, timeline, name: str,
                 updates: WeightUpdateLog | None = None, apply_timeout: float | None = None):
        check_updates_in_flight(engine)
        self.engine, self.receiver, self.timeout, self.updates = engine, receiver, timeout, updates
        self.apply_timeout = timeout if apply_timeout is None else apply_timeout
        self.timeline, self.name = timeline, name
        self._stop = threading.Event()
        self._thread: BackgroundThread | None = None

    def _watch(self) -> None:
        handed = self.engine.weight_version
        while not self._stop.wait(self.POLL_S):
            newest = self.receiver.poll(handed)
            if newest is not None:
                handed = newest[0]
                within_deadline(lambda: hand_weights(self.engine, newest[1], handed),  # noqa: B023 - called here
                                side=f"rollout replica {self.name}", version=handed, phase="apply",
                                timeout_s=self.apply_timeout)
                if self.updates is not None:
                    self.updates.record(handed, self.receiver)
                if self.timeline is not None:
                    self.timeline.instant(self.name, "weights_in_flight", version=handed)

    def __enter__(self):
        self._stop.clear()
        self._thread = BackgroundThread(f"{self.name}-weights", self._watch)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout)


def rollout_loop(worker, queue, receiver, steps: range, *, max_staleness: int, batch_size: int, timeout: float,
                 timeline=None, name: str = "rollout", consumer: str | None = None, scorer=None, cores=None,
                 history: SamplerHistory | None = None, on_weight_update: str = "finish",
                 updates: WeightUpdateLog | None = None, deadlines: WeightDeadlines | None = None) -> int:
    """Generate partitions `steps` in order, respecting the staleness bound (the rollout side of every
    workflow but `sync`). Weights change between partitions, and with `on_weight_update="resume"` also
    while one generates (`InFlightUpdates`). Returns rows generated. `consumer`
    names this replica to the queue, so its rows can be released if it dies; `scorer` scores the
    responses in place (see `RolloutWorker.run_partition`); `cores` (a `CoreLending`) is told when
    this replica waits for weights, so another role may use its cores meanwhile; `history` records the
    engine's generator state after each partition; `updates` logs each version the engine takes. Taking a
    version (`receive`) and loading it into the engine (`apply`) each run under their `deadlines` (default:
    `timeout`), `WeightDeadlineError` naming this replica otherwise."""
    engine = worker.engine
    limits = deadlines or WeightDeadlines(timeout, timeout, timeout)
    side = f"rollout replica {name}"
    generated = 0
    try:
        in_flight: contextlib.AbstractContextManager = contextlib.nullcontext()
        if on_weight_update == "resume":
            in_flight = InFlightUpdates(engine, receiver, timeout=timeout, timeline=timeline, name=name,
                                        updates=updates, apply_timeout=limits.apply)
        for step in steps:
            t0 = time.time()
            needed = oldest_admissible_version(step, max_staleness)

            def take(needed=needed):
                newest = receiver.poll(engine.weight_version)
                if (engine.weight_version if newest is None else newest[0]) < needed:  # not taken twice
                    if cores is not None:
                        cores.idle()
                    newest = receiver.wait_for(needed, limits.receive)
                return newest

            newest = within_deadline(take, side=side, version=needed, phase="receive", timeout_s=limits.receive)
            if cores is not None:
                cores.busy()
            t1 = time.time()
            if newest is not None:
                version, weights = newest
                within_deadline(lambda: hand_weights(engine, weights, version), side=side,  # noqa: B023 - called here
                                version=version, phase="apply", timeout_s=limits.apply)
                if updates is not None:
                    updates.record(newest[0], receiver)
                newest = weights = None  # let go: a delta receiver then patches that version in place
            t2 = time.time()
            with in_flight:
                generated += worker.run_partition(queue, partition_name(step), batch_size=batch_size,
                                                  timeout=timeout, consumer=consumer, scorer=scorer)
            if history is not None:
                history.record(step, engine)
            if timeline is not None:
                timeline.add_span(name, "wait_weights", t0, t1, step=step)
                timeline.add_span(name, "weight_swap", t1, t2, version=engine.weight_version)
                timeline.add_span(name, "generate", t2, time.time(), step=step)
    finally:
        if history is not None:
            history.end()
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

        def target():
            try:
                fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - surfaced in join()
                self.error = err

        self.thread = threading.Thread(target=target, name=name, daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"worker thread {self.thread.name!r} failed: {self.error!r}") from self.error

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        self.check()
        if self.thread.is_alive():
            raise TimeoutError(f"worker thread {self.thread.name!r} did not finish within {timeout:.0f} s")
