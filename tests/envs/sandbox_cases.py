"""Attacks on the python tool's strict sandbox, each a piece of model-written code, run by
tests/envs/test_sandbox_boundary.py as root (in the test process) and as an unprivileged user (this file run as a
script under `setpriv`, printing {case: what the tool returned} as JSON)."""

from __future__ import annotations

import json
import sys

from asyncflow.envs.sandbox import SandboxLimits, ToolLimitError, run_python

LIMITS = SandboxLimits(timeout_s=20.0, cpu_s=2, memory_mb=256, max_threads=16, scratch_mb=16)
HOST_SYSCTL = "/proc/sys/fs/lease-break-time"

CASES = {
    # S1: the host's kernel settings, and who the code runs as
    "sysctl_write": f"p = {HOST_SYSCTL!r}\nv = int(open(p).read())\nopen(p, 'w').write(str(v + 1))\nprint('wrote')",
    "proc_sys_writable": (
        "import os\nopened = 0\n"
        "for top, dirs, files in os.walk('/proc/sys'):\n"
        "    for name in files:\n"
        "        try:\n            open(os.path.join(top, name), 'w').close()\n            opened += 1\n"
        "        except OSError:\n            pass\n"
        "print('opened', opened)"),
    "identity": ("import os\ncaps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
                 "print(os.getuid(), os.geteuid(), caps[0])"),
    # S2: memory outside the address-space limit
    "sysv_shm": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "ids = [libc.shmget(0, 128 * 2**20, 0o1600) for _ in range(3)]\n"
                 "print('shm', ids, ctypes.get_errno())"),
    "dev_shm": "open('/dev/shm/fill', 'wb').write(b'x' * 64 * 2**20)\nprint('wrote')",
    "memfd": ("import os\nfd = os.memfd_create('fill')\nos.write(fd, b'x' * 64 * 2**20)\nprint('wrote')"),
    "writable_dirs": (  # every folder two levels down from / (the mounts and their parents), and /dev/shm
        "import os\nwritable = []\n"
        "for top, dirs, files in os.walk('/'):\n"
        "    if top.startswith('/proc') or top.count('/') > 2:\n        dirs[:] = []\n        continue\n"
        "    try:\n        open(os.path.join(top, '.probe'), 'w').close()\n        writable.append(top)\n"
        "    except OSError:\n        pass\n"
        "print(writable)"),
    "scratch_fill": "open('/tmp/fill', 'wb').write(b'x' * 64 * 2**20)\nprint('wrote')",
    # S3: threads
    "threads": ("import threading, time\nthreading.stack_size(32768)\nstarted = 0\n"
                "try:\n    for _ in range(1000):\n"
                "        threading.Thread(target=time.sleep, args=(1,), daemon=True).start()\n        started += 1\n"
                "except RuntimeError:\n    pass\nprint('started', started)"),
    # limits told from what the supervisor saw, not from exit codes or text
    "exit_152": "import os\nos._exit(152)",
    "exit_153": "import os\nos._exit(153)",
    "printed_memoryerror": "print('MemoryError')\nraise SystemExit(1)",
    "cpu": "while True:\n    pass",
    "output": "print('a' * 100_000)",
    "memory": "chunks = []\nwhile True:\n    chunks.append(b'x' * 2**20)",
}


def run_all(cases: dict[str, str] = CASES) -> dict[str, str]:
    """What the tool returns for each case: its output, or `refused: <message>`."""
    results = {}
    for name, code in cases.items():
        try:
            results[name] = run_python(code, LIMITS)
        except (ToolLimitError, TimeoutError) as err:
            results[name] = f"refused: {err}"
    return results


if __name__ == "__main__":
    json.dump(run_all(), sys.stdout)
