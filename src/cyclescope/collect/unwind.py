"""Unwinding user stack snapshots with the binaries' .eh_frame (--call-graph dwarf).

Most distribution binaries are built without frame pointers, so the kernel's frame-pointer
callchain stops after the first frame or wanders off. With PERF_SAMPLE_REGS_USER and
PERF_SAMPLE_STACK_USER each sample carries the user registers and a copy of the top of the user
stack; this module walks that copy frame by frame with the call frame information of the image
each PC falls in (images/cfi.py), as perf does at report time with libunwind or libdw. We do it at
collection time because the database keeps aggregated stacks, not raw snapshots.

A walk stops where the information ends: the outermost frame (a return address rule of
"undefined", as _start has), a PC in no mapping or in code without CFI (hand-written assembly; JIT
code named by a perf map is stepped over by its frame pointer, or as CPython's trampolines), a
saved word outside the snapshot (a deep stack: raise the snapshot size), a rule we do not follow,
or the depth limit. Why each walk stopped is counted.

Reading an image's CFI takes up to a second (readelf's decoding, parsed: python3.11 0.9 s; 2-7 s
through pyelftools where binutils is missing) the first time, before the per-user cache has it.
It runs on a worker thread; samples that need a table still loading wait in a bounded queue and
are unwound when it is ready, so the drain loop never stalls and no stack is cut short by the
loading.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from cyclescope.errors import DataError
from cyclescope.images import cfi
from cyclescope.perf.abi import MAX_DEPTH, PERF_CONTEXT_USER, X86_REGS_USER_MASK, X86Reg, regs_in_mask

if TYPE_CHECKING:
    import numpy as np

    from cyclescope.images.cache import Cache
    from cyclescope.images.maps import Mapper, ProcessState
    from cyclescope.images.registry import ImageTable

COLUMN = {r: i for i, r in enumerate(regs_in_mask(X86_REGS_USER_MASK))}
IP, SP, BP = COLUMN[X86Reg.IP], COLUMN[X86Reg.SP], COLUMN[X86Reg.BP]
# DWARF register number -> column of the sampled registers, for the first frame's CFA rule.
DWARF_COLUMN = {d: COLUMN[X86Reg(p)] for d, p in cfi.DWARF_TO_PERF.items() if X86Reg(p) in COLUMN}
MASK64 = (1 << 64) - 1
MAX_PENDING = 8192  # samples waiting for a table (8 KiB each at most: 64 MiB)


PENDING = object()
# What the loader gives for JIT code (an image named by /tmp/perf-PID.map): no CFI. V8, the JVM
# and LuaJIT keep an rbp frame in their code so that perf's frame-pointer walk passes through it;
# the walk steps over such a frame by its rbp and goes on with CFI below (Unwinder._jit_step).
FRAME_POINTER = object()
# CPython's perf trampoline (Python/asm_trampoline.S, 3.12 and 3.13 with -X perf), one copy per
# code object: `sub $8,%rsp; call *%rcx; add $8,%rsp; ret`. It keeps no rbp frame: rbp holds
# whatever the interpreter left there, which may point at a frame further up, so a frame-pointer
# guess there can skip frames (the caller's Python frames went missing from 14 of 356 stacks in one
# run). A return address into one is the 7 bytes `call *%rcx` (ff d1) before it and `add $8,%rsp;
# ret` (48 83 c4 08 c3) at it; profile.bpf.c checks the same bytes.
TRAMPOLINE_RETURN = bytes.fromhex("ffd1" "4883c408c3")


@dataclass
class UnwindStats:
    samples: int = 0
    frames: int = 0
    deferred: int = 0

    def __post_init__(self) -> None:
        self.stops: Counter[str] = Counter()

    @property
    def truncated_loading(self) -> int:
        """Walks cut short at a table still loading (the queue was full, or the run ended)."""
        return self.stops["loading"]


class Unwinder:
    """Walks user stack snapshots. tables(image, pid) gives an image's CfiTable, None (it has
    none), or PENDING (still loading); pid is a process that maps it."""

    def __init__(self, tables: Callable[[int, int], object], max_depth: int = MAX_DEPTH,
                 code: Callable[[int, int, int], bytes | None] | None = None) -> None:
        self.tables = tables
        self.max_depth = max_depth
        self.stats = UnwindStats()
        # code(pid, address, size): the process's bytes there, or None (gone, unmapped, not ours).
        self.code = code if code is not None else process_bytes
        self._trampolines: dict[tuple[int, int], bool] = {}  # (pid, return address) -> into one

    def unwind(self, proc: ProcessState, regs: list[int], stack: bytes,
               loading_stops: bool = False) -> tuple[list[int], str] | None:
        """User frames, leaf first (the PC, then return addresses), and why the walk stopped; None
        when an image's table is still loading (or, with loading_stops, a stop there). proc is the
        process's maps (ProcessState)."""
        pc = regs[IP]
        sp = regs[SP]
        bp: int | None = regs[BP]
        base = sp
        size = len(stack)

        def read(addr: int) -> int | None:
            o = addr - base
            if o < 0 or o + 8 > size:
                return None
            return int.from_bytes(stack[o : o + 8], "little")

        frames = [pc]
        starts, ends, biases, images = proc.starts, proc.ends, proc.biases, proc.images
        pid = getattr(proc, "pid", 0)
        first = True
        reason = "depth"
        while len(frames) < self.max_depth:
            i = bisect.bisect_right(starts, pc) - 1
            if i < 0 or pc >= ends[i] or images[i] <= 0:
                reason = "no-mapping"
                break
            got = self.tables(images[i], pid)
            if got is PENDING:
                if not loading_stops:
                    return None
                reason = "loading"
                break
            if got is FRAME_POINTER:
                step = self._jit_step(pc, sp, bp, read, proc, not first and self._trampoline(pid, pc))
                if step is None:
                    reason = "no-cfi"
                    break
                pc, sp, bp = step
                if pc == 0:
                    reason = "end"
                    break
                frames.append(pc)
                first = False
                continue
            table = cast("cfi.CfiTable | None", got)
            # A return address points after its call: look up the call itself.
            row = table.lookup(pc - biases[i] - (0 if first else 1)) if table is not None else None
            if row is None or table is None:
                reason = "no-cfi"
                break
            if row.cfa_kind == cfi.CFA_REG:
                if first:
                    col = DWARF_COLUMN.get(row.cfa_reg)
                    r = regs[col] if col is not None else None
                else:
                    r = sp if row.cfa_reg == cfi.DW_RSP else bp if row.cfa_reg == cfi.DW_RBP else None
                if r is None:
                    reason = "rule"
                    break
                cfa = (r + row.cfa_off) & MASK64
            else:
                known = ({d: regs[c] for d, c in DWARF_COLUMN.items()} if first
                         else {cfi.DW_RSP: sp, cfi.DW_RBP: bp, cfi.DW_RA: pc})
                known = {k: v for k, v in known.items() if v is not None}
                v = cfi.evaluate(table.exprs[row.expr], known, read)
                if v is None:
                    reason = "rule"
                    break
                cfa = v
            if row.ra_kind == cfi.SAVED_NONE:
                reason = "end"
                break
            if row.ra_kind != cfi.SAVED_AT:
                reason = "rule"
                break
            ra = read(cfa + row.ra_off)
            if ra is None:
                reason = "stack"
                break
            if row.bp_kind == cfi.SAVED_AT:
                bp = read(cfa + row.bp_off)
            elif row.bp_kind == cfi.SAVED_UNKNOWN:
                bp = None
            if ra == 0:
                reason = "end"
                break
            if cfa <= sp and not first:
                reason = "loop"  # the stack grows down: a caller's frame is above its callee's
                break
            sp = cfa
            pc = ra
            frames.append(pc)
            first = False
        return frames, reason

    def _trampoline(self, pid: int, ra: int) -> bool:
        """Whether return address ``ra`` of process ``pid`` is in a CPython perf trampoline (its
        code read once per address; False where it cannot be read)."""
        key = (pid, ra)
        got = self._trampolines.get(key)
        if got is None:
            got = bool(pid) and self.code(pid, ra - 2, len(TRAMPOLINE_RETURN)) == TRAMPOLINE_RETURN
            if len(self._trampolines) >= 1 << 16:
                self._trampolines.clear()
            self._trampolines[key] = got
        return got

    @staticmethod
    def _jit_step(pc: int, sp: int, bp: int | None, read: Callable[[int], int | None],
                  proc: ProcessState, trampoline: bool = False) -> tuple[int, int, int | None] | None:
        """The caller's (pc, sp, bp) of a frame in JIT code, which has no CFI. In a CPython perf
        trampoline (``trampoline``: its code was read) as it lays out its frame, `sub $8, %rsp;
        call *%rcx`: the return address 8 bytes above the callee's CFA, rbp untouched. Elsewhere
        first by its frame pointer, where rbp points into the stack at a return address into
        mapped code (V8, the JVM, LuaJIT's maps), then as a trampoline (the leaf frame, or code
        that could not be read). Each guess is taken only if the return address it reads is in an
        image of the process; None when none is."""

        def mapped(a: int | None) -> bool:
            if not a:
                return False
            j = bisect.bisect_right(proc.starts, a) - 1
            return j >= 0 and a < proc.ends[j] and proc.images[j] > 0

        if not trampoline and bp is not None and bp >= sp and not bp & 7:
            ra = read(bp + 8)
            if mapped(ra):
                assert ra is not None
                return ra, bp + 16, read(bp)
        ra = read(sp + 8)
        if mapped(ra):
            assert ra is not None
            return ra, sp + 16, bp
        return None


def process_bytes(pid: int, address: int, size: int) -> bytes | None:
    """``size`` bytes of process ``pid`` at ``address`` (process_vm_readv); None where they cannot
    be read."""
    from cyclescope.collect.procmem import ProcessMemory

    return ProcessMemory(pid, max(size, 16)).read(address, size)


class TableLoader:
    """CFI tables per image index, loaded on a worker thread through the per-user cache."""

    def __init__(self, images: ImageTable, cache: Cache | None = None, vdso: bytes | None = None) -> None:
        self.images = images  # ImageTable: index -> ImageInfo
        self.cache = cache
        self.vdso = vdso
        self.tables: dict[int, object] = {}  # what _load gives (a CfiTable here), or None
        self.failed: dict[int, str] = {}
        self._futures: dict[int, cf.Future[object]] = {}
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="cyclescope-cfi")
        self.pids: dict[int, int] = {}  # image -> a pid that maps it (its /proc/PID/root: containers)

    def __call__(self, image: int, pid: int = 0) -> object:
        if self.images[image].kind == "jit":
            return FRAME_POINTER
        t = self.tables.get(image, PENDING)
        if t is not PENDING:
            return t
        fut = self._futures.get(image)
        if fut is None:
            if pid:
                self.pids[image] = pid
            self._futures[image] = self._pool.submit(self._load, image)
            return PENDING  # never stall the drain: the sample waits for a later one
        if not fut.done():
            return PENDING
        del self._futures[image]
        try:
            self.tables[image] = fut.result()
        except Exception as e:
            self.tables[image] = None
            self.failed[image] = f"{type(e).__name__}: {e}"
        return self.tables[image]

    def _load(self, image: int) -> object:
        return self._table(image, cached=True)

    def _table(self, image: int, cached: bool) -> cfi.CfiTable | None:
        """The image's table (through the per-user cache where ``cached``); None where it has none."""
        info = self.images[image]
        if info.kind == "vdso":
            return cfi.build_from_bytes(self.vdso) if self.vdso is not None else None
        if info.kind != "elf" or info.offsets != "vaddr":
            return None  # JIT maps, file offsets of unreadable binaries, the kernel
        key = info.build_id or None
        pid = self.pids.get(image)
        paths = [info.path] + ([f"/proc/{pid}/root{info.path}"] if pid else [])
        err: Exception | None = None
        for p in paths:
            try:
                return cfi.load(p, key, self.cache if cached else None)
            except (OSError, DataError) as e:
                err = e
        raise DataError(f"{info.path}: {err}")

    def pending(self) -> bool:
        return bool(self._futures)

    def wait(self, timeout: float) -> None:
        """Let loads in flight finish (at the end of a run)."""
        if self._futures:
            cf.wait(list(self._futures.values()), timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def user_chain(kernel_chain: tuple[int, ...], user_frames: list[int]) -> tuple[int, ...]:
    """A callchain in the kernel's form: its kernel part, then the unwound user frames. Whatever
    the kernel gave after its PERF_CONTEXT_USER marker (nothing with exclude_callchain_user, the
    frame-pointer walk without it) is replaced."""
    out: list[int] = []
    for a in kernel_chain:
        if a == PERF_CONTEXT_USER:
            break
        out.append(a)
    out.append(PERF_CONTEXT_USER)
    out.extend(user_frames)
    return tuple(out)


@dataclass
class _Waiting:
    pid: int
    proc: ProcessState | None
    ip: int
    event: int
    comm: int
    kernel_chain: tuple[int, ...]
    regs: list[int]
    stack: bytes


@dataclass
class Unwound:
    pids: list[int] = field(default_factory=list)
    ips: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    comms: list[int] = field(default_factory=list)
    chains: list[tuple[int, ...]] = field(default_factory=list)


class DwarfStacks:
    """Turns samples with user registers and stack snapshots into callchains for StackAggregator,
    holding back those whose images' tables are still loading."""

    def __init__(self, loader: TableLoader, max_depth: int = MAX_DEPTH, max_pending: int = MAX_PENDING) -> None:
        self.loader = loader
        self.unwinder = Unwinder(loader, max_depth)
        self.max_pending = max_pending
        self.waiting: list[_Waiting] = []

    @property
    def stats(self) -> UnwindStats:
        return self.unwinder.stats

    def _one(self, w: _Waiting, force: bool) -> tuple[int, ...] | None:
        if not w.regs:
            return w.kernel_chain  # no user registers (a kernel thread): the kernel's part alone
        if w.proc is None:
            frames, reason = [w.regs[IP]], "no-mapping"
        else:
            res = self.unwinder.unwind(w.proc, w.regs, w.stack, loading_stops=force)
            if res is None:
                return None
            frames, reason = res
        st = self.stats
        st.samples += 1
        st.frames += len(frames)
        st.stops[reason] += 1
        return user_chain(w.kernel_chain, frames)

    def chains(self, mapper: Mapper, pids: list[int], ips: list[int], events: list[int], comms: list[int],
               kernel_chains: list[tuple[int, ...] | None], regs_rows: list[int], regs: np.ndarray | None,
               stack: np.ndarray | None, stack_len: np.ndarray | None, force: bool = False) -> Unwound:
        """The samples unwound now: the waiting ones whose tables arrived, then this batch's (per
        sample: pid, ip, event index, command, and the chain in user_chain's form). force: unwind
        everything (the end of a run)."""
        out = Unwound()
        todo = self.waiting
        self.waiting = []
        for pid, ip, ev, cm, kc, r in zip(pids, ips, events, comms, kernel_chains, regs_rows, strict=True):
            if r >= 0 and regs is not None and stack is not None and stack_len is not None:
                n = int(stack_len[r])
                w = _Waiting(pid, mapper.procs.get(pid), ip, ev, cm, kc or (), regs[r].tolist(),
                             stack[r, :n].tobytes())
            else:
                w = _Waiting(pid, None, ip, ev, cm, kc or (), [], b"")
            todo.append(w)
        over = len(todo) - self.max_pending
        for w in todo:
            ch = self._one(w, force or over > 0)
            if ch is None:
                self.waiting.append(w)
                self.stats.deferred += 1
                continue
            if over > 0:
                over -= 1
            out.pids.append(w.pid)
            out.ips.append(w.ip)
            out.events.append(w.event)
            out.comms.append(w.comm)
            out.chains.append(ch)
        return out
