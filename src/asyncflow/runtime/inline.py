"""Inline runtime: every worker in this process (the rollout loop on a thread).

Owns: the in-process TransferQueue, the one rollout worker (built here from the `RolloutSpec`, scoring
with the driver's reward worker), and, for `stream` / `async`, the thread its rollout loop runs on. Used
for debugging, tests, and the colocated `sync` baseline (which drives `local_rollout` itself).

Invariant: once the rollout thread runs, only it touches the rollout engine (with partial rollouts, its
weight watcher hands versions to `update_weights`, which the engine applies on the rollout thread); new
weights reach it through the weight channel, never by a direct call from the trainer thread (its sampling
generator is read through the loop's `SamplerHistory`).
"""

from __future__ import annotations

from asyncflow.runtime.base import RolloutSpec, build_rollout_worker
from asyncflow.transfer import TransferQueue
from asyncflow.workers.loops import BackgroundThread, SamplerHistory, restore_sampler, rollout_loop, sampler_state
from asyncflow.workers.reward import RewardWorker

REPLICA = "rollout"


class InlineRuntime:
    weight_sync = "inprocess"
    scores_in_rollout = False  # the reward loop runs on a thread of its own
    weight_sync_options: dict = {}
    trainer_cores = None  # one process: no core lending between workers

    def __init__(self, config, spec: RolloutSpec, scorer: RewardWorker):
        self.config = config
        self.spec = spec
        self.scorer = scorer
        self.local_rollout = build_rollout_worker(spec, scorer)
        self.thread: BackgroundThread | None = None
        self.receiver = None
        self.history: SamplerHistory | None = None

    def make_queue(self, tasks):
        rt = self.config.runtime
        return TransferQueue.local(num_storage_units=rt.storage_units, tasks=tasks, timeout=rt.call_timeout_s)

    def start_rollout(self, queue, receiver_spec, steps, *, max_staleness: int, timeline, sampler_states=None) -> None:
        """Run the rollout loop over `steps` on a thread."""
        self.receiver = receiver_spec.open()
        restore_sampler(self.local_rollout.engine, (sampler_states or {}).get(REPLICA))
        self.history = SamplerHistory(keep=max_staleness + 4)
        self.thread = BackgroundThread(
            REPLICA, rollout_loop, self.local_rollout, queue, self.receiver, steps, max_staleness=max_staleness,
            batch_size=self.spec.max_batch_size, timeout=self.config.runtime.call_timeout_s,
            timeline=timeline, history=self.history, on_weight_update=self.spec.on_weight_update,
        )

    def sampler_states(self, step: int, timeout: float) -> dict:
        """Replica -> the engine's generator state after partition `step` (what partition `step + 1` starts from);
        without a rollout thread (`sync`), its state now."""
        if self.history is None:
            return {REPLICA: sampler_state(self.local_rollout.engine)}
        return {REPLICA: self.history.after(step, timeout, alive=self.check)}

    def reward_failures(self) -> dict[str, float]:
        return {}  # the driver's reward worker counts them

    def check(self) -> None:
        if self.thread is not None:
            self.thread.check()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.local_rollout.close()
