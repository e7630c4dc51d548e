"""Interpreting the next few instructions after a sample (the value-sampling paper's section 2.1).

From the registers captured at the interrupt, the stack snapshot and the process's
memory read promptly with process_vm_readv, the unicorn engine emulates the next L
instructions without side effects, one at a time, and each step is recorded:
registers read, effective address, loaded and stored values, registers written,
where control went. A run stops cleanly, and says why, at a system call or other
instruction that leaves user space, at a fault or unmapped memory, at an access
through fs/gs (their bases are not in the sampled registers), at a vector register
whose value is unknown (perf does not sample xmm registers), or after L steps.

Memory model: every page is the emulator's own copy. Code pages are copied from the
process on first fetch and kept (code does not change, JIT aside). A data page is
written afresh the first time a run touches it (the effective address is known
before each step), from a copy read from the process once per drain, and the stack
snapshot taken at the interrupt is written over it, so the run sees the
interrupt-time stack and the process's memory as of the drain.
Writes never reach the process. (Unicorn's MMIO pages would avoid the copies, but
their Python callbacks cost about 15 us per access here: more than a page copy.)

The hot calls go to libunicorn through ctypes directly: unicorn's Python binding
costs about 5 us per register read and write, the raw batch calls about 1 us for
all registers (measured here), and a run makes dozens of them.
"""

from __future__ import annotations

import ctypes
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cyclescope.values.api import MASK64, Step, StepBatch, StepRecord
from cyclescope.values.insn import ROW_COL, ROW_REGS, ROW_STRUCT, InsnDetail, decode, effective_address_row, row_value
from cyclescope.values.procmem import ProcessMemory

PAGE = 4096
STOP_REASONS = ("length", "syscall", "fault", "unmapped", "tls", "vector", "undecodable", "unsupported")
MemReader = Callable[[int, int], bytes | None]
_RSP, _RBP, _RIP = ROW_COL["rsp"], ROW_COL["rbp"], ROW_COL["rip"]
_UNMAPPED_ERRORS = frozenset({6, 7, 8})  # UC_ERR_READ_UNMAPPED, UC_ERR_WRITE_UNMAPPED, UC_ERR_FETCH_UNMAPPED


@dataclass
class RunResult:
    steps: list[Step]
    reason: str


def _uc() -> Any:
    import unicorn
    import unicorn.x86_const

    return unicorn


class _Raw:
    """Direct libunicorn entry points for the per-step calls."""

    def __init__(self) -> None:
        from unicorn.unicorn_py3.unicorn import uclib

        lib = ctypes.CDLL(uclib._name)
        self.read_batch = lib.uc_reg_read_batch
        self.read_batch.restype = ctypes.c_int
        self.write_batch = lib.uc_reg_write_batch
        self.write_batch.restype = ctypes.c_int
        self.emu_start = lib.uc_emu_start
        self.emu_start.restype = ctypes.c_int
        self.emu_start.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.c_size_t]
        self.mem_read = lib.uc_mem_read
        self.mem_read.restype = ctypes.c_int
        self.mem_read.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.mem_write = lib.uc_mem_write
        self.mem_write.restype = ctypes.c_int
        self.mem_write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
        self.buf = ctypes.create_string_buffer(64)
        x = _uc().x86_const
        names = ["eflags" if n == "flags" else n for n in ROW_REGS]
        self.names = names
        self.n = len(names)
        self.ids = (ctypes.c_int * self.n)(*[getattr(x, f"UC_X86_REG_{r.upper()}") for r in names])
        self.vals = (ctypes.c_uint64 * self.n)()
        base = ctypes.addressof(self.vals)
        self.ptrs = (ctypes.c_void_p * self.n)(*[base + 8 * i for i in range(self.n)])


_RAW: _Raw | None = None


def _raw() -> _Raw:
    global _RAW
    if _RAW is None:
        _RAW = _Raw()
    return _RAW


class _Emulator:
    """One process's emulator. Every page is unicorn RAM: code pages are copied once and kept;
    data pages are written afresh the first time a run touches them (and the stack snapshot over
    them), so a run never sees an earlier run's writes. A data page is read from the process once
    per drain (``generation``) and the copy reused by the drain's other runs: process_vm_readv
    costs about 6.5 us here whatever the size, writing a page into unicorn under 1 us, and the
    runs of a drain are all interpreted within milliseconds, well after their interrupts anyway.
    The snapshot is written only when a run first touches it."""

    def __init__(self, pid: int, reader: MemReader) -> None:
        u = _uc()
        self.pid = pid
        self.read_process = reader
        self.uc = u.Uc(u.UC_ARCH_X86, u.UC_MODE_64)
        self.handle = ctypes.c_void_p(self.uc._uch.value)
        self.pages: dict[int, bool] = {}  # page -> is code
        self.fresh: set[int] = set()  # data pages written afresh in this run
        self.generation = -1
        self.copies: dict[int, bytes | None] = {}  # data pages as read from the process in this generation
        # Decoded instructions by address (code is copied once), with why a run must stop there.
        self.plans: dict[int, tuple[InsnDetail | None, str | None]] = {}
        self.snap_base = 0
        self.snap = b""
        self.snap_written = False
        self.failed = False
        self.uc.hook_add(u.UC_HOOK_MEM_UNMAPPED, self._unmapped)

    # memory -------------------------------------------------------------------------
    def begin(self, rsp: int, stack: bytes, generation: int) -> None:
        self.fresh = set()
        self.failed = False
        self.snap_base, self.snap = rsp, stack
        self.snap_written = False
        if generation != self.generation:
            self.generation = generation
            self.copies = {}

    def _process_page(self, page: int) -> bytes | None:
        if page in self.copies:
            return self.copies[page]
        data = self.read_process(page, PAGE)
        self.copies[page] = data
        return data

    def _map(self, page: int, code: bool, content: bool = True) -> bool:
        """Map ``page`` from the process (zeros when ``content`` is False and it cannot be read)."""
        u = _uc()
        data = self.read_process(page, PAGE) if code else self._process_page(page)
        if data is None and content:
            return False
        try:
            self.uc.mem_map(page, PAGE, u.UC_PROT_ALL)
        except u.UcError:
            return False
        if data is not None:
            self.write(page, data)
        self.pages[page] = code
        if not code:
            self.fresh.add(page)
        return True

    def _write_snapshot(self) -> bool:
        """Write the interrupt-time stack over its pages (mapped as zeros if the process is gone)."""
        if not self.snap_written:
            self.snap_written = True
            rsp, stack = self.snap_base, self.snap
            for page in range(rsp & ~(PAGE - 1), rsp + len(stack), PAGE):
                if page not in self.pages and not self._map(page, code=False, content=False):
                    self.snap = b""
                    return False
            self.write(rsp, stack)
        return True

    def ensure(self, addr: int, size: int) -> bool:
        """Make [addr, addr+size) current for this run: map or refresh its pages. False if unmapped."""
        end = addr + size
        snap_lo, snap_hi = self.snap_base, self.snap_base + len(self.snap)
        if snap_lo <= addr and end <= snap_hi:
            return self._write_snapshot()  # wholly inside the snapshot
        for page in range(addr & ~(PAGE - 1), end, PAGE):
            if page in self.fresh:
                continue
            is_code = self.pages.get(page)
            if is_code:
                continue
            on_stack = bool(self.snap) and page < snap_hi and snap_lo < page + PAGE
            if is_code is None:
                if not self._map(page, code=False, content=not on_stack):
                    return False
            else:
                data = self._process_page(page)
                if data is None:
                    return False
                self.write(page, data)
                self.fresh.add(page)
            if on_stack:
                self._restore_snapshot(page)
        return True

    def _restore_snapshot(self, page: int) -> None:
        lo = max(page, self.snap_base)
        hi = min(page + PAGE, self.snap_base + len(self.snap))
        if lo < hi:
            self.write(lo, self.snap[lo - self.snap_base : hi - self.snap_base])

    def read(self, addr: int, size: int) -> bytes | None:
        r = _raw()
        if size > 64 or r.mem_read(self.handle, addr, r.buf, size):
            return None
        return r.buf.raw[:size]

    def write(self, addr: int, data: bytes) -> None:
        _raw().mem_write(self.handle, addr, data, len(data))

    def _unmapped(self, uc: Any, access: int, address: int, size: int, value: int, user: Any) -> bool:
        u = _uc()
        page = address & ~(PAGE - 1)
        ok = self._map(page, code=access == u.UC_MEM_FETCH_UNMAPPED)
        if ok and self.snap:
            self._restore_snapshot(page)
        end_page = (address + size - 1) & ~(PAGE - 1)
        if ok and end_page != page and end_page not in self.pages:
            ok = self._map(end_page, code=False)
        if not ok:
            self.failed = True
        return ok

    def code(self, pc: int) -> bytes | None:
        """Up to 16 instruction bytes at ``pc``: from our copy of the page, else the process."""
        page = pc & ~(PAGE - 1)
        n = min(16, page + PAGE - pc)
        head = self.read(pc, n) if self.pages.get(page) else self.read_process(pc, n)
        if head is None:
            return None
        if n < 16:
            head += self.read_process(page + PAGE, 16 - n) or b""
        return head

    def plan(self, pc: int) -> tuple[InsnDetail | None, str | None]:
        """The instruction at ``pc`` and, when the interpreter cannot run it whatever the state, why."""
        code = self.code(pc)
        d = decode(code, pc) if code else None
        stop = None
        if d is None:
            stop = "undecodable" if code else "unmapped"
        elif d.kind == "syscall":
            stop = "syscall"
        elif d.mem is not None and d.mem.segment:
            stop = "tls"
        elif d.string_op:
            stop = "unsupported"
        plan = (d, stop)
        if code and self.pages.get(pc & ~(PAGE - 1)) and len(self.plans) < 65536:
            self.plans[pc] = plan  # only once the page is ours: the process's own bytes may be read mid-write
        return plan

    def read_vec(self, name: str) -> int:
        x = _uc().x86_const
        v = self.uc.reg_read(getattr(x, f"UC_X86_REG_{name.upper()}"))
        return int(v) if isinstance(v, int) else 0


class Interpreter:
    """Emulates up to L instructions from a sampled state, per process, without side effects."""

    def __init__(self, max_processes: int = 8, reader: Callable[[int], MemReader] | None = None) -> None:
        self.max_processes = max_processes
        self._reader = reader or (lambda pid: ProcessMemory(pid).read)
        self._emus: OrderedDict[int, _Emulator] = OrderedDict()
        self.stops: Counter[str] = Counter()
        self.runs = 0
        self.generation = 0  # process memory read in one generation is reused within it
        self.steps = 0

    def next_drain(self) -> None:
        """Runs from here on read process memory afresh (each page once, then the copy)."""
        self.generation += 1

    def forget(self, pid: int) -> None:
        """The process exited or exec'd: its pages are no longer valid."""
        self._emus.pop(pid, None)

    def _emulator(self, pid: int) -> _Emulator:
        e = self._emus.get(pid)
        if e is None:
            e = _Emulator(pid, self._reader(pid))
            self._emus[pid] = e
            while len(self._emus) > self.max_processes:
                self._emus.popitem(last=False)
        else:
            self._emus.move_to_end(pid)
        return e

    def run(self, pid: int, regs: dict[str, int], stack: bytes, length: int,
            known_vec: dict[str, int] | None = None) -> RunResult:
        """One run as Steps. ``regs``: 64-bit general-purpose registers, rip and flags at the
        interrupt; ``stack``: the bytes from rsp up. ``known_vec``: vector registers whose values are
        known (exact mode)."""
        self.next_drain()  # a lone run reads the process's memory now
        recs: list[StepRecord] = []
        row = ROW_STRUCT.pack(*(regs.get(n, 0) & MASK64 for n in ROW_REGS))
        reason = self.execute(pid, row, stack, length, recs, 0, known_vec)
        steps = StepBatch.from_records(recs, [None]).to_steps()
        return RunResult(steps[0][1] if steps else [], reason)

    def execute(self, pid: int, row: bytes, stack: bytes, length: int, out: list[StepRecord], run: int,
                known_vec: dict[str, int] | None = None) -> str:
        """Emulate up to ``length`` instructions from the registers ``row`` (ROW_REGS order, packed
        as ROW_STRUCT) and append a StepRecord per instruction to ``out``, tagged ``run``; returns why
        the run stopped. The hot loop of value sampling: per step one emulated instruction and one
        batch read of the registers, kept as bytes (numpy takes them whole)."""
        self.runs += 1
        e = self._emulator(pid)
        e.begin(row_value(row, _RSP), stack, self.generation)
        r = _raw()
        h = e.handle
        ctypes.memmove(r.vals, row, len(row))
        r.write_batch(h, r.ids, r.ptrs, r.n)
        vec = dict(known_vec or {})
        if known_vec:
            x = _uc().x86_const
            for name, v in known_vec.items():
                e.uc.reg_write(getattr(x, f"UC_X86_REG_{name.upper()}"), v)
        pc = row_value(row, _RIP)
        cur = row
        reason = "length"
        n = 0
        plans = e.plans
        for i in range(length):
            plan = plans.get(pc)
            if plan is None:
                plan = e.plan(pc)
            insn, stop = plan
            if stop is not None:
                reason = stop
                break
            assert insn is not None
            if insn.vreads and any(v not in vec for v in insn.vreads):
                reason = "vector"
                break
            m = insn.mem
            ea = loaded = stored = None
            if m is not None:
                ea = effective_address_row(m, cur, insn.next_address)
                if ea is not None:
                    if not e.ensure(ea, max(1, m.size)):
                        reason = "unmapped"
                        break
                    if m.read:
                        data = e.read(ea, min(m.size, 8))
                        loaded = int.from_bytes(data, "little") if data else None
            if insn.stack_op:
                sp = row_value(cur, _RBP if insn.mnemonic == "leave" else _RSP)
                if not e.ensure(sp - 8, 16):
                    reason = "unmapped"
                    break
            err = r.emu_start(h, pc, 0, 0, 1)
            if err or e.failed:
                reason = "unmapped" if e.failed or err in _UNMAPPED_ERRORS else "fault"
                break
            r.read_batch(h, r.ids, r.ptrs, r.n)
            after = bytes(r.vals)
            vres = None
            if insn.vwrites:
                vres = {}
                for vname in insn.vwrites:
                    val = e.read_vec(vname)
                    vec[vname] = val
                    vres[vname] = val & MASK64
            if m is not None and m.write and ea is not None:
                data = e.read(ea, min(m.size, 8))
                stored = int.from_bytes(data, "little") if data else None
            next_pc = r.vals[_RIP]
            out.append(StepRecord(run, i == 0, pc, insn, cur, after, ea, loaded, stored, next_pc, vres))
            n += 1
            cur = after
            pc = next_pc
        self.steps += n
        self.stops[reason] += 1
        return reason


def describe_stops(stops: Counter[str]) -> str:
    total = sum(stops.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in stops.most_common())

