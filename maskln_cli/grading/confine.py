"""The grader's child confined before it imports a submission (Linux): whatever the submission
does, it can reach no process of the grader, nor a neighbour's.

:func:`confine` (called in the child, never in the grader):

- drops every capability, from the bounding set too (a grader run as root gives its child no
  ``CAP_SYS_PTRACE``, ``CAP_KILL``, ``CAP_DAC_OVERRIDE``: as root it is then one more process of
  the same user, whom ``PR_SET_DUMPABLE`` 0 keeps out of the grader);
- sets ``PR_SET_NO_NEW_PRIVS`` (no set-user-ID program gives them back);
- installs a seccomp filter (x86-64 and aarch64) that refuses, with ``EPERM``:

  - signals to any process outside the child's own (its pid, ``kill(0)``, its process group):
    ``kill``, ``tkill``, ``tgkill``, ``rt_sigqueueinfo``, ``rt_tgsigqueueinfo``,
    ``pidfd_send_signal``; probing with signal 0 stays allowed;
  - changing another process: its resource limits (``prlimit64``: an ``RLIMIT_CPU`` of one
    second kills it), its priority, CPUs or scheduling (``setpriority``, ``ioprio_set``, for a
    whole user too; ``sched_setaffinity``, ``sched_setscheduler``, ``sched_setparam``,
    ``sched_setattr``), its memory's placement (``migrate_pages``, ``move_pages``): each only
    for itself;
  - the indirect ways to signal another process: making it the owner of a file descriptor
    (``fcntl`` ``F_SETOWN``, ``F_SETOWN_EX``; ``ioctl`` ``FIOSETOWN``, ``SIOCSPGRP``,
    ``TIOCSPGRP``: SIGIO, or any signal ``F_SETSIG`` names, goes to the owner), and a process
    created as the grader's own child (``clone`` with ``CLONE_PARENT``, whose exit signal, any
    signal, goes to the grader; ``clone3``, whose flags a filter cannot read, says ``ENOSYS``
    and the C library falls back to ``clone``);
  - reading or writing another process: ``ptrace``, ``process_vm_readv``,
    ``process_vm_writev``, ``pidfd_getfd``, ``process_madvise``;
  - namespaces and mounts: ``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag,
    ``mount``, ``umount2``, ``pivot_root`` and the new mount API (a user namespace would give
    back every capability over mounts it makes, a cgroup namespace a cgroup to freeze);
  - every 32-bit (x32 and i386) system call, which would bypass these numbers;

- run as root, before it drops its capabilities, it gives itself a mount namespace of its own
  where ``/proc`` and ``/sys`` (the cgroup hierarchies with them) are read-only: root owns the
  ``/proc/<pid>`` files of the grader's processes (they are not dumpable) and the cgroup files,
  and a root child without capabilities could still write them (raise the grader's
  ``oom_score_adj``, move it into a frozen or tiny cgroup).

What it does not do: files (the child runs as the user, with the user's files; :mod:`.guard`
and the class grader's checks see what changed), the network, ``/proc/<pid>/mem`` of a process
that is dumpable (the grader's processes are not), the machine's shared resources (CPU time,
memory, processes, disk: a submission can slow its neighbours down, not change a verdict).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
CAPABILITY_VERSION_3 = 0x20080522

# Classic BPF, as seccomp reads it (linux/filter.h, linux/seccomp.h).
LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
JUMP_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JUMP_AT_LEAST = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JUMP_ANY_BIT = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RETURN = 0x06  # BPF_RET | BPF_K
ALLOW = 0x7FFF0000
REFUSE = 0x00050000 | errno.EPERM
NO_SUCH_CALL = 0x00050000 | errno.ENOSYS
NR, ARCH = 0, 4


def argument(index: int) -> int:
    """Offset of the low 32 bits of system call argument ``index`` (little-endian)."""
    return 16 + 8 * index


CLONE_PARENT = 0x00008000
CLONE_NEW = 0x7E020000
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID and NEWNET (NEWTIME is clone3's)."""
MOUNT_CALLS = ("unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount",
               "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")  # fmt: skip
"""System calls refused whatever their arguments: namespaces and mounts."""
PRIO_USER, IOPRIO_WHO_USER = 2, 3
PID_FIRST = ("prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam",
             "sched_setattr", "migrate_pages", "move_pages")  # fmt: skip
"""System calls whose first argument is the process they change."""
F_SETOWN, F_SETOWN_EX = 8, 15
OWNER_IOCTLS = (0x8901, 0x8902, 0x5410)  # FIOSETOWN, SIOCSPGRP, TIOCSPGRP

# (audit arch, first 32-bit-ABI number or None, system call numbers) per machine.
SYSCALLS = {
    "x86_64": (
        0xC000003E,
        0x40000000,  # x32
        {
            "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
            "rt_tgsigqueueinfo": 297, "pidfd_send_signal": 424, "ptrace": 101,
            "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
            "process_madvise": 440, "clone": 56, "clone3": 435, "fcntl": 72, "ioctl": 16,
            "prlimit64": 302, "sched_setaffinity": 203, "sched_setscheduler": 144,
            "sched_setparam": 142, "sched_setattr": 314, "migrate_pages": 256,
            "move_pages": 279, "setpriority": 141, "ioprio_set": 251, "unshare": 272,
            "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "mount_setattr": 442,
        },
    ),
    "aarch64": (
        0xC00000B7,
        None,
        {
            "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
            "rt_tgsigqueueinfo": 240, "pidfd_send_signal": 424, "ptrace": 117,
            "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
            "process_madvise": 440, "clone": 220, "clone3": 435, "fcntl": 25, "ioctl": 29,
            "prlimit64": 261, "sched_setaffinity": 122, "sched_setscheduler": 119,
            "sched_setparam": 118, "sched_setattr": 274, "migrate_pages": 238,
            "move_pages": 239, "setpriority": 140, "ioprio_set": 30, "unshare": 97,
            "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "mount_setattr": 442,
        },
    ),
}  # fmt: skip


class Program:
    """A seccomp filter being written: instructions, with forward jumps to labels."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def add(self, code: int, k: int, true: int | str = 0, false: int | str = 0) -> None:
        self.code.append((code, true, false, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.add(LOAD_WORD, offset)

    def returns(self, action: int) -> None:
        self.add(RETURN, action)

    def assemble(self) -> bytes:
        def offset(at: int, jump: int | str) -> int:
            target = self.labels[jump] if isinstance(jump, str) else at + 1 + jump
            assert target > at, "forward jumps only"
            return target - at - 1

        return b"".join(
            struct.pack("=HBBI", code, offset(at, true), offset(at, false), k & 0xFFFFFFFF)
            for at, (code, true, false, k) in enumerate(self.code)
        )


def build_filter(machine: str, own: int) -> bytes | None:
    """The filter for ``machine`` (``platform.machine()``), for a child whose pid (and process
    group) is ``own``; None where the system call numbers are not known here."""
    if machine not in SYSCALLS:
        return None
    arch, foreign, nr = SYSCALLS[machine]
    p = Program()
    p.load(ARCH)
    p.add(JUMP_EQUAL, arch, 1, 0)
    p.returns(REFUSE)  # i386 system calls on x86-64: other numbers
    p.load(NR)
    if foreign is not None:
        p.add(JUMP_AT_LEAST, foreign, "refuse", 0)
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
                 "process_madvise", "pidfd_send_signal", *MOUNT_CALLS):  # fmt: skip
        p.add(JUMP_EQUAL, nr[name], "refuse", 0)
    p.add(JUMP_EQUAL, nr["clone3"], "no_such_call", 0)
    p.add(JUMP_EQUAL, nr["clone"], "clone", 0)
    p.add(JUMP_EQUAL, nr["fcntl"], "fcntl", 0)
    p.add(JUMP_EQUAL, nr["ioctl"], "ioctl", 0)
    p.add(JUMP_EQUAL, nr["kill"], "kill", 0)
    for name in ("tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        p.add(JUMP_EQUAL, nr[name], "own_process", 0)
    for name in PID_FIRST:
        p.add(JUMP_EQUAL, nr[name], "itself", 0)
    p.add(JUMP_EQUAL, nr["setpriority"], "setpriority", 0)
    p.add(JUMP_EQUAL, nr["ioprio_set"], "ioprio_set", 0)
    p.returns(ALLOW)
    # prlimit64(pid, ...), sched_*(pid, ...), *_pages(pid, ...): 0 (itself) or its own pid.
    p.label("itself")
    p.load(argument(0))
    p.add(JUMP_EQUAL, 0, "allow", 0)
    p.add(JUMP_EQUAL, own, "allow", "refuse")
    # setpriority(which, who, ...), ioprio_set(which, who, ...): not a whole user's processes;
    # a process or a group: 0 or its own.
    p.label("setpriority")
    p.load(argument(0))
    p.add(JUMP_EQUAL, PRIO_USER, "refuse", "who")
    p.label("ioprio_set")
    p.load(argument(0))
    p.add(JUMP_EQUAL, IOPRIO_WHO_USER, "refuse", 0)
    p.label("who")
    p.load(argument(1))
    p.add(JUMP_EQUAL, 0, "allow", 0)
    p.add(JUMP_EQUAL, own, "allow", "refuse")
    # kill(pid, sig): its own pid, its own group (0 or -pid), or signal 0 (a probe).
    p.label("kill")
    p.load(argument(1))
    p.add(JUMP_EQUAL, 0, "allow", 0)
    p.load(argument(0))
    p.add(JUMP_EQUAL, 0, "allow", 0)
    p.add(JUMP_EQUAL, -own, "allow", 0)
    p.add(JUMP_EQUAL, own, "allow", "refuse")
    # tkill(tid), tgkill(tgid, ...), rt_(tg)sigqueueinfo(tgid, ...): its own process only.
    p.label("own_process")
    p.load(argument(0))
    p.add(JUMP_EQUAL, own, "allow", "refuse")
    p.label("clone")
    p.load(argument(0))
    p.add(JUMP_ANY_BIT, CLONE_PARENT | CLONE_NEW, "refuse", "allow")
    p.label("fcntl")
    p.load(argument(1))
    p.add(JUMP_EQUAL, F_SETOWN, "refuse", 0)
    p.add(JUMP_EQUAL, F_SETOWN_EX, "refuse", "allow")
    p.label("ioctl")
    p.load(argument(1))
    for request in OWNER_IOCTLS:
        p.add(JUMP_EQUAL, request, "refuse", 0)
    p.returns(ALLOW)
    p.label("allow")
    p.returns(ALLOW)
    p.label("refuse")
    p.returns(REFUSE)
    p.label("no_such_call")
    p.returns(NO_SUCH_CALL)
    return p.assemble()


class _Filter(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def drop_capabilities(libc: ctypes.CDLL) -> None:
    """No capability left, nor any to gain back by running a program (as root, too)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as last:
            highest = int(last.read())
    except (OSError, ValueError):
        highest = 63
    for capability in range(highest + 1):
        libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(capability), 0, 0, 0)  # needs CAP_SETPCAP
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: twice (64 bits), empty
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def read_only_kernel_files(libc: ctypes.CDLL) -> list[str]:
    """As root, with CAP_SYS_ADMIN still: a mount namespace of this process's own, where every
    mount at or under ``/proc`` and ``/sys`` is read-only (the grader's ``oom_score_adj``, the
    cgroup hierarchies); what could not be done, in words. Others: nothing to do (those files
    are root's)."""
    if os.geteuid() != 0:
        return []
    if libc.unshare(CLONE_NEWNS) != 0:
        return [f"no mount namespace of its own ({os.strerror(ctypes.get_errno())})"]
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return [f"mounts not private ({os.strerror(ctypes.get_errno())})"]
    missing = []
    for point in _kernel_mounts():
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        if libc.mount(b"none", point.encode(), None, flags, None) != 0:
            missing.append(f"{point} still writable ({os.strerror(ctypes.get_errno())})")
    return missing


def _kernel_mounts() -> list[str]:
    """Mount points at or under /proc and /sys (from /proc/self/mountinfo)."""
    points = []
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[4].encode().decode("unicode_escape") if len(fields) > 4 else ""
                if point in ("/proc", "/sys") or point.startswith(("/proc/", "/sys/")):
                    points.append(point)
    except OSError:
        return ["/proc", "/sys"]
    return points


def confine() -> list[str]:
    """Confine this process (see the module docstring); returns what could not be done, in
    words (an empty list when everything was). Not Linux: ``["not Linux"]``."""
    if not sys.platform.startswith("linux"):
        return ["not Linux"]
    missing = []
    libc = _libc()
    missing += read_only_kernel_files(libc)
    try:
        drop_capabilities(libc)
    except (OSError, AttributeError) as error:
        missing.append(f"capabilities kept ({error})")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        missing.append("no PR_SET_NO_NEW_PRIVS")
    program = build_filter(platform.machine(), os.getpid())
    if program is None:
        missing.append(f"no system call filter on {platform.machine()}")
        return missing
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _Filter(len(program) // 8, ctypes.cast(buffer, ctypes.c_char_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        missing.append(f"no system call filter ({os.strerror(ctypes.get_errno())})")
    return missing
