"""The seccomp filter of the python tool's strict sandbox (`asyncflow.envs.sandbox`), through libseccomp's Python
binding (`pyseccomp`, imported here only).

Owns: `DENIED_SYSCALLS`, `seccomp_filter` (the BPF program bwrap `--seccomp` loads) and `SeccompUnavailable`.

Invariant: the program is built once per process (cached); a missing binding or libseccomp.so.2 is a
`SeccompUnavailable` naming what to install, never a sandbox without the filter.
"""

from __future__ import annotations

import errno
import functools
import socket
import tempfile


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its Python binding) cannot be loaded here."""


DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "mount", "umount2", "pivot_root",
    "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key",
    "request_key", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "personality", "open_by_handle_at", "name_to_handle_at",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "lookup_dcookie", "vhangup", "iopl", "ioperm",
    "fork", "vfork", "execveat",
    # memory the address-space limit does not count: SysV and POSIX IPC objects, memfd files
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
    "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "memfd_create", "memfd_secret",
    # signals and handles by pidfd (pid 1, bwrap's init, is refused to kill() below)
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "process_madvise", "process_mrelease",
)
"""Refused with EPERM inside the strict sandbox (a deny list in the spirit of Docker's default profile), besides
the argument rules of `seccomp_filter`."""
_CLONE_THREAD, _CLONE_NEWUSER = 0x00010000, 0x10000000


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes:
    """The sandbox's seccomp program (BPF, as bwrap `--seccomp` reads it); `SeccompUnavailable` without
    libseccomp. Besides `DENIED_SYSCALLS`: clone() only starts threads (no process, no user namespace); clone3
    answers ENOSYS, whose flags a filter cannot read, so the C library falls back to clone(); sockets only of
    AF_UNIX (a socketpair); no signal to PID 1 (bwrap's init) or to a process group by negative pid. The code
    itself was started by execve, which therefore stays allowed: it can only replace itself."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as err:  # the binding, or libseccomp.so.2 it loads
        raise SeccompUnavailable(f"libseccomp is not available ({err}; Debian: apt-get install libseccomp2)") from err
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    refuse = seccomp.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(refuse, name)
        except (ValueError, OSError):  # not a system call of this architecture (fork on arm64): nothing to refuse
            continue
    rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))
    rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    for call in ("kill", "tkill", "tgkill"):
        rules.add_rule(refuse, call, seccomp.Arg(0, seccomp.EQ, 1))
    rules.add_rule(refuse, "kill", seccomp.Arg(0, seccomp.MASKED_EQ, 0x80000000, 0x80000000))
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()
