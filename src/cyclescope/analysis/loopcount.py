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

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cyclescope.arrays import counts, distinct, group, median
from cyclescope.perf.abi import GPRS, STACK_BYTES, STACK_WORDS

if TYPE_CHECKING:
    from cyclescope.analysis.worker import Worker

# A loop's count is used only when at least this share of the consecutive pairs of samples in it
# were in one execution of it: pairs exist in an execution only if it outlasts a sampling period,
# and where executions last about one period the ones that do are the slow ones (measured on
# tests/programs/kernels.c's branchy: 3% of pairs in one execution, at a third of the true rate).
# Where executions last many periods, pairs weigh them by their time, which is what the count needs.
MIN_SAME = 0.5
HIGH_SAME = 0.9
MIN_PAIRS = 5
HIGH_PAIRS = 20
MIN_TRIP_SAMPLES = 20  # samples with a known trip count before the mean trip count is used
# Procedures larger than this are not analyzed: interpreters' dispatch functions (tens of KiB), whose
# loops have no counter register, would cost seconds each.
MAX_PROC_BYTES = 64 << 10
MAX_WAITING = 1 << 18  # samples held back while their procedures are analyzed
# A procedure is analyzed once it has this many samples: a loop count needs pairs of samples in the
# loop (MIN_PAIRS), and system-wide the daemon sees hundreds of procedures with a handful each
# (measured: 869 procedures, 17.9 s of one CPU in the first 18 s, analyzing every one).
ANALYZE_AFTER = 32
# The analyses may use at most this share of one CPU (over the run), beyond ANALYSIS_ALLOWANCE_S
# granted at the start; past it new procedures wait. Without the allowance, the first image opened
# on a fresh cache (0.2-0.3 s of the worker's CPU) held the first procedure's analysis back to 2 s
# into a recording (the budget's share of 2 s), and a system-wide run of 3 s watched it for a
# third of its time.
ANALYSIS_BUDGET = 0.10
ANALYSIS_ALLOWANCE_S = 0.5
MAX_INFLIGHT = 4  # system-wide: requests with the worker at once (LoopCounter._over_budget)
# Loop tables kept in memory (their arrays run over every instruction of a procedure, a counter's
# over its loop's: a large one is a few hundred KiB). Past this, the least recently used go; a procedure sampled
# again is asked for again, and comes from the user's cache by build-id. A daemon under a fork storm
# of compilers otherwise gathered the tables of every hot procedure of cc1 and kept them.
MAX_TABLE_BYTES = 48 << 20
RECENT_DECAY = 0.9  # LoopCounter.recent: a drain's weight in the next
# A trip window of an entry alone (analysis/trips.py) also gives the procedure's entries per second
# of the thread's time where it ran: the argument's move rate over the window and LOCAL_AROUND_NS
# on each side of it (from the thread's samples in the procedure, which no trap slows outside the
# window) over the window's move per entry (analysis/progress.py, "local rate"). Samples of a
# procedure whose argument moves are kept for LOCAL_HISTORY_NS of their time to find those around a
# window, which may have come in the drain before; a window not resolved within LOCAL_KEEP_NS of
# the samples' time after it is dropped.
LOCAL_AROUND_NS = 10_000_000
LOCAL_HISTORY_NS = 3_000_000_000
LOCAL_KEEP_NS = 3_000_000_000
SETTLING_DRAIN_S = 0.25  # system-wide: drains while procedures are analyzed (LoopCountProcessor.next_drain_s)
MAX_RECENT = 1 << 16  # LoopCounter.recent's entries before those faded under one sample go
STATS = ("own", "own_period", "followed", "next_own", "pairs", "iterations", "pair_period", "mismatched",
         "rejected", "trip_samples", "inv_trip")
_S = {n: i for i, n in enumerate(STATS)}
# The PROGRESS sums this side keeps per argument (the trip windows keep the others: trips.PROGRESS_ROWS)
LOCAL_PROGRESS = ("pairs", "delta", "pair_period", "back", "back_period", "local_windows", "local_rate",
                  "local_rate_sq")
_LOW48 = (1 << 48) - 1


def _last_known(vals: list[np.ndarray], known: list[np.ndarray],
                cum: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per value, its last known sample over a thread's samples in a procedure (``vals``, ``known``,
    ``cum``: the earlier last known one, if any, then this drain's rows): its value, whether there
    is one, and the thread's time at it."""
    v, k, c = np.concatenate(vals), np.concatenate(known), np.concatenate(cum)
    last = len(k) - 1 - np.argmax(k[::-1], axis=0)  # per value, its last known row (0 where none)
    cols = np.arange(k.shape[1])
    return v[last, cols].copy(), k[last, cols].copy(), c[last, cols].copy()


class Window:
    """A per-instruction array that is zero (False) outside [lo, lo + len(data)), indexed like the
    whole one by arrays of instruction indices: a counter's offsets and validity, which hold only
    inside its loop. Held whole, they were most of a daemon's loop tables (cc1's 1,027 tables in
    the user's cache: 15.2 of 23.2 MiB, 1.3 MiB in windows)."""

    __slots__ = ("data", "lo")

    def __init__(self, data: np.ndarray, lo: int) -> None:
        self.data = data
        self.lo = lo

    @staticmethod
    def pair(offs: np.ndarray, valid: np.ndarray) -> tuple[Window, Window]:
        """The offsets and validity over all instructions, cut to where the counter is valid."""
        idx = np.flatnonzero(valid)
        lo, hi = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
        return Window(offs[lo:hi].copy(), lo), Window(valid[lo:hi].copy(), lo)

    def __getitem__(self, ix: np.ndarray) -> np.ndarray:
        k = np.asarray(ix, np.int64) - self.lo
        ok = (k >= 0) & (k < len(self.data))
        out = np.zeros(k.shape, self.data.dtype)
        out[ok] = self.data[k[ok]]
        return out

    def indices(self) -> np.ndarray:
        """Where a validity window is True, as instruction indices."""
        return self.lo + np.flatnonzero(self.data)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + 16


@dataclass
class LoopTable:
    """The loops of one procedure as arrays over its instructions, for vectorized lookups."""

    addrs: np.ndarray  # uint64, sorted instruction addresses
    inner: np.ndarray  # int32 per instruction: innermost loop, -1 outside every loop
    depth: np.ndarray  # int32 per loop (1: outermost)
    anc: np.ndarray  # int32 [loop, depth]: the loop's ancestor at that depth (itself at its own), -1
    headers: np.ndarray  # uint64 per loop
    invariants: list[np.ndarray]  # per loop: columns (GPRS order) of registers the loop never writes
    # per loop: (column, width, step, offset per instruction, offset valid per instruction), the two
    # as Windows over the loop's instructions
    counters: list[list[tuple[int, int, int, Window, Window]]]
    # per loop, where a counter's start and end are known (loops.Counter init and limit): (width,
    # step, init column or -1, init constant, limit column or -1, limit constant, the counter's column,
    # its offsets, valid), else None: every sample in the loop then knows its execution's trip count
    trips: list[tuple[int, int, int, int, int, int, int, Window, Window, bool] | None] = field(
        default_factory=list)
    blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # uint64: the CFG's block starts
    # int8 [instruction, value]: the register holding an argument's entry value there, or a
    # register's value at the progress point (analysis/progress.entry_args: NVALUES), and each
    # value's width
    args: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int8))  # none followed
    argwidth: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    # uint64 per block (as ``blocks``): where to probe it (block_sites), and whether the kernel
    # emulates the instruction there
    sites: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    site_emulated: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    point: int = 0  # the progress point's address (analysis/progress.progress_point), 0: none

    @property
    def empty(self) -> bool:
        return not len(self.headers)

    def index(self, addr: int) -> int | None:
        """The index of the instruction at ``addr`` (in ``addrs``, ``args``...), None where none starts there."""
        k = int(np.searchsorted(self.addrs, np.uint64(addr)))
        return k if k < len(self.addrs) and int(self.addrs[k]) == addr else None

    @property
    def nbytes(self) -> int:
        n = self.addrs.nbytes + self.inner.nbytes + self.depth.nbytes + self.anc.nbytes + self.headers.nbytes
        n += self.blocks.nbytes + self.args.nbytes + self.sites.nbytes + self.site_emulated.nbytes
        n += sum(a.nbytes for a in self.invariants)
        n += sum(o.nbytes + v.nbytes for loop in self.counters for _, _, _, o, v in loop)
        return n + 200 * (len(self.counters) + 1)  # the lists and tuples around them


ANALYSIS_VERSION = 8  # of loop_table's output: cached tables of another version are not used


def table_arrays(t: LoopTable) -> dict[str, np.ndarray]:
    """A LoopTable as plain arrays (for the cache: no pickled objects)."""
    inv_off = np.cumsum([0] + [len(x) for x in t.invariants]).astype(np.int64)
    crow: list[tuple[int, int, int, int, int]] = []  # loop, column, width, step, start in the flat lists
    idx_parts: list[np.ndarray] = []
    off_parts: list[np.ndarray] = []
    pos = 0
    counter_at: dict[tuple[int, int], int] = {}
    for loop, cs in enumerate(t.counters):
        for col, width, step, offs, valid in cs:
            where = valid.indices()
            counter_at[(loop, col)] = len(crow)
            crow.append((loop, col, width, step, pos))
            idx_parts.append(where.astype(np.int64))
            off_parts.append(offs[where].astype(np.int64))
            pos += len(where)
    trow = []
    for loop, tr in enumerate(t.trips):
        if tr is not None:
            width, step, icol, iadd, lcol, ladd, ccol, _offs, _valid, cross = tr
            trow.append((loop, width, step, icol, iadd, lcol, ladd, ccol, int(cross), counter_at[(loop, ccol)]))
    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return {
        "version": np.array([ANALYSIS_VERSION]), "addrs": t.addrs, "inner": t.inner, "depth": t.depth, "anc": t.anc,
        "headers": t.headers, "inv": cat(list(t.invariants)), "inv_off": inv_off,
        "crow": np.array(crow, np.int64).reshape(-1, 5), "cidx": cat(idx_parts), "coff": cat(off_parts),
        "trow": np.array(trow, np.int64).reshape(-1, 10), "blocks": t.blocks, "args": t.args,
        "argwidth": t.argwidth, "sites": t.sites, "site_emulated": t.site_emulated,
        "point": np.array([t.point], np.uint64),
    }


def table_from_arrays(a: dict[str, np.ndarray]) -> LoopTable | None:
    """The LoopTable table_arrays made, or None for another version's (or arrays that do not make
    one: the table is then analyzed again)."""
    try:
        return _table_from_arrays(a)
    except (KeyError, IndexError, ValueError, TypeError):
        return None


def _table_from_arrays(a: dict[str, np.ndarray]) -> LoopTable | None:
    if int(a["version"][0]) != ANALYSIS_VERSION:
        return None
    n_insn, n_loops = len(a["addrs"]), len(a["headers"])
    if not n_loops:
        return EMPTY
    inv_off = a["inv_off"]
    invariants = [a["inv"][inv_off[i] : inv_off[i + 1]].astype(np.intp) for i in range(n_loops)]
    counters: list[list[tuple[int, int, int, Window, Window]]] = [[] for _ in range(n_loops)]
    flat: list[tuple[Window, Window]] = []
    crow = a["crow"]
    for r, (loop, col, width, step, start) in enumerate(crow.tolist()):
        end = int(crow[r + 1][4]) if r + 1 < len(crow) else len(a["cidx"])
        idx = a["cidx"][start:end].astype(np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= n_insn):
            raise IndexError("a counter's instruction outside the procedure")
        lo = int(idx.min()) if len(idx) else 0
        n = int(idx.max()) + 1 - lo if len(idx) else 0
        offs = np.zeros(n, np.int64)
        valid = np.zeros(n, bool)
        offs[idx - lo] = a["coff"][start:end]
        valid[idx - lo] = True
        pair = (Window(offs, lo), Window(valid, lo))
        counters[loop].append((col, width, step, *pair))
        flat.append(pair)
    trips: list[tuple[int, int, int, int, int, int, int, Window, Window, bool] | None] = [None] * n_loops
    for loop, width, step, icol, iadd, lcol, ladd, ccol, cross, k in a["trow"].tolist():
        trips[loop] = (width, step, icol, iadd, lcol, ladd, ccol, flat[k][0], flat[k][1], bool(cross))
    return LoopTable(a["addrs"], a["inner"], a["depth"], a["anc"], a["headers"], invariants, counters, trips,
                     np.asarray(a["blocks"], np.uint64), np.asarray(a["args"], np.int8),
                     np.asarray(a["argwidth"], np.int8), np.asarray(a["sites"], np.uint64),
                     np.asarray(a["site_emulated"], bool), int(a["point"][0]))


EMPTY = LoopTable(np.zeros(0, np.uint64), np.zeros(0, np.int32), np.zeros(0, np.int32),
                  np.zeros((0, 1), np.int32), np.zeros(0, np.uint64), [], [])


def loop_table(code: bytes, start: int, end: int, name_at: Callable[[int], str | None] = lambda a: None,
               read: Callable[[int, int], bytes | None] = lambda a, n: None) -> LoopTable:
    """Disassemble [start, end), build its CFG and return its loops with their counters."""
    # Imported here: a recording whose loop tables are cached never analyzes (capstone, the CFG
    # and the loops cost 14 ms of its start-up), and the worker process that does imports them once.
    from cyclescope.analysis.cfg import build_cfg
    from cyclescope.analysis.loops import find_loops
    from cyclescope.analysis.progress import entry_args, progress_point
    from cyclescope.images.disasm import LazyInfos, disassemble

    insns = disassemble(code, start)
    if not insns:
        return EMPTY
    infos = LazyInfos(insns)  # details only of the instructions the analysis looks at
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
    trips: list[tuple[int, int, int, int, int, int, int, Window, Window, bool] | None] = []
    for lp in loops:
        cs = []
        trip = None
        for c in lp.counters:
            dense_offs = np.zeros(len(insns), np.int64)
            dense_valid = np.zeros(len(insns), bool)
            for a, k in c.offsets.items():
                dense_offs[index[a]] = k
                dense_valid[index[a]] = True
            offs, valid = Window.pair(dense_offs, dense_valid)
            cs.append((col[c.reg], c.width, c.step, offs, valid))
            if trip is None and c.init is not None and c.limit is not None:
                trip = (c.width, c.step, col[c.init.reg] if c.init.reg else -1, c.init.add,
                        col[c.limit.reg] if c.limit.reg else -1, c.limit.add, col[c.reg], offs, valid,
                        c.limit.how == "cross")
        counters.append(cs)
        trips.append(trip)
    point = progress_point(cfg, infos, [lp.addresses for lp in loops])
    args, argwidth = entry_args(cfg, infos, *(point or (-1, ())))
    ordered = sorted(cfg.blocks, key=lambda b: b.start)
    sites = [block_site(insns[b.first : b.last + 1]) for b in ordered]
    return LoopTable(addrs, inner, depth, anc, np.array([lp.header for lp in loops], np.uint64),
                     [np.array([col[r] for r in lp.invariants], np.intp) for lp in loops], counters, trips,
                     np.array([b.start for b in ordered], np.uint64), args, argwidth,
                     np.array([a for a, _ in sites], np.uint64), np.array([e for _, e in sites], bool),
                     insns[point[0]].address if point is not None else 0)


def block_site(insns: list[Any]) -> tuple[int, bool]:
    """Where to count a block's executions with a uprobe, and whether the kernel emulates the
    instruction there: the first instruction it emulates (a push, a relative jump or call, a
    conditional jump: images/disasm.first_emulated) up to the block's first call, else the block's
    first. An emulated hit costs 0.5 us against 14-17 us single-stepped on the Xeons."""
    from cyclescope.images.disasm import first_emulated

    k = first_emulated(insns)
    if k is not None:
        return int(insns[k].address), True
    return (int(insns[0].address), False) if insns else (0, False)


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
    trip_samples: int = 0  # samples whose execution's trip count their registers gave
    inv_trip: float = 0.0  # the sum of 1/trip over them

    @property
    def mean_trip(self) -> float | None:
        """Header executions per execution of the loop (entry), where samples gave it."""
        return self.trip_samples / self.inv_trip if self.trip_samples >= MIN_TRIP_SAMPLES and self.inv_trip else None

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
    resolved: bool = False  # func filled in (the images' procedures were known)
    # uint64 [n, perf/abi.STACK_WORDS]: the words of the user stack from rsp up, and how many of
    # them each sample carries (int64 [n]; 0: none, the eBPF path's or a snapshot cut short)
    stack: np.ndarray = field(default_factory=lambda: np.zeros((0, STACK_WORDS), np.uint64))
    nstack: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.tid)


def analyze_procedure(binary: object | None, start: int) -> tuple[LoopTable, float]:
    """The loops of the procedure at ``start`` of ``binary`` (binaries.code.Binary) and the CPU time
    it took; EMPTY when it cannot be read or analyzed, or is too large."""
    t0 = time.thread_time()
    table = EMPTY
    b: Any = binary
    try:
        proc = b.procedure(start) if b is not None else None
        if proc is not None and proc.end - proc.start <= MAX_PROC_BYTES:
            table = loop_table(b.code(proc.start, proc.end), proc.start, proc.end, b.name_at, b.read)
    except Exception:  # a procedure that cannot be read or analyzed has no usable loops
        table = EMPTY
    return table, time.thread_time() - t0


class Source(Protocol):
    """Where procedures come from: their bounds per image, and their loops (binaries.code)."""

    def bounds(self, img: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Start and end of every procedure of the image, sorted (None: nothing to analyze)."""

    def analyze(self, img: int, start: int) -> tuple[LoopTable, float]:
        """The loops of the procedure at ``start`` and the CPU time the analysis took."""


# In the worker process: the binaries opened lately by image key, least recently used first. An
# open binary holds its symbol table, names and all: 5 MiB for cc1's 26,793 symbols, 25 MiB for
# libarrow's 65,978; a system-wide daemon under a compile loop opens 170 images, and with up to 256
# kept its worker held 88 MiB of its own (bench/soak.py). An image's procedures are asked for
# together, so a few suffice; one dropped is opened again when asked (0.1-0.2 s from the user's
# cache; counted in the analysis budget). The memory a first reading of symbols fragments is the
# worker's retirement's to give back (analysis/worker.py, MAX_OWN_MIB).
_BINARIES: OrderedDict[str, object | None] = OrderedDict()
MAX_BINARIES = 8


def _worker_binary(info: Any) -> object | None:
    from cyclescope.binaries.code import open_binary
    from cyclescope.binaries.symbolize import Symbolizer

    if info.key in _BINARIES:
        _BINARIES.move_to_end(info.key)
        return _BINARIES[info.key]
    if len(_BINARIES) >= MAX_BINARIES:
        from cyclescope import trim_heap

        while len(_BINARIES) >= MAX_BINARIES // 2:
            _BINARIES.popitem(last=False)
        trim_heap()
    b = _BINARIES[info.key] = open_binary(info, Symbolizer(None))
    return b


def _worker_bounds(info: Any) -> tuple[np.ndarray, np.ndarray] | None:
    b: Any = _worker_binary(info)
    if b is None:
        return None
    return np.asarray(b.table.starts, np.uint64), np.asarray(b.table.ends, np.uint64)


def _worker_bounds_timed(info: Any) -> tuple[tuple[np.ndarray, np.ndarray] | None, float]:
    """_worker_bounds and the CPU time it took (opening an image not in the user's cache: 0.1 s for
    libc, 0.75 s for cc1, 1.4 s for libarrow)."""
    t0 = time.thread_time()
    b = _worker_bounds(info)
    return b, time.thread_time() - t0


def _worker_analyze(info: Any, start: int) -> tuple[LoopTable, float]:
    t0 = time.thread_time()
    b = _worker_binary(info)  # opening it again after it was dropped counts in the budget too
    table, _ = analyze_procedure(b, start)
    cpu = time.thread_time() - t0
    if _cacheable(info):
        from cyclescope.images.cache import Cache

        Cache().save_arrays(info.key, f"loops-{start:x}", table_arrays(table))
    return table, cpu


def _cacheable(info: Any) -> bool:
    """An image named by its build-id: what was derived from it once holds for good."""
    return bool(getattr(info, "build_id", None)) and info.key.split("#")[0] == info.build_id


def _cached_bounds(info: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Procedure bounds from the symbol table the Symbolizer cached for this build-id, if any."""
    from cyclescope.images.cache import Cache

    # Not the names: with them a large image's table (libarrow's 66,000 symbols) took the daemon 35 MiB
    # for a moment, without them 9 MiB.
    t = Cache().load(info.key, "symbols", ["start", "end"]) if _cacheable(info) else None
    if t is None:
        return None
    return (t.column("start").to_numpy().astype(np.uint64), t.column("end").to_numpy().astype(np.uint64))


def _cached_table(info: Any, start: int) -> LoopTable | None:
    from cyclescope.images.cache import Cache

    a = Cache().load_arrays(info.key, f"loops-{start:x}") if _cacheable(info) else None
    return table_from_arrays(a) if a is not None else None


class ImageSource:
    """A Source over the collector's image table, whose binaries are opened and analyzed in the
    process that calls ``bounds`` and ``analyze`` (the worker: see LoopCounter)."""

    def __init__(self, info_of: Callable[[int], Any]) -> None:
        self.info_of = info_of

    def bounds(self, img: int) -> tuple[np.ndarray, np.ndarray] | None:
        info = self.info_of(img)
        return _worker_bounds(info) if info.kind == "elf" and info.offsets == "vaddr" else None

    def analyze(self, img: int, start: int) -> tuple[LoopTable, float]:
        return _worker_analyze(self.info_of(img), start)


class LoopCounter:
    """Collects loop-iteration counts from consecutive samples of each thread.

    ``source`` gives each image's procedures and their loops; ``image_key(img)`` the image's
    stable key. ``add`` takes one drain's user-mode samples of the time event in any order.

    With ``background``, the binaries are read and the procedures analyzed in a worker process
    (``info_of`` gives the ImageInfo it opens; ``source`` then serves only when background is off):
    the analysis is pure Python (capstone, a CFG, dominators), and in the collector's process it
    held the GIL from the drains and reading symbols left about 100 MiB behind. An image is opened
    once it has ANALYZE_AFTER samples, a procedure analyzed once it has as many, within
    ANALYSIS_BUDGET of a CPU. A recording's drains wait (up to MAX_WAITING samples) until the
    procedures they touch are ready, so that a short run loses nothing to the analysis; the
    daemon's do not wait."""

    def __init__(self, source: Source | None, image_key: Callable[[int], str], per_task: bool,
                 background: bool = True, analyze_after: int = ANALYZE_AFTER,
                 info_of: Callable[[int], Any] | None = None) -> None:
        self.image_key = image_key
        self.per_task = per_task
        self.source = source or ImageSource(info_of or (lambda i: None))
        self.info_of = info_of
        self._tables: dict[tuple[int, int], LoopTable | None] = {}  # None: being analyzed
        self._held: OrderedDict[tuple[int, int], int] = OrderedDict()  # tables' bytes, least recently used first
        self._held_bytes = 0
        self.max_table_bytes = MAX_TABLE_BYTES
        self.evicted = 0
        self._bounds: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}  # absent: not asked; None: none
        self._pending_bounds: set[int] = set()
        self._seen: dict[tuple[int, int], int] = {}  # samples of procedures not yet analyzed
        self._img_seen: dict[int, int] = {}  # samples per image (opened past the threshold)
        self._started = time.monotonic()
        self.analyze_after = analyze_after
        self.deferred = 0  # analyses put off by the budget
        # The worker starts at the first image or procedure the cache does not have (a binary
        # recorded before needs none: its tables come from the user's cache).
        self._pool: Worker | None = None
        self._inflight = 0  # requests with the worker, not answered yet
        self._background = background and info_of is not None
        self._lock = threading.Lock()
        self._waiting: deque[_Batch] = deque()
        self._waiting_n = 0
        self._last: dict[int, tuple[object, ...]] = {}  # tid -> its last sample's row (from _Batch)
        self.stats: dict[tuple[int, int], np.ndarray] = {}
        # analysis/progress.py: per (image, procedure, argument) [pairs, move, time, back, back time];
        # per thread its time so far (the sum of its samples' periods) and its last sample in each
        # procedure (the arguments' values, which are known, that time)
        self.progress: dict[tuple[int, int, int], np.ndarray] = {}
        self._tcum: dict[int, float] = {}
        # per thread and procedure: each value's last known sample (its value, known, the thread's time)
        self._plast: dict[int, dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._moving: dict[tuple[int, int, int], list[int]] = {}  # since the start: [pairs moving forward, back]
        # stride windows not yet resolved (stride_window), and per (procedure, thread) the samples' recent
        # [time, cum, values, known] in chunks (_local_rates)
        self._strides: list[tuple[tuple[int, int], int, int, int, np.ndarray]] = []
        self._phist: dict[tuple[tuple[int, int], int], deque[tuple[np.ndarray, ...]]] = {}
        self.analysis_s = 0.0
        self.skipped = 0  # samples whose procedure could not be analyzed in time
        # Samples per procedure from note (the eBPF path's rows), decayed by RECENT_DECAY a drain
        # (kept as the weight and the note it was last updated at): which procedures the program's
        # few watched ranges per process go to.
        self.recent: dict[tuple[int, int], tuple[float, int]] = {}
        self._notes = 0
        # (image, start) -> end of the procedures whose tables landed with a loop a register counts
        # (watched gives them), kept as tables land and go
        self._watch_ends: dict[tuple[int, int], int] = {}
        # add gets some samples of each thread only (the eBPF path sends those in watched ranges and
        # the next one on their CPU): a thread's time is not the sum of their periods, so the
        # arguments' moves (analysis/progress.py, per task only in calc) are not tallied, and only
        # the tables of procedures with a counter register are held whole.
        self.partial = False

    # --- images and procedures ----------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], land: Callable[[Any], None],
              failed: Any) -> None:
        """``fn(*args)`` here without a worker, else the worker's ``name`` with ``args``; ``land`` gets
        the result (``failed`` when it raised, or the worker is gone)."""
        if not self._background:
            try:
                land(fn(*args))
            except Exception:  # treated as nothing to analyze
                land(failed)
            return
        if self._pool is None:
            from cyclescope.analysis.worker import Worker

            self._pool = Worker({"bounds": f"{__name__}:_worker_bounds_timed",
                                 "analyze": f"{__name__}:_worker_analyze"})
        with self._lock:
            self._inflight += 1

        def landed(ok: bool, got: Any) -> None:
            with self._lock:
                self._inflight -= 1
            land(got if ok else failed)

        self._pool.call(name, args, landed)

    def _ask_bounds(self, img: int) -> None:
        def land(b: tuple[np.ndarray, np.ndarray] | None) -> None:
            with self._lock:
                self._bounds[img] = b
                self._pending_bounds.discard(img)

        with self._lock:
            self._pending_bounds.add(img)
        if self.info_of is not None:
            info = self.info_of(img)
            if info.kind != "elf" or info.offsets != "vaddr":
                land(None)
                return
            cached = _cached_bounds(info)
            if cached is not None:
                land(cached)
                return

            def land_timed(got: tuple[tuple[np.ndarray, np.ndarray] | None, float]) -> None:
                if not self.per_task:  # system-wide, opening images counts in the analyses' budget
                    with self._lock:
                        self.analysis_s += got[1]
                land(got[0])

            self._call(_worker_bounds_timed, "bounds", (info,), land_timed, (None, 0.0))
        else:
            self._call(self.source.bounds, "", (img,), land, None)

    def _analyze(self, img: int, start: int) -> None:
        def land(got: tuple[LoopTable, float]) -> None:
            t = got[0]
            if self.partial and not any(t.counters):
                # Only watched procedures' samples come with registers (the eBPF path), and this one
                # has no counter to be watched for: its samples reach add only as followers, where
                # being in no loop is all that matters. Held whole, such tables were most of the
                # daemon's 22 MiB of them under a compile loop (bench/soak.py).
                t = EMPTY
            with self._lock:
                self._tables[(img, start)] = t
                self.analysis_s += got[1]
                self._hold((img, start), t)
                bounds = self._bounds.get(img)
                if not t.empty and any(t.counters) and bounds is not None:
                    j = int(procedure_index(bounds, np.array([start], np.uint64))[0])
                    if j >= 0 and int(bounds[0][j]) == start:
                        self._watch_ends[(img, start)] = int(bounds[1][j])

        if self.info_of is not None:
            info = self.info_of(img)
            cached = _cached_table(info, start)
            if cached is not None:
                land((cached, 0.0))
                return
            self._call(_worker_analyze, "analyze", (info, start), land, (EMPTY, 0.0))
        else:
            self._call(self.source.analyze, "", (img, start), land, (EMPTY, 0.0))

    def _request(self, keys: dict[tuple[int, int], int]) -> None:
        """Start analyzing the procedures of ``keys`` (with their new samples) that have enough
        samples now, while the analyses stay within their share of a CPU."""
        for k, n in keys.items():
            with self._lock:
                state = self._tables.get(k, "new")
            if state != "new":
                continue
            seen = self._seen[k] = self._seen.get(k, 0) + n
            if seen < self.analyze_after:
                continue
            if self._over_budget():
                self.deferred += 1
                continue
            self._seen.pop(k, None)
            with self._lock:
                self._tables[k] = None
            self._analyze(*k)

    def _over_budget(self) -> bool:
        """Have the analyses (and system-wide the images opened) taken their share of a CPU? System-
        wide also while MAX_INFLIGHT requests are with the worker: their cost is counted as they
        land, and a daemon's first drain, asking for every image at once, had its worker at a third
        of a CPU for a minute."""
        if not self.per_task and self._inflight >= MAX_INFLIGHT:
            return True
        return self.analysis_s > ANALYSIS_BUDGET * max(1.0, time.monotonic() - self._started) + ANALYSIS_ALLOWANCE_S

    def _hold(self, key: tuple[int, int], table: LoopTable) -> None:
        """Account for a table that landed (the lock held); let the least recently used go past
        max_table_bytes."""
        n = table.nbytes
        self._held_bytes += n - self._held.pop(key, 0)
        self._held[key] = n
        while self._held_bytes > self.max_table_bytes and len(self._held) > 1:
            old, m = self._held.popitem(last=False)
            if old == key:  # the newest is never the one to go
                self._held[old] = m
                self._held.move_to_end(old)
                continue
            self._held_bytes -= m
            self._tables.pop(old, None)
            self._watch_ends.pop(old, None)
            self.evicted += 1

    def bounds(self, img: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Start and end of every procedure of the image, once known (None: not yet, or none)."""
        with self._lock:
            return self._bounds.get(img)

    def table(self, img: int, start: int) -> LoopTable | None:
        with self._lock:
            t = self._tables.get((img, start))
            if t is not None and (img, start) in self._held:
                self._held.move_to_end((img, start))
            return t

    # --- samples ------------------------------------------------------------------------
    def note(self, img: np.ndarray, off: np.ndarray, count: np.ndarray) -> None:
        """Samples counted elsewhere, ``count`` of them at each image offset (the eBPF path's rows,
        whose registers stay in the kernel): their images are opened and their procedures
        analyzed as add's samples would have them, and each procedure's samples weigh it among
        those :meth:`watched` gives (the program then sends their samples' registers to add)."""
        self._notes += 1
        if len(self.recent) > MAX_RECENT:
            self.recent = {k: v for k, v in self.recent.items() if self._weight(v) >= 1.0}
        if not len(img):
            return
        ui, where = group(img.astype(np.int64))
        n_img = np.bincount(where, weights=count.astype(np.float64))
        for g, (i, n) in enumerate(zip(ui.tolist(), n_img.tolist(), strict=True)):
            with self._lock:
                bounds = self._bounds.get(i)
                asked = i in self._bounds or i in self._pending_bounds
            if not asked:
                seen = self._img_seen[i] = self._img_seen.get(i, 0) + int(n)
                if seen < self.analyze_after:
                    continue
                if self._over_budget():  # opened at a later drain
                    self.deferred += 1
                    continue
                self._ask_bounds(int(i))  # from the cache at once, where it has them
                with self._lock:
                    bounds = self._bounds.get(i)
            if bounds is None:
                continue
            m = where == g
            k = procedure_index(bounds, off[m].astype(np.uint64))
            ok = k >= 0
            if not ok.any():
                continue
            starts = bounds[0][k[ok]].astype(np.int64)
            us, w = group(starts)
            per = np.bincount(w, weights=count[m][ok].astype(np.float64))
            keys = {(int(i), int(st)): int(c) for st, c in zip(us.tolist(), per.tolist(), strict=True)}
            for key, c in keys.items():
                self.recent[key] = (self._weight(self.recent.get(key, (0.0, self._notes))) + c, self._notes)
            # Analyzed once its recent samples (decayed) reach analyze_after, not its samples since
            # the start: a process's watch holds its 16 heaviest procedures, and a daemon under a
            # compile loop spent a quarter of its time loading the tables of cc1's long tail, each
            # procedure past the count once in minutes (bench/soak.py).
            hot = {key: due for key in keys if (due := int(np.ceil(self.recent[key][0]))) >= self.analyze_after}
            self._request(hot)

    def _weight(self, v: tuple[float, int]) -> float:
        """A ``recent`` entry's weight now: decayed by RECENT_DECAY for each note since."""
        return v[0] * RECENT_DECAY ** (self._notes - v[1])

    def busy(self) -> bool:
        """Are images' procedures being read, or procedures analyzed?"""
        with self._lock:
            return bool(self._pending_bounds) or any(t is None for t in self._tables.values())

    def watched(self) -> dict[tuple[int, int], tuple[int, float]]:
        """(image, procedure start) -> (its end, its recent samples) of every procedure analyzed so
        far with a loop a counter register counts: the ones whose samples' registers add needs."""
        with self._lock:
            ends = dict(self._watch_ends)
        return {k: (e, self._weight(self.recent.get(k, (0.0, self._notes)))) for k, e in ends.items()}

    def add(self, tid: np.ndarray, time_ns: np.ndarray, cpu: np.ndarray, img: np.ndarray, off: np.ndarray,
            period: np.ndarray, regs: np.ndarray, stack: np.ndarray | None = None,
            nstack: np.ndarray | None = None) -> None:
        """One drain's samples: tid, time, CPU, image index, offset, period (event units) and the 16
        general registers (GPRS order) of each, and the words of the user stack from rsp up
        (``stack``: uint64 [n, up to STACK_WORDS], ``nstack`` of them valid in each; None: none);
        samples outside any ELF procedure are kept for the sequence (they break pairs) but count
        nowhere."""
        ui, uc = counts(img)
        for i, n in zip(ui.tolist(), uc.tolist(), strict=True):
            with self._lock:
                asked = i in self._bounds or i in self._pending_bounds
            if not asked:
                # An image is opened once it has enough samples for one of its procedures to be
                # analyzed: system-wide, most images have a few samples now and then.
                seen = self._img_seen[i] = self._img_seen.get(i, 0) + n
                if seen >= self.analyze_after and (self.per_task or not self._over_budget()):
                    self._ask_bounds(int(i))
        words = np.zeros((len(tid), STACK_WORDS), np.uint64)
        valid = np.zeros(len(tid), np.int64)
        if stack is not None and nstack is not None:
            w = min(stack.shape[1], STACK_WORDS)
            words[:, :w] = stack[:, :w]
            valid = np.minimum(nstack.astype(np.int64), w)
        batch = _Batch(tid.astype(np.int64), time_ns.astype(np.uint64), cpu.astype(np.int64), img.astype(np.int64),
                       off.astype(np.uint64), period.astype(np.float64), regs.astype(np.uint64),
                       np.full(len(tid), -1, np.int64), False, words, valid)
        self._waiting.append(batch)
        self._waiting_n += len(batch)
        # A recording waits for its images and procedures (a short run would otherwise lose most of
        # its pairs); the daemon, which runs for hours, does not hold samples for them.
        self._drain(force=self._waiting_n > MAX_WAITING or not self.per_task)

    def _procedures(self, b: _Batch) -> None:
        """Each sample's procedure (where its image's bounds are known), and the analyses that asks for."""
        keys: dict[tuple[int, int], int] = {}
        for i in counts(b.img)[0].tolist():
            with self._lock:
                bounds = self._bounds.get(i)
            if bounds is None or not len(bounds[0]):
                continue
            m = b.img == i
            k = procedure_index(bounds, b.off[m])
            starts = np.where(k >= 0, bounds[0][np.maximum(k, 0)].astype(np.int64), -1)
            b.func[m] = starts
            u, c = counts(starts)
            keys.update({(int(i), int(s)): int(n) for s, n in zip(u.tolist(), c.tolist(), strict=True) if s >= 0})
        b.resolved = True
        self._request(keys)

    def _drain(self, force: bool) -> None:
        """Count the waiting batches, oldest first, once their images' procedures are known and the
        analyses they asked for are done (all of them, done or not, when ``force``). Procedures not
        asked for (too few samples, or past the budget) do not hold a batch back."""
        while self._waiting:
            b = self._waiting[0]
            if not b.resolved:
                with self._lock:
                    pending = bool(self._pending_bounds & set(counts(b.img)[0].tolist()))
                if pending and not force:
                    return
                self._procedures(b)
            with self._lock:
                busy = any(self._tables.get(k, 0) is None for k in _proc_keys(b.img, b.func))
            if busy and not force:
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
            self._pool.close()
            self._pool = None

    def forget(self, tid: int) -> None:
        self._last.pop(tid, None)
        self._tcum.pop(tid, None)
        self._plast.pop(tid, None)
        for k in [k for k in self._phist if k[1] == tid]:
            del self._phist[k]

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
                       np.concatenate([np.array(cols[7], np.int64), b.func]), True,
                       np.concatenate([np.array(cols[8], np.uint64).reshape(-1, STACK_WORDS), b.stack]),
                       np.concatenate([np.array(cols[9], np.int64), b.nstack]))
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
                                       float(b.period[o]), b.regs[o].tolist(), int(b.func[o]), b.stack[o].tolist(),
                                       int(b.nstack[o]))
        # Instruction index and innermost loop of every sample, per procedure.
        n = len(b)
        inner = np.full(n, -1, np.int64)
        ix = np.full(n, -1, np.int64)
        tables: dict[tuple[int, int], LoopTable] = {}
        ukeys, inv = group(_pack(img, func))
        uniq = _unpack(ukeys)
        # Each group's rows, in order (one sort: a mask per group over every sample cost the
        # system-wide collector's drains, a hundred procedures each, most of their time).
        members = _members(inv, len(uniq))
        for g, (i, s) in enumerate(uniq):
            if s < 0:
                continue
            t = self.table(int(i), int(s))
            rows = members[g]
            if t is None:  # not analyzed (yet): its samples break pairs and count nowhere
                self.skipped += int(fresh[rows].sum())
                continue
            if t.empty:
                continue
            tables[(int(i), int(s))] = t
            k = np.searchsorted(t.addrs, off[rows])
            k = np.minimum(k, len(t.addrs) - 1)
            exact = t.addrs[k] == off[rows]
            ix[rows[exact]] = k[exact]
            inner[rows[exact]] = t.inner[k[exact]]
        # Own samples of every loop (fresh ones only: a carried sample was counted in its drain).
        for g, (i, s) in enumerate(uniq):
            t = tables.get((int(i), int(s)))
            if t is None:
                continue
            rows = members[g]
            rows = rows[fresh[rows] & (inner[rows] >= 0)]
            if not len(rows):
                continue
            la = inner[rows]
            for d in range(1, t.anc.shape[1]):
                lp = t.anc[la, d]
                ok = lp >= 0
                for L, c in zip(*counts(lp[ok]), strict=True):
                    st = self._stat(int(i), int(t.headers[L]))
                    st[_S["own"]] += c
                    these = rows[ok][lp[ok] == L]
                    st[_S["own_period"]] += float(b.period[order[these]].sum())
                    if t.trips and t.trips[L] is not None:
                        n_trip, inv_sum = _trips(t.trips[L], b.regs[order[these]], ix[these])
                        st[_S["trip_samples"]] += n_trip
                        st[_S["inv_trip"]] += inv_sum
        if not self.partial:
            self._progress(b, order, fresh, tid, ix, members, uniq, tables)
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
        for g, sel in enumerate(_members(inv[a], len(uniq))):
            t = tables.get((int(uniq[g][0]), int(uniq[g][1])))
            if t is None or not len(sel):
                continue
            self._pairs(int(uniq[g][0]), t, a[sel], bb[sel], inv[bb[sel]] == g, inner, ix, order, b)

    def _progress(self, b: _Batch, order: np.ndarray, fresh: np.ndarray, tid: np.ndarray, ix: np.ndarray,
                  members: list[np.ndarray], uniq: list[tuple[int, int]],
                  tables: dict[tuple[int, int], LoopTable]) -> None:
        """How far the arguments of each sampled procedure moved between consecutive samples of a
        thread in it (analysis/progress.py). A thread's time is the sum of its samples' periods (per
        task, exactly its CPU time; system-wide, its expected value)."""
        from cyclescope.analysis.progress import JUMP, W32, signed_moves

        f = np.flatnonzero(fresh)
        if not len(f):
            return
        tf = tid[f]
        p = b.period[order[f]]
        seg = np.flatnonzero(np.r_[True, tf[1:] != tf[:-1]])
        seg_id = np.cumsum(np.r_[True, tf[1:] != tf[:-1]]) - 1
        cs = np.cumsum(p)
        base = cs[seg] - p[seg] - np.array([self._tcum.get(int(t), 0.0) for t in tf[seg]])
        cum = np.empty(len(b))
        cum[f] = cs - base[seg_id]
        ends = np.r_[seg[1:], len(f)] - 1
        for t_, e in zip(tf[seg].tolist(), ends.tolist(), strict=True):
            self._tcum[int(t_)] = float(cum[f[e]])
        for g, (i, s) in enumerate(uniq):
            t = tables.get((int(i), int(s)))
            if t is None or not len(t.args):
                continue
            rows = members[g]
            rows = rows[fresh[rows] & (ix[rows] >= 0)]
            if not len(rows):
                continue
            codes = t.args[ix[rows]].astype(np.int64)
            # a value held in a register, or in a stack word the sample carries (progress.NCOLS columns)
            col = codes % W32
            known = (codes >= 0) & ((col < 16) | (col - 16 < b.nstack[order[rows]][:, None]))
            if not known.any():
                continue
            regs = np.concatenate([b.regs[order[rows]], b.stack[order[rows]]], axis=1)
            vals = np.take_along_axis(regs, np.where(known, col, 0), axis=1)
            vals = np.where(codes >= W32, vals & np.uint64(0xFFFFFFFF), vals)
            key = (int(i), int(s))
            # each value's last known sample of the thread in the procedure before this drain's,
            # then this drain's (each value's pairs are of the samples where it is known: a
            # progress point's values are not before the point in each call)
            seq_tid, seq_val, seq_known, seq_cum = [], [], [], []
            for t_ in distinct(tid[rows]).tolist():
                last = self._plast.get(t_, {}).get(key)
                if last is not None:
                    seq_tid.append(np.array([t_]))
                    seq_val.append(last[0][None, :])
                    seq_known.append(last[1][None, :])
                    seq_cum.append(last[2][None, :])
                m = tid[rows] == t_
                seq_tid.append(tid[rows][m])
                seq_val.append(vals[m])
                seq_known.append(known[m])
                seq_cum.append(np.repeat(cum[rows][m][:, None], known.shape[1], axis=1))
                mine = 2 if last is not None else 1  # this thread's pieces: its earlier last known, then its rows
                self._plast.setdefault(t_, {})[key] = _last_known(seq_val[-mine:], seq_known[-mine:], seq_cum[-mine:])
                if self.moving(*key):  # trip windows of its entry alone come (trips.TripWindows._stride_turn)
                    self._keep_history(key, t_, b.time[order[rows]][m], cum[rows][m], vals[m], known[m])
            st_ = np.concatenate(seq_tid)
            sv = np.concatenate(seq_val)
            sk = np.concatenate(seq_known)
            sc = np.concatenate(seq_cum)
            for a in range(sk.shape[1]):
                ka = np.flatnonzero(sk[:, a])
                if len(ka) < 2:
                    continue
                ok = st_[ka[1:]] == st_[ka[:-1]]
                if not ok.any():
                    continue
                with np.errstate(over="ignore"):
                    d = signed_moves(sv[ka[1:], a] - sv[ka[:-1], a], int(t.argwidth[a]))[ok]
                tt = (sc[ka[1:], a] - sc[ka[:-1], a])[ok]
                good = d >= 0
                moving = good & (d > 0) & (tt > 0)
                if moving.sum() >= 5:
                    r = d[moving] / tt[moving]
                    good &= ~((d > 0) & (tt > 0) & (d > JUMP * median(r) * np.maximum(tt, 1e-9)))
                st = self._progress_stat(key, a)
                mv = self._moving.setdefault((key[0], key[1], a), [0, 0])
                mv[0] += int((good & (d > 0)).sum())
                mv[1] += int((~good).sum())
                st[0] += int(good.sum())
                st[1] += float(d[good].sum())
                st[2] += float(tt[good].sum())
                st[3] += int((~good).sum())
                st[4] += float(tt[~good].sum())
        if self._strides:
            self._local_rates({k: t.argwidth for k, t in tables.items() if len(t.args)})

    def _progress_stat(self, key: tuple[int, int], a: int) -> np.ndarray:
        """The PROGRESS sums this side keeps for one argument (take_progress: LOCAL_PROGRESS order)."""
        st = self.progress.get((key[0], key[1], a))
        if st is None:
            st = self.progress[(key[0], key[1], a)] = np.zeros(len(LOCAL_PROGRESS), np.float64)
        return st

    def _keep_history(self, key: tuple[int, int], tid: int, times: np.ndarray, cum: np.ndarray, vals: np.ndarray,
                      known: np.ndarray) -> None:
        """This drain's samples of a thread in a procedure whose argument moves, for _local_rates;
        chunks older than LOCAL_HISTORY_NS of the samples' time go."""
        if not len(times):
            return
        h = self._phist.setdefault((key, tid), deque())
        h.append((times.astype(np.int64), cum.astype(np.float64), vals, known))
        last = int(times[-1])
        while len(h) > 1 and int(h[0][0][-1]) < last - LOCAL_HISTORY_NS:
            h.popleft()

    def stride_window(self, img: int, entry: int, probed_ns: int, unprobed_ns: int, steps: int,
                      moves: np.ndarray) -> None:
        """A trip window of the entry alone (analysis/trips.py, from its thread): its probes trapped
        between these CLOCK_MONOTONIC times (from their attach to the end of their detach), and it
        counted ``steps`` entries after the first, each value moving ``moves`` (NaN where no
        register held it). Resolved against the thread's samples around it once they come."""
        if steps < 1:
            return
        with self._lock:
            self._strides.append(((img, entry), probed_ns, unprobed_ns, steps, np.asarray(moves, np.float64).copy()))

    def _local_rates(self, widths: dict[tuple[int, int], np.ndarray]) -> None:
        """Each pending stride window whose procedure's samples now reach LOCAL_AROUND_NS past it
        (``widths``: the values' widths of the procedures this drain sampled): per value, its
        entries per unit of the thread's time, the value's move rate over the thread's time in the
        LOCAL_AROUND_NS before the window's probes went in and after they were out (no trap slows
        those: the probes trap while they are attached and detached too, and a procedure of 0.2 us
        a call trapped twice a call runs several times slower there), times the window's entries per
        move. Only where one thread sampled the procedure around the window (a window counts the
        process's entries, and two threads' registers do not mix), with samples on both sides of it
        and no move back."""
        from cyclescope.analysis.progress import signed_moves

        with self._lock:
            pending, self._strides = self._strides, []
        now = time.monotonic_ns()
        keep = []
        joined: dict[tuple[int, int], list[tuple[np.ndarray, ...]]] = {}  # per procedure, each thread's history
        for key, t0, t1, steps, moves in pending:
            if now - t1 > LOCAL_KEEP_NS:
                continue  # its samples never came (the process exited, or left the procedure)
            width = widths.get(key)
            if width is None:
                keep.append((key, t0, t1, steps, moves))
                continue
            if key not in joined:
                joined[key] = [tuple(np.concatenate([c[i] for c in h]) for i in range(4))
                               for (k, _tid), h in self._phist.items() if k == key]
            spans = []
            latest = 0
            for times, cum, vals, known in joined[key]:
                latest = max(latest, int(times[-1]))
                lo = int(np.searchsorted(times, t0 - LOCAL_AROUND_NS, "left"))
                hi = int(np.searchsorted(times, t1 + LOCAL_AROUND_NS, "right")) - 1
                if lo < hi and times[lo] <= t0 and times[hi] >= t1:
                    spans.append((times[lo : hi + 1], cum[lo : hi + 1], vals[lo : hi + 1], known[lo : hi + 1]))
            if latest < t1 + LOCAL_AROUND_NS:  # the samples after it are not all in yet
                keep.append((key, t0, t1, steps, moves))
                continue
            if len(spans) != 1:
                continue
            for a, mv in enumerate(moves.tolist()):
                if not mv > 0:
                    continue
                # The samples where a register held the value (a progress point's, only after the
                # point in each call), on both sides of the window; their pairs outside it.
                times, cum, vals, known = (x[spans[0][3][:, a]] for x in spans[0])
                if len(times) < 2 or times[0] > t0 or times[-1] < t1:
                    continue
                with np.errstate(over="ignore"):
                    d = signed_moves(vals[1:, a] - vals[:-1, a], int(width[a]))
                dt = cum[1:] - cum[:-1]
                out = (times[1:] <= t0) | (times[:-1] >= t1)
                if not out.any() or (d[out] < 0).any() or d[out].sum() <= 0 or dt[out].sum() <= 0:
                    continue
                e = float(d[out].sum()) / float(dt[out].sum()) * steps / mv
                st = self._progress_stat(key, a)
                st[5] += 1
                st[6] += e
                st[7] += e * e
        with self._lock:
            self._strides = keep + self._strides

    def moving(self, img: int, start: int) -> bool:
        """Has an argument of the procedure (or a value at its progress point) moved forward
        between its samples (a few times, and seldom back) since the recording began? Trip windows
        measure its move per entry then."""
        from cyclescope.analysis.progress import MAX_BACK, MIN_MOVING, NVALUES

        for a in range(NVALUES):
            mv = self._moving.get((img, start, a))
            if mv is not None and mv[0] >= MIN_MOVING and mv[1] <= MAX_BACK * (mv[0] + mv[1]):
                return True
        return False

    def take_progress(self) -> Any:
        """The arguments' moves since the last take, as a PROGRESS tally table (db/tallies.py)."""
        from cyclescope.analysis.progress import tally

        rows = [(self.image_key(i), e, a, v) for (i, e, a), v in self.progress.items() if v[0] or v[3] or v[5]]
        self.progress = {}
        return tally([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                     {n: [float(r[3][k]) for r in rows] for k, n in enumerate(LOCAL_PROGRESS)})

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
            for loop in counts(L[m])[0].tolist():
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
            cols[n] = v if n.endswith("period") or n == "inv_trip" else np.rint(v).astype(np.uint64)
        return build(LOOPS, cols)


def _members(inv: np.ndarray, n: int) -> list[np.ndarray]:
    """For each of ``n`` groups, the positions in ``inv`` (each position's group) that hold it,
    in increasing order."""
    order = np.argsort(inv, kind="stable")
    ends = np.cumsum(np.bincount(inv, minlength=n)) if len(inv) else np.zeros(n, np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64) if n else ends
    return [order[starts[g] : ends[g]] for g in range(n)]


def procedure_index(bounds: tuple[np.ndarray, np.ndarray], off: np.ndarray) -> np.ndarray:
    """The index in ``bounds`` (sorted starts, ends) of the procedure holding each offset, -1 where
    none does."""
    starts, ends = bounds
    if not len(starts):  # an image without procedures (a stripped one's symbols)
        return np.full(len(off), -1, np.int64)
    k = np.searchsorted(starts, off, side="right").astype(np.int64) - 1
    return np.where((k >= 0) & (off < ends[np.maximum(k, 0)]), k, -1)


def _pack(img: np.ndarray, func: np.ndarray) -> np.ndarray:
    """(image index, procedure start or -1) as one uint64 each, for one sort (np.unique over rows
    is ten times slower): the index above the start's 48 bits, -1 as all ones."""
    return (img.astype(np.uint64) << np.uint64(48)) | (func.astype(np.uint64) & np.uint64(_LOW48))


def _unpack(keys: np.ndarray) -> list[tuple[int, int]]:
    return [(k >> 48, -1 if k & _LOW48 == _LOW48 else k & _LOW48) for k in keys.tolist()]


def _proc_keys(img: np.ndarray, func: np.ndarray) -> list[tuple[int, int]]:
    """The distinct (image, procedure start) of samples in a procedure."""
    m = func >= 0
    if not m.any():
        return []
    return _unpack(distinct(_pack(img[m], func[m])))


def _trips(spec: tuple[int, int, int, int, int, int, int, Window, Window, bool], regs: np.ndarray,
           ix: np.ndarray) -> tuple[int, float]:
    """Samples in a loop whose execution's trip count their registers give, and the sum of 1/trip:
    samples fall on executions in proportion to their iterations, so (samples) / (sum of 1/trip)
    is the mean trip count per execution. A trip count that does not hold the sample's own
    position (a counter outside [init, limit]) is left out."""
    width, step, icol, iadd, lcol, ladd, ccol, offs, valid, cross = spec
    ok = (ix >= 0) & valid[np.maximum(ix, 0)]
    if not ok.any():
        return 0, 0.0
    r = regs[ok]
    mask = np.uint64((1 << width) - 1) if width < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        init = (r[:, icol] if icol >= 0 else np.zeros(len(r), np.uint64)) + np.uint64(iadd & 0xFFFFFFFFFFFFFFFF)
        limit = (r[:, lcol] if lcol >= 0 else np.zeros(len(r), np.uint64)) + np.uint64(ladd & 0xFFFFFFFFFFFFFFFF)
        here = r[:, ccol] - offs[ix[ok]].astype(np.uint64)
        span = ((limit - init) & mask).astype(np.float64)
        done = ((here - init) & mask).astype(np.float64)
    if step < 0:  # counting down: the distances run the other way
        span = ((init - limit) & mask).astype(np.float64)
        done = ((init - here) & mask).astype(np.float64)
    s = abs(step)
    half = 2.0 ** (width - 1)
    if cross:
        # leaves on reaching or passing the limit: a limit behind the start still runs the header once
        span = np.where(span >= half, 0.0, span)
        trips = np.ceil(span / s) + 1
        good = (done % s == 0) & (done / s < trips) & (trips < 2.0**40)
    else:
        trips = span / s + 1
        good = (span % s == 0) & (done % s == 0) & (done / s < trips) & (trips >= 1) & (trips < 2.0**40)
    return int(good.sum()), float(np.sum(1.0 / trips[good]))


def _iterations(counters: list[tuple[int, int, int, Window, Window]], ra: np.ndarray, rb: np.ndarray,
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
        self._own = -1

    def bind(self, ctx: Any) -> None:
        self.counter = LoopCounter(None, lambda i: ctx.table[i].key, ctx.per_task, self.background,
                                   info_of=lambda i: ctx.table[i])
        if not ctx.per_task:
            # System-wide on the eBPF path, a procedure's samples bring their registers only once it
            # is analyzed and watched: the first drain early, and more while analyses are under way
            # (settling), so that a command recorded for a second or two is watched for most of it.
            self.first_drain_s = SETTLING_DRAIN_S
        self._cols = np.array([ctx.regs_columns[r] for r in GPRS], np.intp)
        self._time_event = ctx.time_event
        self._own = os.getpid()

    def process(self, d: Any) -> None:
        if self.counter is None or self._time_event < 0 or not len(d.samples):
            return
        s = d.samples
        if d.regs is None:
            if d.count is not None:  # the eBPF path's rows: which procedures to analyze and watch
                from cyclescope.perf.abi import MISC_USER

                self.counter.partial = True  # add gets the watched samples and their followers only

                # Not the recorder's own samples (system-wide it samples itself), nor its helpers'
                # (collect/helpers.py: the analysis worker itself, importing numpy and capstone as
                # it starts): their libraries' procedures (numpy's, the interpreter's) would be
                # analyzed and watched for nothing, and opening libpython took the worker's first
                # answers past the analyses' budget, so that a binary first seen system-wide was
                # watched only from 4.5-5 s in.
                from cyclescope.collect.helpers import is_helper

                m = ((d.event == self._time_event) & (s["cpumode"] == MISC_USER) & (d.image > 0)
                     & (s["pid"] != self._own))
                pids = distinct(s["pid"][m])
                helper = [p for p in pids.tolist() if is_helper(p)]
                if helper:
                    m &= ~np.isin(s["pid"], helper)
                self.counter.note(d.image[m], d.offset[m], d.count[m])
            return
        m = (d.event == self._time_event) & (s["regs"] >= 0)
        if not m.any():
            return
        rows = s["regs"][m]
        stack = nstack = None
        if d.stack is not None and d.stack_len is not None and d.stack.shape[1] >= 8:
            # the words of the user stack from rsp up (perf/abi.STACK_WORDS: values spilled there)
            nb = min(d.stack.shape[1], STACK_BYTES) // 8 * 8
            stack = np.ascontiguousarray(d.stack[rows][:, :nb]).view("<u8")
            nstack = np.minimum(d.stack_len[rows].astype(np.int64), nb) // 8
        self.counter.add(s["tid"][m], s["time"][m], s["cpu"][m], d.image[m], d.offset[m], d.period[m],
                         d.regs[rows][:, self._cols], stack, nstack)

    def process_watched(self, d: Any) -> None:
        """The eBPF path's samples in the ranges :meth:`watched` named, each with the next sample
        on its CPU, with their registers (collect/loopwatch.py)."""
        if self.counter is not None:
            self.counter.partial = True
            self.process(d)

    def watched(self) -> dict[tuple[int, int], tuple[int, float]]:
        """The procedures whose samples' registers the loop counter needs (LoopCounter.watched)."""
        return self.counter.watched() if self.counter is not None else {}

    def next_drain_s(self) -> float | None:
        """How soon the next drain should come: system-wide, SETTLING_DRAIN_S while images or
        procedures asked for are being read or analyzed (the eBPF path watches them once they
        land); None (no hurry) otherwise."""
        if self.counter is None or self.counter.per_task or not self.counter.busy():
            return None
        return SETTLING_DRAIN_S

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
        from cyclescope.db.tallies import PROGRESS

        t = self.counter.take()
        out = [write_tally(db, epoch, host, LOOPS, t)] if t.num_rows else []
        pg = self.counter.take_progress()
        return out + ([write_tally(db, epoch, host, PROGRESS, pg)] if pg.num_rows else [])

    def close(self) -> None:
        if self.counter is not None:
            self.counter.close()

    def status(self) -> dict[str, Any]:
        c = self.counter
        if c is None:
            return {}
        return {"procedures": len(c._tables), "tables_mib": round(c._held_bytes / 2**20, 1), "evicted": c.evicted,
                "analysis_s": round(c.analysis_s, 3), "skipped": c.skipped,
                "deferred": c.deferred}

    def summary(self) -> str | None:
        return None  # calc reports what the counts covered
