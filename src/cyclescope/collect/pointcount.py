"""Exact execution counts of several instructions at once: one BPF program, one uprobe_multi link.

A perf uprobe counter (collect/kernel.open_uprobe_counter) counts one instruction, and its close
waits about 85 ms in the kernel, closes serializing while the probes still open keep trapping
(analysis/anchors.py). A BPF program attached to many file offsets by one BPF_TRACE_UPROBE_MULTI
link (kernel 6.6 and later) counts them all and is detached in one go: 8 offsets closed in 42 ms
with the program at full speed, against 782 ms at 11% of its speed for 8 counters
(bench/uprobemulti.py). A hit costs the same trap either way.

The program is written here as 99 BPF instructions and loaded with raw bpf(2) calls through
ctypes, because the libbpf this project can load (Debian 12's 1.1, collect/ebpf.py) has no
uprobe_multi attach function and the program is too small to be worth a compiled object: it reads
the attach point's cookie (bpf_get_attach_cookie), which is the point's slot, and adds one to that
slot of an array map, unless a count of hits to let pass (the map's last slot, taken down by one
at every hit) is still above zero. That count is the window's gate: a link's probes are installed
one after another as it is created (13 ms for 8 of them, the program running meanwhile) and
removed one after another as it is closed, so counting only between the two is what makes the
counts of a window's points comparable (analysis/trips.py). At the first point (a procedure's
entry) it also keeps the general registers of the first and the last counted hit, in a second
map: how far an argument moves per entry (analysis/progress.py). Only counts and those two sets
of registers leave the kernel, and the registers go no further than the collector's sums of moves.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

import numpy as np

from cyclescope.collect.kernel import close_fd
from cyclescope.errors import CycleScopeError

SYS_BPF = 321  # x86-64
BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_PROG_LOAD, BPF_LINK_CREATE = 0, 1, 2, 5, 28
BPF_MAP_TYPE_ARRAY, BPF_PROG_TYPE_KPROBE, BPF_TRACE_UPROBE_MULTI = 2, 2, 48
BPF_FUNC_MAP_LOOKUP_ELEM, BPF_FUNC_GET_ATTACH_COOKIE = 1, 174
SLOTS = 64  # points one counter can count (slots of its map), the last one the hits still to skip
SKIP_SLOT = SLOTS - 1
GATE = 1 << 62  # a skip no window reaches: the points trap but nothing is counted
ENOTSUPP = 524  # the kernel's (include/linux/errno.h), which Python's errno does not name
# Where struct pt_regs (x86-64) keeps the general registers, in perf's order (perf/abi.GPRS: rax,
# rbx, rcx, rdx, rsi, rdi, rbp, rsp, r8-r15): the first point's hits keep them (analysis/progress.py).
GPR_OFFSETS = (80, 40, 88, 96, 104, 112, 32, 152, 72, 64, 56, 48, 24, 16, 8, 0)
REGS_BYTES = 16 * len(GPR_OFFSETS)  # their values at the first and at the last counted hit

_libc = ctypes.CDLL(None, use_errno=True)


def _bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, len(attr))
    r = _libc.syscall(SYS_BPF, cmd, buf, len(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(r)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def program(map_fd: int, regs_fd: int) -> bytes:
    """if (atomic_fetch_add(&counts[SKIP], -1) > 0) return 0;  (the first hits of a window pass)
    slot = bpf_get_attach_cookie(ctx); old = atomic_fetch_add(&counts[slot], 1);
    if (slot == 0) {  (the first point: a procedure's entry)
        if (old == 0) regs.first = ctx's general registers;  (the first counted hit)
        regs.last = ctx's general registers;
    }
    return 0."""
    def lookup(fd: int) -> list[bytes]:
        return [
            _insn(0xBF, 2, 10), _insn(0x07, 2, 0, 0, -4),  # r2 = r10 - 4: the key's address
            _insn(0x18, 1, 1, 0, fd), _insn(0),  # r1 = the map (ld_imm64, BPF_PSEUDO_MAP_FD)
            _insn(0x85, imm=BPF_FUNC_MAP_LOOKUP_ELEM),  # r0 = &map[key] or NULL
        ]

    def keep(at: int) -> list[bytes]:  # regs[at + i] = the i-th general register (pt_regs, r6)
        return [x for i, off in enumerate(GPR_OFFSETS)
                for x in (_insn(0x79, 1, 6, off), _insn(0x7B, 0, 1, 8 * (at + i)))]

    last = keep(len(GPR_OFFSETS))
    first = keep(0)
    out = [_insn(0xB7, 0), _insn(0x95)]  # return 0
    tail = [
        _insn(0x55, 7, 0, len(first) + len(last) + 9, 0),  # if slot != 0 goto out
        _insn(0xBF, 8, 1),  # r8 = the entry's count before this hit
        _insn(0x62, 10, 0, -4, 0),  # *(u32 *)(r10 - 4) = 0
        *lookup(regs_fd),
        _insn(0x15, 0, 0, len(first) + len(last) + 1, 0),  # if r0 == NULL goto out
        _insn(0x55, 8, 0, len(first), 0),  # if the entry was counted before goto last
        *first, *last, *out,
    ]
    count = [
        _insn(0xBF, 1, 6),  # r1 = the context
        _insn(0x85, imm=BPF_FUNC_GET_ATTACH_COOKIE),  # r0 = the point's cookie: its slot
        _insn(0xBF, 7, 0),  # r7 = the slot
        _insn(0x63, 10, 0, -4),  # *(u32 *)(r10 - 4) = w0: the key
        *lookup(map_fd),
        _insn(0x15, 0, 0, len(tail), 0),  # if r0 == NULL goto out (past the two below, to tail's end but two)
        _insn(0xB7, 1, imm=1), _insn(0xDB, 0, 1, 0, 0x01),  # r1 = atomic_fetch_add((u64 *)r0, 1)
        *tail,
    ]
    skip = [
        _insn(0xBF, 6, 1),  # r6 = the context
        _insn(0x62, 10, 0, -4, SKIP_SLOT),  # *(u32 *)(r10 - 4) = SKIP_SLOT
        *lookup(map_fd),
        _insn(0x15, 0, 0, 3, 0),  # if r0 == NULL goto count
        _insn(0xB7, 1, imm=-1), _insn(0xDB, 0, 1, 0, 0x01),  # r1 = atomic_fetch_add((u64 *)r0, -1)
        _insn(0x65, 1, 0, len(count) - 2, 0),  # if (s64)r1 > 0 goto out (the count's last two)
    ]
    return b"".join(skip + count)


class PointCounter:
    """The counting program and its map; ``attach`` one link over up to SLOTS file offsets of one
    file, ``counts`` reads the slots. One window at a time: ``zero`` before each."""

    def __init__(self) -> None:
        self.map = self.prog = self.regs_map = -1
        try:
            self.map = _bpf(BPF_MAP_CREATE, struct.pack("<IIII", BPF_MAP_TYPE_ARRAY, 4, 8, SLOTS) + bytes(112))
            self.regs_map = _bpf(BPF_MAP_CREATE, struct.pack("<IIII", BPF_MAP_TYPE_ARRAY, 4, REGS_BYTES, 1)
                                 + bytes(112))
            code = program(self.map, self.regs_map)
            code_buf = ctypes.create_string_buffer(code, len(code))
            lic, log = ctypes.create_string_buffer(b"GPL"), ctypes.create_string_buffer(1 << 14)
            attr = struct.pack("<IIQQIIQII16sII", BPF_PROG_TYPE_KPROBE, len(code) // 8, ctypes.addressof(code_buf),
                               ctypes.addressof(lic), 1, len(log), ctypes.addressof(log), 0, 0, b"cs_points", 0,
                               BPF_TRACE_UPROBE_MULTI) + bytes(64)
            try:
                self.prog = _bpf(BPF_PROG_LOAD, attr)
            except OSError as e:
                detail = log.value.decode(errors="replace").strip().splitlines()[-1:] or [""]
                raise CycleScopeError(f"the point-counting BPF program did not load ({e.strerror}"
                                      f"{': ' + detail[0] if detail[0] else ''})") from None
        except OSError as e:
            self.close()
            raise CycleScopeError(f"BPF maps unavailable ({e.strerror})") from None
        except CycleScopeError:
            self.close()
            raise

    def attach(self, path: str, offsets: list[int], pid: int = 0) -> int:
        """A link counting each of ``offsets`` (file offsets in ``path``) into the slot of its index,
        in process ``pid`` only (0: every process mapping the file). Returns the link's fd: counting
        stops when it is detached."""
        if not 0 < len(offsets) < SLOTS:
            raise ValueError(f"between 1 and {SLOTS - 1} offsets")
        p = ctypes.create_string_buffer(os.fsencode(path))
        offs = (ctypes.c_uint64 * len(offsets))(*offsets)
        cookies = (ctypes.c_uint64 * len(offsets))(*range(len(offsets)))
        attr = struct.pack("<IIIIQQQQIII", self.prog, 0, BPF_TRACE_UPROBE_MULTI, 0, ctypes.addressof(p),
                           ctypes.addressof(offs), 0, ctypes.addressof(cookies), len(offsets), 0, pid) + bytes(64)
        try:
            return _bpf(BPF_LINK_CREATE, attr)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP):
                raise CycleScopeError(f"uprobe_multi refused {path} ({e.strerror}: kernel 6.6 or later is needed, "
                                      f"and instructions uprobes can take)") from None
            raise

    def _elem(self, cmd: int, slot: int, value: ctypes.Array[ctypes.c_char], map_fd: int | None = None) -> None:
        key = ctypes.c_uint32(slot)
        _bpf(cmd, struct.pack("<IIQQQ", self.map if map_fd is None else map_fd, 0, ctypes.addressof(key),
                              ctypes.addressof(value), 0))

    def zero(self, n: int, skip: int = 0) -> None:
        """Counts of the first ``n`` slots to zero; the next ``skip`` hits (of any point) pass
        uncounted."""
        v = ctypes.create_string_buffer(8)
        for i in range(n):
            self._elem(BPF_MAP_UPDATE_ELEM, i, v)
        self.set_skip(skip)

    def counts(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.uint64)
        v = ctypes.create_string_buffer(8)
        for i in range(n):
            self._elem(BPF_MAP_LOOKUP_ELEM, i, v)
            out[i] = struct.unpack("<Q", v.raw)[0]
        return out

    def set_skip(self, skip: int) -> None:
        """The next ``skip`` hits (of any point) pass uncounted (GATE: none counts)."""
        self._elem(BPF_MAP_UPDATE_ELEM, SKIP_SLOT, ctypes.create_string_buffer(struct.pack("<q", skip), 8))

    def skip_left(self) -> int:
        """The hits still to pass uncounted (at most zero once counting began)."""
        v = ctypes.create_string_buffer(8)
        self._elem(BPF_MAP_LOOKUP_ELEM, SKIP_SLOT, v)
        return int(struct.unpack("<q", v.raw)[0])

    def first_regs(self) -> tuple[np.ndarray, np.ndarray]:
        """The general registers (perf/abi.GPRS order) at the first point's first and last counted
        hits since the counts were zeroed (meaningful where it counted two hits or more)."""
        v = ctypes.create_string_buffer(REGS_BYTES)
        self._elem(BPF_MAP_LOOKUP_ELEM, 0, v, self.regs_map)
        a = np.frombuffer(v.raw, np.uint64)
        n = len(GPR_OFFSETS)
        return a[:n].copy(), a[n:].copy()

    def detach(self, link: int) -> None:
        """Remove a link's probes (they stop trapping one by one as the close goes)."""
        close_fd(link)

    def close(self) -> None:
        for fd in (self.prog, self.map, self.regs_map):
            if fd >= 0:
                close_fd(fd)
        self.map = self.prog = self.regs_map = -1
