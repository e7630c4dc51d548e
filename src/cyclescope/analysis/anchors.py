"""Anchors: exact counts of hot procedures' entries, the scale calc needs without a cycle model.

calc's frequencies within a procedure rest on loop counters, trip counts and the model; the
number of times the procedure itself is entered sets the scale of everything straight-line in it,
and the model gets that wrong wherever stalls hide its cycles. The kernel counts executions of one
instruction exactly: a uprobe perf event in counting mode (collect/kernel.open_uprobe_counter).
Each hit traps (HIT_COST_S) and a probe traps from its open until its close
begins, enabled or not, and closes serialize in the kernel at about 80 ms each, from parallel
threads too (CLOSE_S; measured on kernel 6.18 with a loop calling the probed function: 0.15 M
calls/s from the open, disabled or not; per task, full speed again as the probe's close began;
per CPU, as the last of the function's probes began to close). So a window of n fds traps for
about (n - 1) CLOSE_S after it ends, and the closer reads each fd's count just before closing it,
so that those traps are paid for too. An anchor is counted in windows: continuously where its hits
are rare, and where they are not, in short windows (window_length: about one every
WINDOWS_EVERY_S) opened at random steps so that its traps stay within its part of the budget
(``--anchor-budget``, a share of one CPU the profiled programs may lose; allocate: the cheap
anchors what they cost, the rest by the procedures' samples): a token bucket grants each anchor
its share of the time, a window opens once it is paid for, and the time a window registered and
did not count comes back. An anchor's first window measures its rate and lasts FIRST_WINDOW_S.
Over all anchors, a hard cap: no window opens, and an open one ends, while the traps counted
exceed the budget of the time since the first tick (where a rate swings, as system-wide when
processes come and go, shares alone overran it). The scheduler runs when something needs it, not
on a clock: at a short window's end, every CHECK_S while windows count at their expected rates,
every TICK_S while a rate is new or rising, and otherwise when the next anchor will have paid for
its window.

What a window's count means: the entries during the window, against the procedure's own samples
(of the time event) taken during the same window by the same tasks. Their ratio, entries per
sample of the procedure's own time, times the procedure's samples in the whole profile, is its
entry count; this holds whatever share of the time the windows covered and across phases, since a
window's samples weigh it exactly as the profile does. The traps' own time is in the kernel, but
not all of their effect: the timer interrupts held back while the kernel handles a trap land on
the instruction it returns to, so the windows' samples in the entry's first NEAR_BYTES are
tallied apart and left out (AnchorStats.entries), and the caches and predictors the trap disturbed
slow what follows (short entries are counted low: calc's MIN_ANCHOR_ENTRY_CYCLES). The tallies
(db/tallies.py ANCHORS) are sums, mergeable by addition: hits, samples in windows, those near the
entry, counted time.

Scale points: where an entry is too short for its own windows to count it undisturbed, a few of
the procedure's rare blocks, counted as one, take its place (analysis/trips.py, "Scale windows"):
their anchor opens no windows of its own here (``external``); the trip windows' thread counts them
and registers each window (open_point, close_point), and the samples count against it as against
an entry's. Its tallies are keyed by the point's address; the entry's anchor counts on.

Tasks: with ``record``'s per-task sampling, each window counts the threads that ran the procedure
lately (at most MAX_TASKS), and only their samples count against it; system-wide (the daemon),
every task on every CPU.
"""

from __future__ import annotations

import contextlib
import errno
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cyclescope.analysis.loopcount import procedure_index
from cyclescope.arrays import counts, distinct
from cyclescope.errors import CycleScopeError

# A uprobe hit's cost to the probed task: 5.81 us [5.54, 6.10] of trap (bench/probecost.py, counting
# mode; ../shared/MACHINE-NOTES.md had 9.3 us on an older kernel), and about 0.5 us of the task's own
# time disturbed after it (200,000 hits of a 3 us function: +0.09 s of user time).
HIT_COST_S = 6.5e-6
AFTER_TRAP_S = HIT_COST_S - 5.81e-6  # the task's time disturbed after a trap, beyond the trap itself
CLOSE_S = 0.085  # a probe's close (measured 70-100 ms); closes serialize, and the fds still open trap
DEFAULT_BUDGET = 0.01  # a share of one CPU the probed programs may lose to anchors' traps
ANCHOR_AFTER = 64  # samples of a procedure before it gets an anchor
MAX_ANCHORS = 16
TICK_S = 0.01  # the shortest scheduling step but one
# An anchor's first window, which measures its rate, lasts this long: it is paid for before the rate
# is known, and at 500,000 entries a second 10 ms of it cost 33 ms of traps, so that the first
# windows of a program's 16 anchors spent the budget of the next 20 s.
FIRST_WINDOW_S = 0.002
CHECK_S = 0.05  # the step while every counting window keeps to its anchor's rate
IDLE_S = 1.0  # the longest step (new anchors wake the scheduler: AnchorSet.kick)
WINDOW_S = 0.2  # the longest window of an anchor that cannot be counted all the time
MIN_WINDOW_S = TICK_S  # the shortest
WINDOWS_EVERY_S = 2.0  # a costly anchor's windows are made short enough to open about this often
WINDOW_SLACK_S = 0.002  # how late a window ends after its length (the ticker sleeps until then)
MAX_CREDIT_S = 4 * WINDOW_S + 1.0  # the most window time an anchor's bucket holds
CLOSER_IDLE_S = 1.0  # the closer's longest sleep (it is woken when there is work)
KEEP_NS = 30_000_000_000  # windows kept for samples that arrive late
RECENT_NS = 5_000_000_000  # a thread that sampled the procedure this recently is counted
MAX_TASKS = 4  # threads per window in per-task mode
ALLOWANCE = 0.05  # trap seconds the budget grants ahead of time (first windows, which measure the rates)
QUIET_SHARE = 0.001  # of the time in an anchor's traps from which its windows are not quiet (AnchorSet.quiet_ns)
NEAR_BYTES = 12  # the entry's first bytes, where a trap returns (tallied apart: see AnchorStats.entries)


@dataclass
class Window:
    start: int  # CLOCK_MONOTONIC ns, counting on
    end: int | None = None  # None: still counting
    tids: frozenset[int] | None = None  # None: every task
    probe: bool = False  # measures the rate only (system-wide, on one CPU): counts nothing
    length: float = WINDOW_S  # seconds it lasts where its anchor cannot count all the time
    hits: int = 0  # counted so far
    tallied_hits: int = 0  # of those, already in the anchor's tallies (take() reaches into open windows)
    tallied_ns: int | None = None  # counting time tallied up to here (None: from the start)
    read_at: int | None = None  # when its counters were last read
    samples: int = 0  # a scale point's open window: the samples and near ones it took so far
    near: int = 0
    pid: int = 0  # a scale point's window per task: the process it counted (0: every process)


@dataclass
class Anchor:
    """The entry of one procedure, or one of its scale points: where it is in the file, its
    windows and its tallies."""

    img: int
    start: int  # the procedure's vaddr (its entry) and end
    end: int
    path: str
    file_offset: int  # of the probed instruction
    at: int | None = None  # a scale point's vaddr, probed instead of the entry (None: the entry)
    # A scale point, whose windows the trip windows' thread counts (open_point, close_point)
    external: bool = False
    fds: dict[int, int] = field(default_factory=dict)  # fd -> its count at the last read
    window: Window | None = None
    windows: deque[Window] = field(default_factory=deque)
    rate: float | None = None  # hits per second while counting (None: not measured yet)
    tids: dict[int, int] = field(default_factory=dict)  # tid -> time of its last sample here
    failed: str | None = None
    credit: float = 0.0  # seconds of registered probes the budget has granted and not yet spent
    last_tick: int | None = None
    seen: int = 0  # the procedure's samples so far, in windows or not (its weight in allocate)
    # tallies since the last take
    hits: int = 0
    samples: int = 0
    near: int = 0  # of those, at the first bytes after the entry (NEAR_BYTES), where traps return
    counted_ns: int = 0
    nwindows: int = 0
    cost_s: float = 0.0  # estimated trap time spent so far (status)
    total_windows: int = 0  # windows over the run (status)
    # A hit's cost where the entry's first instruction is one the kernel emulates (a push: 0.5 us
    # against 14-17 us single-stepped on the Xeons; images/disasm.uprobe_emulated); None: the set's
    emulated_hit_s: float | None = None

    def hit_s(self, hit_cost_s: float) -> float:
        return self.emulated_hit_s or hit_cost_s

    @property
    def probed(self) -> int:
        """The vaddr of the probed instruction (the key of its tallies)."""
        return self.start if self.at is None else self.at

    def share(self, budget: float, hit_cost_s: float = HIT_COST_S) -> float:
        """The share of the time this anchor may count for its traps to cost ``budget`` of a CPU."""
        if self.rate is None or self.rate <= 0:
            return 1.0
        return min(1.0, budget / (self.rate * self.hit_s(hit_cost_s)))


def hit_cost(emulated: bool = False) -> float:
    """A hit's cost on this machine, as the anchors' budget charges it (collect/clock.charged_hit_s),
    at an instruction the kernel single-steps or (``emulated``) one it emulates."""
    from cyclescope.collect.clock import charged_hit_s

    return charged_hit_s(HIT_COST_S, AFTER_TRAP_S, emulated)


def allocate(budget: float, anchors: list[Anchor], hit_cost_s: float = HIT_COST_S) -> dict[int, float]:
    """Each anchor's part of ``budget`` (by id()): the cheap ones what counting them all the time
    costs (with a quarter in hand, so that a rate that rises a little keeps its anchor counting all
    the time), the rest split among the others in proportion to their procedures' samples
    (weighted water-filling): a rare entry's unused part goes to the frequent ones instead of lying
    idle, and the procedures that hold most of the profile, whose counts matter most, get the most
    window time (xz's hc_find_func holds 75% of its samples and is entered 500,000 times a second,
    as are three more of its anchored procedures). An anchor whose rate is not measured yet needs its
    proportional part."""
    out: dict[int, float] = {}

    def weight(a: Anchor) -> float:
        return float(a.seen) + 1.0

    def need(a: Anchor) -> float:
        return 1.25 * a.rate * a.hit_s(hit_cost_s) if a.rate is not None and a.rate > 0 else float("inf")

    left, todo = budget, sorted(anchors, key=lambda a: need(a) / weight(a))
    total = sum(weight(a) for a in todo)
    for a in todo:
        fair = left * weight(a) / total if total > 0 else 0.0
        out[id(a)] = part = min(need(a), fair)
        left -= part
        total -= weight(a)
    return out


def window_length(share: float, nfds: int) -> float:
    """How long a window of an anchor that may count ``share`` of the time lasts: short enough
    that one opens about every WINDOWS_EVERY_S (many short windows sample a program's phases
    better than a few long ones: at 50 times the default budget, xz's hc_find_func had 4 and 5
    windows of WINDOW_S in two runs of 12 s, counted 0.70 and 0.99 of exact), at least MIN_WINDOW_S, and at least the
    time its probes trap while they close one after another (system-wide, CLOSE_S a CPU)."""
    return min(WINDOW_S, max(MIN_WINDOW_S, CLOSE_S * max(0, nfds - 1), share * WINDOWS_EVERY_S))


def near_samples(addresses: Any, samples: Any, entry: int) -> float:
    """The samples (per instruction, at ``addresses``) in the entry's first NEAR_BYTES: what
    AnchorStats.entries leaves out of the profile's side where the windows tallied them apart."""
    a = np.asarray(addresses, np.uint64)
    m = (a >= np.uint64(entry)) & (a < np.uint64(entry + NEAR_BYTES))
    return float(np.asarray(samples, np.float64)[m].sum())


def _tally(a: Anchor, w: Window, now: int) -> None:
    """What ``w`` counted since it was last tallied, into ``a``'s tallies (under the set's lock)."""
    a.hits += w.hits - w.tallied_hits
    a.counted_ns += now - (w.tallied_ns if w.tallied_ns is not None else w.start)
    w.tallied_hits, w.tallied_ns = w.hits, now


class Probes:
    """The kernel side (collect/kernel.py), replaceable by a fake in tests."""

    def __init__(self) -> None:
        from cyclescope.collect import kernel

        self.kernel = kernel
        self.pmu = kernel.uprobe_pmu_type()

    def open(self, path: str, file_offset: int, pid: int, cpu: int) -> int:
        if self.pmu is None:
            raise CycleScopeError("this kernel has no uprobe PMU")
        fd = self.kernel.open_uprobe_counter(self.pmu, path, file_offset, pid, cpu)
        self.kernel.ioctl_enable(fd)
        return fd

    def read(self, fd: int) -> int:
        return self.kernel.read_counter(fd)[0]

    def close(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            self.kernel.ioctl_disable(fd)
        self.kernel.close_fd(fd)


@dataclass
class _Tick:
    """What one scheduling step's anchors share: when the first step was, the hard cap on traps,
    what they spent so far, each anchor's part of the budget (by id), and how soon the next step is
    needed."""

    anchors: list[Anchor]
    started: int  # the clock's time of the first tick (ns)
    cap: float
    spent: float
    parts: dict[int, float]
    hit_cost_s: float
    wait: float = IDLE_S

    def share(self, a: Anchor) -> float:
        return a.share(self.parts[id(a)], self.hit_cost_s)

    def costly(self, b: Anchor) -> bool:
        """Counted in short windows, one at a time (AnchorSet._waiting)."""
        return b.rate is None or self.share(b) < 1.0


class AnchorSet:
    """Chooses anchors, opens and closes their windows (``tick``, from a thread) and matches the
    samples of each drain to the windows (``add``)."""

    def __init__(self, per_task: bool, image_key: Callable[[int], str], budget: float = DEFAULT_BUDGET,
                 probes: Any = None, cpus: tuple[int, ...] = (), clock: Callable[[], int] | None = None,
                 rng: random.Random | None = None, hit_cost_s: float = HIT_COST_S,
                 emulated_hit_cost_s: float | None = None) -> None:
        self.per_task = per_task
        self.hit_cost_s = hit_cost_s  # a hit's cost to the probed task (uprobe_hit_cost on this machine)
        self.emulated_hit_cost_s = emulated_hit_cost_s  # at an entry the kernel emulates (None: as any)
        self.image_key = image_key
        self.budget = budget
        self.probes = probes
        self.cpus = cpus
        self.clock = clock or (lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        self.rng = rng or random.Random()
        self.anchors: dict[tuple[int, int], Anchor] = {}  # by image and probed vaddr
        self.entries = 0  # of those, procedures' entries (the rest are scale points)
        self.refused: set[tuple[int, int]] = set()  # procedures that cannot be anchored
        self.lock = threading.Lock()
        self._closing: deque[tuple[Anchor, dict[int, int]]] = deque()  # (anchor, fd -> count read)
        self.wake = threading.Event()  # set when fds wait to be closed
        self.closes = 0  # fds waiting to be closed or closing
        self.kick = threading.Event()  # set when the scheduler (tick) should run now: a new anchor
        self.opened = 0
        self.failures = 0
        self.started: int | None = None  # the budget accrues from here (the recording's start; else the first tick)
        # Quiet spans for the trip windows' local rates (analysis/trips.py): no window opens before
        # hold_ns (the clock's), and trapped_ns is when the last window's probes stopped trapping
        # (their fds closed).
        self.hold_ns = 0
        self.trapped_ns = 0
        self._closing_now: Anchor | None = None  # whose fds the closer is closing

    # --- choosing ------------------------------------------------------------------------------
    def want(self, img: int, start: int) -> bool:
        with self.lock:
            return ((img, start) not in self.anchors and (img, start) not in self.refused
                    and self.entries < MAX_ANCHORS)

    def place(self, img: int, start: int, end: int, path: str | None, file_offset: int | None) -> None:
        cheap = self._emulated_hit_s(path, file_offset) if path is not None and file_offset is not None else None
        with self.lock:
            if path is None or file_offset is None:
                self.refused.add((img, start))
            elif self.entries < MAX_ANCHORS and (img, start) not in self.anchors:
                self.anchors[(img, start)] = Anchor(img, start, end, path, file_offset, emulated_hit_s=cheap)
                self.entries += 1
                self.kick.set()

    def place_point(self, img: int, start: int, at: int, file_offset: int) -> bool:
        """A scale point of the procedure anchored at ``start``: the instruction at vaddr ``at``
        (``file_offset`` in the same file), whose windows the trip windows' thread counts right
        after its windows of the entry and the point (analysis/trips.py, "Scale windows"), and
        registers here (open_point, close_point) so that the procedure's samples in them count
        against their hits, as an entry's do (the trip windows' budget pays for them: the entry
        goes on counting in its own, calc's count where the point's windows are too few to agree).
        False when the procedure has no anchor or the point one already."""
        with self.lock:
            a = self.anchors.get((img, start))
            if a is None or a.at is not None or (img, at) in self.anchors:
                return False
            path = a.path
        cheap = self._emulated_hit_s(path, file_offset)
        with self.lock:
            self.anchors[(img, at)] = Anchor(img, start, a.end, path, file_offset, at=at, emulated_hit_s=cheap,
                                             external=True)
            self.kick.set()
        return True

    def open_point(self, img: int, at: int, pid: int = 0) -> bool:
        """A window of the scale point at ``at`` begins now, counting process ``pid`` (the one the
        trip windows count: per task, the process that sampled the procedure last) or every process
        (0: system-wide, every process mapping the file)."""
        with self.lock:
            a = self.anchors.get((img, at))
            if a is None or not a.external or a.failed is not None or a.window is not None:
                return False
            a.window = Window(self.clock(), None, None, length=0.0, pid=pid)
            a.windows.append(a.window)
        return True

    def close_point(self, img: int, at: int, hits: int | None) -> None:
        """The scale point's window ends now, having counted ``hits`` (None: its count was lost,
        and the window with it)."""
        with self.lock:
            a = self.anchors.get((img, at))
            if a is None or a.window is None:
                return
            w, a.window = a.window, None
            now = self.clock()
            w.end = now
            if hits is None:  # lost: so are the samples it took
                a.windows.remove(w)
                a.samples, a.near = max(0, a.samples - w.samples), max(0, a.near - w.near)
                return
            w.hits = hits
            _tally(a, w, now)
            a.nwindows += 1
            a.total_windows += 1

    def fail_point(self, img: int, at: int, why: str) -> None:
        """The scale point at ``at`` can no longer be counted (its summary says why)."""
        with self.lock:
            a = self.anchors.get((img, at))
            if a is not None and a.external:
                a.failed = why
                self.kick.set()

    def _emulated_hit_s(self, path: str, file_offset: int) -> float | None:
        """What a hit at this entry costs if the kernel emulates its first instruction, else None."""
        from cyclescope.images.disasm import uprobe_emulated_at

        if self.emulated_hit_cost_s is None or not uprobe_emulated_at(path, file_offset):
            return None
        return self.emulated_hit_cost_s

    # --- windows -------------------------------------------------------------------------------
    def _open(self, a: Anchor, tids: frozenset[int] | None, cpus: tuple[int, ...]) -> bool:
        targets = [(t, -1) for t in sorted(tids)] if tids is not None else [(-1, c) for c in cpus]
        fds: dict[int, int] = {}
        error: str | None = None
        for pid, cpu in targets:
            try:
                fds[self.probes.open(a.path, a.file_offset, pid, cpu)] = 0
            except (OSError, CycleScopeError) as e:  # a thread gone meanwhile (ESRCH); a probe refused
                if getattr(e, "errno", None) != errno.ESRCH:
                    self.failures += 1
                    error = str(e)
        if not fds:
            a.failed = error
            return False
        a.fds = fds
        self.opened += len(fds)
        return True

    def _read(self, a: Anchor) -> int:
        """Hits since the last read, over the anchor's fds."""
        n = 0
        for fd, last in list(a.fds.items()):
            try:
                v = self.probes.read(fd)
            except OSError:
                v = last
            n += v - last
            a.fds[fd] = v
        return n

    def _tids(self, a: Anchor, now: int) -> frozenset[int] | None:
        if not self.per_task:
            return None
        recent = sorted(((t, tid) for tid, t in a.tids.items() if now - t < RECENT_NS), reverse=True)
        return frozenset(tid for _, tid in recent[:MAX_TASKS])

    def tick(self) -> float:
        """One scheduling step: read the counting anchors, end or go on with their windows, open
        windows at random for the others. Returns the seconds until the next step is needed
        (between TICK_S and IDLE_S): a window that keeps to its anchor's rate is read every CHECK_S,
        one whose rate is new or rising every TICK_S, and an anchor waiting for its budget sleeps
        until it is paid for. (Ticking every TICK_S whatever happened cost the recorder about
        0.25 s of CPU per 10 s, mostly thread wake-ups and counter reads: 20 times what counting
        cost the programs.)"""
        with self.lock:
            every = list(self.anchors.values())
            anchors = [a for a in every if a.failed is None and not a.external]
        now = self.clock()
        if self.started is None:
            self.started = now
        # The hard cap: the traps counted so far (hits times hit_cost_s) stay within the budget of
        # the time since the first tick, plus ALLOWANCE. The shares below keep each anchor's windows
        # within its part when its rate holds; where it does not (system-wide, a function's rate
        # swings as processes come and go), no window opens until time has paid for the overrun.
        t = _Tick(anchors, self.started, cap=self.budget * (now - self.started) / 1e9 + ALLOWANCE,
                  spent=sum(a.cost_s for a in anchors), parts=allocate(self.budget, anchors, self.hit_cost_s),
                  hit_cost_s=self.hit_cost_s)
        for a in sorted(anchors, key=lambda a: a.rate is not None):  # first windows first: they measure the rates
            if a.window is not None:
                self._counting(a, a.window, t)
            else:
                self._waiting(a, t)
        with self.lock:  # every anchor's old windows go, a scale point's (its windows are not ticked) too
            horizon = self.clock() - KEEP_NS
            for a in every:
                while a.windows and a.windows[0].end is not None and a.windows[0].end < horizon:
                    a.windows.popleft()
        first = any(a.window is not None and a.rate is None for a in anchors)  # one measuring its rate
        return max(FIRST_WINDOW_S if first else TICK_S, t.wait)

    def _counting(self, a: Anchor, w: Window, t: _Tick) -> None:
        """A tick for an anchor whose window ``w`` is open: read it, and end it or let it go on."""
        # Read at every step, so that the cap can end a window early: where a rate swings, a
        # window of WINDOW_S could cost many times what its share allowed.
        hits = self._read(a)
        now = self.clock()
        with self.lock:
            w.hits += hits
            a.cost_s += hits * a.hit_s(self.hit_cost_s)
        t.spent += hits * a.hit_s(self.hit_cost_s)
        over = t.spent >= t.cap
        span = now - w.start
        since = (now - (w.read_at or w.start)) / 1e9
        w.read_at = now
        steady = a.rate is not None and hits <= 2 * a.rate * since + 10
        if a.rate is not None and not w.probe and span >= 1e9:
            a.rate = w.hits / (span / 1e9)  # a long window's own rate, as it goes
        share = t.share(a)
        if a.rate is not None and not over and (
                (share < 1.0 and span < w.length * 1e9)  # a costly anchor's window lasts its length
                or (share >= 1.0 and self._tids(a, now) == w.tids)):  # a cheap one's goes on
            step = CHECK_S if steady else TICK_S
            if share < 1.0:
                step = min(step, w.length - span / 1e9)
            t.wait = min(t.wait, step)
            return
        # The time it registered and did not count comes back: the first window, which
        # measures the rate, lasts a step but registered as a whole one (before this, an
        # anchor of 500,000 entries a second never paid it back within a minute), and so
        # does one the cap ends early.
        a.credit += max(0.0, w.length - span / 1e9)
        with self.lock:
            w.end = now
            a.window = None
            if not w.probe:
                _tally(a, w, now)
            if span >= 1_000_000 and (a.rate is None or span < 1e9):
                rate = w.hits / (span / 1e9) * (len(self.cpus) if w.probe else 1)
                first_rate = a.rate is None
                a.rate = rate if a.rate is None else 0.5 * (a.rate + rate)
                if first_rate:
                    # Its share of the time since the recording began, now that the share
                    # is known: the budget accrues from the start, as the cap's does. An
                    # anchor placed at the first drain (then a second in) otherwise waited a
                    # third of a second for its next window, past the end of a program of
                    # 1.3 s (difference.c's mix: 6 entries seen, and the model's count).
                    part = min(t.parts[id(a)], 1.25 * a.rate * a.hit_s(self.hit_cost_s))
                    a.credit = min(a.credit + a.share(part, self.hit_cost_s) * (now - t.started) / 1e9, MAX_CREDIT_S)
        self._retire(a)
        t.wait = min(t.wait, TICK_S)  # the next window may open at once (a cheap anchor's)

    def _waiting(self, a: Anchor, t: _Tick) -> None:
        """A tick for an anchor with no window open: earn credit, and open one when it is paid for."""
        share = t.share(a)
        # A token bucket: the anchor earns its share of the time, and a window (with the
        # probes' close) spends what it registers; windows open once it is paid for, at a
        # random step among the next few, so that they spread over the run (a short run gets
        # its share too) without keeping step with a program's own period.
        now = self.clock()
        if a.rate is not None:  # no credit before the rate is known (it would pay for seconds of windows)
            a.credit = min(a.credit + share * (now - (a.last_tick or now)) / 1e9, MAX_CREDIT_S)
        a.last_tick = now
        # A window traps until it ends (the ticker wakes for it), then while its fds close
        # one after another.
        nfds = len(self._tids(a, now) or ()) if self.per_task else len(self.cpus)
        closing = CLOSE_S * max(0, nfds - 1)
        length = window_length(share, nfds)
        registered = length + WINDOW_SLACK_S + closing
        if share < 1.0 and a.credit < registered and a.total_windows <= 1:
            # Its first window that counts: now, as long as the credit pays for (at least
            # MIN_WINDOW_S), not a whole one later: a program of under a second ended
            # before that (difference.c's mix: placed at 0.25 s, a window of 0.2 s paid
            # for at 0.7 s; the count rested on the first window's 13 entries).
            short = a.credit - WINDOW_SLACK_S - closing
            if short >= max(MIN_WINDOW_S, closing):
                length, registered = short, a.credit
        if now < self.hold_ns and self._disturbs(a):  # the trip windows' samples around a window of theirs
            t.wait = min(t.wait, max(TICK_S, (self.hold_ns - now) / 1e9))
            return
        if t.spent >= t.cap:  # nothing opens until the time since the start has paid for the traps
            t.wait = min(t.wait, max(TICK_S, (t.spent - ALLOWANCE) / self.budget - (now - t.started) / 1e9))
            return
        if share < 1.0 and a.credit < registered:
            t.wait = min(t.wait, max(TICK_S, (registered - a.credit) / share))
            return
        if t.costly(a) and (self.closes or any(b.window is not None and t.costly(b) for b in t.anchors)):
            # One costly window at a time, opened once the last one's probes have closed:
            # closes serialize (CLOSE_S each), and a probe waiting for its close traps at
            # its full rate (xz's first windows, ended together: 0.41 s of traps in 18 s,
            # nearly all of it while their closes waited in line).
            t.wait = min(t.wait, TICK_S)
            return
        if share < 1.0 and self.rng.random() >= 0.5:
            t.wait = min(t.wait, TICK_S)
            return
        tids = self._tids(a, self.clock())
        if tids is not None and not tids:
            t.wait = min(t.wait, CHECK_S)  # no thread ran it lately: new samples will name some
            return
        a.credit -= registered
        # System-wide, an entry never counted may run millions of times a second in every
        # process (a libc function): the first window probes its rate on one CPU only, and
        # counts nothing (its samples on other CPUs are not matched).
        probe = not self.per_task and a.rate is None and len(self.cpus) > 1
        if self._open(a, tids, self.cpus[:1] if probe else self.cpus):
            with self.lock:
                a.window = Window(self.clock(), None, tids, probe, length=length)
                if not probe:
                    a.windows.append(a.window)
                    a.nwindows += 1
                    a.total_windows += 1
            t.wait = min(t.wait, FIRST_WINDOW_S if a.rate is None else min(length, CHECK_S) if share < 1.0
                       else CHECK_S)

    def _retire(self, a: Anchor) -> None:
        fds = dict(a.fds)
        a.fds = {}
        if fds:
            with self.lock:
                self._closing.append((a, fds))
                self.closes += len(fds)
            self.wake.set()

    def _disturbs(self, a: Anchor) -> bool:
        """Do the anchor's probes trap often enough to slow what the samples around them show? (Its
        rate is not known yet, or its traps take QUIET_SHARE of the time or more: a cheap anchor's
        windows stay open all the time and trap next to never, a program's main once.)"""
        return a.rate is None or a.rate * a.hit_s(self.hit_cost_s) >= QUIET_SHARE

    def quiet_ns(self) -> int:
        """How long no anchor's probe has trapped at a rate that matters (_disturbs): 0 while such
        a window is open or its fds close."""
        with self.lock:
            if (self._closing_now is not None and self._disturbs(self._closing_now)) or any(
                    self._disturbs(a) for a, _ in self._closing) or any(
                    a.window is not None and self._disturbs(a) for a in self.anchors.values()):
                return 0
            return max(0, self.clock() - self.trapped_ns)

    def hold(self, until_ns: int) -> None:
        """No window opens before ``until_ns`` (the clock's; 0: from now on they may): a span of
        samples without traps."""
        with self.lock:
            self.hold_ns = until_ns

    def close_pending(self) -> None:
        """Close the fds of ended windows (slow: the closer thread calls this). Each fd's count is
        read just before its close: the hits since the window ended are traps it cost too."""
        while True:
            with self.lock:
                if not self._closing:
                    return
                a, fds = self._closing.popleft()
                self._closing_now = a
            for fd, last in fds.items():
                try:
                    late = self.probes.read(fd) - last
                except OSError:
                    late = 0
                with self.lock:
                    a.cost_s += max(0, late) * a.hit_s(self.hit_cost_s)
                self.probes.close(fd)
                with self.lock:
                    self.closes -= 1
                    if self._disturbs(a):
                        self.trapped_ns = self.clock()
            with self.lock:
                self._closing_now = None

    def stop(self) -> None:
        """End every window now (the run is ending) and close everything."""
        with self.lock:
            anchors = list(self.anchors.values())
        for a in anchors:
            if a.external:  # its count is the trip windows' thread's: an open window is lost
                self.close_point(a.img, a.probed, None)
            elif a.window is not None:
                hits = self._read(a)
                now = self.clock()
                with self.lock:
                    w = a.window
                    w.end = now
                    w.hits += hits
                    a.cost_s += hits * a.hit_s(self.hit_cost_s)
                    a.window = None
                    if not w.probe:
                        _tally(a, w, now)
            self._retire(a)
        self.close_pending()

    # --- samples -------------------------------------------------------------------------------
    def add(self, tid: np.ndarray, time_ns: np.ndarray, img: np.ndarray, off: np.ndarray,
            pid: np.ndarray | None = None) -> None:
        """One drain's samples of the time event: those in an anchored procedure count against the
        windows they fall in (by their time, and their thread, or for a scale point's window its
        process, in per-task mode)."""
        with self.lock:
            anchors = list(self.anchors.values())
        for a in anchors:
            m = (img == a.img) & (off >= a.start) & (off < a.end)
            if not m.any():
                continue
            t = time_ns[m].astype(np.int64)
            th = tid[m].astype(np.int64)
            with self.lock:
                a.seen += len(t)
                if self.per_task:  # each thread's latest sample here (per thread, not per sample)
                    order = np.lexsort((t, th))
                    ths, ts = th[order], t[order]
                    last = np.r_[ths[1:] != ths[:-1], True]
                    for x, y in zip(ths[last].tolist(), ts[last].tolist(), strict=True):
                        if y > a.tids.get(x, -1):
                            a.tids[x] = y
                if not a.windows:
                    continue
                starts = np.array([w.start for w in a.windows], np.int64)
                ends = np.array([w.end if w.end is not None else np.iinfo(np.int64).max for w in a.windows],
                                np.int64)
                k = np.searchsorted(starts, t, side="right") - 1
                inside = (k >= 0) & (t < ends[np.maximum(k, 0)])
                if self.per_task:  # a window counts only the threads it probed (per window, not per sample)
                    wins = list(a.windows)
                    for wi in distinct(k[inside]).tolist():
                        w = wins[wi]
                        if w.tids is not None:
                            sel = inside & (k == wi)
                            inside[sel] = np.isin(th[sel], np.fromiter(w.tids, np.int64, len(w.tids)))
                        elif w.pid and pid is not None:
                            sel = inside & (k == wi)
                            inside[sel] = pid[m][sel].astype(np.int64) == w.pid
                o = off[m].astype(np.int64)
                near = inside & (o >= a.probed) & (o < a.probed + NEAR_BYTES)
                a.samples += int(inside.sum())
                a.near += int(near.sum())
                if a.external and a.window is not None:  # what an open window took, should it be lost
                    last = len(a.windows) - 1
                    a.window.samples += int((inside & (k == last)).sum())
                    a.window.near += int((near & (k == last)).sum())

    def take(self) -> Any:
        """The tallies since the last take, as an ANCHORS table (db/tallies.py)."""
        from cyclescope.db.tallies import ANCHORS, build

        rows: list[tuple[str, int, int, int, int, int, int]] = []
        now = self.clock()
        with self.lock:
            for a in self.anchors.values():
                if a.window is not None and not a.window.probe:
                    _tally(a, a.window, now)  # a window that goes on: what it counted so far
                if a.hits or a.samples or a.nwindows:
                    rows.append((self.image_key(a.img), a.probed, a.hits, a.samples, a.counted_ns, a.nwindows,
                                 a.near))
                a.hits = a.samples = a.counted_ns = a.nwindows = a.near = 0
        cols = list(zip(*rows, strict=True)) if rows else [(), (), (), (), (), (), ()]
        return build(ANCHORS, {"image": list(cols[0]), "entry": np.array(cols[1], np.uint64),
                               "hits": np.array(cols[2], np.uint64), "samples": np.array(cols[3], np.uint64),
                               "counted_s": np.array(cols[4], np.float64) / 1e9,
                               "windows": np.array(cols[5], np.uint64), "near": np.array(cols[6], np.uint64)})

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"anchors": len(self.anchors), "counting": sum(a.window is not None for a in self.anchors.values()),
                    "failed": sum(a.failed is not None for a in self.anchors.values()),
                    "trap_s": round(sum(a.cost_s for a in self.anchors.values()), 3), "opened": self.opened}


@dataclass(frozen=True)
class AnchorStats:
    """One anchor's tally summed over a selection: the procedure's entries counted in windows,
    and its own samples (of the time event) in those windows."""

    hits: int
    samples: int
    counted_s: float
    windows: int
    near: int = 0  # of ``samples``, those in the entry's first NEAR_BYTES (0 in tallies older than it)

    def entries(self, procedure_samples: float, procedure_near: float = 0.0) -> float | None:
        """Entries over the whole profile: hits per window sample times the procedure's samples.

        Where the windows' samples in the entry's first NEAR_BYTES were tallied apart (``near``),
        both sides leave them out (``procedure_near``: the profile's samples there): a trap returns
        to the instruction after the probed one, and the timer interrupts held back while the kernel
        handled it land there, so that those bytes took samples in the windows that no execution
        took outside them (xz's hc_find_func, 1.75 M entries: 881 of the 4,032 samples the probe
        added to the procedure, on bytes that had 2 without it; bench/out/trapnear.log)."""
        if self.near > 0:
            rest = self.samples - self.near
            return self.hits / rest * max(0.0, procedure_samples - procedure_near) if rest > 0 else None
        if self.samples <= 0:
            return None
        return self.hits / self.samples * procedure_samples

    @property
    def confidence(self) -> str:
        """How far the ratio can be trusted: its error is about 1/sqrt(samples in windows)."""
        return "high" if self.samples >= 200 else "medium" if self.samples >= 30 else "low"


class AnchorProcessor:
    """The collector's processor (collect/processor.py) around AnchorSet: the time event's samples
    go in; procedures past ANCHOR_AFTER samples get an anchor at their entry (their bounds from the
    loop counter's, ``loops``); an ANCHORS tally comes out at every flush. A thread opens and ends
    the windows at the steps tick asks for, another closes the probes' fds (each close waits for the
    kernel)."""

    name = "anchors"
    needs_regs = False
    # The collector's first drain comes this soon (else a second in): anchors are placed from the
    # samples, and most of the accuracy suite's recordings (bench/accuracy.py) ended before a
    # second. Not sooner: the drain's samples must name the hot procedures (ANCHOR_AFTER each).
    first_drain_s = 0.25

    def __init__(self, loops: Any, budget: float = DEFAULT_BUDGET) -> None:
        self.loops = loops  # analysis.loopcount.LoopCountProcessor
        self.budget = budget
        self.set: AnchorSet | None = None
        self._info_of: Callable[[int], Any] = lambda i: None
        self._time_event = -1
        self._seen: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def bind(self, ctx: Any) -> None:
        from cyclescope.collect.session import online_cpus

        self.set = AnchorSet(ctx.per_task, lambda i: ctx.table[i].key, self.budget, Probes(), online_cpus(),
                             hit_cost_s=hit_cost(), emulated_hit_cost_s=hit_cost(emulated=True))
        # The budget accrues from the recording's start, not from the first anchor's placement (at
        # the first drain): the cap's, and each anchor's share once its rate is known.
        self.set.started = self.set.clock()
        self._info_of = lambda i: ctx.table[i]
        self._time_event = ctx.time_event

    def _locate(self, img: int, start: int) -> tuple[str | None, int | None]:
        """The file and file offset of the instruction at vaddr ``start`` of image ``img``, when the
        file on disk is the one sampled."""
        import os

        from cyclescope.images.elf import read_load_info

        info = self._info_of(img)
        if info is None or info.kind != "elf" or info.offsets != "vaddr" or not info.path.startswith("/"):
            return None, None
        try:
            st = os.stat(info.path)
            if info.size is not None and st.st_size != info.size:
                return None, None
            elf = read_load_info(info.path)
        except (OSError, CycleScopeError):
            return None, None
        if info.build_id and elf.build_id and elf.build_id != info.build_id:
            return None, None
        return info.path, elf.file_offset(start)

    def _start(self) -> None:
        def ticker() -> None:
            # Each step says when the next is needed; a new anchor (kick) or finish wakes it sooner.
            while not self._stop.is_set():
                if self.set is None:
                    return
                delay = self.set.tick()
                self.set.kick.wait(delay)
                self.set.kick.clear()

        def closer() -> None:
            # Woken as soon as a window ends (its probes trap until closed), or by finish; not on a
            # timer: a wake-up every tick cost the recorder CPU for nothing.
            while not self._stop.is_set():
                if self.set is None:
                    return
                self.set.wake.wait(CLOSER_IDLE_S)
                self.set.wake.clear()
                self.set.close_pending()

        for fn in (ticker, closer):
            t = threading.Thread(target=fn, name=f"anchors-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

    def process(self, d: Any) -> None:
        aset, counter = self.set, getattr(self.loops, "counter", None)
        if aset is None or counter is None or self._time_event < 0 or not len(d.samples):
            return
        m = d.event == self._time_event
        if not m.any():
            return
        s = d.samples[m]
        img, off = d.image[m], d.offset[m]
        # Procedures with enough samples get an anchor (their bounds once the loop counter has them);
        # then the samples count against the windows, and name the threads to probe. Once every
        # anchor is placed, samples are no longer counted per procedure.
        for i in distinct(img).tolist() if aset.entries < MAX_ANCHORS else ():
            b = counter.bounds(int(i))
            if b is None:
                continue
            k = procedure_index(b, off[img == i])
            u, c = counts(k[k >= 0])
            for j, n in zip(u.tolist(), c.tolist(), strict=True):
                key = (int(i), int(b[0][j]))
                seen = self._seen[key] = self._seen.get(key, 0) + n
                if seen >= ANCHOR_AFTER and aset.want(*key):
                    del self._seen[key]
                    aset.place(key[0], key[1], int(b[1][j]), *self._locate(*key))
                    if not self._threads and aset.anchors:
                        self._start()
        aset.add(s["tid"], s["time"], img, off, s["pid"])

    def forget(self, pid: int, tid: int) -> None:
        if self.set is not None:
            with self.set.lock:
                for a in self.set.anchors.values():
                    a.tids.pop(tid, None)

    def finish(self) -> None:
        self._stop.set()
        if self.set is not None:
            self.set.wake.set()  # the closer, waiting for work
            self.set.kick.set()  # the ticker, waiting for its next step
        for t in self._threads:
            t.join(timeout=5.0)
        if self.set is not None:
            self.set.stop()

    def flush(self, db: Any, epoch: int, host: str) -> list[Any]:
        from cyclescope.db.tallies import ANCHORS, write_tally

        if self.set is None:
            return []
        t = self.set.take()
        return [write_tally(db, epoch, host, ANCHORS, t)] if t.num_rows else []

    def close(self) -> None:
        if not self._stop.is_set():
            self.finish()

    def status(self) -> dict[str, Any]:
        return self.set.status() if self.set is not None else {}

    def summary(self) -> str | None:
        aset = self.set
        if aset is None or not aset.anchors:
            return None
        with aset.lock:
            failed = [a.failed for a in aset.anchors.values() if a.failed]
            counted = sum(1 for a in aset.anchors.values() if a.total_windows and a.at is None)
            points = sum(1 for a in aset.anchors.values() if a.total_windows and a.at is not None)
        st = aset.status()
        line = (f"anchors: the entries of {counted} procedure{'' if counted == 1 else 's'}"
                + (f" and {points} scale point{'' if points == 1 else 's'}" if points else "")
                + f" counted exactly in windows ({st['trap_s']:.2f} s of the programs' time in traps)")
        if failed:
            line += f"; {len(failed)} could not be probed ({failed[0]})"
        return line
