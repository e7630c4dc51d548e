"""Interpreting the next few instructions after a sample (the value-sampling paper's section 2.1).

From the registers captured at the interrupt, the stack snapshot and the process's
memory read promptly with process_vm_readv, the unicorn engine emulates the next L
instructions without side effects, and each step is recorded: registers read,
effective address, loaded and stored values, registers written, where control went.
A run stops cleanly, and says why, at a system call or other instruction that leaves
user space, at a fault or unmapped memory, at an access through fs/gs (their bases
are not in the sampled registers), at a vector register whose value is unknown (perf
does not sample xmm registers), or after L steps.

The per-step loop is C (stepper.c, built once by stepper.py): a unicorn code hook
closes each step and opens the next, a write hook logs the old bytes of every write.
Python decodes each address once (capstone) into a plan the loop keeps, and maps and
refreshes pages when the loop asks. Each run is one call: about 5 us for L = 4, where a
Python loop of single steps cost about 75 us (unicorn's per-start cost and ctypes calls
per step).

Memory model: every page is the emulator's own copy. Code pages are copied from the
process on first fetch and kept (code does not change, JIT aside). A data page is
refreshed the first time a drain's runs touch it (the effective address is known before
each step), from a copy read from the process once per drain. The stack snapshot taken
at the interrupt is written over its pages for the run. After each run every write it
made, and the snapshot, are undone, so the next run sees the process's memory as of the
drain, never another run's writes; writes never reach the process. (Unicorn's MMIO pages
would avoid the copies, but their Python callbacks cost about 15 us per access here;
unmapping and mapping pages again costs 30 us or more a page, growing with the pages
mapped.)
"""

from __future__ import annotations

import ctypes
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cyclescope.collect.procmem import ProcessMemory
from cyclescope.values import stepper
from cyclescope.values.api import MASK64, Step, StepBatch
from cyclescope.values.insn import ROW_COL, ROW_REGS, ROW_STRUCT, InsnDetail, decode

PAGE = 4096
# Pages one emulator maps before the next call (a run, or a drain's runs) gets a fresh one. unicorn
# rebuilds its memory map on every mem_map and on release, so a map costs more with every page
# already mapped (on these VMs 0.4 ms a page at 512, 1.7 ms at 1,024; releasing 1,024 pages 1.6 s).
# A program that reads memory widely, like the demo's pointer chase, maps thousands: `record
# --exact interpret` of the demo's 1 s run took over 14 minutes, most of it releasing the emulator
# at exit; 19 s with the cap. The SQLite shell's run, with fewer pages, is as fast either way.
# The fresh one decodes its plans again from decode's cache, and reads its pages from the process again.
MAX_PAGES = 256
STOP_REASONS = ("length", "syscall", "fault", "unmapped", "tls", "vector", "undecodable", "unsupported")
MemReader = Callable[[int, int], bytes | None]
MAX_PLANS = 65536  # decoded instructions kept per process
MAX_INSNS = 1 << 20  # decoded instructions kept in all


@dataclass
class RunResult:
    steps: list[Step]
    reason: str


def _uc() -> Any:
    import unicorn
    import unicorn.x86_const

    return unicorn


def _plan(pc: int, insn: InsnDetail | None, stop: str | None, ident: int) -> stepper.Plan:
    """The C loop's plan of the instruction at ``pc``."""
    p = stepper.Plan()
    p.pc = pc
    p.id = ident
    p.stop = STOP_REASONS.index(stop) if stop else 0
    if insn is None:
        return p
    p.isize = insn.size
    m = insn.mem
    if m is not None:
        p.flags |= stepper.P_MEM | (stepper.P_READ if m.read else 0) | (stepper.P_WRITE if m.write else 0)
        p.size = min(m.size, 255)
        p.disp = m.disp
        p.scale = m.scale
        p.base = stepper.REG_NONE if not m.base else stepper.REG_RIP if m.base == "rip" \
            else ROW_COL.get(m.base, stepper.REG_UNKNOWN)
        p.index = stepper.REG_NONE if not m.index else ROW_COL.get(m.index, stepper.REG_UNKNOWN)
    if insn.stack_op:
        p.flags |= stepper.P_STACK | (stepper.P_LEAVE if insn.mnemonic == "leave" else 0)
    for names, mask in ((insn.vreads, p.vread), (insn.vwrites, p.vwrite)):
        for name in names:
            b = stepper.VEC_BIT.get(name)
            if b is None:  # a vector register the loop does not know: never run it
                p.stop = STOP_REASONS.index("unsupported")
            else:
                mask[b >> 6] |= 1 << (b & 63)
    return p


class _Emulator:
    """One process's emulator and its C loop. Every page is unicorn RAM: code pages are copied once
    and kept; a data page is refreshed (``refresh``) when the loop first touches it in a drain, from
    a copy read from the process once per drain (``generation``) and reused by the drain's other
    runs: process_vm_readv costs about 6.5 us here whatever the size, writing a page into unicorn
    under 1 us, and the runs of a drain are all interpreted within milliseconds, well after their
    interrupts anyway."""

    def __init__(self, pid: int, reader: MemReader, lib: Any, callback: Any) -> None:
        u = _uc()
        self.pid = pid
        self.read_process = reader
        self.uc = u.Uc(u.UC_ARCH_X86, u.UC_MODE_64)
        self.handle = ctypes.c_void_p(self.uc._uch.value)
        self.pages: dict[int, bool] = {}  # page -> is code
        self.generation = -1
        self.copies: dict[int, bytes | None] = {}  # data pages as read from the process in this generation
        self.uc.hook_add(u.UC_HOOK_MEM_UNMAPPED, self._unmapped)
        self.lib = lib
        self.ctx = lib.stp_new(self.handle, callback, pid)
        if not self.ctx:
            raise stepper.StepperError("the interpreter's inner loop could not hook the emulator")

    def close(self, unhook: bool = True) -> None:
        ctx = getattr(self, "ctx", None)  # None too when __init__ failed before making it
        if ctx:
            self.lib.stp_free(ctx, int(unhook))
            self.ctx = None

    def __del__(self) -> None:
        self.close(unhook=False)  # the emulator may be gone already (a cycle's finalizers run in any order)

    # memory -------------------------------------------------------------------------
    def begin(self, generation: int) -> None:
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
        return True

    def refresh(self, page: int, stack: bool) -> bool:
        """Make ``page`` hold this drain's copy (the loop asks once per page and drain); a stack page
        the process will not give is mapped as zeros (the snapshot is written over it)."""
        is_code = self.pages.get(page)
        if is_code:
            return True
        if is_code is None:
            return self._map(page, code=False, content=not stack)
        data = self._process_page(page)
        if data is None:
            return stack
        self.write(page, data)
        return True

    def read(self, addr: int, size: int) -> bytes | None:
        try:
            return bytes(self.uc.mem_read(addr, size))
        except _uc().UcError:
            return None

    def write(self, addr: int, data: bytes) -> None:
        self.uc.mem_write(addr, data)

    def _unmapped(self, uc: Any, access: int, address: int, size: int, value: int, user: Any) -> bool:
        u = _uc()
        page = address & ~(PAGE - 1)
        ok = self._map(page, code=access == u.UC_MEM_FETCH_UNMAPPED)
        end_page = (address + size - 1) & ~(PAGE - 1)
        if ok and end_page != page and end_page not in self.pages:
            ok = self._map(end_page, code=False)
        return ok  # False: unicorn stops the run with an unmapped-memory error

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
        return d, stop


class Interpreter:
    """Emulates up to L instructions from a sampled state, per process, without side effects.

    A drain's runs go one ``execute`` call each into one buffer of steps; ``take`` turns them into a
    StepBatch and empties it."""

    def __init__(self, max_processes: int = 8, reader: Callable[[int], MemReader] | None = None) -> None:
        self.max_processes = max_processes
        self._reader = reader or (lambda pid: ProcessMemory(pid).read)
        self._lib = stepper.load()
        self._callback = stepper.PAGE_CALLBACK(self._need_page)  # kept alive as long as the C side may call it
        self._emus: OrderedDict[int, _Emulator] = OrderedDict()
        self.stops: Counter[str] = Counter()
        self.runs = 0
        self.generation = 0  # process memory read in one generation is reused within it
        self.steps = 0
        self.insns: list[InsnDetail] = []  # every instruction planned, by the id the loop records
        self._insn_ids: dict[InsnDetail, int] = {}
        self._out = stepper.Out()
        self._steps = np.zeros(0, stepper.STEP_DTYPE)
        self._vres = np.zeros(0, stepper.VRES_DTYPE)
        self._reserve(256)

    @property
    def buffered_steps(self) -> int:
        """Steps in the buffer, waiting for :meth:`take`."""
        return int(self._out.n)

    def next_drain(self) -> None:
        """Runs from here on read process memory afresh (each page once, then the copy)."""
        self.generation += 1

    def forget(self, pid: int) -> None:
        """The process exited or exec'd: its pages are no longer valid."""
        e = self._emus.pop(pid, None)
        if e is not None:
            e.close()

    def _emulator(self, pid: int) -> _Emulator:
        """The process's emulator, ready for this drain (the least recently used ones beyond
        max_processes are closed by ``_evict``, never while a call may still use them)."""
        e = self._emus.get(pid)
        if e is not None and len(e.pages) > MAX_PAGES:
            self._emus.pop(pid).close()  # a fresh emulator: every map into this one costs more
            e = None
        if e is None:
            e = _Emulator(pid, self._reader(pid), self._lib, self._callback)
            self._emus[pid] = e
        else:
            self._emus.move_to_end(pid)
        e.begin(self.generation)
        return e

    def _evict(self) -> None:
        while len(self._emus) > self.max_processes:
            self._emus.popitem(last=False)[1].close()

    def _need_page(self, key: int, page: int, stack: int) -> int:
        """The loop's request for a page of process ``key`` (a ctypes callback: never raises)."""
        try:
            e = self._emus.get(key)
            return int(e is not None and e.refresh(page, bool(stack)))
        except Exception:
            return 0

    def _add_plan(self, e: _Emulator) -> None:
        """Decode the instruction the loop stopped at for want of a plan, and give it the plan."""
        lib = self._lib
        pc = lib.stp_need_pc(e.ctx)
        insn, stop = e.plan(pc)
        if lib.stp_plan_count(e.ctx) >= MAX_PLANS:
            lib.stp_clear_plans(e.ctx)
        lib.stp_add_plan(e.ctx, ctypes.byref(_plan(pc, insn, stop, self._insn_id(insn) if insn else -1)))

    def _finish(self, e: _Emulator) -> int:
        """Run on after a stop for want of a plan until the run ends; its reason code."""
        r = stepper.NEED_PLAN
        while r == stepper.NEED_PLAN:
            self._add_plan(e)
            r = self._lib.stp_go(e.ctx)
        return r & 0xFF

    def _stamp(self) -> int:
        """This drain's generation as the loop counts them (from 1: 0 marks a page never refreshed)."""
        return self.generation % 0xFFFFFFFF + 1

    def _account(self, steps_before: int, reasons: list[str]) -> None:
        """Count runs just done (their reasons) and the steps they added to the buffer."""
        self._evict()
        self.runs += len(reasons)
        self.steps += self._out.n - steps_before
        self.stops.update(reasons)

    def _reserve(self, steps: int) -> None:
        """Room for ``steps`` more steps (and their vector results) in the buffer."""
        o = self._out
        if o.n + steps <= len(self._steps) and o.vn + 4 * steps <= len(self._vres):
            return
        cap = max(2 * len(self._steps), o.n + steps, 256)
        grown = np.zeros(cap, stepper.STEP_DTYPE)
        grown[: o.n] = self._steps[: o.n]
        vgrown = np.zeros(4 * cap, stepper.VRES_DTYPE)
        vgrown[: o.vn] = self._vres[: o.vn]
        self._steps, self._vres = grown, vgrown
        o.steps, o.cap = grown.ctypes.data, cap
        o.vres, o.vcap = vgrown.ctypes.data, 4 * cap

    def _insn_id(self, insn: InsnDetail) -> int:
        i = self._insn_ids.get(insn)
        if i is None:
            i = self._insn_ids[insn] = len(self.insns)
            self.insns.append(insn)
        return i

    def run(self, pid: int, regs: dict[str, int], stack: bytes, length: int,
            known_vec: dict[str, int] | None = None) -> RunResult:
        """One run as Steps. ``regs``: 64-bit general-purpose registers, rip and flags at the
        interrupt; ``stack``: the bytes from rsp up. ``known_vec``: vector registers whose values are
        known (exact mode)."""
        self.next_drain()  # a lone run reads the process's memory now
        self._out.n = self._out.vn = 0
        row = ROW_STRUCT.pack(*(regs.get(n, 0) & MASK64 for n in ROW_REGS))
        reason = self.execute(pid, row, stack, length, 0, known_vec)
        steps = self.take(np.zeros(1, np.uint64), np.full(1, -1)).to_steps()
        return RunResult(steps[0][1] if steps else [], reason)

    def execute(self, pid: int, row: bytes, stack: bytes, length: int, run: int,
                known_vec: dict[str, int] | None = None) -> str:
        """Emulate up to ``length`` instructions from the registers ``row`` (ROW_REGS order, packed
        as ROW_STRUCT) and the stack snapshot ``stack`` (from row's rsp up); the steps go to the
        buffer tagged ``run``. Why the run stopped."""
        e = self._emulator(pid)
        known = [0, 0]
        if known_vec:
            x = _uc().x86_const
            for name, v in known_vec.items():
                b = stepper.VEC_BIT.get(name)
                if b is not None:
                    e.uc.reg_write(getattr(x, f"UC_X86_REG_{name.upper()}"), v)
                    known[b >> 6] |= 1 << (b & 63)
        self._reserve(length)
        before = self._out.n
        r = self._lib.stp_run(e.ctx, ctypes.byref(self._out), row, stack, len(stack), length, run, self._stamp(),
                              known[0], known[1])
        reason = STOP_REASONS[self._finish(e) if r == stepper.NEED_PLAN else r & 0xFF]
        self._account(before, [reason])
        return reason

    def execute_many(self, pids: list[int], rows: np.ndarray, stacks: np.ndarray, lens: np.ndarray, length: int,
                     deadline: float = 0.0, first_run: int = 0) -> list[str]:
        """A drain's runs in one call: run j from ``rows[j]`` (ROW_REGS columns) and the first
        ``lens[j]`` bytes of ``stacks[j]``, in process ``pids[j]``, its steps tagged first_run + j
        (the buffer keeps the steps of earlier calls until :meth:`take`). With a
        ``deadline`` (time.perf_counter seconds) the loop checks the clock every 8 runs and starts no
        run past it. The reasons of the runs done: a prefix of them all."""
        n = len(pids)
        if not n:
            return []
        rows = np.ascontiguousarray(rows, "<u8").reshape(n, len(ROW_REGS))
        if stacks.shape[1] == 0:
            stacks = np.zeros((n, 8), np.uint8)
        stacks = np.ascontiguousarray(stacks, np.uint8)
        lens = np.ascontiguousarray(lens, np.uint32)
        emus = {pid: self._emulator(pid) for pid in dict.fromkeys(pids)}
        ctxs = (ctypes.c_void_p * n)(*[emus[p].ctx for p in pids])
        self._reserve(n * length)
        before = self._out.n
        reasons = np.zeros(n, np.uint8)
        at = ctypes.c_int32(0)
        deadline_ns = int(deadline * 1e9) if deadline > 0 else 0
        gen = self._stamp()
        lib, out = self._lib, ctypes.byref(self._out)
        start = 0
        while True:
            r = lib.stp_run_many(ctxs, out, rows.ctypes.data, stacks.ctypes.data, stacks.shape[1], lens.ctypes.data,
                                 n, length, gen, deadline_ns, start, reasons.ctypes.data, ctypes.byref(at))
            if r != stepper.NEED_PLAN:
                break
            reasons[at.value] = self._finish(emus[pids[at.value]])
            start = at.value + 1
        names = [STOP_REASONS[c] for c in reasons[: at.value].tolist()]
        if first_run:
            self._steps["run"][before : self._out.n] += first_run
        self._account(before, names)
        return names

    def take(self, ctx_v0: np.ndarray, ctx_img: np.ndarray) -> StepBatch:
        """The buffer's steps as a StepBatch; empties the buffer. ``ctx_v0``, ``ctx_img``: each run's
        call site (an offset in image ctx_img, -1: unknown), indexed by run."""
        o = self._out
        n, vn = o.n, o.vn
        o.n = o.vn = 0
        if len(self.insns) > MAX_INSNS:  # a long-lived daemon forgets old instructions now and then
            steps = self._steps[:n]
            for e in self._emus.values():
                self._lib.stp_clear_plans(e.ctx)
            live, steps["insn"] = np.unique(steps["insn"], return_inverse=True)
            self.insns = [self.insns[i] for i in live.tolist()]
            self._insn_ids = {d: i for i, d in enumerate(self.insns)}
        if not n:
            return StepBatch.empty()
        st = self._steps[:n]
        ids, group = np.unique(st["insn"], return_inverse=True)
        run = st["run"].astype(np.int64)
        vres: list[dict[str, int] | None] = [None] * n
        if vn:
            for j, name, v in self._vres[:vn][["step", "name", "value"]].tolist():
                d = vres[j] = vres[j] or {}
                d[stepper.VEC_NAMES[name]] = v
        cv0, cimg = np.asarray(ctx_v0, np.uint64), np.asarray(ctx_img, np.int64)
        return StepBatch(run, st["sampled"].astype(bool), st["pc"].copy(), group.reshape(-1).astype(np.int64),
                         [self.insns[i] for i in ids.tolist()], st["in"].copy(), st["out"].copy(), None, None,
                         st["ea"].copy(), st["has_ea"].astype(bool), st["loaded"].copy(),
                         st["has_loaded"].astype(bool), st["stored"].copy(), st["has_stored"].astype(bool),
                         st["next_pc"].copy(), np.ones(n, bool), cv0[run], cimg[run], vres)


def describe_stops(stops: Counter[str]) -> str:
    total = sum(stops.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in stops.most_common())

