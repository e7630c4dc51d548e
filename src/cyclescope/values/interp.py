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
copied afresh the first time a run touches it (the effective address is known
before each step), and the stack snapshot taken at the interrupt is written over
it, so the run sees the interrupt-time stack and the process's current memory.
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

from cyclescope.values.api import Step
from cyclescope.values.insn import GP64, InsnDetail, decode, effective_address
from cyclescope.values.procmem import ProcessMemory

PAGE = 4096
STOP_REASONS = ("length", "syscall", "fault", "unmapped", "tls", "vector", "undecodable", "unsupported")
MemReader = Callable[[int, int], bytes | None]
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
        names = [*GP64, "rip", "eflags"]
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
    data pages are refreshed from the process the first time a run touches them (and the
    stack snapshot written over them), so a run never sees an earlier run's writes."""

    def __init__(self, pid: int, reader: MemReader) -> None:
        u = _uc()
        self.pid = pid
        self.read_process = reader
        self.uc = u.Uc(u.UC_ARCH_X86, u.UC_MODE_64)
        self.handle = ctypes.c_void_p(self.uc._uch.value)
        self.pages: dict[int, bool] = {}  # page -> is code
        self.fresh: set[int] = set()  # data pages refreshed in this run
        self.insns: dict[int, InsnDetail | None] = {}  # decoded instructions by address (code is copied once)
        self.snap_base = 0
        self.snap = b""
        self.failed = False
        self._buf = ctypes.create_string_buffer(64)
        self.uc.hook_add(u.UC_HOOK_MEM_UNMAPPED, self._unmapped)

    # memory -------------------------------------------------------------------------
    def begin(self, rsp: int, stack: bytes) -> None:
        self.fresh = set()
        self.failed = False
        self.snap_base, self.snap = rsp, stack
        if stack:
            for page in range(rsp & ~(PAGE - 1), rsp + len(stack), PAGE):
                if page not in self.pages and not self._map(page, code=False, content=False):
                    self.snap = b""
                    return
            self.write(rsp, stack)

    def _map(self, page: int, code: bool, content: bool = True) -> bool:
        """Map ``page`` from the process (zeros when ``content`` is False and it cannot be read)."""
        u = _uc()
        data = self.read_process(page, PAGE)
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

    def ensure(self, addr: int, size: int) -> bool:
        """Make [addr, addr+size) current for this run: map or refresh its pages. False if unmapped."""
        snap_end = self.snap_base + len(self.snap)
        for page in range(addr & ~(PAGE - 1), addr + size, PAGE):
            is_code = self.pages.get(page)
            if is_code is None:
                if not self._map(page, code=False):
                    return False
                if self.snap and page <= snap_end and self.snap_base < page + PAGE:
                    self._restore_snapshot(page)
            elif not is_code and page not in self.fresh:
                if self.snap_base <= addr and addr + size <= snap_end:
                    continue  # wholly inside the snapshot, which begin() wrote
                data = self.read_process(page, PAGE)
                if data is None:
                    return False
                self.write(page, data)
                self._restore_snapshot(page)
                self.fresh.add(page)
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

    # registers -----------------------------------------------------------------------
    def write_regs(self, regs: dict[str, int]) -> None:
        r = _raw()
        r.vals[:] = [regs.get("flags" if name == "eflags" else name, 0) & 0xFFFFFFFFFFFFFFFF for name in r.names]
        r.write_batch(self.handle, r.ids, r.ptrs, r.n)

    def read_regs(self) -> dict[str, int]:
        r = _raw()
        r.read_batch(self.handle, r.ids, r.ptrs, r.n)
        return dict(zip(r.names, r.vals[:], strict=True))

    def step(self, pc: int) -> int:
        return int(_raw().emu_start(self.handle, pc, 0, 0, 1))

    def insn(self, pc: int) -> InsnDetail | None:
        if pc in self.insns:
            return self.insns[pc]
        code = self.code(pc)
        d = decode(code, pc) if code else None
        if code and self.pages.get(pc & ~(PAGE - 1)) and len(self.insns) < 65536:
            self.insns[pc] = d  # only once the page is ours: the process's own bytes may be read mid-write
        return d

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
        self.steps = 0

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
        """``regs``: 64-bit general-purpose registers, rip and flags at the interrupt; ``stack``: the
        bytes from rsp up. ``known_vec``: vector registers whose values are known (exact mode)."""
        self.runs += 1
        e = self._emulator(pid)
        e.begin(regs.get("rsp", 0), stack)
        pc = regs["rip"]
        e.write_regs(regs)
        vec = dict(known_vec or {})
        if known_vec:
            x = _uc().x86_const
            for name, v in known_vec.items():
                e.uc.reg_write(getattr(x, f"UC_X86_REG_{name.upper()}"), v)
        cur = dict(regs)
        steps: list[Step] = []
        reason = "length"
        for i in range(length):
            insn = e.insn(pc)
            if insn is None:
                reason = "undecodable" if pc in e.insns else "unmapped"
                break
            if insn.kind == "syscall":
                reason = "syscall"
                break
            if insn.mem is not None and insn.mem.segment:
                reason = "tls"
                break
            if insn.vreads and any(v not in vec for v in insn.vreads):
                reason = "vector"
                break
            if insn.string_op:
                reason = "unsupported"
                break
            step = Step(pc, insn, cur, sampled=(i == 0))
            m = insn.mem
            if m is not None:
                step.ea = effective_address(m, cur, insn.next_address)
                if step.ea is not None:
                    if not e.ensure(step.ea, max(1, m.size)):
                        reason = "unmapped"
                        break
                    if m.read:
                        data = e.read(step.ea, min(m.size, 8))
                        step.loaded = int.from_bytes(data, "little") if data else None
            if insn.stack_op:
                sp = cur.get("rbp", 0) if insn.mnemonic == "leave" else cur.get("rsp", 0)
                if not e.ensure(sp - 8, 16):
                    reason = "unmapped"
                    break
            err = e.step(pc)
            if err or e.failed:
                reason = "unmapped" if e.failed or err in _UNMAPPED_ERRORS else "fault"
                break
            after = e.read_regs()
            step.results = {w.name: w.extract(after[w.full]) for w in insn.writes}
            for vname in insn.vwrites:
                val = e.read_vec(vname)
                vec[vname] = val
                step.results[vname] = val & 0xFFFFFFFFFFFFFFFF
            if m is not None and m.write and step.ea is not None:
                data = e.read(step.ea, min(m.size, 8))
                step.stored = int.from_bytes(data, "little") if data else None
            step.next_pc = after["rip"]
            steps.append(step)
            self.steps += 1
            after["flags"] = after.pop("eflags")
            cur = after
            pc = after["rip"]
        self.stops[reason] += 1
        return RunResult(steps, reason)


def regs_from_perf(row: Any, columns: dict[str, int]) -> dict[str, int]:
    """A decoded user-register row → {64-bit name: value} for the interpreter."""
    vals = [int(v) for v in row]
    out = {name: vals[col] for name, col in columns.items() if name not in ("cs", "ss")}
    return out


def describe_stops(stops: Counter[str]) -> str:
    total = sum(stops.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in stops.most_common())


def insn_for(code: bytes, pc: int) -> InsnDetail | None:
    return decode(code, pc)
