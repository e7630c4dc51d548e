"""Measuring the core clock, so that time-based samples convert to cycles.

Without a PMU, cyclescope samples cpu-clock, whose period is nanoseconds;
instruction frequency estimates need the period in cycles. /proc/cpuinfo's
"cpu MHz" is the nominal clock (2.45 GHz here) while cores run at turbo
clocks (measured 3.0 GHz here): a 20% error in every estimated execution
count. So cyclescope measures the clock itself: a chain of dependent adds
(one cycle each on every x86-64 core since the Pentium Pro) runs from an
executable page for about 10 ms, and cycles per nanosecond is adds / time.

Hand-written machine code rather than a library because nothing else runs
a known number of cycles from Python: the interpreter's own loops cost an
unknown and variable number of cycles per iteration.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import struct
import time

ADDS_PER_ITERATION = 16


def _code(iterations: int) -> bytes:
    # mov rcx, imm64; xor eax, eax; loop: (add rax, 1) x16; dec rcx; jnz loop; ret
    body = b"\x48\x83\xc0\x01" * ADDS_PER_ITERATION  # add rax, 1
    loop = body + b"\x48\xff\xc9"  # dec rcx
    jnz = b"\x0f\x85" + struct.pack("<i", -(len(loop) + 6))
    return b"\x48\xb9" + struct.pack("<Q", iterations) + b"\x31\xc0" + loop + jnz + b"\xc3"


def measure_ghz(duration_s: float = 0.01, repeats: int = 3) -> float | None:
    """Core cycles per nanosecond on the CPU this thread runs on, or None if it cannot be measured."""
    try:
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError):
        return None  # W^X policy: no executable anonymous memory
    try:
        buf = ctypes.c_char.from_buffer(page)
        addr = ctypes.addressof(buf)
        fn_type = ctypes.CFUNCTYPE(ctypes.c_uint64)
        best = 0.0
        iterations = 20_000
        for _ in range(repeats + 1):
            page.seek(0)
            page.write(_code(iterations))
            fn = fn_type(addr)
            t0 = time.perf_counter_ns()
            fn()
            dt = time.perf_counter_ns() - t0
            ghz = iterations * ADDS_PER_ITERATION / max(dt, 1)
            best = max(best, ghz)  # the run least disturbed by interrupts
            # Scale so one run lasts about duration_s.
            iterations = max(1000, int(iterations * duration_s * 1e9 / max(dt, 1)))
        del fn, buf
        return best if 0.2 < best < 8.0 else None
    finally:
        with contextlib.suppress(BufferError):
            page.close()
