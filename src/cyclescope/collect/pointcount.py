"""Exact execution counts of several instructions at once: one BPF program, one uprobe_multi link.

A perf uprobe counter (collect/kernel.open_uprobe_counter) counts one instruction, and its close
waits about 85 ms in the kernel, closes serializing while the probes still open keep trapping
(analysis/anchors.py). A BPF program attached to many file offsets by one BPF_TRACE_UPROBE_MULTI
link (kernel 6.6 and later) counts them all and is detached in one go: 8 offsets closed in 42 ms
with the program at full speed, against 782 ms at 11% of its speed for 8 counters
(bench/uprobemulti.py). A hit costs the same trap either way.

The program is written here as 138 BPF instructions and loaded with raw bpf(2) calls through
ctypes, because the libbpf this project can load (Debian 12's 1.1, collect/ebpf.py) has no
uprobe_multi attach function and the program is too small to be worth a compiled object: it reads
the attach point's cookie (bpf_get_attach_cookie), which is the point's slot, and adds one to that
slot of an array map, unless a count of hits to let pass (the map's last slot, taken down by one
at every hit) is still above zero. That count is the window's gate: a link's probes are installed
one after another as it is created (13 ms for 8 of them, the program running meanwhile) and
removed one after another as it is closed, so counting only between the two is what makes the
counts of a window's points comparable (analysis/trips.py). At the first two points (a
procedure's entry and, in a window of the entry alone, its progress point) it also keeps the
general registers of the first and the last counted hit, in a second map: how far an argument or
a value moves per entry (analysis/progress.py). Only counts and those sets of registers leave the
kernel, and the registers go no further than the collector's sums of moves.
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
SLOTS = 64  # slots of the counts' map: the points, then the stop flag and the hits still to skip
SKIP_SLOT = SLOTS - 1
STOP_SLOT = SLOTS - 2  # nonzero: the first point's next hit shuts the gate (PointCounter.end_at_entry)
FROM_SLOT = SLOTS - 3  # nonzero: the other points count from the first point's first hit on (whole runs)
GATE = 1 << 62  # a skip no window reaches: the points trap but nothing is counted
ENOTSUPP = 524  # the kernel's (include/linux/errno.h), which Python's errno does not name
# Where struct pt_regs (x86-64) keeps the general registers, in perf's order (perf/abi.GPRS: rax,
# rbx, rcx, rdx, rsi, rdi, rbp, rsp, r8-r15): the first point's hits keep them (analysis/progress.py).
GPR_OFFSETS = (80, 40, 88, 96, 104, 112, 32, 152, 72, 64, 56, 48, 24, 16, 8, 0)
REGS_BYTES = 16 * len(GPR_OFFSETS)  # their values at the first and at the last counted hit
REGS_SLOTS = 2  # the points whose hits keep them: the entry and its progress point

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
    slot = bpf_get_attach_cookie(ctx);
    if (slot == 0) {  (the first point: a procedure's entry)
        if (counts[STOP]) counts[SKIP] = GATE;  (asked to end: this entry is the last counted)
    } else if (counts[FROM] && counts[0] == 0) return 0;  (whole runs: the others from the first entry on)
    old = atomic_fetch_add(&counts[slot], 1);
    if (slot < REGS_SLOTS) {  (the first points: a procedure's entry, its progress point)
        if (old == 0) regs[slot].first = ctx's general registers;  (the first counted hit)
        regs[slot].last = ctx's general registers;
    }
    return 0.

    So a window of whole runs (PointCounter.zero's ``whole``) that is asked to end
    (PointCounter.end_at_entry) counts whole runs of the procedure, its entries but one: from its
    first entry to the entry that shut it. (A window over a procedure entered once, a program's
    long-running loop nest, counts its loop headers' ratios without whole runs.) A window of
    fixed length counted the loop iterations of the run it opened in without its entry, and the
    part of the run it closed in with its entry; where runs vary in length (xz's hash chains), the
    ratio came out high by about the variance of a run's iterations over their mean, per window
    (xz's match finder: 1.10-1.14 of exact in four sets, 25-30 entries a window).

    Written with labels: an item is an instruction, or (label,) marking the next one, or an
    instruction whose offset is a label's name (resolved below)."""
    def lookup(fd: int) -> list[bytes]:
        return [
            _insn(0xBF, 2, 10), _insn(0x07, 2, 0, 0, -4),  # r2 = r10 - 4: the key's address
            _insn(0x18, 1, 1, 0, fd), _insn(0),  # r1 = the map (ld_imm64, BPF_PSEUDO_MAP_FD)
            _insn(0x85, imm=BPF_FUNC_MAP_LOOKUP_ELEM),  # r0 = &map[key] or NULL
        ]

    def at(fd: int, key: int) -> list[bytes]:  # r0 = &map[key] or NULL
        return [_insn(0x62, 10, 0, -4, key), *lookup(fd)]

    def keep(base: int) -> list[bytes]:  # regs[base + i] = the i-th general register (pt_regs, r6)
        return [x for i, off in enumerate(GPR_OFFSETS)
                for x in (_insn(0x79, 1, 6, off), _insn(0x7B, 0, 1, 8 * (base + i)))]

    Item = bytes | tuple[str] | tuple[int, int, int, str, int]
    code: list[Item] = [
        _insn(0xBF, 6, 1),  # r6 = the context
        *at(map_fd, SKIP_SLOT),
        (0x15, 0, 0, "counted", 0),  # if r0 == NULL goto counted
        _insn(0xB7, 1, imm=-1), _insn(0xDB, 0, 1, 0, 0x01),  # r1 = atomic_fetch_add((u64 *)r0, -1)
        (0x65, 1, 0, "out", 0),  # if (s64)r1 > 0 goto out: a hit the gate lets pass
        ("counted",),
        _insn(0xBF, 1, 6),  # r1 = the context
        _insn(0x85, imm=BPF_FUNC_GET_ATTACH_COOKIE),  # r0 = the point's cookie: its slot
        _insn(0xBF, 7, 0),  # r7 = the slot
        (0x55, 7, 0, "other", 0),  # if slot != 0 goto other
        *at(map_fd, STOP_SLOT),
        (0x15, 0, 0, "count", 0),  # if r0 == NULL goto count
        _insn(0x79, 1, 0, 0),  # r1 = counts[STOP]
        (0x15, 1, 0, "count", 0),  # if r1 == 0 goto count
        *at(map_fd, SKIP_SLOT),
        (0x15, 0, 0, "out", 0),
        _insn(0x18, 1, 0, 0, GATE & 0xFFFFFFFF), _insn(0, imm=GATE >> 32),  # r1 = GATE (ld_imm64)
        _insn(0x7B, 0, 1, 0),  # counts[SKIP] = GATE: shut after this entry, which counts
        (0x05, 0, 0, "count", 0),
        ("other",),
        *at(map_fd, FROM_SLOT),
        (0x15, 0, 0, "count", 0),
        _insn(0x79, 1, 0, 0),  # r1 = counts[FROM]
        (0x15, 1, 0, "count", 0),  # if not asked for whole runs goto count
        *at(map_fd, 0),
        (0x15, 0, 0, "out", 0),
        _insn(0x79, 1, 0, 0),  # r1 = counts[0]
        (0x15, 1, 0, "out", 0),  # if no entry was counted yet goto out
        ("count",),
        _insn(0x63, 10, 7, -4),  # *(u32 *)(r10 - 4) = w7: the key
        *lookup(map_fd),
        (0x15, 0, 0, "out", 0),
        _insn(0xB7, 1, imm=1), _insn(0xDB, 0, 1, 0, 0x01),  # r1 = atomic_fetch_add((u64 *)r0, 1)
        (0x25, 7, 0, "out", REGS_SLOTS - 1),  # if slot > REGS_SLOTS - 1 goto out
        _insn(0xBF, 8, 1),  # r8 = the point's count before this hit
        _insn(0x63, 10, 7, -4),  # *(u32 *)(r10 - 4) = w7: the slot's registers
        *lookup(regs_fd),
        (0x15, 0, 0, "out", 0),
        (0x55, 8, 0, "last", 0),  # if the point was counted before goto last
        *keep(0),
        ("last",),
        *keep(len(GPR_OFFSETS)),
        ("out",),
        _insn(0xB7, 0), _insn(0x95),  # return 0
    ]
    where: dict[str, int] = {}
    n = 0
    for item in code:
        if isinstance(item, tuple) and len(item) == 1:
            where[item[0]] = n
        else:
            n += 1
    out: list[bytes] = []
    for item in code:
        if isinstance(item, bytes):
            out.append(item)
        elif len(item) == 5:
            op, dst, src, label, imm = item
            out.append(_insn(op, dst, src, where[label] - (len(out) + 1), imm))
    return b"".join(out)


class PointCounter:
    """The counting program and its map; ``attach`` one link over up to SLOTS file offsets of one
    file, ``counts`` reads the slots. One window at a time: ``zero`` before each."""

    def __init__(self) -> None:
        self.map = self.prog = self.regs_map = -1
        try:
            self.map = _bpf(BPF_MAP_CREATE, struct.pack("<IIII", BPF_MAP_TYPE_ARRAY, 4, 8, SLOTS) + bytes(112))
            self.regs_map = _bpf(BPF_MAP_CREATE, struct.pack("<IIII", BPF_MAP_TYPE_ARRAY, 4, REGS_BYTES, REGS_SLOTS)
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
        if not 0 < len(offsets) <= FROM_SLOT:
            raise ValueError(f"between 1 and {FROM_SLOT} offsets")
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

    def zero(self, n: int, skip: int = 0, whole: bool = False) -> None:
        """Counts of the first ``n`` slots to zero, and no end asked for; the next ``skip`` hits (of
        any point) pass uncounted. ``whole``: the points but the first count from its first hit on
        (whole runs of a procedure entered there: see ``program``)."""
        v = ctypes.create_string_buffer(8)
        for i in [*range(n), STOP_SLOT]:
            self._elem(BPF_MAP_UPDATE_ELEM, i, v)
        self._elem(BPF_MAP_UPDATE_ELEM, FROM_SLOT, ctypes.create_string_buffer(struct.pack("<q", int(whole)), 8))
        self.set_skip(skip)

    def end_at_entry(self) -> None:
        """Shut the gate at the first point's next hit (counted, its registers kept): the window
        then holds whole runs of a procedure entered there, one fewer than its entries.
        skip_left turns positive when it has."""
        self._elem(BPF_MAP_UPDATE_ELEM, STOP_SLOT, ctypes.create_string_buffer(struct.pack("<q", 1), 8))

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

    def first_regs(self, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The general registers (perf/abi.GPRS order) at a point's first and last counted hits
        since the counts were zeroed (meaningful where it counted two hits or more): the first
        point's, or the second's (``slot`` 1)."""
        if not 0 <= slot < REGS_SLOTS:
            raise ValueError(f"registers are kept for the first {REGS_SLOTS} points only")
        v = ctypes.create_string_buffer(REGS_BYTES)
        self._elem(BPF_MAP_LOOKUP_ELEM, slot, v, self.regs_map)
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
