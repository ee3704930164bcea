"""Permission to run AMX tile instructions, asked for before a CPU engine's first step.

On Linux a process must ask the kernel for AMX tile data (``arch_prctl`` with
``ARCH_REQ_XCOMP_PERM``) before any of its threads runs an AMX instruction; without it the
first one ends the process with SIGILL. vLLM's CPU attention uses AMX for bf16 KV on CPUs
that have it, but (as of vLLM 0.32) leaves the asking to oneDNN, which asks the first
time one of its own matmuls uses AMX: a large prefill does, a step of a few tokens does
not. An engine whose first step computes only a prompt's last token, because this
connector loaded the rest of the prompt's KV from the pool (a decode engine's first
request), runs AMX attention before anything asked, and dies. Asking once when the
connector takes the KV caches prevents that; the permission is the process's, so every
thread has it.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def amx_permitted() -> bool:
    """Whether this process may run AMX tile instructions (False where there are none)."""
    if not _x86_64_linux():
        return False
    features = ctypes.c_uint64(0)
    if _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.addressof(features)) != 0:
        return False
    return bool(features.value & (1 << _XFEATURE_XTILEDATA))


def permit_amx() -> bool:
    """Ask the kernel to let this process use AMX tiles, where the CPU has them; whether it
    may now. A CPU without AMX, or a kernel that refuses, is not an error: vLLM then runs
    AMX code only if something else got the permission."""
    if _x86_64_linux() and not amx_permitted():
        _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)  # fails (EINVAL) where there is no AMX
    return amx_permitted()


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"


def _arch_prctl(code: int, argument: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(argument))
