"""Inline runtime: every worker in this process (the rollout loop on a thread).

Owns: the in-process TransferQueue, the in-process weight channel, and the rollout thread. Used
for debugging, tests, and the colocated `sync` baseline.

Invariant: once the rollout thread runs, only it touches the rollout engine (with partial rollouts, its
weight watcher hands versions to `update_weights`, which the engine applies on the rollout thread); new
weights reach it through the weight channel, never by a direct call from the trainer thread (its sampling generator is
read through the loop's `SamplerHistory`).
"""

from __future__ import annotations

from asyncflow.transfer import TransferQueue
from asyncflow.workers.loops import BackgroundThread, SamplerHistory, restore_sampler, rollout_loop

REPLICA = "rollout"


class InlineRuntime:
    weight_sync = "inprocess"
    scores_in_rollout = False  # the reward loop runs on a thread of its own
    weight_sync_options: dict = {}
    trainer_cores = None  # one process: no core lending between workers

    def __init__(self, config):
        self.config = config
        self.thread = None
        self.receiver = None
        self.history: SamplerHistory | None = None

    def make_queue(self, tasks):
        rt = self.config.runtime
        return TransferQueue.local(num_storage_units=rt.storage_units, tasks=tasks, timeout=rt.call_timeout_s)

    def start_rollout(
        self, run, queue, receiver_spec, steps, *, max_staleness: int, make_scorer=None, sampler_states=None
    ) -> None:
        """Run the rollout loop over `steps` on a thread; `sampler_states` (replica -> generator state, from
        `sampler_states` of an earlier run) sets the engine's sampling generator first."""
        self.receiver = receiver_spec.open()
        restore_sampler(run.rollout.engine, (sampler_states or {}).get(REPLICA))
        self.history = SamplerHistory(keep=max_staleness + 4)
        self.thread = BackgroundThread(
            REPLICA, rollout_loop, run.rollout, queue, self.receiver, steps, max_staleness=max_staleness,
            batch_size=self.config.rollout.max_batch_size, timeout=self.config.runtime.call_timeout_s,
            timeline=run.timeline, history=self.history, on_weight_update=self.config.rollout.on_weight_update,
        )

    def sampler_states(self, step: int, timeout: float) -> dict:
        """Replica -> the engine's generator state after partition `step` (what partition `step + 1` starts from)."""
        if self.history is None:
            return {}
        return {REPLICA: self.history.after(step, timeout, alive=self.check)}

    def check(self) -> None:
        if self.thread is not None:
            self.thread.check()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
