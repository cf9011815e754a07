"""Confinement of a reward worker subprocess, applied before the reward function is imported.

What holds, without root and on any Linux (each layer is tried; `confine` returns which ones took):
- memory: `RLIMIT_AS` caps the address space (a runaway allocation raises MemoryError in the worker);
- files: the working directory, HOME and TMPDIR are a scratch directory, and where the kernel has
  Landlock (Linux >= 5.13, unprivileged) every write, create, delete or rename outside it is refused
  by the kernel; reads are not restricted (the function must import its own code and data);
- network: a new network namespace (no interface but a down loopback) where the process may create one:
  as root, or through an unprivileged user namespace where the distribution allows them; else Landlock
  (ABI >= 4) refuses every TCP bind and connect; in every case an audit hook refuses to create
  AF_INET / AF_INET6 sockets from Python (best effort on its own: ctypes can bypass it).
Elsewhere (macOS, no Landlock, no namespaces) only the memory limit, the scratch directory and the audit
hook hold. Children of the function inherit the limits, the namespace and the Landlock domain.
"""

from __future__ import annotations

import ctypes
import os
import resource
import socket
import sys
from typing import Any

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SYS_LANDLOCK = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # same on x86_64 and aarch64
_PR_SET_NO_NEW_PRIVS = 38
# Landlock filesystem rights: write file, remove dir/file, make char/dir/reg/sock/fifo/block/sym (ABI 1),
# refer (ABI 2), truncate (ABI 3); reading and executing are left unhandled, hence allowed everywhere.
_FS_WRITE_ABI1 = 0x2 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800 | 0x1000
_FS_REFER, _FS_TRUNCATE = 0x2000, 0x4000
_NET_BIND_TCP, _NET_CONNECT_TCP = 0x1, 0x2


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _landlock_abi(libc: Any) -> int:
    if not sys.platform.startswith("linux"):
        return 0
    version = libc.syscall(_SYS_LANDLOCK["create_ruleset"], None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(version), 0)


def _landlock(scratch: str, libc: Any, abi: int) -> list[str]:
    """Writes only beneath `scratch` (and to /dev/null); with ABI >= 4 no TCP bind/connect either."""
    fs = _FS_WRITE_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    attr = _RulesetAttr(fs, net)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 4 else 8
    ruleset = libc.syscall(_SYS_LANDLOCK["create_ruleset"], ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        return []
    try:
        for path, access in ((scratch, fs), ("/dev/null", 0x2 | (_FS_TRUNCATE if abi >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(access, fd)
                if libc.syscall(_SYS_LANDLOCK["add_rule"], ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0)):
                    return []
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.syscall(_SYS_LANDLOCK["restrict_self"], ruleset,
                                                                         ctypes.c_uint32(0)):
            return []
    finally:
        os.close(ruleset)
    return ["landlock-writes"] + (["landlock-tcp"] if net else [])


def _network_namespace(libc: Any) -> list[str]:
    if not sys.platform.startswith("linux"):
        return []
    if libc.unshare(_CLONE_NEWNET) == 0:
        return ["netns"]
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        return ["userns-netns"]
    return []


def _refuse_inet_sockets(event: str, args: tuple) -> None:
    if event == "socket.__new__" and len(args) > 1 and args[1] in (socket.AF_INET, socket.AF_INET6):
        raise PermissionError("network access is disabled in reward functions (rollout reward sandbox)")


def confine(scratch: str, memory_limit_mb: int | None) -> list[str]:
    """Apply every layer the platform allows to this process; returns the names of those that hold."""
    held = []
    if memory_limit_mb:
        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        held.append("rlimit-as")
    os.chdir(scratch)
    os.environ.update(HOME=scratch, TMPDIR=scratch, TMP=scratch, TEMP=scratch)
    held.append("scratch-cwd")
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is not None:
        held += _network_namespace(libc)
        abi = _landlock_abi(libc)
        if abi:
            held += _landlock(scratch, libc, abi)
    sys.addaudithook(_refuse_inet_sockets)
    held.append("audit-no-inet-sockets")
    return held
