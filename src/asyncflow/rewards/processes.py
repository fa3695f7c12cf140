"""Reward scoring in worker processes that are killed when a call runs past its timeout.

Owns: `ProcessPool`, the engine of `RewardRunner(isolation="process")`.
Invariants:
- At most `max_workers` live worker processes and no extra thread in the parent. A worker is a fresh
  interpreter (`python -c`, started with subprocess: never `fork`, the parent holds torch and Ray
  threads; not `multiprocessing`, whose spawn/forkserver re-import the caller's `__main__`, which
  breaks an unguarded user script). It gets the parent's `sys.path`, so `module:function` rewards
  load as in the parent.
- A worker receives chunks of samples over a pipe and writes every sample's result into memory shared
  with the parent as it goes, and where it is (position in the chunk, start time) into a shared slot:
  the parent enforces the per-sample timeout without a message per sample; one message per chunk each way.
- A sample past its timeout: its worker is killed (SIGKILL) and replaced; the sample counts as a
  timeout, the samples that worker had finished keep their results, the rest of its chunk go back to
  the queue. A worker that dies on its own (segfault, `os._exit`, out of memory): the sample it was in
  fails (kind "died"), same recovery. A worker whose parent is gone exits within a second, even if its
  reward call is hung. Nothing is left behind: no stuck thread, no stray process.
- Scores are those of in-process scoring: the same `contract.call_reward` runs in the worker.
- A reward function that cannot be loaded in a worker (its module does not import there) raises
  `RewardSpecError` from `score` instead of failing every sample; a worker that does not start within
  `START_TIMEOUT_S` raises RuntimeError.
- `score` calls are serialized (one lock); workers ignore SIGINT (the parent handles Ctrl-C).
- POSIX only (pipes and shared memory are passed to the worker as inherited file descriptors).

Cost, measured for `numeric_match` on 1000 samples with 4 workers on the shared 2-core machine: about
10-55 us per sample of wall time more than calling it directly (threads: 9-19 us; the machine was loaded,
so these vary), and a worker start of about 0.1-0.4 s (a fresh interpreter importing `asyncflow.rewards`),
paid once and again after each kill. Use it for reward functions that may hang, not for the cheap ones.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for

from asyncflow.rewards.contract import Failure, RewardFn, RewardSpecError, call_reward

CHUNK = 64  # most samples sent to a worker at once (and the size of its shared result arrays)
START_TIMEOUT_S = 60.0  # a worker must be ready (its reward function loaded) within this
_SHARED_BYTES = 16 + 9 * CHUNK  # slot: 2 doubles; values: CHUNK doubles; status: CHUNK bytes

# The worker's entry point: fds of its two pipe ends and of the shared memory are its arguments.
_BOOT = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]), writable=False)\n"
    "sys.path[:] = conn.recv()\n"
    "from asyncflow.rewards.processes import worker_main\n"
    "worker_main(conn, Connection(int(sys.argv[2]), readable=False), int(sys.argv[3]), int(sys.argv[4]))\n"
)


class _Shared:
    """The memory a worker shares with the parent: slot [position, start], values, status."""

    def __init__(self, fd: int):
        self.memory = mmap.mmap(fd, _SHARED_BYTES)
        self.slot = (ctypes.c_double * 2).from_buffer(self.memory, 0)
        self.values = (ctypes.c_double * CHUNK).from_buffer(self.memory, 16)
        self.status = (ctypes.c_byte * CHUNK).from_buffer(self.memory, 16 + 8 * CHUNK)  # 0 pending, 1 ok, 2 failed


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(requests: Connection, replies: Connection, shared_fd: int, parent_pid: int) -> None:
    """A worker process: load the reward function, then score chunks until told to stop."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    shared = _Shared(shared_fd)
    slot, values, status = shared.slot, shared.values, shared.status
    try:
        fn_name, fn = requests.recv_bytes().decode(), pickle.loads(requests.recv_bytes())
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
        replies.send(("broken", f"{type(err).__name__}: {err}"))
        return
    replies.send(("ready",))
    while True:
        try:
            items = requests.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if items is None:
            return
        failures = []
        for j, (completion, ground_truth, metadata) in enumerate(items):
            slot[1] = time.monotonic()  # start first: the parent reads the position, then the start
            slot[0] = j
            value, failure = call_reward(fn, fn_name, completion, ground_truth, metadata)
            if failure is None:
                values[j] = value
                status[j] = 1
            else:
                status[j] = 2
                failures.append((j, failure))
        replies.send(("done", failures))


class _Worker:
    """One worker process, its two pipes and the memory it shares with the parent."""

    def __init__(self, fn_bytes: bytes, fn_name: str):
        if hasattr(os, "memfd_create"):
            shared_fd = os.memfd_create("asyncflow-reward")
        else:
            with tempfile.TemporaryFile() as file:
                shared_fd = os.dup(file.fileno())
        os.ftruncate(shared_fd, _SHARED_BYTES)
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        child_fds = (to_child_r, from_child_w, shared_fd)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, *map(str, child_fds), str(os.getpid())],
                pass_fds=child_fds, stdin=subprocess.DEVNULL,
            )
            self.shared = _Shared(shared_fd)
        finally:
            for fd in child_fds:
                os.close(fd)
        self.requests = Connection(to_child_w, readable=False)
        self.conn = Connection(from_child_r, writable=False)  # replies
        self.requests.send(sys.path)
        self.requests.send_bytes(fn_name.encode())
        self.requests.send_bytes(fn_bytes)
        self.slot, self.values, self.status = self.shared.slot, self.shared.values, self.shared.status
        self.started = time.monotonic()
        self.ready = False
        self.chunk: list[int] | None = None  # sample indices being scored

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def send(self, indices: list[int], items: list[tuple]) -> None:
        ctypes.memset(self.status, 0, len(indices))
        self.slot[1] = time.monotonic()
        self.slot[0] = 0
        self.chunk = indices
        self.requests.send(items)

    def stop(self, kill: bool = False) -> None:
        if not kill:
            try:
                self.requests.send(None)
                self.process.wait(2.0)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                kill = True
        if kill and self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.requests.close()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.stop()
        except Exception:  # noqa: BLE001, S110 - best effort at shutdown
            pass
    workers.clear()


class ProcessPool:
    """`max_workers` reward worker processes; see the module invariants."""

    def __init__(self, fn: RewardFn, fn_name: str, max_workers: int, timeout_s: float):
        self.fn_name = fn_name
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.kills = 0  # worker processes killed for running past the timeout
        self._fn_bytes = pickle.dumps(fn)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def close(self) -> None:
        _stop_all(self._workers)  # the finalizer stays armed for workers started by a later `score`

    def score(self, completions: list[str], ground_truths: list[str],
              metadatas: list[dict | None]) -> tuple[list[float], list[tuple[int, Failure]]]:
        with self._lock:
            return self._score(completions, ground_truths, metadatas)

    def _score(self, completions, ground_truths, metadatas):
        n = len(completions)
        rewards = [0.0] * n
        failures: list[tuple[int, Failure]] = []
        pending = deque(range(n))
        remaining = n
        while len(self._workers) < self.max_workers:
            self._workers.append(_Worker(self._fn_bytes, self.fn_name))
        while remaining:
            for worker in self._workers:
                if worker.ready and worker.chunk is None and pending:
                    size = min(CHUNK, -(-len(pending) // (2 * len(self._workers))))
                    indices = [pending.popleft() for _ in range(size)]
                    try:
                        worker.send(indices, [(completions[i], ground_truths[i], metadatas[i]) for i in indices])
                    except OSError:  # it died while idle: nothing of this chunk ran
                        worker.chunk = None
                        pending.extendleft(reversed(indices))
                        self._recover(worker, "died", rewards, failures, pending)
            deadline = time.monotonic() + self.timeout_s
            for worker in self._workers:
                if worker.chunk is not None:
                    deadline = min(deadline, worker.slot[1] + self.timeout_s)
                elif not worker.ready:
                    deadline = min(deadline, worker.started + START_TIMEOUT_S)
            by_conn = {worker.conn: worker for worker in self._workers}
            for conn in wait_for(list(by_conn), timeout=max(deadline - time.monotonic(), 0.001)):
                worker = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the process died on its own
                    if not worker.ready:
                        worker.stop(kill=True)
                        self.close()
                        raise RewardSpecError(
                            f"a worker process for reward {self.fn_name!r} died while loading it (exit code "
                            f"{worker.exitcode}; reward.isolation: process)"
                        ) from None
                    remaining -= self._recover(worker, "died", rewards, failures, pending)
                    continue
                if message[0] == "ready":
                    worker.ready = True
                elif message[0] == "done":
                    remaining -= self._collect(worker, message[1], rewards, failures)
                else:  # "broken": the reward function cannot be loaded in a worker process
                    self.close()
                    raise RewardSpecError(
                        f"reward {self.fn_name!r} cannot be loaded in a worker process (reward.isolation: process): "
                        f"{message[1]}"
                    )
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.chunk is not None:
                    position, start = int(worker.slot[0]), worker.slot[1]
                    if now - start >= self.timeout_s:
                        remaining -= self._recover(worker, "timeout", rewards, failures, pending, position)
                elif not worker.ready and now - worker.started > START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"a reward worker process for {self.fn_name!r} did not start within "
                                       f"{START_TIMEOUT_S:g} s")
        return rewards, failures

    def _collect(self, worker: _Worker, chunk_failures, rewards, failures) -> int:
        """Results of a finished chunk; returns the number of samples settled."""
        indices = worker.chunk
        assert indices is not None, "only a worker with a chunk finishes one"
        worker.chunk = None
        status = worker.status[: len(indices)]
        values = worker.values[: len(indices)]
        details = dict(chunk_failures)
        for k, i in enumerate(indices):
            if status[k] == 1:
                rewards[i] = values[k]
            else:
                failures.append((i, details[k]))
        return len(indices)

    def _recover(self, worker: _Worker, kind: str, rewards, failures, pending, position: int | None = None) -> int:
        """`worker` ran past the timeout at chunk `position` (kind "timeout") or died ("died"): end and
        replace it, keep what it finished, fail the sample it was in, requeue the rest. Returns the
        number of samples settled."""
        try:
            if worker.conn.poll(0):  # it finished the chunk after all, just before being judged
                message = worker.conn.recv()
                if message[0] == "done":
                    return self._collect(worker, message[1], rewards, failures)
        except (EOFError, OSError):
            pass
        worker.stop(kill=True)
        if kind == "timeout":
            self.kills += 1
        else:
            position = int(worker.slot[0])
        self._workers[self._workers.index(worker)] = _Worker(self._fn_bytes, self.fn_name)
        if worker.chunk is None:  # died while idle
            return 0
        settled = 0
        requeue = []
        for k, i in enumerate(worker.chunk):
            status = worker.status[k]
            if status == 1:
                rewards[i] = worker.values[k]
            elif status == 2:
                failures.append((i, Failure(self.fn_name, "error:unknown", "failed (the error was lost when its worker "
                                            "process ended)")))
            elif k == position and kind == "timeout":
                failures.append((i, Failure(self.fn_name, "timeout", f"ran past its {self.timeout_s:g} s timeout "
                                            "(its worker process was killed)")))
            elif k == position:
                failures.append((i, Failure(self.fn_name, "died", f"killed its worker process (exit code "
                                            f"{worker.exitcode})")))
            else:
                requeue.append(i)
                continue
            settled += 1
        pending.extendleft(reversed(requeue))
        return settled
