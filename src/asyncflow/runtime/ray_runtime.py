"""Ray runtime: separated deployment. Rollout replicas are Ray actors, the TransferQueue is Ray actors
(one controller, N storage units), each replica scoring its own responses (a reward worker placed
beside its engine); the trainer stays in the driver.

Owns: starting or joining the Ray cluster (`runtime.address`; a local cluster without dashboard by
default; a failed start is retried once, then a one-line `RayStartError`) and shutting down the one it
started (`hold_ray`: the runtime and a trainer's ranks each hold it; the last to close shuts down a Ray
that asyncflow started, never one the user started), the rollout actors
(CPUs/GPUs from config, each loads the policy through the normal HF loading code and builds its
engine from the registry), the weight-sync transport options of
`runtime.weight_sync`, idle-core lending between the trainer and the replicas on a local CPU
cluster (`runtime.lend_idle_cores`, see `asyncflow.runtime.cores`), a supervisor thread that
watches the replicas, and a multi-rank trainer's ranks as actors (`RayRanks`, launched through
`RayRuntime.rank_launcher`).

Invariants:
- Each replica takes prompt rows from the queue under its own consumer name, so the controller
  knows which rows it holds. When a replica dies, the supervisor `release`s the rows it held that
  have no response yet, waits until Ray has restarted the actor, and runs its loop again (at most
  `runtime.max_restarts` times in all); another replica may take the released rows first. So no
  row is lost, and a row is written (hence trained) once: the queue refuses a second write. (With
  `torch_distributed` weight sync a dead replica ends the run with a clear error instead: a new
  process cannot rejoin the existing process group.)
- The replicas start building when the runtime is made (before a run sets up its trainer, so vLLM starts beside
  the FSDP2 ranks); `start_rollout` waits for them (`runtime.start_timeout_s`) and then starts their loops.
- A replica starts a partition only with weights of version >= step - k (see `workers.loops`).
- A replica records its sampling generator after each partition (`sampler_states`), and a resumed run
  hands each replica the state it had in the checkpointed run (`start_rollout(sampler_states=...)`).
- Every remote call is bounded by `runtime.call_timeout_s`.
- This module is the only runtime code that imports `ray`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar, cast

import ray
import torch
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from asyncflow.observe import Timeline
from asyncflow.observe.memory import METRIC_PREFIX as MEMORY_METRIC_PREFIX
from asyncflow.observe.memory import descendants_peak_rss_mb, peak_rss_mb, return_freed_blocks
from asyncflow.runtime.base import RolloutSpec, build_rollout_worker, weight_deadlines
from asyncflow.runtime.cores import CoreLending, create_core_lending
from asyncflow.transfer.ray_queue import RayTransferQueue
from asyncflow.weights import TransportKind
from asyncflow.weights.deadlines import WeightDeadlineError, WeightDeadlines
from asyncflow.weights.torch_distributed import RESTART_REFUSAL
from asyncflow.workers.loops import SamplerHistory, WeightUpdate, WeightUpdateLog, restore_sampler, rollout_loop
from asyncflow.workers.rollout import RESPONSE_COLUMNS

log = logging.getLogger(__name__)

ROLLOUT_TASK = "rollout"
A = TypeVar("A")


class RayStartError(ConnectionError):
    """The Ray cluster did not start (or could not be joined) in `START_ATTEMPTS` tries."""


START_ATTEMPTS = 3
START_RETRY_PAUSE_S = 2.0


def _spawn(actor_cls: ActorClass[A], *args: object) -> ActorHandle[A]:
    """A new actor of `actor_cls`. Ray types `remote()` as a handle or the class itself (`ActorProxy`, for its
    `@ray.method` typing); it returns a handle."""
    return cast(ActorHandle[A], actor_cls.remote(*args))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def start_ray(*, address: str | None, num_cpus: int | None) -> None:
    """`ray.init`, tried `START_ATTEMPTS` times (a local cluster's start-up can time out on a loaded machine);
    then `RayStartError` with a one-line message naming the address. `address=None` always starts a new local
    cluster (Ray alone would join one that `ray start` left on this machine, even a dead one)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(address=address or "local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
            return
        except Exception as err:  # noqa: BLE001 - ray.init raises plain Exception too (a node's start-up timeout)
            reason = _first_line(err)
            log.warning("Ray did not start (attempt %d of %d): %s", attempt, START_ATTEMPTS, reason)
            log.debug("ray.init failed", exc_info=True)
            try:
                ray.shutdown()  # leaves no half-started local cluster behind
            except Exception:  # noqa: BLE001 - best effort before the retry or the error
                log.debug("ray.shutdown after a failed start", exc_info=True)
            if attempt == START_ATTEMPTS:
                where = f"join the Ray cluster at runtime.address={address}" if address else "start a local Ray cluster"
                raise RayStartError(
                    f"could not {where} ({START_ATTEMPTS} attempts): {reason}; check free memory and /tmp/ray for a "
                    "local cluster, that the head node is up for an address, or run without Ray (runtime.kind=inline)"
                ) from err
            time.sleep(START_RETRY_PAUSE_S)


def start_ray_unless_running(rt) -> bool:
    """`start_ray` with the `runtime` config's address unless Ray runs already; True when it started it. Callers
    that keep Ray for a while take it through `hold_ray`, which records who started it."""
    if ray.is_initialized():
        return False
    if rt.address is None:
        # Ray starts worker processes at nice 15, below the driver and everything else on the host;
        # rollout replicas are on the critical path, so a local cluster runs them at normal priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
    start_ray(address=rt.address, num_cpus=rt.num_cpus if rt.address is None else None)
    return True


class _RayOwnership:
    """Whether this process's Ray was started by asyncflow, and how many holders (a runtime, a trainer's ranks)
    still use it. A Ray the user started (`ray.init` before the run, or one joined at `runtime.address` that the
    user had initialised) is never owned, so never shut down here."""

    lock = threading.Lock()
    holders = 0
    owned = False


def hold_ray(rt) -> Callable[[], None]:
    """Ray for one holder, started (`start_ray_unless_running`, `runtime` config `rt`) unless it runs; -> the
    holder's `release` (idempotent). When asyncflow started Ray, the last release shuts it down, so a run's Ray
    ends with the run however it ends (its `close` runs on errors and Ctrl-C too); a Ray that was running before
    is left running."""
    with _RayOwnership.lock:
        if start_ray_unless_running(rt):
            _RayOwnership.owned = True
        counted = _RayOwnership.owned
        if counted:
            _RayOwnership.holders += 1
    released = threading.Event()

    def release() -> None:
        with _RayOwnership.lock:
            if released.is_set() or not counted:
                released.set()
                return
            released.set()
            _RayOwnership.holders -= 1
            if _RayOwnership.holders == 0 and _RayOwnership.owned:
                _RayOwnership.owned = False
                if rt.address:  # joined, not started: shutdown only disconnects
                    log.info("leaving the Ray cluster at %s", rt.address)
                else:
                    log.info("shutting down the Ray cluster this run started")
                ray.shutdown()

    return release


@contextlib.contextmanager
def ray_session(*, address: str | None, num_cpus: int | None) -> Iterator[None]:
    """Ray started (`start_ray`) for the block and shut down after it."""
    start_ray(address=address, num_cpus=num_cpus)
    try:
        yield
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class Node:
    """A Ray node, as Ray names it: its id and IP address."""

    node_id: str
    ip: str

    @classmethod
    def here(cls) -> Node:
        return cls(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

    def __str__(self) -> str:
        return f"node {self.ip} {self.node_id[:12]}" + ("" if self.alive() else ", lost")

    def alive(self) -> bool:
        try:
            return any(n["NodeID"] == self.node_id and n["Alive"] for n in ray.nodes())
        except Exception:  # noqa: BLE001 - the GCS itself is gone
            return False


class RolloutActor:
    """One rollout replica: its inference engine and worker (built here, in the actor's process, from the spec)
    and the rollout loop over the queue's partitions."""

    def __init__(self, spec: RolloutSpec, name: str):
        torch.set_num_threads(spec.threads)
        if spec.engine == "vllm":
            # vLLM runs the model in processes of its own; this one passes weight buckets on: freed buffers of a
            # MiB or more leave its resident size (glibc kept ~400 MB of them at 166M parameters)
            return_freed_blocks()
        if spec.make_scorer is None:
            raise ValueError("a Ray rollout replica scores its own rows: its RolloutSpec needs make_scorer")
        self.scorer = spec.make_scorer()
        self.worker = build_rollout_worker(spec, self.scorer)
        self.name = name
        self.incarnation = uuid.uuid4().hex  # new after every restart
        self.history = SamplerHistory()
        self.updates = WeightUpdateLog()

    def run(self, queue, receiver_spec, steps: range, max_staleness: int, batch_size: int, timeout: float, cores_spec,
            on_weight_update: str, deadlines: WeightDeadlines | None = None):
        """Generate partitions `steps`; returns (rows generated, timeline events of this replica)."""
        timeline = Timeline()
        receiver = receiver_spec.open()
        cores = cores_spec.open(self.name) if cores_spec is not None else None
        self.history.keep = max_staleness + 4
        try:
            generated = rollout_loop(
                self.worker, queue, receiver, steps, max_staleness=max_staleness, batch_size=batch_size,
                timeout=timeout, timeline=timeline, name=self.name, consumer=self.name, scorer=self.scorer,
                cores=cores, history=self.history, on_weight_update=on_weight_update, updates=self.updates,
                deadlines=deadlines,
            )
        except WeightDeadlineError as err:
            if deadlines is not None and deadlines.restart_on_apply and err.phase == "apply":
                # the engine is stuck in a call that cannot be taken back: this process ends, Ray restarts it
                print(f"asyncflow: {err}; the replica's process ends, to be restarted (weights.on_apply_deadline: "
                      "restart)", file=sys.stderr, flush=True)
                os._exit(1)
            raise
        finally:
            if cores is not None:
                cores.close()
            if receiver.collective:
                _keep_taking(receiver)
            else:
                receiver.close()
        return generated, timeline.events

    def ping(self) -> bool:
        return True

    def node(self) -> Node:
        return Node.here()

    def restore_sampler(self, state) -> None:
        """Set the engine's sampling generator (before `run`), as a resumed run found it in its checkpoint."""
        restore_sampler(self.worker.engine, state)

    def sampler_state(self, step: int, timeout: float):
        """The engine's generator state after partition `step` (waits for the loop to finish it)."""
        return self.history.after(step, timeout)

    def peak_rss_mb(self) -> float:
        return peak_rss_mb()

    def engine_peak_rss_mb(self) -> float:
        """The largest peak among the processes this replica started (vLLM's engine core and worker); 0: none."""
        return descendants_peak_rss_mb()

    def weight_updates(self) -> list[WeightUpdate]:
        """The versions the engine took since the last call."""
        return self.updates.drain()

    def reward_failures(self) -> tuple[str, int, int]:
        """(incarnation, errors, timeouts): the reward functions' failures in this incarnation of the replica."""
        return self.incarnation, self.scorer.errors, self.scorer.timeouts


class RolloutFailedError(ChildProcessError):
    """A rollout replica failed, or died past its restarts; the message names it and its node (an `OSError`: the
    command line reports it in one line)."""


def _keep_taking(receiver, period_s: float = 0.05) -> None:
    """After this replica's last partition: keep taking part in a collective transport's publishes (versions the
    trainer publishes before it learns rollout is done) until the publisher closes or the actor is stopped."""

    def take() -> None:
        try:
            version = -1
            while True:
                received = receiver.poll(version)
                version = received[0] if received is not None else version
                time.sleep(period_s)
        except Exception:  # noqa: BLE001 - the publisher closed: nothing more to take
            log.debug("weight receiver stopped after the rollout loop", exc_info=True)
        finally:
            receiver.close()

    threading.Thread(target=take, name="weights-after-rollout", daemon=True).start()


class RayRuntime:
    """Places rollout replicas as Ray actors; see the module docstring."""

    # Each replica scores its own responses and writes them with their rewards: one queue round trip
    # per batch of rows instead of three more (request, read, write) for a separate reward stage.
    scores_in_rollout = True
    local_rollout = None  # every engine lives in a replica
    weight_sync: TransportKind

    def __init__(self, config, spec: RolloutSpec, scorer=None):  # each replica builds its own (`spec.make_scorer`)
        rt = config.runtime
        self.config = config
        self.spec = spec
        self.timeout = rt.call_timeout_s
        self.start_timeout = rt.start_timeout_s
        self.weight_sync = rt.weight_sync
        if self.weight_sync == "inprocess":
            raise ValueError("runtime.weight_sync=inprocess needs runtime.kind=inline: Ray actors are other processes")
        self._release_ray = hold_ray(rt)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, int(rt.trainer_cpus)))
        self.trainer_cores: CoreLending | None = None
        self._cores_spec = None
        if rt.lend_idle_cores and rt.address is None and rt.rollout_gpus == 0 and rt.trainer_gpus == 0:
            shares = {"trainer": max(1, int(rt.trainer_cpus))}
            shares.update({f"rollout_{r}": max(1, int(rt.rollout_cpus)) for r in range(config.rollout.replicas)})
            try:
                self._cores_spec, self._unlink_cores = create_core_lending(shares, rt.num_cpus or os.cpu_count() or 1)
                self.trainer_cores = self._cores_spec.open("trainer", borrow=True)
            except BaseException:  # no runtime to close: let go of Ray here
                torch.set_num_threads(self._threads_before)
                self._release_ray()
                raise
        self.actors: dict[str, ActorHandle[RolloutActor]] = {}
        self.calls: dict[str, ray.ObjectRef] = {}  # replica name -> its running loop
        self.restarts = 0
        self.generated = 0
        self.error: BaseException | None = None
        self.queue: RayTransferQueue | None = None
        self._loop_args: dict[str, tuple] = {}
        # replica -> last polled (incarnation, errors, timeouts)
        self._reward_counts: dict[str, tuple[str, int, int]] = {}
        self._retired_reward_counts: tuple[int, int] = (0, 0)  # summed over the replicas' dead incarnations
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lock = threading.Lock()
        self.nodes: dict[str, Node] = {}  # replica -> the node it first started on
        try:
            self._spawn_replicas()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def rank_launcher(config):
        """A multi-rank trainer's ranks are Ray actors (`RayRanks`): each launch starts or joins the cluster as the
        runtime does and holds it (`hold_ray`) until the ranks close; each rank gets an equal share of
        `runtime.trainer_cpus` and `runtime.trainer_gpus`."""
        rt = config.runtime
        world = config.train.world_size

        def launch(world_size: int, spec, timeout: float) -> RayRanks:
            release_ray = hold_ray(rt)
            try:
                return RayRanks(world_size, spec, timeout, num_cpus=rt.trainer_cpus / world,
                                num_gpus=rt.trainer_gpus / world, local=rt.address is None,
                                resources=rt.trainer_resources or None, release_ray=release_ray)
            except BaseException:
                release_ray()  # RayRanks released it already if it got that far (a release is idempotent)
                raise

        return launch

    def make_queue(self, tasks):
        units = self.config.runtime.storage_units
        self.queue = RayTransferQueue.create(num_storage_units=units, tasks=tasks, timeout=self.timeout,
                                             node_id=Node.here().node_id)  # the data plane beside the driver
        return self.queue

    @property
    def weight_sync_options(self) -> dict:
        """Options of `asyncflow.weights.make_weight_sync` for `self.weight_sync`."""
        if self.weight_sync == "ray":
            return {"timeout_s": self.timeout}
        if self.weight_sync == "torch_distributed":
            backend = "nccl" if self.config.runtime.rollout_gpus > 0 else "gloo"
            host = "127.0.0.1" if self.config.runtime.address is None else ray.util.get_node_ip_address()
            return {"num_receivers": self.config.rollout.replicas, "timeout_s": self.timeout, "backend": backend,
                    "host": host, "forward_streams": not self.config.weights.stage_on_driver}
        return {}

    def _spawn_replicas(self) -> None:
        """Create one actor per replica, without waiting: they build (imports, model load, engine start) in
        parallel with each other and with whatever the driver sets up next (the trainer's ranks);
        `start_rollout` waits for them."""
        rt = self.config.runtime
        actor_cls = ray.remote(RolloutActor).options(
            num_cpus=rt.rollout_cpus, num_gpus=rt.rollout_gpus, resources=rt.rollout_resources or None,
            max_restarts=rt.max_restarts, max_concurrency=2,
        )
        for r in range(self.config.rollout.replicas):
            spec = replace(self.spec, seed=self.spec.seed + 1000 * r, threads=max(1, int(rt.rollout_cpus)),
                           device="cuda" if rt.rollout_gpus > 0 else "cpu")
            self.actors[f"rollout_{r}"] = _spawn(actor_cls, spec, f"rollout_{r}")

    def start_rollout(self, queue, receiver_spec, steps, *, max_staleness: int, timeline, sampler_states=None) -> None:
        """Run the rollout loop over `steps` on each replica (created with the runtime, placed and checked here);
        `sampler_states` (replica name -> generator state, from `sampler_states` of an earlier run) sets each
        engine's sampling generator."""
        self._place()
        for r, name in enumerate(self.actors):
            spec_r = receiver_spec.for_rank(r + 1) if self.weight_sync == "torch_distributed" else receiver_spec
            self._loop_args[name] = (queue, spec_r, steps, max_staleness, self.spec.max_batch_size, self.timeout,
                                     self._cores_spec, self.spec.on_weight_update, weight_deadlines(self.config))
            state = (sampler_states or {}).get(name)
            if state is not None:  # set before the loop runs: a threaded actor may run two calls at once
                ray.get(self.actors[name].restore_sampler.remote(state), timeout=self.timeout)
            self.calls[name] = self.actors[name].run.remote(*self._loop_args[name])
        self._supervisor = threading.Thread(target=self._supervise, args=(queue, timeline), name="rollout-supervisor",
                                            daemon=True)
        self._supervisor.start()

    def _place(self) -> None:
        """Learn each replica's node (logged); `shared_memory` weights reach only replicas on the driver's node."""
        refs = {name: actor.node.remote() for name, actor in self.actors.items()}  # answered once it is built
        try:
            nodes = ray.get(list(refs.values()), timeout=self.start_timeout)
        except GetTimeoutError:
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
            late = [name for name, ref in refs.items() if ref not in ready]
            raise RolloutFailedError(
                f"rollout replica(s) {', '.join(late)} did not start within {self.start_timeout:.0f} s "
                "(runtime.start_timeout_s: imports, model load and engine start)"
            ) from None
        self.nodes = dict(zip(refs, nodes, strict=True))
        driver = Node.here()
        for name, node in self.nodes.items():
            log.info("rollout replica %s runs on %s%s", name, node, " (the driver's)" if node == driver else "")
            if self.weight_sync == "shared_memory" and node.node_id != driver.node_id:
                raise ValueError(
                    f"runtime.weight_sync=shared_memory reaches replicas on the driver's node only, and rollout "
                    f"replica {name} is on {node} (the driver on {driver}): use runtime.weight_sync=ray or "
                    "torch_distributed on a cluster of several nodes"
                )

    def _supervise(self, queue: RayTransferQueue, timeline: Timeline) -> None:
        """Collect finished loops; release and restart the loop of a replica that died."""
        while not self._stop.is_set():
            with self._lock:
                pending = {ref: name for name, ref in self.calls.items()}
            if not pending:
                return
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in done:
                name = pending[ref]
                try:
                    generated, events = ray.get(ref, timeout=self.timeout)
                    self.generated += generated
                    timeline.merge(events)
                    with self._lock:
                        del self.calls[name]
                except RayActorError as err:
                    if self._stop.is_set():  # killed by `close`
                        return
                    try:
                        self._recover(name, err, queue, timeline)
                    except Exception as recovery_error:  # noqa: BLE001 - no restart, or e.g. the queue's node is gone
                        self.error = recovery_error
                        return
                except BaseException as err:  # noqa: BLE001 - re-raised in the driver by check()
                    self.error = err
                    return

    def _node(self, name: str) -> Node | str:
        return self.nodes.get(name, "an unknown node")

    def _recover(self, name: str, err: BaseException, queue: RayTransferQueue, timeline: Timeline) -> None:
        """`name` died: release the rows it held, wait until Ray has restarted it, and run its loop again. Raises
        (the run's error, see `_supervise`) when it cannot be restarted."""
        self.restarts += 1
        if self.weight_sync == "torch_distributed":
            raise RuntimeError(
                f"rollout replica {name} on {self._node(name)} died ({_first_line(err)}); {RESTART_REFUSAL}")
        if self.restarts > self.config.runtime.max_restarts:
            raise RuntimeError(f"rollout replicas died {self.restarts} times (runtime.max_restarts); last: "
                               f"{name} on {self._node(name)}: {_first_line(err)}")
        released = queue.release(ROLLOUT_TASK, name, RESPONSE_COLUMNS)
        count = sum(len(rows) for rows in released.values())
        log.warning("rollout replica %s on %s died (%s); %d rows it held are released; restarting it", name,
                    self._node(name), type(err).__name__, count)
        timeline.instant(name, "restart", released=count)
        deadline = time.monotonic() + self.start_timeout
        while True:  # calls fail fast with ActorUnavailableError while Ray restarts the process
            try:
                ray.get(self.actors[name].ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
                break
            except (RayActorError, GetTimeoutError) as retry_err:
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise RuntimeError(
                        f"rollout replica {name!r} (on {self._node(name)}) did not come back "
                        f"within {self.start_timeout:.0f} s (runtime.start_timeout_s): no live node has room for it "
                        "(runtime.rollout_cpus, rollout_gpus, rollout_resources); resume with --resume once it has"
                    ) from retry_err
                time.sleep(0.2)
        with self._lock:
            self.calls[name] = self.actors[name].run.remote(*self._loop_args[name])

    def sampler_states(self, step: int, timeout: float) -> dict:
        """Replica name -> its engine's generator state after partition `step`. A replica that is dead or
        restarting is left out (it will sample from a fresh seed after a resume)."""
        refs = {name: actor.sampler_state.remote(step, timeout) for name, actor in self.actors.items()}
        states = {}
        for name, ref in refs.items():
            try:
                states[name] = ray.get(ref, timeout=timeout + self.timeout)
            except (RayActorError, RayTaskError, GetTimeoutError) as err:
                log.warning("checkpoint: no sampler state of rollout replica %s (%s)", name, err)
        return states

    def reward_failures(self) -> dict[str, float]:
        """Reward errors and timeouts summed over the replicas, polled once per step. A replica's counts
        carry over its restarts; those it gathered after the last poll before it died are lost."""
        refs = {name: actor.reward_failures.remote() for name, actor in self.actors.items()}
        for name, ref in refs.items():
            try:
                incarnation, errors, timeouts = ray.get(ref, timeout=self.timeout)
            except (RayActorError, GetTimeoutError):
                continue  # dead or restarting: keep its last counts
            last = self._reward_counts.get(name)
            if last is not None and last[0] != incarnation:  # restarted since the last poll
                errors_before, timeouts_before = self._retired_reward_counts
                self._retired_reward_counts = (errors_before + last[1], timeouts_before + last[2])
            self._reward_counts[name] = (incarnation, errors, timeouts)
        counts = [c[1:] for c in self._reward_counts.values()] + [self._retired_reward_counts]
        return {"reward/errors": float(sum(e for e, _ in counts)), "reward/timeouts": float(sum(t for _, t in counts))}

    def weight_updates(self) -> dict[str, list[WeightUpdate]]:
        """Replica -> the versions its engine took since the last call; a dead or restarting one is left out."""
        refs = {name: actor.weight_updates.remote() for name, actor in self.actors.items()}
        out = {}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=self.timeout)
            except (RayActorError, RayTaskError, GetTimeoutError):
                continue
        return out

    def memory_metrics(self) -> dict[str, float]:
        """Each live replica's peak resident memory (`memory/peak_rss_mb/rollout_R`) and that of the largest process
        its engine started (`rollout_R_engine`: vLLM's worker, which holds the weights and KV cache); a dead or
        restarting one is left out of this step's row."""
        refs = {name: actor.peak_rss_mb.remote() for name, actor in self.actors.items()}
        refs |= {f"{name}_engine": actor.engine_peak_rss_mb.remote() for name, actor in self.actors.items()}
        out = {}
        for name, ref in refs.items():
            try:
                peak = ray.get(ref, timeout=self.timeout)
            except (RayActorError, RayTaskError, GetTimeoutError):
                continue
            if peak > 0:  # an engine that started no process of its own reports none
                out[MEMORY_METRIC_PREFIX + name] = peak
        return out

    def check(self) -> None:
        if self.error is not None:
            raise RolloutFailedError(f"a rollout replica failed: {self.error}") from self.error

    def join(self, timeout: float) -> None:
        if self._supervisor is not None:
            self._supervisor.join(timeout)
            if self._supervisor.is_alive():
                raise TimeoutError(f"rollout replicas did not finish within {timeout:.0f} s")
        self.check()
        log.info("rollout replicas generated %d rows (%d restarts)", self.generated, self.restarts)

    def close(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(self.timeout)  # it looks at `_stop` every 0.2 s: no restart of what is killed next
        for actor in self.actors.values():
            ray.kill(actor)
        if self.queue is not None:
            self.queue.shutdown()
        if self.trainer_cores is not None:
            self.trainer_cores.close()
            self._unlink_cores()
        torch.set_num_threads(self._threads_before)
        self._release_ray()


# ---------------------------------------------------------------------------- ranks of a training engine
class TrainRankActor:
    """One rank of a multi-rank training engine (`asyncflow.engines.fsdp2_train.RankTrainer`) as a Ray actor."""

    def node_address(self, local: bool) -> tuple[str, int]:
        """Where rank 0 listens for the process group: loopback on a local cluster, the node's IP otherwise."""
        from asyncflow.engines.fsdp2_train import free_port

        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(self, rank: int, world: int, host: str, port: int, spec) -> Node:
        from asyncflow.engines.fsdp2_train import RankTrainer

        self.trainer = RankTrainer(rank, world, host, port, spec)
        return Node.here()

    def call(self, method: str, args: tuple):
        return getattr(self.trainer, method)(*args)


class RayRanks:
    """The ranks of `asyncflow.engines.fsdp2_train` as Ray actors (a `RankGroup`), each with `num_cpus` CPUs and
    `num_gpus` GPUs. A rank that dies, raises or does not answer in time ends the call with `RankFailedError`."""

    def __init__(self, world: int, spec, timeout: float, *, num_cpus: float, num_gpus: float, local: bool,
                 resources: dict[str, float] | None = None, release_ray: Callable[[], None] | None = None):
        self._release_ray = release_ray  # the launcher's hold on Ray (`hold_ray`), released by `close`
        actor_cls = ray.remote(TrainRankActor).options(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                                                       max_restarts=0)
        self.actors: list[ActorHandle[TrainRankActor]] = [_spawn(actor_cls) for _ in range(world)]
        self.nodes: list[Node | None] = [None] * world
        try:
            host, port = self._wait([self.actors[0].node_address.remote(local)], "start", timeout)[0]
            setups = [actor.setup.remote(rank, world, host, port, spec) for rank, actor in enumerate(self.actors)]
            self.nodes = self._wait(setups, "start", timeout)
            for rank, node in enumerate(self.nodes):
                log.info("training rank %d runs on %s", rank, node)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, args, timeout: float) -> list:
        refs = [actor.call.remote(method, rank_args) for actor, rank_args in zip(self.actors, args, strict=True)]
        return self._wait(refs, method, timeout)

    def _wait(self, refs: list, method: str, timeout: float) -> list:
        from asyncflow.engines.fsdp2_train import RankFailedError

        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
            failed = [(refs.index(ref), err) for ref, err in self._failures(ready, timeout)]
            if failed:  # a dead rank is the cause of its peers' failed collectives: name it first
                time.sleep(1.0)
                late, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
                failed += [(refs.index(ref), err) for ref, err in self._failures(late, 1.0)]
                rank, err = min(failed, key=lambda f: (not isinstance(f[1], RayActorError), f[0]))
                reason = "died" if isinstance(err, RayActorError) else "failed"
                detail = (str(err.cause if isinstance(err, RayTaskError) else err).strip().splitlines() or [""])[-1]
                self.close()
                where = f" on {self.nodes[rank]}" if self.nodes[rank] is not None else ""
                raise RankFailedError(
                    f"train.engine=fsdp2: rank {rank}{where} {reason} during {method} ({detail}); the other ranks "
                    "were stopped (resume the run from its last checkpoint with --resume)"
                ) from err
            if pending and time.monotonic() > deadline:
                self.close()
                raise RankFailedError(f"train.engine=fsdp2: ranks did not finish {method} within {timeout:.0f} s "
                                      "(runtime.call_timeout_s); the ranks were stopped")
        return ray.get(refs, timeout=timeout)

    @staticmethod
    def _failures(ready: list, timeout: float) -> list:
        """(ref, error) of each finished call in `ready` whose rank died or raised."""
        out = []
        for ref in ready:
            try:
                ray.get(ref, timeout=timeout)
            except (RayActorError, RayTaskError) as err:
                out.append((ref, err))
        return out

    def close(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                log.debug("ray.kill of a train rank", exc_info=True)
        self.actors = []
        if self._release_ray is not None:
            self._release_ray()

