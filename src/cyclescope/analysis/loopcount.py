"""Counting loop iterations between samples: execution counts without a cycle model.

Two consecutive samples of one thread that fall in the same execution of a loop with a counter
register (analysis/loops.py) give the number of iterations the loop ran between them: the
counter's values, each taken back to the header by its offset at the sampled instruction,
differ by that many steps. Over all such pairs, iterations per unit of the thread's time is the
loop's rate while it runs; times the time the loop's blocks were sampled, its header's
execution count (analysis/calc.py). DCPI derived the same count from issue points and a model of
an in-order pipeline; on an out-of-order core without a PMU the model's cycles hide in the shadow
of stalls, while a counter register does not care how long an iteration took.

Pairs in different executions of the loop are told apart by the loop's invariants (the
registers no instruction of the loop writes: a bound, a base pointer, the stack pointer) and by
the counters disagreeing or running backwards; those pairs are counted, not used.

This runs at collection (every sample carries the user registers): the registers are used to
count and then dropped. What is kept per loop is counts (db/tallies.py LOOPS), never a value.

Time: in per-task sampling (``record -- CMD``, ``-p``) a thread's cpu-clock event fires after each
period of the thread's own CPU time, so a pair spans the second sample's period. System-wide,
events are per CPU: a pair counts only when both samples were taken on one CPU within 1.25
periods (the thread ran throughout), and spans the time between them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cyclescope.analysis.loops import GPRS, find_loops

# A loop's count is used only when at least this share of the consecutive pairs of samples in it
# were in one execution of it: pairs exist in an execution only if it outlasts a sampling period,
# and where executions last about one period the ones that do are the slow ones (measured on
# tests/programs/kernels.c's branchy: 3% of pairs in one execution, at a third of the true rate).
# Where executions last many periods, pairs weigh them by their time, which is what the count needs.
MIN_SAME = 0.5
HIGH_SAME = 0.9
MIN_PAIRS = 5
HIGH_PAIRS = 20
MAX_PROC_BYTES = 1 << 20  # procedures larger than this are not analyzed (a CFG of 10^5 blocks)
MAX_WAITING = 1 << 18  # samples held back while their procedures are analyzed
STATS = ("own", "own_period", "followed", "next_own", "pairs", "iterations", "pair_period", "mismatched",
         "rejected")
_S = {n: i for i, n in enumerate(STATS)}


@dataclass
class LoopTable:
    """The loops of one procedure as arrays over its instructions, for vectorized lookups."""

    addrs: np.ndarray  # uint64, sorted instruction addresses
    inner: np.ndarray  # int32 per instruction: innermost loop, -1 outside every loop
    depth: np.ndarray  # int32 per loop (1: outermost)
    anc: np.ndarray  # int32 [loop, depth]: the loop's ancestor at that depth (itself at its own), -1
    headers: np.ndarray  # uint64 per loop
    invariants: list[np.ndarray]  # per loop: columns (GPRS order) of registers the loop never writes
    # per loop: (column, width, step, offset per instruction, offset valid per instruction)
    counters: list[list[tuple[int, int, int, np.ndarray, np.ndarray]]]

    @property
    def empty(self) -> bool:
        return not len(self.headers)


EMPTY = LoopTable(np.zeros(0, np.uint64), np.zeros(0, np.int32), np.zeros(0, np.int32),
                  np.zeros((0, 1), np.int32), np.zeros(0, np.uint64), [], [])


def loop_table(code: bytes, start: int, end: int, name_at: Callable[[int], str | None] = lambda a: None,
               read: Callable[[int, int], bytes | None] = lambda a, n: None) -> LoopTable:
    """Disassemble [start, end), build its CFG and return its loops with their counters."""
    from cyclescope.analysis.cfg import build_cfg
    from cyclescope.images.disasm import InsnInfo, disassemble, insn_info

    insns = disassemble(code, start)
    infos = insn_info(code, start)
    if len(infos) != len(insns):
        infos = (infos + [InsnInfo(frozenset(), frozenset(), False, False, frozenset(), "other")] * len(insns))[
            : len(insns)]
    if not insns:
        return EMPTY
    cfg = build_cfg(insns, start, end, name_at, read, infos)
    loops = find_loops(cfg, infos)
    if not loops:
        return EMPTY
    addrs = np.array([i.address for i in insns], np.uint64)
    index = {i.address: k for k, i in enumerate(insns)}
    inner = np.full(len(insns), -1, np.int32)
    depth = np.array([lp.depth for lp in loops], np.int32)
    for lp in sorted(loops, key=lambda x: x.depth):  # deeper loops overwrite their parents
        for a in lp.addresses:
            inner[index[a]] = lp.id
    maxd = int(depth.max())
    anc = np.full((len(loops), maxd + 1), -1, np.int32)
    for lp in loops:
        cur: int | None = lp.id
        while cur is not None:
            anc[lp.id, loops[cur].depth] = cur
            cur = loops[cur].parent
    col = {r: i for i, r in enumerate(GPRS)}
    counters = []
    for lp in loops:
        cs = []
        for c in lp.counters:
            offs = np.zeros(len(insns), np.int64)
            valid = np.zeros(len(insns), bool)
            for a, k in c.offsets.items():
                offs[index[a]] = k
                valid[index[a]] = True
            cs.append((col[c.reg], c.width, c.step, offs, valid))
        counters.append(cs)
    return LoopTable(addrs, inner, depth, anc, np.array([lp.header for lp in loops], np.uint64),
                     [np.array([col[r] for r in lp.invariants], np.intp) for lp in loops], counters)


@dataclass(frozen=True)
class LoopStats:
    """A loop's tally (db/tallies.py LOOPS), summed over the selection."""

    own: int = 0
    own_period: float = 0.0
    followed: int = 0
    next_own: int = 0
    pairs: int = 0
    iterations: float = 0.0
    pair_period: float = 0.0
    mismatched: int = 0
    rejected: int = 0

    @property
    def same(self) -> float:
        """Share of the pairs of consecutive samples in the loop that were in one execution of it."""
        return self.pairs / self.next_own if self.next_own else 0.0


@dataclass(frozen=True)
class LoopEstimate:
    executions: float  # of the header
    confidence: str  # high, medium
    why: str


def loop_executions(st: LoopStats, loop_samples: float, mean_period: float, calls: bool) -> LoopEstimate | None:
    """The header's execution count: iterations per unit of time while the loop runs, times the
    time its blocks were sampled (``loop_samples`` * ``mean_period``, in the event's units). A loop
    that calls other code spends time in its callees that its own samples do not show; the share
    of its samples followed by another of its own is that of its own time in its whole time (calls
    and loop mixed at the scale of a period). None when the pairs cannot be trusted."""
    if st.pairs < MIN_PAIRS or st.pair_period <= 0 or loop_samples <= 0 or mean_period <= 0:
        return None
    if st.same < MIN_SAME:
        return None
    rate = st.iterations / st.pair_period
    # The loop's own samples' periods: periods are re-drawn every 200 ms, and a loop that runs in
    # one phase of the program sees those of its phase, not the run's mean.
    t = loop_samples * (st.own_period / st.own if st.own and st.own_period > 0 else mean_period)
    if calls:
        q = st.next_own / st.followed if st.followed else 1.0
        t /= max(q, 0.05)
    bad = st.rejected / (st.pairs + st.rejected)
    high = st.same >= HIGH_SAME and st.pairs >= HIGH_PAIRS and not calls and bad < 0.05
    why = (f"loop counter: {st.iterations / st.pairs:,.0f} iterations per period over {st.pairs:,} pairs of "
           f"samples, {100 * st.same:.0f}% of them in one execution" + ("; calls out" if calls else ""))
    return LoopEstimate(rate * t, "high" if high else "medium", why)


@dataclass
class _Batch:
    tid: np.ndarray
    time: np.ndarray
    cpu: np.ndarray
    img: np.ndarray
    off: np.ndarray
    period: np.ndarray
    regs: np.ndarray  # uint64 [n, 16], GPRS order
    func: np.ndarray  # int64 procedure start, -1 outside any analyzable procedure

    def __len__(self) -> int:
        return len(self.tid)


class LoopCounter:
    """Collects loop-iteration counts from consecutive samples of each thread.

    ``binary(img)`` gives an image's procedures and code (images.code.Binary) or None;
    ``image_key(img)`` its stable key. ``add`` takes one drain's user-mode samples of the
    time event in any order. Procedures are analyzed on a worker thread the first time one of
    their instructions is sampled; drains wait (up to MAX_WAITING samples) until the procedures
    they touch are ready, so that a short run loses nothing to the analysis."""

    def __init__(self, binary: Callable[[int], object | None], image_key: Callable[[int], str], per_task: bool,
                 background: bool = True) -> None:
        self.binary = binary
        self.image_key = image_key
        self.per_task = per_task
        self._tables: dict[tuple[int, int], LoopTable | None] = {}  # None: being analyzed
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="loops") \
            if background else None
        self._lock = threading.Lock()
        self._waiting: deque[_Batch] = deque()
        self._waiting_n = 0
        self._last: dict[int, tuple[object, ...]] = {}  # tid -> its last sample's row (from _Batch)
        self.stats: dict[tuple[int, int], np.ndarray] = {}
        self.analysis_s = 0.0
        self.skipped = 0  # samples whose procedure could not be analyzed in time

    # --- procedures ---------------------------------------------------------------------
    def _analyze(self, img: int, start: int) -> None:
        t0 = time.perf_counter()
        table: LoopTable = EMPTY
        b = self.binary(img)
        try:
            proc = b.procedure(start) if b is not None else None  # type: ignore[attr-defined]
            if proc is not None and proc.end - proc.start <= MAX_PROC_BYTES:
                code = b.code(proc.start, proc.end)  # type: ignore[attr-defined]
                table = loop_table(code, proc.start, proc.end, b.name_at, b.read)  # type: ignore[attr-defined]
        except Exception:  # a procedure that cannot be read or analyzed has no usable loops
            table = EMPTY
        with self._lock:
            self._tables[(img, start)] = table
            self.analysis_s += time.perf_counter() - t0

    def _request(self, keys: set[tuple[int, int]]) -> bool:
        """Start analyzing the procedures not yet seen; True when all of ``keys`` are ready."""
        ready = True
        for k in keys:
            with self._lock:
                state = self._tables.get(k, "new")
            if state == "new":
                with self._lock:
                    self._tables[k] = None
                if self._pool is None:
                    self._analyze(*k)
                else:
                    self._pool.submit(self._analyze, *k)
                    ready = False
            elif state is None:
                ready = False
        return ready

    def _table(self, img: int, start: int) -> LoopTable | None:
        with self._lock:
            return self._tables.get((img, start))

    # --- samples ------------------------------------------------------------------------
    def add(self, tid: np.ndarray, time_ns: np.ndarray, cpu: np.ndarray, img: np.ndarray, off: np.ndarray,
            period: np.ndarray, regs: np.ndarray) -> None:
        """One drain's samples: tid, time, CPU, image index, offset, period (event units) and the 16
        general registers (GPRS order) of each; samples outside any ELF procedure are kept for the
        sequence (they break pairs) but count nowhere."""
        func = np.full(len(tid), -1, np.int64)
        keys: set[tuple[int, int]] = set()
        for i in np.unique(img).tolist():
            b = self.binary(int(i))
            if b is None:
                continue
            m = img == i
            starts = b.procedure_starts(off[m])  # type: ignore[attr-defined]
            func[m] = starts
            keys |= {(int(i), int(s)) for s in np.unique(starts).tolist() if s >= 0}
        batch = _Batch(tid.astype(np.int64), time_ns.astype(np.uint64), cpu.astype(np.int64), img.astype(np.int64),
                       off.astype(np.uint64), period.astype(np.float64), regs.astype(np.uint64), func)
        self._request(keys)
        self._waiting.append(batch)
        self._waiting_n += len(batch)
        self._drain(force=self._waiting_n > MAX_WAITING)

    def _drain(self, force: bool) -> None:
        """Count the waiting batches, oldest first, while their procedures are ready (all of them,
        ready or not, when ``force``)."""
        while self._waiting:
            b = self._waiting[0]
            keys = {(int(i), int(s)) for i, s in zip(b.img.tolist(), b.func.tolist(), strict=True) if s >= 0}
            if not force and not all(self._table(*k) is not None for k in keys):
                return
            self._waiting.popleft()
            self._waiting_n -= len(b)
            self._count(b)

    def finish(self, timeout_s: float = 60.0) -> None:
        """Wait (at most ``timeout_s``) for the procedures still being analyzed, then count
        everything that waits."""
        deadline = time.monotonic() + timeout_s
        while self._waiting and time.monotonic() < deadline:
            self._drain(force=False)
            if self._waiting:
                time.sleep(0.02)
        self._drain(force=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def forget(self, tid: int) -> None:
        self._last.pop(tid, None)

    def _stat(self, img: int, header: int) -> np.ndarray:
        k = (img, header)
        s = self.stats.get(k)
        if s is None:
            s = self.stats[k] = np.zeros(len(STATS), np.float64)
        return s

    def _count(self, b: _Batch) -> None:
        # Carry each thread's last sample over from the previous drain, then walk the sequence.
        if self._last:
            carried = list(self._last.values())
            self._last.clear()
            cols = list(zip(*carried, strict=True))
            b = _Batch(np.concatenate([np.array(cols[0], np.int64), b.tid]),
                       np.concatenate([np.array(cols[1], np.uint64), b.time]),
                       np.concatenate([np.array(cols[2], np.int64), b.cpu]),
                       np.concatenate([np.array(cols[3], np.int64), b.img]),
                       np.concatenate([np.array(cols[4], np.uint64), b.off]),
                       np.concatenate([np.array(cols[5], np.float64), b.period]),
                       np.concatenate([np.array(cols[6], np.uint64).reshape(-1, 16), b.regs]),
                       np.concatenate([np.array(cols[7], np.int64), b.func]))
            fresh = np.ones(len(b), bool)
            fresh[: len(carried)] = False
        else:
            fresh = np.ones(len(b), bool)
        if not len(b):
            return
        order = np.lexsort((b.time, b.tid))
        tid, func, img, off = b.tid[order], b.func[order], b.img[order], b.off[order]
        fresh = fresh[order]
        # Each thread's last sample waits for its successor in the next drain.
        last_of = np.flatnonzero(np.append(tid[1:] != tid[:-1], True))
        for j in last_of.tolist():
            o = order[j]
            self._last[int(tid[j])] = (int(b.tid[o]), int(b.time[o]), int(b.cpu[o]), int(b.img[o]), int(b.off[o]),
                                       float(b.period[o]), b.regs[o].tolist(), int(b.func[o]))
        # Instruction index and innermost loop of every sample, per procedure.
        n = len(b)
        inner = np.full(n, -1, np.int64)
        ix = np.full(n, -1, np.int64)
        tables: dict[tuple[int, int], LoopTable] = {}
        fk = np.stack([img, func], axis=1)
        uniq, inv = np.unique(fk, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for g, (i, s) in enumerate(uniq.tolist()):
            if s < 0:
                continue
            t = self._table(int(i), int(s))
            m = inv == g
            if t is None:
                self.skipped += int((m & fresh).sum())
                continue
            if t.empty:
                continue
            tables[(int(i), int(s))] = t
            k = np.searchsorted(t.addrs, off[m])
            k = np.minimum(k, len(t.addrs) - 1)
            exact = t.addrs[k] == off[m]
            rows = np.flatnonzero(m)
            ix[rows[exact]] = k[exact]
            inner[rows[exact]] = t.inner[k[exact]]
        group = inv
        # Own samples of every loop (fresh ones only: a carried sample was counted in its drain).
        for g, (i, s) in enumerate(uniq.tolist()):
            t = tables.get((int(i), int(s)))
            if t is None:
                continue
            rows = np.flatnonzero((group == g) & fresh & (inner >= 0))
            if not len(rows):
                continue
            la = inner[rows]
            for d in range(1, t.anc.shape[1]):
                lp = t.anc[la, d]
                ok = lp >= 0
                for L, c in zip(*np.unique(lp[ok], return_counts=True), strict=True):
                    st = self._stat(int(i), int(t.headers[L]))
                    st[_S["own"]] += c
                    st[_S["own_period"]] += float(b.period[order[rows[ok][lp[ok] == L]]].sum())
        # Pairs: consecutive samples of one thread, the first in a loop.
        a = np.flatnonzero((tid[:-1] == tid[1:]) & (inner[:-1] >= 0))
        if not len(a):
            return
        bb = a + 1
        if not self.per_task:
            oa, ob = order[a], order[bb]
            dt = b.time[ob].astype(np.float64) - b.time[oa].astype(np.float64)
            keep = (b.cpu[oa] == b.cpu[ob]) & (dt <= 1.25 * b.period[ob])
            a, bb = a[keep], bb[keep]
        for g, (i, s) in enumerate(uniq.tolist()):
            t = tables.get((int(i), int(s)))
            if t is None:
                continue
            sel = group[a] == g
            if not sel.any():
                continue
            self._pairs(int(i), t, a[sel], bb[sel], group[bb[sel]] == g, inner, ix, order, b)

    def _pairs(self, img: int, t: LoopTable, a: np.ndarray, bb: np.ndarray, same: np.ndarray, inner: np.ndarray,
               ix: np.ndarray, order: np.ndarray, b: _Batch) -> None:
        la = inner[a]
        lb = np.where(same, inner[bb], -1)
        for d in range(1, t.anc.shape[1]):
            L = t.anc[la, d]
            m = L >= 0
            if not m.any():
                continue
            b_in = m & (lb >= 0)
            b_in[b_in] = t.anc[lb[b_in], d] == L[b_in]
            for loop in np.unique(L[m]).tolist():
                st = self._stat(img, int(t.headers[loop]))
                here = m & (loop == L)
                st[_S["followed"]] += int(here.sum())
                both = here & b_in
                nb = int(both.sum())
                if not nb:
                    continue
                st[_S["next_own"]] += nb
                pa_, pb_ = a[both], bb[both]
                ra, rb = b.regs[order[pa_]], b.regs[order[pb_]]
                inv = t.invariants[loop]
                same_inv = (ra[:, inv] == rb[:, inv]).all(axis=1) if len(inv) else np.ones(nb, bool)
                st[_S["mismatched"]] += int((~same_inv).sum())
                if not t.counters[loop] or not same_inv.any():
                    continue
                ra, rb, ia, ib = ra[same_inv], rb[same_inv], ix[pa_[same_inv]], ix[pb_[same_inv]]
                periods = b.period[order[pb_[same_inv]]]
                if not self.per_task:
                    periods = (b.time[order[pb_[same_inv]]].astype(np.float64)
                               - b.time[order[pa_[same_inv]]].astype(np.float64))
                iters, ok = _iterations(t.counters[loop], ra, rb, ia, ib)
                st[_S["rejected"]] += int((~ok).sum())
                st[_S["pairs"]] += int(ok.sum())
                st[_S["iterations"]] += float(iters[ok].sum())
                st[_S["pair_period"]] += float(periods[ok].sum())

    def take(self) -> Any:
        """The counts since the last take, as a LOOPS tally table (db/tallies.py)."""
        from cyclescope.db.tallies import LOOPS, build

        rows = [(self.image_key(i), h, s) for (i, h), s in self.stats.items() if s[_S["own"]] or s[_S["followed"]]]
        self.stats = {}
        cols: dict[str, object] = {"image": [r[0] for r in rows], "header": np.array([r[1] for r in rows], np.uint64)}
        for n, k in _S.items():
            v = np.array([r[2][k] for r in rows], np.float64)
            cols[n] = v if n.endswith("period") else np.rint(v).astype(np.uint64)
        return build(LOOPS, cols)


def _iterations(counters: list[tuple[int, int, int, np.ndarray, np.ndarray]], ra: np.ndarray, rb: np.ndarray,
                ia: np.ndarray, ib: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Iterations between pairs of samples by every counter valid at both; ok where at least one
    counter is valid, all valid ones agree, and the count is a whole number of steps, not negative."""
    n = len(ia)
    found = np.zeros(n, bool)
    agree = np.ones(n, bool)
    iters = np.zeros(n, np.int64)
    for col, width, step, offs, valid in counters:
        v = valid[ia] & valid[ib]
        if not v.any():
            continue
        with np.errstate(over="ignore"):
            d = (rb[:, col] - offs[ib].astype(np.uint64)) - (ra[:, col] - offs[ia].astype(np.uint64))
        if width == 32:
            d32 = (d & np.uint64(0xFFFFFFFF)).astype(np.int64)
            ds = np.where(d32 >= 1 << 31, d32 - (1 << 32), d32)
        else:
            ds = d.view(np.int64)
        whole = ds % step == 0
        it = ds // step
        good = v & whole
        agree &= ~v | (whole & (~found | (iters == it)))
        iters = np.where(good & ~found, it, iters)
        found |= good
    ok = found & agree & (iters >= 0)
    return iters, ok


class LoopCountProcessor:
    """The collector's processor (collect/processor.py) around LoopCounter: the time event's
    samples with user registers go in; a LOOPS tally comes out at every flush."""

    name = "loops"
    needs_regs = True

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self.counter: LoopCounter | None = None
        self._cols: np.ndarray | None = None
        self._time_event = -1

    def bind(self, ctx: Any) -> None:
        from cyclescope.images.code import BinaryCache

        binaries = BinaryCache(lambda i: ctx.table[i])
        self.counter = LoopCounter(binaries.get, lambda i: ctx.table[i].key, ctx.per_task, self.background)
        self._cols = np.array([ctx.regs_columns[r] for r in GPRS], np.intp)
        self._time_event = ctx.time_event

    def process(self, d: Any) -> None:
        if self.counter is None or d.regs is None or self._time_event < 0 or not len(d.samples):
            return
        s = d.samples
        m = (d.event == self._time_event) & (s["regs"] >= 0)
        if not m.any():
            return
        rows = s["regs"][m]
        self.counter.add(s["tid"][m], s["time"][m], s["cpu"][m], d.image[m], d.offset[m], d.period[m],
                         d.regs[rows][:, self._cols])

    def forget(self, pid: int, tid: int) -> None:
        if self.counter is not None:
            self.counter.forget(tid)

    def finish(self) -> None:
        if self.counter is not None:
            self.counter.finish()

    def flush(self, db: Any, epoch: int, host: str) -> list[Any]:
        from cyclescope.db.tallies import LOOPS, write_tally

        if self.counter is None:
            return []
        t = self.counter.take()
        return [write_tally(db, epoch, host, LOOPS, t)] if t.num_rows else []

    def close(self) -> None:
        if self.counter is not None:
            self.counter.close()

    def status(self) -> dict[str, Any]:
        c = self.counter
        if c is None:
            return {}
        return {"procedures": len(c._tables), "analysis_s": round(c.analysis_s, 3), "skipped": c.skipped}
