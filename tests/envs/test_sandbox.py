"""The python tool's sandbox is an OS boundary: one test per attack, each against the host or the trainer,
run as the trainer runs (root on these machines). Each failed on the audit-hook-only sandbox (`weak`), except
where noted; `strict` needs bubblewrap (scripts/setup.sh installs it) and its absence is itself tested."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from asyncflow.envs.sandbox import (
    SandboxLimits,
    SandboxUnavailable,
    ToolLimitError,
    bubblewrap_problem,
    check_isolation,
    run_python,
)

needs_bwrap = pytest.mark.skipif(bubblewrap_problem() is not None, reason=f"no bubblewrap: {bubblewrap_problem()}")
STRICT = SandboxLimits(timeout_s=10.0, cpu_s=5, isolation="strict")


def run(code: str, limits: SandboxLimits = STRICT) -> str:
    try:
        return run_python(code, limits)
    except (ToolLimitError, TimeoutError) as err:
        return f"refused: {err}"


@needs_bwrap
def test_cannot_signal_the_trainer():
    out = run("import os\nprint(os.getppid())\nos.kill(os.getppid(), 9)\nprint('sent')")
    assert os.getpid() and str(os.getpid()) not in out.splitlines()[:1], "the trainer is not its parent in sight"
    assert run("print(1+1)").strip() == "2", "the trainer and the tool are alive"


@needs_bwrap
def test_sees_no_environment_of_the_trainer(monkeypatch):
    monkeypatch.setenv("ASYNCFLOW_API_KEY", "secret-key-123")
    assert "secret-key-123" not in run("import os\nprint(dict(os.environ))\nprint(open('/proc/1/environ').read())")


@needs_bwrap
@pytest.mark.parametrize("code", [
    "import ctypes\nctypes.CDLL(None).system(b'touch /tmp/escaped_ctypes_system')",
    "import ctypes, os\npid = ctypes.CDLL(None).fork()\nif pid == 0:\n    open('/tmp/escaped_ctypes_fork', 'w')\n",
    "import multiprocessing as mp\nctx = mp.get_context('spawn')\np = ctx.Process(target=print)\np.start()",
    "import _posixsubprocess, os\nprint('ok')",
])  # fmt: skip
def test_processes_it_starts_stay_inside(code, tmp_path):
    run(code)
    assert not list(Path("/tmp").glob("escaped_*")), "a child reached the host's /tmp"


@needs_bwrap
@pytest.mark.slow
def test_a_session_leaving_child_dies_with_the_timeout():
    marker = f"/tmp/asyncflow-outlived-{os.getpid()}"
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3)\n"
            f"    open({marker!r}, 'w')\nelse:\n    time.sleep(60)")
    assert run(code, SandboxLimits(timeout_s=1.0, isolation="strict")).startswith("refused")
    time.sleep(4)
    assert not os.path.exists(marker), "the detached child outlived the timeout (or wrote to the host)"


@needs_bwrap
@pytest.mark.slow
def test_no_filesystem_outside_its_scratch(tmp_path):
    secret = tmp_path / "run_folder_secret.txt"
    secret.write_text("weights")
    out = run(f"print(open({str(secret)!r}).read())")
    assert "weights" not in out
    run(f"open({str(tmp_path / 'written')!r}, 'w').write('x')\nopen('/root/planted', 'w').write('x')")
    assert not (tmp_path / "written").exists() and not Path("/root/planted").exists()
    assert run("open('/tmp/ok', 'w').write('scratch')\nprint(open('/tmp/ok').read())").strip() == "scratch"
    assert run("open('/tmp/big', 'wb').write(b'x' * 64_000_000)").startswith("refused"), "scratch is size-limited"


@needs_bwrap
def test_no_unix_socket_and_no_network(tmp_path):
    import socket

    path = str(tmp_path / "host.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    server.settimeout(0.5)
    run(f"import _socket\ns = _socket.socket(_socket.AF_UNIX)\ns.connect({path!r})")
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()


@needs_bwrap
def test_no_proc_of_the_trainer():
    out = run(f"import os\nprint(os.path.exists('/proc/{os.getpid()}/mem'))")
    assert out.strip() == "False"


def test_strict_refuses_without_bubblewrap(monkeypatch):
    import asyncflow.envs.sandbox as sandbox

    monkeypatch.setattr(sandbox, "bubblewrap_problem", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(SandboxUnavailable, match="env.python_isolation=weak"):
        check_isolation(SandboxLimits(isolation="strict"))


def test_a_printed_memoryerror_is_not_the_memory_limit():
    assert "MemoryError" in run("print('MemoryError')", SandboxLimits(isolation="weak"))


SECCOMP_PROBE = """
import ctypes, threading
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(result):
    return ctypes.get_errno() if result == -1 else 0
print('status', [line.split()[1] for line in open('/proc/self/status') if line.startswith('Seccomp:')][0])
print('unshare', errno_of(libc.unshare(0x10000000)))
print('ptrace', errno_of(libc.ptrace(16, 1, 0, 0)))
print('mount', errno_of(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))
print('bpf', errno_of(libc.syscall(321, 0, 0, 0)))
print('io_uring_setup', errno_of(libc.syscall(425, 1, 0)))
print('keyctl', errno_of(libc.syscall(250, 0, 0, 0, 0, 0)))
print('clone_newuser', errno_of(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)))
print('fork', errno_of(libc.fork()))
print('socket_inet', errno_of(libc.socket(2, 1, 0)))
print('kill_init', errno_of(libc.kill(1, 0)))
print('kill_group', errno_of(libc.kill(-1, 0)))
pair = (ctypes.c_int * 2)()
print('socketpair', libc.socketpair(1, 1, 0, pair))
done = []
thread = threading.Thread(target=lambda: done.append(1))
thread.start(); thread.join()
print('thread', done)
"""


@needs_bwrap
def test_a_seccomp_filter_refuses_what_widens_the_kernels_surface():
    """Without the filter, code in the sandbox (no capabilities, but root in its user namespace) could create
    user namespaces and processes, trace, open inet sockets, signal bwrap's init, and reach bpf, io_uring and
    keyrings: kernel surface an escape starts from. EPERM (1) for each, through ctypes too; threads and a unix
    socketpair still work (the audit hook, which ctypes passes, is not what stops them)."""
    seen = dict(line.split(" ", 1) for line in run(SECCOMP_PROBE).strip().splitlines())
    assert seen.pop("status") == "2", "the filter is in force"
    assert seen.pop("thread") == "[1]" and seen.pop("socketpair") == "0"
    refused = ["unshare", "ptrace", "mount", "bpf", "io_uring_setup", "keyctl", "clone_newuser", "fork",
               "socket_inet", "kill_init", "kill_group"]
    assert seen == dict.fromkeys(refused, "1"), seen
