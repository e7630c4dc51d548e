"""Reading another process's memory with process_vm_readv(2) (no stop, no ptrace attach)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_readv = _libc.process_vm_readv
_readv.restype = ctypes.c_ssize_t
_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]


class ProcessMemory:
    """Reads of one process's address space; a failed read returns None (unmapped, or the process is gone)."""

    def __init__(self, pid: int, buf_size: int = 4096) -> None:
        self.pid = pid
        self._buf = ctypes.create_string_buffer(buf_size)
        self._local = _IoVec(ctypes.cast(self._buf, ctypes.c_void_p), buf_size)
        self._remote = _IoVec(0, 0)
        self.reads = 0
        self.failures = 0

    def read(self, addr: int, size: int) -> bytes | None:
        if size > len(self._buf):
            self._buf = ctypes.create_string_buffer(size)
            self._local.iov_base = ctypes.cast(self._buf, ctypes.c_void_p)
        self._local.iov_len = size
        self._remote.iov_base = addr
        self._remote.iov_len = size
        self.reads += 1
        n = _readv(self.pid, ctypes.byref(self._local), 1, ctypes.byref(self._remote), 1, 0)
        if n != size:
            self.failures += 1
            return None
        return self._buf.raw[:size]

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
