"""Trip windows: exact ratios between the counts of a procedure's entry, loop headers and hot blocks.

An anchor (analysis/anchors.py) gives a procedure's entry count; the loop counters give a loop's
count where a register counts its iterations. Most samples of real programs sit in loops that
neither measures: their exit depends on data (a match finder's chain), their counter lives in
memory, and their count is the model's, which stalls make wrong by factors (docs/benchmarks.md,
"calc accuracy"). Yet how many times a block runs per run of another does not depend on how long
anything took, so counting them together for a short while gives that ratio exactly, whatever
the traps do to the time: a trap disturbs the caches and predictors (which is why an anchor's
entry count of a short procedure comes out low), never which way a branch goes.

So a procedure that got an anchor and has loops gets windows here: one BPF program attached by
one uprobe_multi link (collect/pointcount.py) to its entry, up to MAX_HEADERS loop headers and the
blocks that hold its samples (MAX_POINTS in all), counting each into its own slot for WINDOW_S,
then detached in one go. The program is gated: it counts only once every probe of the link is in
and stops before the close begins, since a link installs and removes its probes one by one while
the program runs (ungated, the entry counted alone at first and xz's match finder came out at
15-25 trips per entry against 34). The windows' counts are summed per point (db/tallies.py
TRIPS: mergeable by addition like the rest); calc carries whichever of the points has a measured
count (an anchor, a loop counter) to the others by the ratios (analysis/calc.py, method
``trip-window``).

Where each point is probed: at the first instruction of its block that the kernel emulates at a
hit (a conditional jump, a push: images/disasm.uprobe_emulated; loopcount.block_site), else at the
block's first. An emulated hit costs 0.41 us against 14.3 us single-stepped on the Xeon with AMX
(bench/probecost.py), so a window counts about thirty times the executions for the same traps.
The first point's hits also keep the registers that move with an argument, and a procedure whose
argument moves forward gets every other window for its entry alone, which ends at an entry and
measures how far the argument moves per entry: analysis/progress.py.

Cost: every hit traps (0.4-17 us on these machines, by the instruction), so a loop run hundreds
of millions of times a second runs at the traps' pace while a window is open. Windows are short
and spread over the run at random steps so that the traps stay within BUDGET_SHARE of the anchors'
budget of one CPU (a token bucket over the time since the recording began: the first window opens
at once, the next when the budget has paid for the last). Each window goes to the procedure whose
windows have cost least per sample it took (_claim), so that a procedure holding most of the
samples gets most of the windows. Per task (``record -- CMD``, ``-p``), a
window counts the process that sampled the procedure last; system-wide, every process mapping the
file.

What the sums weigh: the ratios change with a program's phases (xz's hash chains grow as its
dictionary fills), and each window counts the phase it falls in, in proportion to what it counts.
Where traps set the pace a window holds a few executions (about 140 hits in 2 ms on the Xeons
where single-stepped, 5,000 where emulated); where the loop does not run (xz's first
milliseconds, empty chains) a window counts untrapped entries by the thousand and outweighs many
others. Windows also cut executions at their edges.
calc's confidence asks for windows as well as hits (MEDIUM_WINDOWS, HIGH_WINDOWS).

Scale windows: the ratios above need one measured count to scale them by, and where the entry is
short (a match finder called every 73 ns), its anchor's own windows run at the traps' pace and its
count comes out low (0.31-0.75 of exact: anchors.py, calc's MIN_ANCHOR_ENTRY_CYCLES). A block run
once in a hundred entries traps a hundred times less often. So a procedure whose anchor measured
entries of under SCALE_ENTRY_S beside their traps, after SCALE_AFTER windows of all its points,
gets every other window for its entry and its other blocks (a survey, SCALE_BATCH at a time, the
least sampled first), keeps a few rare ones as one point (_choose_scale), and from then on counts
the entry and that point alone (their exact ratio, with the spread of the windows' own ratios:
SCALE tally), each such window followed by up to POINT_WINDOW_S of the point alone, registered
with the anchors (_point_window: the point's count against the procedure's samples, undisturbed
by the entry's traps). calc multiplies the two (calc._scaled). A rare block runs in bursts, so
this needs many windows to agree, and runs of a few seconds rarely have them: calc uses it only
where the windows' spread says it may.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cyclescope.analysis.loopcount import LOCAL_AROUND_NS
from cyclescope.errors import CycleScopeError

MAX_HEADERS = 15  # loop headers counted beside the entry (outermost first)
MAX_POINTS = 32  # with the blocks that hold the procedure's samples, most first
BLOCK_SHARE = 0.02  # a block is counted when it holds at least this share of the procedure's samples
POINTS_AFTER = 100  # the procedure's samples (since its anchor) before its points are chosen
# How long a window counts. Short, so that many fit the budget and sample the run's phases (xz's
# match finder runs 26 trips per entry over the first MB of the suite's input, 34 over the whole);
# windows of 10 ms spent a short run's budget in its first half second.
WINDOW_S = 0.002
# A window of an entry alone (analysis/progress.py) as long: it measures a move per entry, and the
# moves between entries are heavy-tailed (xz's match finder is not called while a long match is
# skipped), so what the stride's error needs is many intervals, and a window's own cost
# (EMULATED_WINDOW_COST_S) is most of what it is charged: at 2 ms an entry probed where the kernel
# emulates the hit counts about 600 (xz) for 1.3 ms charged, four times what 0.5 ms counted for 1.1.
STRIDE_WINDOW_S = 0.002
# Past ENOUGH_STEPS entries (analysis/progress.py) a moving entry still gets one window alone in this
# many of its turns, so that its moves per entry sample the whole run and not only its start (the
# run's phases move them: xz's 5-9 positions per entry over most tenths of the suite's input, 16.6
# over one).
STRIDE_LATER = 4
# A window of the entry alone ends at an entry (TripWindows._next_entry): it counts on for up to
# TAIL_S until the entry runs again, looking without a pause for the first TAIL_SPIN_S (a look is
# one bpf(2) call, about 2 us; entries come every few microseconds under traps), then every
# TAIL_STEP_S (the collector's own CPU: a millisecond of looking at each window cost more than the
# windows' own work).
TAIL_S = 0.02
FULL_TAIL_S = 0.002  # a window of all the points waits for its entry this long at most: they all trap meanwhile
# Windows of whole runs in a row that held none before a procedure's windows have a fixed length (a
# program's loop nest, entered once; one such window may come where a hot procedure is not running)
EMPTY_RUNS = 2
# Around a window of the entry alone, the anchors' windows are held off (AnchorSet.hold: from the
# wait for quiet, at most QUIET_WAIT_S, through the window, HOLD_NS in all, then LOCAL_AFTER_NS past
# its detach), so that the samples LOCAL_AROUND_NS on each side of it saw no trap.
LOCAL_AFTER_NS = LOCAL_AROUND_NS + 2_000_000
QUIET_WAIT_S = 0.1
QUIET_STEP_S = 0.002
HOLD_NS = 400_000_000
TAIL_SPIN_S = 0.0002
TAIL_STEP_S = 0.0002
BUDGET_SHARE = 1.0  # of the anchors' budget (a share of one CPU)
ALLOWANCE = 0.003  # trap seconds granted ahead of time: the first window opens at once, the others are paced
# What a window costs the probed program beyond its hits' traps, charged to the budget with them:
# `record` of bench/workload.c (8 s at 5 kHz, 62-76 windows a run, their hits charged 0.07-0.08 s)
# cost the program 0.25-0.43 s of CPU more than without trip windows, and 7-11 windows about
# nothing; about 4 ms a window, of which the hits are about 1. Where the rest goes was not found
# (windows over instructions that never run cost nothing measurable; a hit costs what it is charged).
WINDOW_COST_S = 0.003
# ... where every point of the window is probed at an instruction the kernel emulates (0.5 us a hit
# against 14-17 us single-stepped): a window of 2 ms over one such point of tests/programs/progress.c
# (5,100-5,500 hits) slowed the program by 2.3-2.9 ms, its hits' traps and no more (a window over a
# single-stepped point, 150 hits, by 1.8-2.8 ms: the traps fill the window either way).
EMULATED_WINDOW_COST_S = 0.001
JITTER = 0.5  # the wait before a window is drawn from [1 - JITTER, 1 + JITTER] times the budget's pace
IDLE_S = 0.25  # the longest sleep when nothing can be counted yet
MIN_GAP_S = 0.05  # the shortest time between two windows
# calc uses a ratio once the rarer of its two points has this many hits (analysis/calc._by_ratios),
# in low, medium and high confidence
MIN_HITS = 20
MEDIUM_HITS = 100
HIGH_HITS = 1000
# ... and windows (phases of the run sampled): a ratio from one or two windows is low confidence
MEDIUM_WINDOWS = 3
HIGH_WINDOWS = 10


# Scale windows: where the entry is too short for its anchor's own count (its windows' rate says an
# entry takes under SCALE_ENTRY_S beside its trap: the 30,000 cycles from which calc trusts an
# anchor, MIN_ANCHOR_ENTRY_CYCLES), windows of the entry and a few rare blocks alone (the module's
# docstring, "Scale windows"). The first ones survey SCALE_BATCH candidate blocks each; a candidate
# with SCALE_CHOOSE_HITS hits run more often than once in SCALE_MIN_RATIO entries, or one with
# fewer after SCALE_MAX_RATIO entries a hit, is dropped; the point is up to SCALE_SITES of the rest
# counted as one, kept once together they run once in SCALE_AIM_RATIO entries (_choose_scale): rare
# enough that their traps barely disturb the procedure's time, common enough that windows of the
# entry see them (10-15 runs in a 2 ms window of 1,300 entries).
SCALE_ENTRY_S = 10e-6
SCALE_BATCH = MAX_POINTS - 1
SCALE_MIN_RATIO = 30.0
SCALE_AIM_RATIO = 100.0
SCALE_MAX_RATIO = 2000.0
SCALE_CHOOSE_HITS = 5
SCALE_SITES = 8  # rare blocks counted together as the point
# Every other window of such a procedure is a scale window until its point has SCALE_ENOUGH hits in
# them, then one in SCALE_LATER (the ratio changes with the run's phases, as the trips' do).
SCALE_ENOUGH = 1000
SCALE_LATER = 4
SCALE_AFTER = 3  # windows of all the points before the first scale window
# Each scale window of the chosen point is followed by one of the point alone this long: its count
# against the procedure's samples (at 5 kHz, about 200 of them where the procedure holds the time),
# shorter where the point's own traps would cost more than POINT_TRAPS_S in it (a "rare" block of a
# procedure called 200 million times a second still runs millions of times a second), at least
# MIN_POINT_WINDOW_S.
POINT_WINDOW_S = 0.05
POINT_TRAPS_S = 0.005
MIN_POINT_WINDOW_S = 0.005


@dataclass
class ScalePoint:
    """A candidate or chosen scale point of a procedure (where it is probed: Target.candidates):
    its hits and the entry's in the scale windows that counted it (since the last take, and over
    the run)."""

    hits: int = 0
    entry_hits: int = 0
    windows: int = 0
    hits_sq: float = 0.0  # each window's hits squared, the entry's, and their product, summed
    entry_sq: float = 0.0
    cross: float = 0.0
    total_hits: int = 0
    total_entry: int = 0

    @property
    def ratio(self) -> float | None:
        return self.total_entry / self.total_hits if self.total_hits else None


@dataclass(frozen=True)
class ScaleStats:
    """A scale point's SCALE tally summed over a selection: its hits and the entry's in the
    scale windows, the windows, and the sums of squares and products of the windows' counts."""

    hits: int
    entry_hits: int
    windows: int
    hits_sq: float = 0.0
    entry_sq: float = 0.0
    cross: float = 0.0

    @property
    def ratio(self) -> float | None:
        """Entries per run of the point."""
        return self.entry_hits / self.hits if self.hits > 0 else None

    @property
    def ratio_error(self) -> float | None:
        """The ratio's relative standard error, from how far the windows' own ratios spread (the
        ratio estimator's: rare blocks run in bursts, so that a Poisson error from the hits alone
        says far too little); None from fewer than two windows."""
        from cyclescope.analysis.confidence import ratio_error

        return ratio_error(self.windows, self.entry_hits, self.hits, self.entry_sq, self.hits_sq, self.cross)

    @property
    def confidence(self) -> str | None:
        """How far the ratio can be trusted: used (low) from MIN_HITS hits and an error of
        SCALE_ERROR_LOW, medium from MEDIUM_HITS, MEDIUM_WINDOWS and SCALE_ERROR_MEDIUM, high from
        HIGH_HITS, HIGH_WINDOWS and SCALE_ERROR_HIGH; None: not used."""
        err = self.ratio_error
        if err is None or self.hits < MIN_HITS or err > SCALE_ERROR_LOW:
            return None
        if self.hits >= HIGH_HITS and self.windows >= HIGH_WINDOWS and err <= SCALE_ERROR_HIGH:
            return "high"
        if self.hits >= MEDIUM_HITS and self.windows >= MEDIUM_WINDOWS and err <= SCALE_ERROR_MEDIUM:
            return "medium"
        return "low"


# The scale ratio's relative standard errors (ScaleStats.ratio_error) up to which it is used, and in
# medium and high confidence
SCALE_ERROR_LOW = 0.25
SCALE_ERROR_MEDIUM = 0.10
SCALE_ERROR_HIGH = 0.04


# The rows of Target.progress: the trip windows' side of a PROGRESS tally (db/tallies.py)
PROGRESS_ROWS = ("windows", "window_steps", "window_delta", "window_back", "window_delta_sq", "window_steps_sq",
                 "window_cross")


@dataclass
class Target:
    """One procedure's points: its entry first, then loop headers, then hot blocks (vaddrs in the
    image), their file offsets, and what the windows counted since the last take."""

    img: int
    entry: int
    path: str
    points: list[int]
    offsets: list[int]
    pid: int = 0  # the process counted (0: every process mapping the file)
    hits: np.ndarray | None = None
    windows: int = 0
    total_windows: int = 0
    failed: str | None = None
    core: int = 0  # the entry and the loop headers: points[:core] (the rest are sampled blocks)
    # analysis/progress.py: the arguments' widths (None: not followed), and per argument the windows
    # that counted two entries or more, their entries - 1 and moves, and those whose move went back
    argwidth: np.ndarray | None = None
    site_args: np.ndarray | None = None  # int8 per value: the register holding it at the entry's probe
    # The procedure's progress point (analysis/progress.progress_point), counted beside the entry in
    # its windows alone: its file offset, whether its hit is emulated, and per value the register
    # holding it there (its own values only: the arguments come from the entry's registers)
    point_offset: int | None = None
    point_emulated: bool = False
    point_args: np.ndarray | None = None
    # Its windows have a fixed length: EMPTY_RUNS windows of whole runs in a row held none
    # (TripWindows._window); those in a row so far.
    fixed: bool = False
    empty: int = 0
    emulated: list[bool] = field(default_factory=list)  # per point: its probe's hit is emulated (cheap)
    progress: np.ndarray = field(default_factory=lambda: np.zeros((len(PROGRESS_ROWS), 0), np.float64))
    stride_windows: int = 0  # windows of the entry alone (for its arguments' moves), and their entries
    stride_entries: int = 0
    turns: int = 0
    seen: float = 0.0  # the procedure's samples since it got its anchor: its claim on the windows
    spent_s: float = 0.0  # what its windows cost the program (charged to the budget)
    # Scale windows: the entry's rate as its anchor measured it, the candidate blocks' sites not
    # surveyed yet (most sampled first), the points surveyed (by site vaddr), the one chosen
    entry_rate: float | None = None
    entry_hit_s: float = 0.0  # what its anchor charges a hit
    scale_pool: list[int] = field(default_factory=list)
    scale: dict[int, ScalePoint] = field(default_factory=dict)
    scale_at: int | None = None  # the chosen point's key (its first site), and all its sites
    scale_sites: list[int] = field(default_factory=list)
    used_keys: set[int] = field(default_factory=set)
    scale_done: bool = False  # surveyed, nothing rare enough: no more scale windows
    scale_turns: int = 0
    scale_windows: int = 0  # over the run
    point_rate: float | None = None  # the point's hits a second in its last window alone
    candidates: dict[int, tuple[int, bool, int]] = field(default_factory=dict)  # site -> (file offset, emulated, block)
    blocks: np.ndarray | None = None  # the loop table's block starts, and their samples since the anchor
    block_samples: np.ndarray | None = None


def points_of(entry: int, file_offset: int, headers: np.ndarray, depth: np.ndarray,
              blocks: np.ndarray | None = None, block_samples: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """The entry, up to MAX_HEADERS loop headers, outermost loops first (an inner loop's ratio to
    its outer loop is what a loop counter on the outer one needs), then the blocks (their starts,
    ``blocks``) holding at least BLOCK_SHARE of the procedure's samples (``block_samples``), most
    first, up to MAX_POINTS in all; and their file offsets (the procedure lies in one segment:
    offsets move with addresses). Every instruction of a block runs as often as its first, so a
    block's count is its first instruction's."""
    order = np.lexsort((np.asarray(headers, np.uint64), np.asarray(depth)))
    hs = [int(headers[i]) for i in order if int(headers[i]) != entry][:MAX_HEADERS]
    points = [entry, *hs]
    if blocks is not None and block_samples is not None and len(blocks) and block_samples.sum() > 0:
        total = float(block_samples.sum())
        taken = set(points)
        for i in np.argsort(-block_samples, kind="stable").tolist():
            if len(points) >= MAX_POINTS or block_samples[i] < BLOCK_SHARE * total:
                break
            if int(blocks[i]) not in taken:
                points.append(int(blocks[i]))
                taken.add(int(blocks[i]))
    return points, [file_offset + (p - entry) for p in points]


class TripWindows:
    """The collector's processor: procedures with an anchor and loops get trip windows; a TRIPS
    tally comes out at every flush. One thread opens, waits and closes the windows in turn."""

    name = "trips"
    needs_regs = False

    def __init__(self, anchors: Any, loops: Any, budget: float) -> None:
        self.anchors = anchors  # analysis.anchors.AnchorProcessor: which procedures, and where they are
        self.loops = loops  # analysis.loopcount.LoopCountProcessor: their loops
        self.budget = budget * BUDGET_SHARE
        self.targets: dict[tuple[int, int], Target] = {}
        self._block_samples: dict[tuple[int, int], np.ndarray] = {}  # until its target is made
        self.lock = threading.Lock()
        self.counter: Any = None
        self.error: str | None = None
        self.per_task = True
        self.image_key: Any = lambda i: str(i)
        self.hit_cost_s = 6.5e-6
        self.emulated_hit_s = 6.5e-6  # at a probe the kernel emulates (bind measures both)
        self.spent_s = 0.0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rng = random.Random()

    def bind(self, ctx: Any) -> None:
        from cyclescope.analysis.anchors import hit_cost

        self.per_task = ctx.per_task
        self.image_key = lambda i: ctx.table[i].key
        self.hit_cost_s = hit_cost()
        self.emulated_hit_s = hit_cost(emulated=True)
        self.started = time.monotonic()

    # --- choosing ------------------------------------------------------------------------------
    def process(self, d: Any) -> None:
        aset = getattr(self.anchors, "set", None)
        counter = getattr(self.loops, "counter", None)
        if aset is None or counter is None or self.error is not None:
            return
        with aset.lock:
            anchored = [(k, a.path, a.file_offset, a.end, a.rate, a.hit_s(aset.hit_cost_s))
                        for k, a in aset.anchors.items() if a.at is None]
        for key, path, file_offset, end, rate, hit_s in anchored:
            m = (d.image == key[0]) & (d.offset >= key[1]) & (d.offset < end) if len(d.samples) else None
            t = self.targets.get(key)
            if t is None:
                table = counter.table(*key)
                if table is None or table.empty:
                    continue
                # The blocks' samples since the anchor, to choose the blocks worth counting.
                seen = self._block_samples.get(key)
                if seen is None or len(seen) != len(table.blocks):
                    seen = self._block_samples[key] = np.zeros(len(table.blocks), np.float64)
                if m is not None and m.any() and len(table.blocks):
                    k = np.searchsorted(table.blocks, d.offset[m].astype(np.uint64), side="right") - 1
                    seen += np.bincount(k[k >= 0], minlength=len(seen))[: len(seen)]
                if seen.sum() < POINTS_AFTER:
                    continue
                points, _ = points_of(key[1], file_offset, table.headers, table.depth, table.blocks, seen)
                del self._block_samples[key]
                if len(points) < 2:
                    continue
                core = len(points_of(key[1], file_offset, table.headers, table.depth)[0])  # entry, headers
                # Each block is probed where the kernel emulates the hit, if it can (loopcount.block_site)
                site = dict(zip(table.blocks.tolist(), table.sites.tolist(), strict=True))
                cheap = dict(zip(table.blocks.tolist(), table.site_emulated.tolist(), strict=True))
                offsets = [file_offset + (site.get(p, p) - key[1]) for p in points]
                t = Target(key[0], key[1], path, points, offsets, hits=np.zeros(len(points), np.uint64), core=core,
                           emulated=[bool(cheap.get(p, False)) for p in points], seen=float(seen.sum()))
                # Scale candidates: the other blocks' sites, probed only if the entry turns out short
                # (_scale_turn), the least sampled first
                taken = set(points)
                for i, b in enumerate(table.blocks.tolist()):
                    if b not in taken:
                        st = int(table.sites[i])
                        t.candidates[st] = (file_offset + (st - key[1]), bool(table.site_emulated[i]), i)
                        t.scale_pool.append(st)
                t.blocks, t.block_samples = table.blocks, seen
                if len(table.args):  # which registers hold the arguments where the entry is probed
                    k = table.index(site.get(key[1], key[1]))
                    if k is not None:
                        t.argwidth, t.site_args = table.argwidth.copy(), table.args[k].copy()
                        _follow_point(t, table, path, file_offset)
                with self.lock:
                    self.targets[key] = t
            elif m is not None:
                t.seen += float(np.count_nonzero(m))
                if t.scale_pool and t.blocks is not None and t.block_samples is not None and m.any():
                    k = np.searchsorted(t.blocks, d.offset[m].astype(np.uint64), side="right") - 1
                    with self.lock:
                        t.block_samples += np.bincount(k[k >= 0], minlength=len(t.blocks))[: len(t.blocks)]
            t.entry_rate, t.entry_hit_s = rate, hit_s
            if self.per_task and m is not None and m.any():  # the process that sampled it last
                t.pid = int(d.samples["pid"][m][-1])
        if self.targets and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trip-windows", daemon=True)
            self._thread.start()

    # --- windows -------------------------------------------------------------------------------
    def _run(self) -> None:
        from cyclescope.collect.pointcount import PointCounter

        try:
            self.counter = PointCounter()
        except CycleScopeError as e:
            self.error = str(e)
            return
        try:
            while not self._stop.is_set():
                wait = self._step()
                if wait > 0:
                    self._stop.wait(wait)
        finally:
            self.counter.close()

    def _step(self) -> float:
        """One window if the budget has paid for it; else the seconds to wait."""
        with self.lock:
            ready = [t for t in self.targets.values() if t.failed is None and (t.pid or not self.per_task)]
        if not ready:
            return IDLE_S
        elapsed = time.monotonic() - self.started
        owed = self.spent_s - ALLOWANCE - self.budget * elapsed
        if owed > 0:
            return max(MIN_GAP_S, owed / self.budget * self.rng.uniform(1.0 - JITTER, 1.0 + JITTER))
        with self.lock:
            counted = [t for t in self.targets.values() if t.spent_s > 0]
        typical = sum(t.spent_s for t in counted) / max(1, sum(t.total_windows + t.stride_windows + t.scale_windows
                                                             for t in counted))
        self._window(min(ready, key=lambda t: _claim(t, typical or WINDOW_COST_S)))
        return MIN_GAP_S

    def _stride_turn(self, t: Target) -> bool:
        """Is this window of ``t`` one of its entry alone? Every other one while an argument of the
        procedure moves forward (analysis/progress.py) and its windows have counted fewer than
        ENOUGH_STEPS entries, one in STRIDE_LATER after that: with its loop headers and blocks
        trapping too, a window of a short entry holds a few dozen entries (xz's match finder runs 37
        header runs each); alone, a few hundred in STRIDE_WINDOW_S. Per task only: system-wide a
        window counts every process mapping the file, and their registers do not mix."""
        from cyclescope.analysis.progress import ENOUGH_STEPS

        if t.argwidth is None or not self.per_task:
            return False
        counter = getattr(self.loops, "counter", None)
        if counter is None or not counter.moving(t.img, t.entry):
            return False
        t.turns += 1
        return t.turns % (2 if t.stride_entries < ENOUGH_STEPS else STRIDE_LATER) == 1

    def _scale_turn(self, t: Target) -> list[list[int]]:
        """The scale points this window of ``t`` counts beside its entry, as groups of sites each
        counted as one (none: not a scale window): while surveying, each candidate of a batch on
        its own; then the chosen sites as one. Once the procedure's own windows have counted its
        points SCALE_AFTER times, every other window of a procedure whose entry is short, until the
        point has SCALE_ENOUGH hits in them, then one in SCALE_LATER; none for a procedure with an
        argument that moves forward (analysis/progress.py gives its entry count, and its windows of
        the entry alone need the turns). Runs of a few seconds hold a few windows a procedure, and
        there the other windows' ratios, even scaled by a short entry's low count, are far closer
        than the model's counts, and need the turns: with surveys in every window of a short
        entry's procedure, xz's match finder's loop kept the model's count, 33.6 times exact, and
        the suite's share of samples within 15% was 25.3% (docs/benchmarks.md, "Scale points")."""
        if t.scale_done or not t.entry_rate or 1.0 / t.entry_rate - t.entry_hit_s >= SCALE_ENTRY_S:
            return []
        if t.total_windows < SCALE_AFTER or self._moving(t):
            return []
        if t.scale_at is None and not t.scale_pool:
            return []
        t.scale_turns += 1
        chosen = t.scale.get(t.scale_at) if t.scale_at is not None else None
        every = SCALE_LATER if chosen is not None and chosen.total_hits >= SCALE_ENOUGH else 2
        if t.scale_turns % every != 1 % every:
            return []
        if t.scale_at is not None:
            return [t.scale_sites]
        # The least sampled first: most blocks run as often as the entry or more, and a window
        # with them in traps at their pace (lzip's match finder: 47-106 entries in 2 ms, against
        # 1,400 for its entry alone); a block never sampled is rare or never runs, and costs
        # little either way.
        if t.block_samples is not None:
            bs = t.block_samples
            t.scale_pool.sort(key=lambda st: (float(bs[t.candidates[st][2]]), st))
        batch = t.scale_pool[:SCALE_BATCH]
        for st in batch:
            t.scale.setdefault(st, ScalePoint())
        return [[st] for st in batch]

    def _moving(self, t: Target) -> bool:
        """Does an argument of ``t``'s procedure move forward (its windows of the entry alone)?"""
        counter = getattr(self.loops, "counter", None)
        return t.argwidth is not None and counter is not None and bool(counter.moving(t.img, t.entry))

    def _choose_scale(self, t: Target, batch: list[int], refused: bool) -> None:
        """After a survey window of ``batch``: candidates run more often than one entry in
        SCALE_MIN_RATIO (the window's entries were few) and those too rare or never run (no
        SCALE_CHOOSE_HITS hits, and SCALE_MAX_RATIO entries for each hit and one more) leave the
        pool, and the others are surveyed again in the next. The point is a set of the rare ones,
        counted as one (a rare block's runs come in bursts: lzip's match finder's rarest blocks
        ran 80-650 entries apart in windows a few milliseconds apart; the sum of several
        burst less): the most often run first, while the set runs at most once in
        SCALE_MIN_RATIO entries, up to SCALE_SITES of them. It is kept once it runs once in
        SCALE_AIM_RATIO entries or more often, or once the pool is empty; none: scale windows end."""
        if t.scale_at is not None:
            return
        for st in batch:
            p = t.scale[st]
            frequent = p.total_hits >= SCALE_CHOOSE_HITS and (p.ratio or 0.0) < SCALE_MIN_RATIO
            rare = p.total_hits < SCALE_CHOOSE_HITS and p.total_entry >= SCALE_MAX_RATIO * (p.total_hits + 1)
            if refused or frequent or rare:  # (refused: an instruction uprobes refuse is in the batch)
                t.scale.pop(st)
            if refused or frequent or rare or p.total_hits >= SCALE_CHOOSE_HITS:
                t.scale_pool.remove(st)
        fit = sorted(((p.total_hits, st) for st, p in t.scale.items()
                      if p.total_hits >= SCALE_CHOOSE_HITS and p.ratio is not None
                      and SCALE_MIN_RATIO <= p.ratio <= SCALE_MAX_RATIO), reverse=True)
        sites: list[int] = []
        rate = 0.0  # runs of the set per entry
        for _, st in fit:
            r = t.scale[st].ratio
            if r is not None and len(sites) < SCALE_SITES and (rate + 1.0 / r) * SCALE_MIN_RATIO <= 1.0:
                sites.append(st)
                rate += 1.0 / r
        if sites and (rate * SCALE_AIM_RATIO >= 1.0 or not t.scale_pool):
            key = sites[0]
            first = t.scale[key]
            # The set's hits so far: its sites were surveyed in different windows, so only the key
            # site's own go on (its entries are the same windows').
            t.scale_at, t.scale_sites = key, sites
            t.used_keys.add(key)
            t.scale = {key: first}
            aset = getattr(self.anchors, "set", None)
            if aset is not None:
                aset.place_point(t.img, t.entry, key, t.candidates[key][0])
            if len(sites) > 1:  # a set: its tallies start with the windows that count it whole
                first.hits = first.entry_hits = first.windows = 0
                first.total_hits = first.total_entry = 0
                first.hits_sq = first.entry_sq = first.cross = 0.0
        elif not t.scale_pool:
            t.scale_done = True
            t.scale.clear()

    def _window(self, t: Target) -> None:
        from cyclescope.collect.pointcount import GATE

        alone = self._stride_turn(t)
        with self.lock:
            groups = [] if alone else self._scale_turn(t)
            sites = [st for g in groups for st in g]
            scaled = [g[0] for g in groups]  # each group's key
        n = 1 if alone else 1 + len(sites) if groups else len(t.points)
        offsets = [t.offsets[0], *(t.candidates[st][0] for st in sites)] if groups else t.offsets[:n]
        emulated = [t.emulated[0], *(t.candidates[st][1] for st in sites)] if groups else t.emulated
        if alone and t.point_offset is not None:  # the progress point's registers beside the entry's
            n, offsets, emulated = 2, [t.offsets[0], t.point_offset], [t.emulated[0], t.point_emulated]
        # Gated while the link's probes are installed one by one (the first would count alone),
        # and again before the close removes them one by one (the module's docstring).
        quiet = alone and self._quiet_before()
        # Whole runs of the procedure (from an entry to an entry): the ratios' end effects go
        # (pointcount.program). A procedure whose windows held no run (entered once a run: a
        # program's loop nest) has its loop headers' ratios counted in windows of fixed length.
        whole = alone or not t.fixed
        self.counter.zero(n, GATE, whole)
        probed_ns = time.monotonic_ns()  # the samples' clock (CLOCK_MONOTONIC): from here to the
        # detach's end the probes may trap (loopcount.LoopCounter._local_rates leaves that time out)
        try:
            link = self.counter.attach(t.path, offsets, t.pid if self.per_task else 0)
        except CycleScopeError as e:
            self._release_hold(alone)
            if alone and n == 2:  # its progress point refused (the kernel does not say which): the entry alone
                with self.lock:
                    t.point_offset = t.point_args = None
                return
            if scaled:
                with self.lock:
                    if t.scale_at is not None:  # refused now (a file replaced?): the entry counts again
                        aset = getattr(self.anchors, "set", None)
                        if aset is not None:
                            aset.fail_point(t.img, t.scale_at, str(e))
                        t.scale_done, t.scale_at = True, None
                        t.scale.clear()
                    else:
                        self._choose_scale(t, scaled, refused=True)
                return
            if t.total_windows == 0 and 1 < t.core < len(t.points) and not alone:
                # An instruction uprobes refuse (the kernel does not say which): the sampled blocks'
                # first instructions go, the entry and the loop headers are tried at the next window.
                with self.lock:
                    t.points, t.offsets = t.points[: t.core], t.offsets[: t.core]
                    t.hits = np.zeros(t.core, np.uint64)
                return
            t.failed = str(e)
            return
        except OSError as e:
            self._release_hold(alone)
            if e.errno == errno.ESRCH:  # the process is gone: wait for the next one
                t.pid = 0
            else:
                t.failed = f"uprobe_multi on {t.path}: {e.strerror}"
            return
        try:
            passed = GATE - self.counter.skip_left()  # hits while the probes were being installed
            self.counter.set_skip(0)
            self._stop.wait(STRIDE_WINDOW_S if alone else WINDOW_S)
            ended = whole and self._end_at_entry(TAIL_S if alone else FULL_TAIL_S)
            if not ended:
                self.counter.set_skip(GATE)
        finally:
            self.counter.detach(link)
        unprobed_ns = time.monotonic_ns()
        aset = getattr(self.anchors, "set", None)
        if alone and aset is not None:  # the samples after it, untrapped too
            aset.hold(unprobed_ns + LOCAL_AFTER_NS)
        passed += GATE - self.counter.skip_left()  # and while they were being removed
        got = self.counter.counts(n)
        # A window that ended at an entry holds its entries but one as whole runs of the procedure,
        # against which its other points' counts are ratios (pointcount.program).
        runs = got.copy()
        if ended and runs[0] > 0:
            runs[0] -= 1
        moves = None
        paired = False
        # Only a window of the entry alone measures a move per entry: it waits for its last entry
        # up to TAIL_S (_end_at_entry); a window of all the points up to FULL_TAIL_S only: made
        # longer the same way it kept every point trapping for up to TAIL_S where the entry is rare,
        # at a cost the budget's charge per window does not cover (bench/overhead.py: the default
        # at 1.25 times plain sampling's extra CPU, 1.22 times the same without trip windows).
        if alone and t.argwidth is not None and t.site_args is not None and got[0] >= 2:
            try:
                moves = _moves(t.argwidth, t.site_args, *self.counter.first_regs())  # one process's entries
                if n == 2 and t.point_args is not None and got[1] >= 2:
                    # The point's values moved this far over its hits but one; per entry, as the
                    # arguments' moves are (the point may not run at every entry).
                    own = _moves(t.argwidth, t.point_args, *self.counter.first_regs(1))
                    own *= (float(got[0]) - 1) / float(runs[0]) * float(got[1]) / (float(got[1]) - 1)
                    moves = np.where(np.isnan(moves), own, moves)
            except OSError:  # the registers' map unreadable: this window's counts still stand
                moves = None
        with self.lock:
            assert t.hits is not None
            if moves is not None:
                if t.progress.shape[1] != len(moves):
                    t.progress = np.zeros((len(PROGRESS_ROWS), len(moves)), np.float64)
                loops = getattr(self.loops, "counter", None)
                if loops is not None and quiet:  # its entries per second, from the move rate sampled around it
                    loops.stride_window(t.img, t.entry, probed_ns, unprobed_ns, int(got[0]) - 1, moves)
                held = ~np.isnan(moves)
                fwd = held & (moves >= 0)
                steps = np.where(fwd, float(got[0] - 1), 0.0)
                moved = np.where(fwd, moves, 0.0)
                t.progress[0] += held
                t.progress[1] += steps
                t.progress[2] += moved
                t.progress[3] += held & ~fwd
                t.progress[4] += moved * moved  # how far the windows agree (ProgressStats.stride_error)
                t.progress[5] += steps * steps
                t.progress[6] += moved * steps
            if alone:
                t.stride_windows += 1
                t.stride_entries += int(got[0])
            elif scaled:  # each point against the entry in the same window
                paired = t.scale_at is not None  # the chosen point: its own window follows
                firsts = np.cumsum([0] + [len(g) for g in groups[:-1]])
                for st, h in zip(scaled, np.add.reduceat(got[1:], firsts).tolist() if len(sites) else [],
                                 strict=True):
                    p = t.scale[st]
                    p.hits += int(h)
                    p.total_hits += int(h)
                    p.entry_hits += int(runs[0])
                    p.total_entry += int(runs[0])
                    p.windows += 1
                    p.hits_sq += float(h) * float(h)
                    p.entry_sq += float(runs[0]) * float(runs[0])
                    p.cross += float(h) * float(runs[0])
                t.scale_windows += 1
                self._choose_scale(t, scaled, refused=False)
            elif whole and runs[0] < 1:  # no whole run (not counted): after EMPTY_RUNS, windows of fixed length
                t.empty += 1
                t.fixed = t.empty >= EMPTY_RUNS
            else:  # the ratios: only windows that counted every point together
                t.empty = 0
                t.hits += runs
                t.windows += 1
                t.total_windows += 1
            cost = self._cost(emulated, got, passed)
            t.spent_s += cost
            self.spent_s += cost
        if scaled and paired:
            self._point_window(t)

    def _point_window(self, t: Target) -> None:
        """The scale point alone for POINT_WINDOW_S, right after a window of it and the entry (the
        same phase of the run: a rare block's rate moves with the data far more than the entry's
        does, and windows apart saw lzip's match finder at 1.85 times its exact count), registered
        with the anchors (AnchorSet.open_point, close_point), which count the procedure's samples
        in it against its hits: its count, undisturbed by the entry's traps."""
        from cyclescope.collect.pointcount import GATE

        aset = getattr(self.anchors, "set", None)
        st = t.scale_at
        if aset is None or st is None:
            return
        sites = t.scale_sites or [st]
        self.counter.zero(len(sites), GATE)
        try:
            link = self.counter.attach(t.path, [t.candidates[x][0] for x in sites], t.pid if self.per_task else 0)
        except (CycleScopeError, OSError):
            return
        opened = False
        hit_s = self._dearest_hit_s(t, sites)
        length = POINT_WINDOW_S if not t.point_rate else max(
            MIN_POINT_WINDOW_S, min(POINT_WINDOW_S, POINT_TRAPS_S / (t.point_rate * hit_s)))
        took = 0.0
        pid = t.pid if self.per_task else 0
        try:
            passed = GATE - self.counter.skip_left()
            self.counter.set_skip(0)
            opened = aset.open_point(t.img, st, pid)
            began, cpu = time.monotonic(), _cpu_ns(pid)
            self._stop.wait(length)
            self.counter.set_skip(GATE)
            took, after = time.monotonic() - began, _cpu_ns(pid)
            if cpu is not None and after is not None and after > cpu:  # the process's own time, traps included
                took = (after - cpu) / 1e9
        finally:
            got = self.counter.counts(len(sites))
            hits = int(got.sum())
            if opened:  # (cut short as the run ends, it counted what it counted)
                aset.close_point(t.img, st, hits)
            self.counter.detach(link)
        passed += GATE - self.counter.skip_left()
        cost = self._cost([t.candidates[x][1] for x in sites], got, passed)
        with self.lock:
            t.spent_s += cost
            self.spent_s += cost
            if took > 0:
                t.point_rate = hits / took
                self._thin(t, sites, got, took)

    def _thin(self, t: Target, sites: list[int], got: np.ndarray, took: float) -> None:
        """After a window of the point alone: where a run of the point left the program under
        SCALE_ENTRY_S of its own time (the window's time per hit less the trap; per task the
        process's CPU time, which a busy machine's other tasks do not inflate), its own traps
        disturb it as an entry's do, and the count would come out low (scale.c's two rare blocks
        together: 0.77 of exact); the site run most leaves the set, which becomes a new point, under
        a key not used before (each key's tallies are one set's)."""
        hits = int(got.sum())
        hit_s = self._dearest_hit_s(t, sites)
        if hits <= 0 or took / hits - hit_s >= SCALE_ENTRY_S or len(sites) < 2:
            return
        rest = [x for x, _ in sorted(zip(sites, got.tolist(), strict=True), key=lambda p: p[1])[:-1]]
        key = next((x for x in rest if x not in t.used_keys), None)
        if key is None:
            return
        t.scale_at, t.scale_sites = key, [key, *(x for x in rest if x != key)]  # the key first: it keys the group
        t.used_keys.add(key)
        t.scale[key] = ScalePoint()  # the last set's rows stay until taken
        t.point_rate = None
        aset = getattr(self.anchors, "set", None)
        if aset is not None:
            aset.place_point(t.img, t.entry, key, t.candidates[key][0])

    def _dearest_hit_s(self, t: Target, sites: list[int]) -> float:
        """What a hit costs at the dearest of ``sites`` (emulated or single-stepped)."""
        return max(self.emulated_hit_s if t.candidates[x][1] else self.hit_cost_s for x in sites)

    def _quiet_before(self) -> bool:
        """Before a window of an entry alone: hold the anchors' windows off until it is over, and
        wait (up to QUIET_WAIT_S) until none has trapped for LOCAL_AFTER_NS, so that the samples
        on both sides of it run untrapped (the local rates, loopcount.LoopCounter._local_rates: an
        anchor's window on the same procedure opened 5 ms after a window of lzip's
        match finder had ended, its traps slowing the samples the window's rate was taken from).
        False where the wait ran out: the window's moves still count, its local rate does not."""
        aset = getattr(self.anchors, "set", None)
        if aset is None:
            return True
        aset.hold(time.monotonic_ns() + HOLD_NS)
        deadline = time.monotonic() + QUIET_WAIT_S
        while aset.quiet_ns() < LOCAL_AFTER_NS:
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            time.sleep(QUIET_STEP_S)
        return True

    def _release_hold(self, alone: bool) -> None:
        """A window of the entry alone that did not open: the anchors' windows may open again."""
        aset = getattr(self.anchors, "set", None)
        if alone and aset is not None:
            aset.hold(0)

    def _end_at_entry(self, tail_s: float) -> bool:
        """Count on until the entry runs once more after the window's time (the counting program
        then shuts the gate itself: PointCounter.end_at_entry), or ``tail_s`` has passed; True if
        it ended at an entry.

        An argument's move per entry is measured from the registers of the window's first and last
        counted entries, so it covers the intervals between entries that began and ended inside the
        window. A window of fixed length mostly leaves out the intervals longer than itself, and
        those are where the argument moves most (xz's match finder is not entered while long
        matches are skipped: its windows measured 5.2-6.5 positions per entry against 7.35 over the
        run). Ending the window at an entry instead keeps every interval that began in it, which is
        a share of the intervals that does not depend on their lengths. An interval longer than
        the tail is still left out (the window ends without it, as a window of fixed length did).
        The same end makes a window of all the points hold whole runs of the procedure, its
        entries but one (the counting program counts the other points from the first entry on):
        the ratios' denominator (_window)."""
        if int(self.counter.counts(1)[0]) == 0:
            return False
        self.counter.end_at_entry()
        start = time.monotonic()
        while self.counter.skip_left() <= 0:
            waited = time.monotonic() - start
            if waited >= tail_s or self._stop.is_set():
                return False
            if waited > TAIL_SPIN_S:  # a long interval: no need to look every few microseconds
                time.sleep(TAIL_STEP_S)
        return True

    def _cost(self, emulated: list[bool], got: np.ndarray, passed: int) -> float:
        """What a window of the first ``len(got)`` points cost the program: each point's hits at its
        probe's cost (``emulated`` or not), the hits that passed the gate at the dearest of them, and
        the window's own (WINDOW_COST_S, less where every probe is emulated)."""
        cheap = np.array((list(emulated) + [False] * len(got))[: len(got)], bool)
        per = np.where(cheap, self.emulated_hit_s, self.hit_cost_s)
        own = EMULATED_WINDOW_COST_S if cheap.all() else WINDOW_COST_S
        return float(np.dot(got.astype(np.float64), per)) + passed * float(per.max(initial=0.0)) + own

    # --- the collector's side -----------------------------------------------------------------
    def take(self) -> Any:
        """The tallies since the last take, as a TRIPS table (db/tallies.py)."""
        from cyclescope.db.tallies import TRIPS, build

        image: list[str] = []
        entry: list[int] = []
        point: list[int] = []
        hits: list[int] = []
        windows: list[int] = []
        entry_hits: list[int] = []
        with self.lock:
            for t in self.targets.values():
                if not t.windows or t.hits is None:
                    continue
                for p, h in zip(t.points, t.hits.tolist(), strict=True):
                    image.append(self.image_key(t.img))
                    entry.append(t.entry)
                    point.append(p)
                    hits.append(int(h))
                    windows.append(t.windows)
                    entry_hits.append(int(t.hits[0]))
                t.hits[:] = 0
                t.windows = 0
        return build(TRIPS, {"image": image, "entry": np.array(entry, np.uint64),
                             "entry_hits": np.array(entry_hits, np.uint64),
                             "point": np.array(point, np.uint64), "hits": np.array(hits, np.uint64),
                             "windows": np.array(windows, np.uint64)})

    def take_scale(self) -> Any:
        """The scale windows' tallies since the last take, as a SCALE table (db/tallies.py)."""
        from cyclescope.db.tallies import SCALE, build

        rows: list[tuple[str, int, int, int, int, int, float, float, float]] = []
        with self.lock:
            for t in self.targets.values():
                if t.scale_at is None:  # a survey's counts say which point to keep, not how often
                    continue
                for st, p in list(t.scale.items()):
                    if p.windows:
                        rows.append((self.image_key(t.img), t.entry, st, p.hits, p.entry_hits, p.windows, p.hits_sq,
                                     p.entry_sq, p.cross))
                    p.hits = p.entry_hits = p.windows = 0
                    p.hits_sq = p.entry_sq = p.cross = 0.0
                    if st != t.scale_at:  # an earlier set's, thinned since: taken
                        del t.scale[st]
        cols = list(zip(*rows, strict=True)) if rows else [()] * 9
        return build(SCALE, {"image": list(cols[0]), "entry": np.array(cols[1], np.uint64),
                             "point": np.array(cols[2], np.uint64), "hits": np.array(cols[3], np.uint64),
                             "entry_hits": np.array(cols[4], np.uint64), "windows": np.array(cols[5], np.uint64),
                             "hits_sq": np.array(cols[6], np.float64), "entry_sq": np.array(cols[7], np.float64),
                             "cross": np.array(cols[8], np.float64)})

    def take_progress(self) -> Any:
        """The windows' side of the arguments' moves since the last take, as a PROGRESS table."""
        from cyclescope.analysis.progress import NARGS, tally

        rows = []
        with self.lock:
            for t in self.targets.values():
                if t.progress[0].any():
                    # every argument, and the point's values its windows held
                    rows += [(self.image_key(t.img), t.entry, a, t.progress[:, a].copy())
                             for a in range(t.progress.shape[1]) if a < NARGS or t.progress[0, a]]
                    t.progress[:] = 0
        return tally([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                     {n: [float(r[3][k]) for r in rows] for k, n in enumerate(PROGRESS_ROWS)})

    def forget(self, pid: int, tid: int) -> None:
        if pid == tid:  # a process exited or exec'd: its targets wait for the next sample
            with self.lock:
                for t in self.targets.values():
                    if t.pid == pid:
                        t.pid = 0

    def finish(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def flush(self, db: Any, epoch: int, host: str) -> list[Any]:
        from cyclescope.db.tallies import PROGRESS, SCALE, TRIPS, write_tally

        t = self.take()
        out = [write_tally(db, epoch, host, TRIPS, t)] if t.num_rows else []
        sc = self.take_scale()
        out += [write_tally(db, epoch, host, SCALE, sc)] if sc.num_rows else []
        pg = self.take_progress()
        return out + ([write_tally(db, epoch, host, PROGRESS, pg)] if pg.num_rows else [])

    def close(self) -> None:
        self.finish()

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"procedures": len(self.targets), "windows": sum(t.total_windows for t in self.targets.values()),
                    "scale_windows": sum(t.scale_windows for t in self.targets.values()),
                    "trap_s": round(self.spent_s, 3)}

    def summary(self) -> str | None:
        with self.lock:
            counted = [t for t in self.targets.values() if t.total_windows]
            strided = [t for t in self.targets.values() if t.stride_windows]
            scaled = [t for t in self.targets.values() if t.scale_windows]
            nscale = sum(t.scale_windows for t in scaled)
            chosen = sum(t.scale_at is not None for t in scaled)
            failed = [t.failed for t in self.targets.values() if t.failed]
            nwin = sum(t.total_windows for t in counted)
            nstride = sum(t.stride_windows for t in strided)
        if not counted and not strided and not scaled and not failed and self.error is None:
            return None
        if self.error is not None:
            return f"trip windows: off ({self.error})"
        one = len(counted) == 1
        parts = []
        if counted:
            parts.append(f"the loops and hot blocks of {len(counted)} procedure{'' if one else 's'} counted beside "
                         f"{'its entry' if one else 'their entries'} in {nwin} window{'' if nwin == 1 else 's'}")
        if strided:
            parts.append(f"the entr{'y' if len(strided) == 1 else 'ies'} of {len(strided)} with moving arguments "
                         f"alone in {nstride}{' more' if counted else ''} window{'' if nstride == 1 else 's'}")
        if scaled:
            parts.append(f"the short entr{'y' if len(scaled) == 1 else 'ies'} of {len(scaled)} beside rare blocks "
                         f"in {nscale}{' more' if counted or strided else ''} window{'' if nscale == 1 else 's'} "
                         f"({chosen} with a scale point)")
        line = f"trip windows: {', '.join(parts) or 'nothing counted'} ({self.spent_s:.2f} s of the programs' time " \
               "charged to them)"
        if failed:
            line += f"; {len(failed)} could not be probed ({failed[0]})"
        return line


def _cpu_ns(pid: int) -> int | None:
    """The CPU time of process ``pid``'s threads so far (ns, from /proc's schedstat), or None
    (``pid`` 0: system-wide, or the process gone)."""
    if pid <= 0:
        return None
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total


def _claim(t: Target, typical_s: float) -> float:
    """Which procedure the next window counts: the one whose windows cost least per sample it took,
    so that the budget goes to procedures as their samples do (calc's errors are weighed by samples:
    xz's match finder holds three quarters of its samples, and counted in turn with five other
    procedures it got two to four windows in three runs of 4 s; six to nine now). A new procedure,
    nothing spent yet, is charged a window's ``typical_s`` ahead: where a run affords a few windows,
    a procedure with a tenth of the samples took one of the three that the hot one needed (lzip's
    match finder: its entry alone once, then two new procedures, and no window of its loops)."""
    return (t.spent_s or typical_s) / max(t.seen, 1.0)


def _follow_point(t: Target, table: Any, path: str, file_offset: int) -> None:
    """``t``'s progress point from its loop table (loopcount.LoopTable.point), where it has one."""
    from cyclescope.analysis.progress import NARGS
    from cyclescope.images.disasm import uprobe_emulated_at

    if not table.point:
        return
    k = table.index(table.point)
    if k is None:
        return
    t.point_args = table.args[k].copy()
    t.point_args[:NARGS] = -1
    t.point_offset = file_offset + (table.point - t.entry)
    t.point_emulated = uprobe_emulated_at(path, t.point_offset)


def _moves(width: np.ndarray, holders: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Each argument's move between a window's first and last counted entries, from the general
    registers there (``holders``: analysis/progress.entry_args' code per argument at the probe);
    NaN where no register holds it (a stack word's holding is the samples', not the probe's)."""
    from cyclescope.analysis.progress import W32, signed_moves

    out = np.full(len(width), np.nan)
    for a, (w, c) in enumerate(zip(width.tolist(), holders.tolist(), strict=True)):
        if c < 0 or c % W32 >= len(first):
            continue
        r = c % W32
        with np.errstate(over="ignore"):
            d = last[r : r + 1] - first[r : r + 1]
        out[a] = signed_moves(d, 32 if c >= W32 else int(w))[0]
    return out
