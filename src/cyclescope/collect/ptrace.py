"""The few ptrace(2) requests exact mode needs, through ctypes (x86-64 only).

No maintained Python library wraps ptrace for this (python-ptrace covers far more and
copies registers through slower paths), and the calls are a handful.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PTRACE_TRACEME = 0
PTRACE_CONT = 7
PTRACE_SINGLESTEP = 9
PTRACE_GETREGS = 12
PTRACE_GETFPREGS = 14
PTRACE_SETOPTIONS = 0x4200
PTRACE_GETSIGINFO = 0x4202
PTRACE_O_EXITKILL = 1 << 20
PTRACE_EVENT_EXEC = 4
PTRACE_O_TRACEEXEC = 1 << 4
TRAP_TRACE = 2
TRAP_PERF = 6  # si_code of a perf_event sigtrap (Linux 5.13+)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_ptrace = _libc.ptrace
_ptrace.restype = ctypes.c_long
_ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

# struct user_regs_struct, in order.
USER_REGS = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
             "orig_rax", "rip", "cs", "flags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs")


class _Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in USER_REGS]


class _SigInfo(ctypes.Structure):
    _fields_ = [("si_signo", ctypes.c_int), ("si_errno", ctypes.c_int), ("si_code", ctypes.c_int),
                ("_pad", ctypes.c_byte * 116)]


class PtraceError(OSError):
    pass


def _call(req: int, pid: int, addr: int | None, data: int | ctypes.c_void_p | None) -> int:
    r = _ptrace(req, pid, addr, data)
    if r == -1:
        err = ctypes.get_errno()
        raise PtraceError(err, f"ptrace({req}) on {pid}: {os.strerror(err)}")
    return int(r)


def traceme() -> None:
    """In a child before exec: let the parent trace it (the exec then stops it with SIGTRAP)."""
    _call(PTRACE_TRACEME, 0, None, None)


def set_options(pid: int, options: int) -> None:
    _call(PTRACE_SETOPTIONS, pid, None, options)


def cont(pid: int, sig: int = 0) -> None:
    _call(PTRACE_CONT, pid, None, sig)


def singlestep(pid: int) -> None:
    _call(PTRACE_SINGLESTEP, pid, None, 0)


class Tracee:
    """Register and signal access to one stopped thread, reusing buffers."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self._regs = _Regs()
        self._fp = (ctypes.c_uint8 * 512)()
        self._si = _SigInfo()

    def regs(self) -> dict[str, int]:
        _call(PTRACE_GETREGS, self.tid, None, ctypes.cast(ctypes.byref(self._regs), ctypes.c_void_p))
        r = self._regs
        return {n: getattr(r, n) for n in USER_REGS}

    def xmm(self) -> dict[str, int]:
        """xmm0-15 (128-bit values) from the FXSAVE area."""
        _call(PTRACE_GETFPREGS, self.tid, None, ctypes.cast(ctypes.byref(self._fp), ctypes.c_void_p))
        raw = bytes(self._fp)
        return {f"xmm{i}": int.from_bytes(raw[160 + 16 * i : 176 + 16 * i], "little") for i in range(16)}

    def siginfo(self) -> tuple[int, int]:
        """(si_signo, si_code) of the signal that stopped the thread."""
        _call(PTRACE_GETSIGINFO, self.tid, None, ctypes.cast(ctypes.byref(self._si), ctypes.c_void_p))
        return self._si.si_signo, self._si.si_code
