"""The strict sandbox holds when the trainer runs as root and when it runs as a normal user: the host's kernel
settings, memory outside the limit (SysV, /dev/shm, memfd), threads, and limits reported from what the supervisor
observed. Each case (tests/envs/sandbox_cases.py) runs as root in this process and, as an unprivileged uid, in a
child started through `setpriv`, in a private mount namespace where the Python install is reachable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_cases import HOST_SYSCTL, LIMITS, run_all  # noqa: E402

from asyncflow.envs.sandbox import bubblewrap_problem

pytestmark = pytest.mark.skipif(bubblewrap_problem() is not None, reason=f"no bubblewrap: {bubblewrap_problem()}")
REPO = Path(__file__).resolve().parents[2]
TEST_UID = 4242


def _blocked_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` that others cannot search (a 0700 home), or None."""
    for parent in reversed(Path(path).parents):
        if str(parent) != "/" and not os.stat(parent).st_mode & 0o001:
            return str(parent)
    return None


def _as_unprivileged_user() -> dict[str, str]:
    """run_all() as uid TEST_UID: bwrap (as root) gives it a mount namespace where the Python install and the
    checkout are reachable, and setpriv drops to the uid before the cases run."""
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    needed = [sys.base_prefix, sys.prefix, str(REPO)]
    mounts = []
    for blocked in dict.fromkeys(filter(None, map(_blocked_ancestor, needed))):
        mounts += ["--perms", "0755", "--tmpfs", blocked]
        for path in (path for path in needed if path.startswith(blocked + "/")):
            between = [str(parent) for parent in reversed(Path(path).parents) if str(parent).startswith(blocked + "/")]
            mounts += [*(arg for parent in between for arg in ("--perms", "0755", "--dir", parent)),
                       "--ro-bind", path, path]
    command = [bwrap, "--dev-bind", "/", "/", *mounts, setpriv, f"--reuid={TEST_UID}", f"--regid={TEST_UID}",
               "--clear-groups", "--inh-caps=-all", sys.executable, str(Path(__file__).with_name("sandbox_cases.py"))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module", params=["root", "user"])
def seen(request) -> dict[str, str]:
    if os.geteuid() != 0:
        if request.param == "user":
            return run_all()
        pytest.skip("the trainer does not run as root here")
    host_value = Path(HOST_SYSCTL).read_text()
    shm_before = Path("/proc/sysvipc/shm").read_text()
    results = run_all() if request.param == "root" else _as_unprivileged_user()
    assert Path(HOST_SYSCTL).read_text() == host_value, "the host's sysctl changed"
    assert Path("/proc/sysvipc/shm").read_text() == shm_before, "a SysV segment appeared on the host"
    return results


@pytest.mark.slow
def test_no_kernel_setting_of_the_host_opens_for_writing(seen):
    assert "wrote" not in seen["sysctl_write"]
    assert seen["proc_sys_writable"].strip() == "opened 0"


def test_the_code_runs_unprivileged(seen):
    uid, euid, capabilities = seen["identity"].split()
    assert uid == euid != "0" and int(capabilities, 16) == 0, seen["identity"]


def test_no_memory_outside_the_limit(seen):
    assert seen["sysv_shm"].strip() == "shm [-1, -1, -1] 1", seen["sysv_shm"]  # EPERM
    for case in ("dev_shm", "memfd", "scratch_fill"):
        assert seen[case].startswith("refused") and "wrote" not in seen[case], (case, seen[case])
    assert json.loads(seen["writable_dirs"].replace("'", '"')) == ["/tmp"], seen["writable_dirs"]


def test_threads_are_limited(seen):
    started = int(seen["threads"].split()[-1])
    assert 1 <= started < LIMITS.max_threads, seen["threads"]


@pytest.mark.parametrize("case, message", [
    ("exit_152", "python: exited with status 152: "),
    ("exit_153", "python: exited with status 153: "),
    ("printed_memoryerror", "python: exited with status 1: MemoryError"),
    ("cpu", "python: killed after 2 s of CPU time"),
    ("output", "python: output exceeded 4096 bytes"),
    ("memory", "python: exited with status 1: MemoryError (the tool's memory limit is 256 MB)"),
])  # fmt: skip
def test_limits_are_told_from_what_was_observed(seen, case, message):
    assert seen[case].startswith(f"refused: {message}"), seen[case]


def test_calls_at_once_each_get_their_own_sandbox():
    """Eight calls at once, as a rollout's ToolBox makes them: each starts (its own user namespace, id maps and
    file descriptors) and reports its own limit."""
    from concurrent.futures import ThreadPoolExecutor

    codes = ["import os\nprint(os.getuid())", "import os\nos._exit(152)"] * 4
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda code: run_all({"case": code})["case"], codes))
    assert seen[0::2] == [seen[0]] * 4 and seen[0].strip() != "0", seen
    assert all(text.startswith("refused: python: exited with status 152") for text in seen[1::2]), seen
