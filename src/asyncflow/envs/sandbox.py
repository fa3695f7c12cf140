"""The sandbox of the `python` tool: model-written code in a child process with limits.

Owns: `run_python`, `SandboxLimits`, `sandbox_command` (the bubblewrap command prefix), `SandboxUnavailable` and
`ToolLimitError`; the seccomp program is `asyncflow.envs.pyseccomp_filter`'s.

With `isolation="strict"` (the default) the child runs inside
bubblewrap: its own PID, network, IPC, UTS and mount namespaces, no capabilities, an empty environment, the system
and the Python install read-only and nothing else of the host, a private size-limited /tmp as the only writable
place; the wall-clock timeout kills bwrap, and its PID namespace (children that left the session included) dies with
it. A seccomp filter (libseccomp, through bwrap `--seccomp`) refuses the system calls that widen the kernel's attack
surface or reach outside the sandbox (`DENIED_SYSCALLS`: new namespaces, ptrace, mount, bpf, perf events, io_uring,
keyrings, modules, ...) with EPERM. Where bubblewrap or libseccomp cannot run, `strict` refuses with
`SandboxUnavailable` naming what is missing; `weak` keeps only the in-process layers. In both, the child runs
`python -I` (no user site, no environment variables read), sets its own hard rlimits before the code runs
(RLIMIT_CPU, RLIMIT_AS for memory, RLIMIT_FSIZE for output: stdout and stderr go to a file, so a flood is stopped by
the kernel with SIGXFSZ, RLIMIT_NOFILE) and installs an audit hook that refuses `socket.*` events and process
creation (a hook is not a boundary: ctypes passes it; the namespaces are the boundary). `weak` adds `unshare -rn`
(no network) where unprivileged user namespaces exist.

Invariants: every run is bounded by `timeout_s` of wall clock (the child and its PID namespace are killed); the
child never sees the trainer's environment variables; `strict` never silently falls back to `weak`.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from asyncflow.envs.pyseccomp_filter import SeccompUnavailable, seccomp_filter

_CHILD = r"""
import resource, sys
cpu, memory, output = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL one second later
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
    """`strict`: inside a bubblewrap sandbox (`sandbox_command`); `weak`: the audit hook and rlimits only."""
    scratch_mb: int = 16


CHILD_ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}


class SandboxUnavailable(RuntimeError):
    """The isolation the config asks for cannot be had on this machine."""


@functools.lru_cache(maxsize=1)
def bubblewrap_problem() -> str | None:
    """Why a bubblewrap sandbox cannot run here (None: it can): bwrap missing, or its namespaces refused."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap; scripts/setup.sh does it)"
    try:
        probe = subprocess.run([*_bwrap_args(bwrap, 1), "/bin/true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap could not start: {err}"
    if probe.returncode != 0:
        return f"bwrap cannot create its namespaces here: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


def _bwrap_args(bwrap: str, scratch_mb: int) -> list[str]:
    """A fresh PID, network, IPC, UTS and mount namespace; no environment; no capabilities; the system and the
    Python install read-only, nothing else of the host (no home, run folders, sockets, /proc of the host); a
    private size-limited /tmp the only writable place; killed with its parent, its whole PID namespace with it."""
    binds = []
    for path in dict.fromkeys(["/usr", "/lib", "/lib64", "/bin", sys.base_prefix]):
        if os.path.exists(path):
            binds += ["--ro-bind", path, path]
    return [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", *binds, "--proc", "/proc", "--dev", "/dev",
            "--size", str(scratch_mb * 2**20), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp"]


def _seccomp_program() -> bytes:
    """`seccomp_filter()`, its libseccomp missing as `SandboxUnavailable`."""
    try:
        return seccomp_filter()
    except SeccompUnavailable as err:
        raise SandboxUnavailable(str(err)) from err


def sandbox_command(limits: SandboxLimits, seccomp_fd: int | None = None) -> list[str]:
    """The command prefix and interpreter that run the child of `run_python` at `limits.isolation` (`strict`: with
    the seccomp program readable at `seccomp_fd`)."""
    if limits.isolation == "weak":
        return [*network_namespace_prefix(), sys.executable]
    problem = bubblewrap_problem()
    if problem is None:
        try:
            _seccomp_program()
        except SandboxUnavailable as err:
            problem = str(err)
    if problem is not None:
        raise SandboxUnavailable(f"env.python_isolation=strict: {problem}; set env.python_isolation=weak to run "
                                 "model-written code with the audit hook and rlimits only, knowingly")
    seccomp = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    return [*_bwrap_args(shutil.which("bwrap"), limits.scratch_mb), *seccomp, os.path.realpath(sys.executable)]


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """Run `code` in the sandbox (module docstring); returns its stdout+stderr, or raises `ToolLimitError` naming
    the limit it hit (`TimeoutError` for the wall clock)."""
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as program:
        pass_fds = ()
        if limits.isolation == "strict":
            program.write(_seccomp_program())
            program.seek(0)
            pass_fds = (program.fileno(),)
        command = [
            *sandbox_command(limits, *pass_fds), "-I", "-c", _CHILD,
            str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.max_output_bytes + 1),
        ]
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True, cwd=tempfile.gettempdir(),
            env=CHILD_ENVIRONMENT,  # nothing of the trainer's (API keys), for bwrap itself too: /proc/1/environ
            pass_fds=pass_fds,
        )
        try:
            child.communicate(code.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise TimeoutError(f"python: killed after the {limits.timeout_s:g} s time limit") from None
        out.seek(0)
        text = out.read(limits.max_output_bytes + 1).decode("utf-8", errors="replace")
    # the signal that ended the child: negative status from Popen, 128 + signal from bwrap's init
    killed_by = -child.returncode if child.returncode < 0 else (child.returncode - 128 if child.returncode > 128 else 0)
    killed_by = killed_by if killed_by in signal.valid_signals() else 0  # sys.exit(200) is no signal
    if killed_by == signal.SIGXFSZ or len(text) > limits.max_output_bytes:
        raise ToolLimitError(f"python: output exceeded {limits.max_output_bytes} bytes")
    if killed_by == signal.SIGXCPU:
        raise ToolLimitError(f"python: killed after {limits.cpu_s} s of CPU time")
    lines = text.strip().splitlines()
    if child.returncode != 0 and lines and lines[-1].startswith("MemoryError"):  # raised, not merely printed
        raise ToolLimitError(f"python: exceeded the {limits.memory_mb} MB memory limit")
    if killed_by:
        raise ToolLimitError(f"python: killed by {signal.Signals(killed_by).name}")
    if child.returncode != 0:
        raise ToolLimitError(f"python: exited with status {child.returncode}: {lines[-1] if lines else ''}")
    return text


class ToolLimitError(RuntimeError):
    """A tool hit one of its limits (CPU, memory, output) or failed; the message is shown to the model."""


