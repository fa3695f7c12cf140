"""Inline runtime: every worker in this process (the rollout loop on a thread).

Owns: the in-process TransferQueue, the one rollout worker (built here from the `RolloutSpec`, scoring
with the driver's reward worker), for `stream` / `async` the thread its rollout loop runs on, and
`ProcessRanks`, the ranks of a multi-rank training engine as processes of this machine (launched through
`InlineRuntime.rank_launcher`). Used for debugging, tests, and the colocated `sync` baseline (which drives
`local_rollout` itself).

Invariant: once the rollout thread runs, only it touches the rollout engine (with partial rollouts, its
weight watcher hands versions to `update_weights`, which the engine applies on the rollout thread); new
weights reach it through the weight channel, never by a direct call from the trainer thread (its sampling
generator is read through the loop's `SamplerHistory`).
"""

from __future__ import annotations

import logging
import signal
import time
import traceback
from collections.abc import Sequence
from typing import Any

from asyncflow.engines.fsdp2_train import RankFailedError, RankSpec, RankTrainer, free_port
from asyncflow.runtime.base import RolloutSpec, build_rollout_worker, weight_deadlines
from asyncflow.transfer import TransferQueue
from asyncflow.weights import TransportKind
from asyncflow.workers.loops import (
    BackgroundThread,
    SamplerHistory,
    WeightUpdate,
    WeightUpdateLog,
    restore_sampler,
    rollout_loop,
    sampler_state,
)
from asyncflow.workers.reward import RewardWorker

REPLICA = "rollout"
POLL_S = 0.05
ROOT_CAUSE_WAIT_S = 3.0  # after a rank reports an error, how long to look for a rank that died (the cause)
log = logging.getLogger(__name__)


class InlineRuntime:
    weight_sync: TransportKind = "inprocess"
    scores_in_rollout = False  # the reward loop runs on a thread of its own
    weight_sync_options: dict = {}
    trainer_cores = None  # one process: no core lending between workers

    def __init__(self, config, spec: RolloutSpec, scorer: RewardWorker):
        self.config = config
        self.spec = spec
        self.local_rollout = build_rollout_worker(spec, scorer)
        self.thread: BackgroundThread | None = None
        self.receiver = None
        self.history: SamplerHistory | None = None
        self.updates = WeightUpdateLog()

    @staticmethod
    def rank_launcher(config) -> type[ProcessRanks]:
        """A multi-rank trainer's ranks are processes of this machine."""
        return ProcessRanks

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
            updates=self.updates, deadlines=weight_deadlines(self.config),
        )

    def sampler_states(self, step: int, timeout: float) -> dict:
        """Replica -> the engine's generator state after partition `step` (what partition `step + 1` starts from);
        without a rollout thread (`sync`), its state now."""
        if self.history is None:
            return {REPLICA: sampler_state(self.local_rollout.engine)}
        return {REPLICA: self.history.after(step, timeout, alive=self.check)}

    def reward_failures(self) -> dict[str, float]:
        return {}  # the driver's reward worker counts them

    def weight_updates(self) -> dict[str, list[WeightUpdate]]:
        return {REPLICA: self.updates.drain()}

    def memory_metrics(self) -> dict[str, float]:
        return {}  # the replica runs in the driver: the driver's peak is its

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


# ---------------------------------------------------------------------------- ranks of a training engine
def _rank_main(rank: int, world: int, port: int, spec: RankSpec, conn) -> None:
    """A rank process: build the `RankTrainer`, then answer (method, args) messages until `None` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver stops ranks
    try:
        trainer = RankTrainer(rank, world, "127.0.0.1", port, spec)
        conn.send(("ok", None))
    except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", _describe(err), traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            break
        if message is None:
            break
        method, args = message
        try:
            conn.send(("ok", getattr(trainer, method)(*args)))
        except BaseException as err:  # noqa: BLE001
            conn.send(("error", _describe(err), traceback.format_exc()))
    trainer.shutdown()


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


# Imported once by the fork server: each rank then starts in well under a second instead of importing torch and
# transformers itself (20+ s on a loaded 2-core machine), and forks from a process that runs no threads.
FORKSERVER_PRELOAD = ["asyncflow.runtime.inline", "asyncflow.models.loading", "torch.distributed.fsdp",
                      "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict"]


class ProcessRanks:
    """The ranks as torch multiprocessing processes on this machine (forked by the fork server), each answering
    over a pipe. Tensors in messages travel through shared memory (torch's reductions)."""

    def __init__(self, world: int, spec: RankSpec, timeout: float):
        import torch.multiprocessing as mp

        context = mp.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
        port = free_port()
        self.conns, self.processes = [], []
        for rank in range(world):
            parent, child = context.Pipe()
            process = context.Process(
                target=_rank_main, args=(rank, world, port, spec, child), name=f"fsdp2-rank{rank}", daemon=True
            )
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        try:
            self._collect("start", timeout)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]  # all started: each has one

    def call(self, method: str, args: Sequence[tuple], timeout: float) -> list[Any]:
        for conn, rank_args in zip(self.conns, args, strict=True):
            try:
                conn.send((method, rank_args))
            except (BrokenPipeError, OSError):
                pass  # the rank is gone: `_collect` names it
        return self._collect(method, timeout)

    def _collect(self, method: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < len(self.conns):
            for rank, conn in enumerate(self.conns):
                if rank in results:
                    continue
                if conn.poll(POLL_S / len(self.conns)):
                    try:
                        reply = conn.recv()
                    except (EOFError, OSError):
                        self._fail(rank, method, None)
                    if reply[0] == "error":
                        log.debug("fsdp2 rank %d failed in %s:\n%s", rank, method, reply[2])
                        self._fail(rank, method, f"failed: {reply[1]}")
                    results[rank] = reply[1]
                elif self.processes[rank].exitcode is not None:
                    self._fail(rank, method, None)
            if len(results) < len(self.conns) and time.monotonic() > deadline:
                waiting = [r for r in range(len(self.conns)) if r not in results]
                self.close()
                raise RankFailedError(
                    f"train.engine=fsdp2: rank(s) {waiting} did not finish {method} within {timeout:.0f} s "
                    "(runtime.call_timeout_s); the ranks were stopped"
                )
        return [results[r] for r in range(len(self.conns))]

    def _fail(self, rank: int, method: str, error: str | None) -> None:
        """Stop the ranks and raise for `rank`, which reported `error` (None: it died or closed its pipe). A rank
        killed meanwhile is named instead: a dead peer makes the others' collectives fail, it is the cause."""
        deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
        while time.monotonic() < deadline:
            killed = [r for r, p in enumerate(self.processes) if p.exitcode not in (None, 0)]
            if killed:
                rank = rank if rank in killed else killed[0]
                error = f"exited with code {self.processes[rank].exitcode}"
                break
            if error is None and self.processes[rank].exitcode is not None:
                break
            time.sleep(POLL_S)
        pid = self.processes[rank].pid
        error = error or f"exited with code {self.processes[rank].exitcode}"
        self.close()
        raise RankFailedError(
            f"train.engine=fsdp2: rank {rank} (pid {pid}) {error} during {method}; the other ranks were stopped "
            "(resume the run from its last checkpoint with --resume)"
        )

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=5.0)
            for stop in (process.terminate, process.kill):
                if process.is_alive():
                    stop()
                    process.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []


