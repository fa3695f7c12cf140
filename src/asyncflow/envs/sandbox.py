"""The sandbox of the `python` tool: model-written code in a child process with limits.

Owns: `run_python`, `SandboxLimits`, `check_isolation`, `bubblewrap_problem`, `SandboxUnavailable` and
`ToolLimitError`; the seccomp program is `asyncflow.envs.pyseccomp_filter`'s.

With `isolation="strict"` (the default) the child runs inside bubblewrap, in its own user, PID, network, IPC, UTS
and mount namespaces, as an unprivileged uid with no capabilities:
- as a normal user, bwrap maps that user's uid into the new user namespace;
- as root, bwrap waits (`--userns-block-fd`) while this process maps `limits.sandbox_uid` (default 65534,
  `nobody`) into the namespace beside uid 0, which bwrap needs for its own setup; the child's first act, before any
  model-written code, is to drop to `sandbox_uid` (groups, gid, uid), which clears its last capabilities. Host files
  owned by root, `/proc/sys` included, are then someone else's files.
The mount namespace holds the system and the Python install read-only, an empty read-only `/proc/sys` over the
sandbox's own `/proc`, a `/dev` of `null`, `zero`, `random` and `urandom` only (no `/dev/shm`, no pts), and a
private size-limited `/tmp`, the only writable place; the root is read-only. A seccomp filter (libseccomp, through
bwrap `--seccomp`) refuses with EPERM the system calls that widen the kernel's attack surface, reach outside the
sandbox or hold memory outside RLIMIT_AS (`DENIED_SYSCALLS`: new namespaces, ptrace, mount, bpf, io_uring,
keyrings, SysV IPC, memfd, pidfd signals, ...). Where bubblewrap or libseccomp cannot run, `strict` refuses with
`SandboxUnavailable` naming what is missing; `weak` keeps only the in-process layers.

In both, the child runs `python -I` (no user site, no environment variables read), sets hard rlimits before the
code runs (RLIMIT_CPU, RLIMIT_AS for memory, RLIMIT_FSIZE for output: stdout and stderr go to a file, so a flood
is stopped by the kernel with SIGXFSZ, RLIMIT_NOFILE, and RLIMIT_NPROC: threads, counted in the sandbox's own user
namespace under `strict`) and installs an audit hook that refuses `socket.*` events and process creation (a hook is
not a boundary: ctypes passes it; the namespaces are the boundary). `weak` adds `unshare -rn` (no network) where
unprivileged user namespaces exist.

A limit is reported from what this process observed, never from an exit status or text the code controls: output
from the size of the output file, CPU time from the kernel's accounting of the child (`wait4`), the wall clock from
this process's own timer. Memory is refused by the kernel (RLIMIT_AS) as a `MemoryError` inside the code, which the
code may catch: the tool shows it as the code's own failure, with the limit beside it.

Invariants: every run is bounded by `timeout_s` of wall clock (the child and its PID namespace are killed); the
child never sees the trainer's environment variables; `strict` never silently falls back to `weak`; under
`strict` model-written code never runs as uid 0 of the host.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from asyncflow.envs.pyseccomp_filter import SeccompUnavailable, seccomp_filter

_CHILD = r"""
import os, resource, sys
uid, cpu, memory, output, threads = (int(x) for x in sys.argv[1:6])
if uid >= 0:  # started by root: leave uid 0, and with it every capability, before anything else
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
if threads:  # strict only: counted in the sandbox's own user namespace, not over all of the user's processes
    resource.setrlimit(resource.RLIMIT_NPROC, (threads, threads))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # SIGKILL at the limit
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
code = sys.stdin.read()
_BLOCKED = ("subprocess.Popen", "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn")
def _guard(event, args):
    if event.startswith("socket.") or event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_guard)
del _guard
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""

_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_SETUP_TIMEOUT_S = 10.0
"""How long bwrap may take to report its user namespace (as root) before the start counts as failed."""
_CPU_EVIDENCE = 0.9
"""A failed run that used this fraction of `cpu_s` was ended by the CPU limit: the kernel kills at the limit, but
the CPU time `wait4` reports can fall short of it (by 57 ms of 2 s, seen with 8 sandboxes at once)."""


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """`("unshare", "-rn")` when an unprivileged user + network namespace can be made here, else `()` (the audit
    hook alone then refuses sockets)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (unshare, "-rn") if ok else ()


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 256
    max_output_bytes: int = 4096
    isolation: str = "strict"
    """`strict`: inside a bubblewrap sandbox (module docstring); `weak`: the audit hook and rlimits only."""
    scratch_mb: int = 16
    """Size of the private `/tmp` (`strict`), the only place the code can write."""
    max_threads: int = 16
    """Threads of the code, its main thread included (RLIMIT_NPROC in the sandbox's user namespace)."""
    sandbox_uid: int = 65534
    """The host uid (and gid) the code runs as when the trainer is root (`strict`); `nobody` by default."""

    def __post_init__(self) -> None:
        if self.sandbox_uid <= 0 or self.max_threads < 1:
            raise ValueError(f"sandbox_uid must be a positive uid (got {self.sandbox_uid}) and max_threads at least 1 "
                             f"(got {self.max_threads})")


CHILD_ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}


class SandboxUnavailable(RuntimeError):
    """The isolation the config asks for cannot be had on this machine."""


class ToolLimitError(RuntimeError):
    """A tool hit one of its limits (CPU, memory, output) or failed; the message is shown to the model."""


def _as_root() -> bool:
    return os.geteuid() == 0


def _bwrap_args(bwrap: str, scratch_mb: int, userns_fds: tuple[int, int] | None) -> list[str]:
    """A fresh user, PID, network, IPC, UTS and mount namespace; no environment; no capabilities (as root, only
    CAP_SETUID/CAP_SETGID inside the user namespace, for the child's drop to the sandbox uid); the system and the
    Python install read-only, nothing else of the host; `/proc/sys` empty and read-only; a `/dev` of four
    devices; a private size-limited /tmp the only writable place; killed with its parent, its whole PID namespace
    with it. `userns_fds` (info, block): bwrap reports its child's pid on the first and waits on the second
    until the user namespace's id maps are written (`_map_ids`)."""
    binds = [path for path in dict.fromkeys(["/usr", "/lib", "/lib64", "/bin", sys.base_prefix])
             if os.path.exists(path)]
    # parents of the binds, made traversable: a Python install under a 0700 home must be readable by the sandbox uid
    parents = dict.fromkeys(str(parent) for path in binds for parent in reversed(Path(path).parents)
                            if str(parent) != "/")
    args = [bwrap, "--unshare-all", "--unshare-user", "--as-pid-1", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--cap-drop", "ALL"]
    if userns_fds is not None:
        info_fd, block_fd = userns_fds
        args += ["--info-fd", str(info_fd), "--userns-block-fd", str(block_fd),
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for parent in parents:
        args += ["--perms", "0755", "--dir", parent]
    for path in binds:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--tmpfs", "/proc/sys", "--remount-ro", "/proc/sys", "--perms", "0755", "--dir", "/dev"]
    for device in _DEVICES:
        args += ["--dev-bind", device, device]
    return [*args, "--perms", "1777", "--size", str(scratch_mb * 2**20), "--tmpfs", "/tmp", "--remount-ro", "/",
            "--chdir", "/tmp"]


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` becomes readable within `timeout_s` (poll: a trainer's descriptors may number past select's
    1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


def _read_child_pid(info_fd: int, deadline: float) -> int:
    """The pid bwrap writes (JSON `child-pid`) to `info_fd` once its namespaces exist; `SandboxUnavailable` when
    it closes the pipe first or takes past `deadline`."""
    data = b""
    while True:
        if not _readable(info_fd, deadline - time.monotonic()):
            raise SandboxUnavailable(f"bwrap did not report its namespaces within {_SETUP_TIMEOUT_S:g} s")
        chunk = os.read(info_fd, 4096)
        if not chunk:
            raise SandboxUnavailable("bwrap exited before creating its namespaces")
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except ValueError:  # not the whole document yet
            continue


def _map_ids(pid: int, sandbox_uid: int) -> None:
    """Map uid/gid 0 (bwrap's own setup) and `sandbox_uid` (the code) into the user namespace of `pid`."""
    for name in ("uid_map", "gid_map"):
        Path(f"/proc/{pid}/{name}").write_text(f"0 0 1\n{sandbox_uid} {sandbox_uid} 1\n")


def _start(limits: SandboxLimits, command: list[str], seccomp_fd: int | None, **popen) -> subprocess.Popen:
    """`command` in bwrap at `limits` (strict; `seccomp_fd`: the filter program to load), returned once the code
    inside can run. Popen keywords pass through; the environment is `CHILD_ENVIRONMENT` (nothing of the
    trainer's, for bwrap itself too: /proc/1/environ)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap; "
                                 "scripts/setup.sh does it)")
    seccomp = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    fds = tuple(popen.pop("pass_fds", ()))
    popen.update(env=CHILD_ENVIRONMENT, start_new_session=True, cwd=tempfile.gettempdir())
    if not _as_root():
        return subprocess.Popen([*_bwrap_args(bwrap, limits.scratch_mb, None), *seccomp, *command], pass_fds=fds,
                                **popen)
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    try:  # each fd closed exactly once: a second close could hit another thread's new fd of the same number
        try:
            child = subprocess.Popen([*_bwrap_args(bwrap, limits.scratch_mb, (info_write, block_read)), *seccomp,
                                      *command], pass_fds=(*fds, info_write, block_read), **popen)
        finally:
            os.close(info_write)
            os.close(block_read)
        try:
            _map_ids(_read_child_pid(info_read, time.monotonic() + _SETUP_TIMEOUT_S), limits.sandbox_uid)
            os.write(block_write, b"1")
        except BaseException:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        return child
    finally:
        os.close(info_read)
        os.close(block_write)


@functools.lru_cache(maxsize=1)
def bubblewrap_problem() -> str | None:
    """Why a bubblewrap sandbox cannot run here (None: it can): bwrap missing, or its namespaces refused."""
    try:
        with tempfile.TemporaryFile() as errors:
            probe = _start(SandboxLimits(scratch_mb=1), ["/bin/true"], None, stdout=errors, stderr=errors)
            if probe.wait(timeout=20) != 0:
                errors.seek(0)
                return f"bwrap cannot create its namespaces here: {errors.read().decode(errors='replace')[:200]}"
    except SandboxUnavailable as err:
        return str(err)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap could not start: {err}"
    return None


def check_isolation(limits: SandboxLimits) -> None:
    """Raise `SandboxUnavailable` (naming what is missing and the key that accepts less) when `limits.isolation`
    cannot be had here; `weak` always can."""
    if limits.isolation == "weak":
        return
    problem = bubblewrap_problem()
    if problem is None:
        try:
            seccomp_filter()
        except SeccompUnavailable as err:
            problem = str(err)
    if problem is not None:
        raise SandboxUnavailable(f"env.python_isolation=strict: {problem}; set env.python_isolation=weak to run "
                                 "model-written code with the audit hook and rlimits only, knowingly")


def _wait(child: subprocess.Popen, timeout_s: float) -> resource.struct_rusage:
    """Reap `child` within `timeout_s` and return its resource usage (its reaped descendants included); past the
    timeout its process group is killed and `TimeoutError` raised."""
    pidfd = os.pidfd_open(child.pid)
    try:
        exited = _readable(pidfd, timeout_s)
    finally:
        os.close(pidfd)
    if not exited:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise TimeoutError(f"python: killed after the {timeout_s:g} s time limit")
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return usage


def _limit_error(limits: SandboxLimits, returncode: int, usage: resource.struct_rusage, output_bytes: int,
                last_line: str) -> ToolLimitError | None:
    """The error to report for a finished child (None: it succeeded), from what the supervisor observed: the
    output file's size and the kernel's CPU-time accounting of the child. The exit status and `last_line` (text
    the code controls) only describe a failure, never make it a limit: a `MemoryError` is the code's own
    exception (RLIMIT_AS refuses the allocation; the code may catch it), shown with the limit beside it."""
    if output_bytes > limits.max_output_bytes:
        return ToolLimitError(f"python: output exceeded {limits.max_output_bytes} bytes")
    if returncode == 0:
        return None
    if usage.ru_utime + usage.ru_stime >= _CPU_EVIDENCE * limits.cpu_s:
        return ToolLimitError(f"python: killed after {limits.cpu_s} s of CPU time")
    ended = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with status {returncode}"
    note = f" (the tool's memory limit is {limits.memory_mb} MB)" if last_line.startswith("MemoryError") else ""
    return ToolLimitError(f"python: {ended}: {last_line}{note}")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """Run `code` in the sandbox (module docstring); returns its stdout+stderr, or raises `ToolLimitError` naming
    the limit it hit (`TimeoutError` for the wall clock)."""
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    check_isolation(limits)
    strict = limits.isolation == "strict"
    drop_to = limits.sandbox_uid if strict and _as_root() else -1
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as program:
        source.write(code.encode())
        source.seek(0)
        child_args = ["-I", "-c", _CHILD, str(drop_to), str(limits.cpu_s), str(limits.memory_mb * 2**20),
                      str(limits.max_output_bytes + 1), str(limits.max_threads if strict else 0)]
        if strict:
            program.write(seccomp_filter())
            program.seek(0)
            child = _start(limits, [os.path.realpath(sys.executable), *child_args], program.fileno(), stdin=source,
                           stdout=out, stderr=out, pass_fds=(program.fileno(),))
        else:
            child = subprocess.Popen([*network_namespace_prefix(), sys.executable, *child_args], stdin=source,
                                     stdout=out, stderr=out, start_new_session=True, cwd=tempfile.gettempdir(),
                                     env=CHILD_ENVIRONMENT)
        usage = _wait(child, limits.timeout_s)
        output_bytes = os.fstat(out.fileno()).st_size
        out.seek(0)
        text = out.read(limits.max_output_bytes + 1).decode("utf-8", errors="replace")
    lines = text.strip().splitlines()
    error = _limit_error(limits, child.returncode, usage, output_bytes, lines[-1] if lines else "")
    if error is not None:
        raise error
    return text
