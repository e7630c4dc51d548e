"""Anchors (analysis/anchors.py) without the kernel: windows opened and ended by tick on a fake
clock and fake probes, samples matched to the windows by time and thread, the tallies they give,
and calc taking an anchored entry count."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from cyclescope.analysis.anchors import (
    ALLOWANCE,
    CHECK_S,
    CLOSE_S,
    FIRST_WINDOW_S,
    HIT_COST_S,
    MAX_TASKS,
    TICK_S,
    WINDOW_S,
    WINDOW_SLACK_S,
    AnchorSet,
    AnchorStats,
    allocate,
    window_length,
)
from cyclescope.db.tallies import ANCHORS, merge
from tests.unit.test_calc import MCPU

MS = 1_000_000


class FakeProbes:
    """Counters that count ``rate`` hits per second of the fake clock while open."""

    def __init__(self, clock: list[int], rate: float, gone: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.clock, self.rate, self.gone = clock, rate, gone
        self.open_at: dict[int, int] = {}
        self.closed: list[int] = []
        self.targets: dict[int, tuple[int, int]] = {}
        self._next = 100

    def open(self, path: str, off: int, pid: int, cpu: int) -> int:
        if pid in self.gone:
            err = OSError("no such process")
            err.errno = 3
            raise err
        self._next += 1
        self.open_at[self._next] = self.clock[0]
        self.targets[self._next] = (pid, cpu)
        return self._next

    def read(self, fd: int) -> int:
        return int((self.clock[0] - self.open_at[fd]) / 1e9 * self.rate)

    def close(self, fd: int) -> None:
        self.closed.append(fd)


def make(per_task: bool, rate: float, budget: float = 0.01, gone: set[int] = frozenset()):  # type: ignore[assignment]
    clock = [10_000 * MS]
    probes = FakeProbes(clock, rate, gone)
    s = AnchorSet(per_task, lambda i: f"img{i}", budget, probes, cpus=(0, 1), clock=lambda: clock[0],
                  rng=random.Random(1))
    s.place(1, 0x1000, 0x1100, "/bin/x", 0x1000)
    return s, probes, clock


def test_a_rare_entry_is_counted_all_the_time_and_its_samples_match_its_windows() -> None:
    s, probes, clock = make(per_task=False, rate=100.0)  # 100 entries a second: 0.1% of a CPU in traps
    s.tick()  # a first window measures the rate on one CPU, and counts nothing
    assert set(probes.targets.values()) == {(-1, 0)}
    clock[0] += 50 * MS
    s.tick()
    s.close_pending()
    assert len(probes.closed) == 1 and s.anchors[(1, 0x1000)].nwindows == 0
    start = clock[0] + 50 * MS
    clock[0] = start
    probes.targets.clear()
    s.tick()  # cheap: a window on every CPU
    assert set(probes.targets.values()) == {(-1, 0), (-1, 1)}
    for _ in range(20):
        clock[0] += 50 * MS
        s.tick()
    assert len(probes.closed) == 1  # never closed again: one window that goes on
    # Samples: 10 in the procedure during the counted second, 3 outside it, 5 in another procedure.
    t_in = np.array([start + k * 90 * MS + 1 for k in range(10)], np.int64)
    t_out = np.array([start - 5 * MS, start - MS, start - 100 * MS], np.int64)
    t = np.concatenate([t_in, t_out, t_in[:5]])
    img = np.ones(len(t), np.int64)
    off = np.array([0x1010] * 13 + [0x2000] * 5, np.uint64)
    s.add(np.arange(len(t)), t, img, off)
    tab = s.take()
    d = tab.to_pydict()
    assert d["image"] == ["img1"] and d["entry"] == [0x1000]
    assert d["samples"] == [10]
    assert d["hits"][0] == pytest.approx(200, abs=6)  # a second of entries on each CPU
    assert d["counted_s"][0] == pytest.approx(1.0, rel=0.01) and d["windows"][0] == 1
    s.stop()
    assert len(probes.closed) == 3


def test_a_frequent_entry_is_counted_in_windows_within_its_budget() -> None:
    rate = 100_000.0  # each counted second would cost 0.95 s of traps
    s, probes, clock = make(per_task=False, rate=rate)
    seconds = 1000
    tick = round(TICK_S * 1e9)
    for _ in range(round(seconds / TICK_S)):
        s.tick()
        s.close_pending()
        clock[0] += tick
    s.stop()
    a = next(iter(s.anchors.values()))
    assert a.rate == pytest.approx(2 * rate, rel=0.01)  # both CPUs' probes count
    # The probes' registered time (windows of their length, then trapping while the fds close one
    # after another) is the budget's share, and so is their trap time.
    share = 0.01 / (2 * rate * HIT_COST_S)
    length = window_length(share, 2)
    assert length == pytest.approx(CLOSE_S)  # system-wide: as long as the second CPU's probe traps in its close
    registered = a.nwindows * (length + WINDOW_SLACK_S + CLOSE_S)
    assert 0.5 * share * seconds < registered < 2 * share * seconds
    assert 0.5 * 0.01 * seconds < a.cost_s < 2 * 0.01 * seconds
    assert a.counted_ns / 1e9 == pytest.approx(a.nwindows * length, rel=0.3)  # each window about its length
    assert len(probes.closed) == 2 * a.nwindows + 1  # each window's probes closed, and the first one's


class SwingingProbes(FakeProbes):
    """Counters whose rate may change while they are open: each read adds the time since the last
    one at the rate of now."""

    def __init__(self, clock: list[int], rate: float) -> None:
        super().__init__(clock, rate)
        self.count: dict[int, tuple[int, float]] = {}

    def read(self, fd: int) -> int:
        last, n = self.count.get(fd, (self.open_at[fd], 0.0))
        n += (self.clock[0] - last) / 1e9 * self.rate
        self.count[fd] = (self.clock[0], n)
        return int(n)


def make_swinging(rate: float) -> tuple[AnchorSet, SwingingProbes, list[int]]:
    """A system-wide set on two CPUs with one anchor, its probes' rate changeable while they count."""
    clock = [10_000 * MS]
    probes = SwingingProbes(clock, rate)
    s = AnchorSet(False, lambda i: f"img{i}", 0.01, probes, cpus=(0, 1), clock=lambda: clock[0],
                  rng=random.Random(1))
    s.place(1, 0x1000, 0x1100, "/bin/x", 0x1000)
    return s, probes, clock


def test_the_traps_stay_within_the_budget_when_a_rate_swings() -> None:
    # An entry that ran 10 times a second, counted all the time, suddenly runs a million times a
    # second on each CPU (system-wide, a busy program started): the window ends at the next tick,
    # and no window opens again until the time since the start has paid for the traps.
    s, probes, clock = make_swinging(10.0)
    tick = round(TICK_S * 1e9)
    for _ in range(100):
        s.tick()
        s.close_pending()
        clock[0] += tick
    a = s.anchors[(1, 0x1000)]
    assert a.window is not None and len(probes.open_at) == 3  # the rate probe, then counting on 2 CPUs
    windows = a.total_windows
    probes.rate = 1_000_000.0
    one_tick = 2 * probes.rate * TICK_S * HIT_COST_S  # a tick of traps on both CPUs: 0.19 s
    for k in range(round(300 / TICK_S)):
        s.tick()
        s.close_pending()
        clock[0] += tick
        elapsed = (k + 101) * TICK_S
        assert a.cost_s <= 0.01 * elapsed + ALLOWANCE + one_tick + 1e-9
    assert a.total_windows >= windows + 3  # and it goes on counting, in windows


def run_by_steps(s: AnchorSet, clock: list[int], seconds: float, on_step=None) -> int:  # type: ignore[no-untyped-def]
    """Drive ``s`` as the ticker thread does: each step after the delay the last one asked for."""
    end = clock[0] + round(seconds * 1e9)
    steps = 0
    while clock[0] < end:
        delay = s.tick()
        s.close_pending()
        steps += 1
        if on_step is not None:
            on_step()
        assert (FIRST_WINDOW_S if any(a.rate is None for a in s.anchors.values()) else TICK_S) <= delay <= 1.0
        clock[0] += round(delay * 1e9)
    return steps


def test_the_scheduler_wakes_only_when_a_window_needs_it() -> None:
    # A costly entry: windows within the budget as with a step every TICK_S, but the scheduler
    # sleeps while the anchor waits for its budget.
    s, probes, clock = make(per_task=False, rate=100_000.0)
    seconds = 1000
    steps = run_by_steps(s, clock, seconds)
    s.stop()
    a = next(iter(s.anchors.values()))
    assert steps < 0.05 * seconds / TICK_S
    share = 0.01 / (2 * 100_000.0 * HIT_COST_S)
    length = window_length(share, 2)
    registered = a.nwindows * (length + WINDOW_SLACK_S + CLOSE_S)
    assert 0.5 * share * seconds < registered < 2 * share * seconds
    # The fake's probes stop at once when they close, so the traps the budget registers for the
    # second CPU's close (CLOSE_S, as long as the window here) cost nothing: about half of it is spent.
    assert 0.35 * 0.01 * seconds < a.cost_s < 2 * 0.01 * seconds
    assert a.counted_ns / 1e9 == pytest.approx(a.nwindows * length, rel=0.3)
    assert len(probes.closed) == len(probes.open_at)  # every window's probes closed
    # A rare entry, counted all the time: its window is read every CHECK_S while its rate holds.
    s, _, clock = make(per_task=False, rate=100.0)
    steps = run_by_steps(s, clock, 100)
    assert steps <= 100 / CHECK_S + 5
    assert s.anchors[(1, 0x1000)].window is not None


def test_a_rate_that_swings_is_caught_at_the_next_step_when_steps_are_long() -> None:
    s, probes, clock = make_swinging(10.0)
    run_by_steps(s, clock, 5)
    a = s.anchors[(1, 0x1000)]
    assert a.window is not None
    probes.rate = 1_000_000.0
    start = clock[0]
    worst = 2 * probes.rate * CHECK_S * HIT_COST_S  # the steps before the swing was seen: 0.95 s

    def within() -> None:
        elapsed = 5 + (clock[0] - start) / 1e9
        assert a.cost_s <= 0.01 * elapsed + ALLOWANCE + worst + 1e-9

    run_by_steps(s, clock, 300, within)
    assert a.total_windows >= 4  # and it goes on counting, in windows


def test_per_task_windows_count_only_the_threads_that_ran_the_procedure() -> None:
    s, probes, clock = make(per_task=True, rate=1000.0, gone={7})
    t0 = clock[0]
    tids = np.array([5, 6, 7, *range(20, 20 + MAX_TASKS)], np.int64)
    # threads 5, 6 and 7 ran it lately, 20.. longer ago (and more of them than MAX_TASKS)
    times = np.array([t0 - MS] * 3 + [t0 - 2 * MS] * MAX_TASKS, np.int64)
    s.add(tids, times, np.ones(len(tids), np.int64), np.full(len(tids), 0x1004, np.uint64))
    s.tick()
    opened = {p for p, _ in probes.targets.values()}
    assert len(opened) == MAX_TASKS - 1 and {5, 6} <= opened and 7 not in opened  # 7 exited: no probe, no failure
    assert s.failures == 0
    clock[0] += 10 * MS
    w = s.anchors[(1, 0x1000)].window
    assert w is not None and w.tids is not None and {5, 6} <= w.tids
    # In the window: thread 5 counts, thread 99 (not probed) does not.
    s.add(np.array([5, 99, 6], np.int64), np.array([t0 + 5 * MS] * 3, np.int64), np.ones(3, np.int64),
          np.full(3, 0x1004, np.uint64))
    assert s.anchors[(1, 0x1000)].samples == 2


def test_a_probe_the_kernel_refuses_marks_the_anchor_failed() -> None:
    class Refusing(FakeProbes):
        def open(self, path: str, off: int, pid: int, cpu: int) -> int:
            raise OSError(22, "Invalid argument")

    clock = [0]
    s = AnchorSet(False, str, 0.01, Refusing(clock, 1.0), cpus=(0,), clock=lambda: clock[0])
    s.place(1, 0x1000, 0x1100, "/bin/x", 0x1000)
    s.place(1, 0x2000, 0x2100, None, None)  # no file to probe: refused, never asked again
    s.tick()
    assert s.status()["failed"] == 1 and not s.want(1, 0x2000)


def test_anchor_tallies_merge_by_addition_and_give_entries() -> None:
    a = AnchorSet(False, lambda i: "k", probes=None)
    empty = a.take()
    assert empty.num_rows == 0 and empty.schema == ANCHORS.schema
    from cyclescope.db.tallies import build

    t1 = build(ANCHORS, {"image": ["k"], "entry": np.array([16], np.uint64), "hits": np.array([30], np.uint64),
                         "samples": np.array([100], np.uint64), "counted_s": np.array([1.0]),
                         "windows": np.array([4], np.uint64), "near": np.array([5], np.uint64)})
    d = merge(ANCHORS, [t1, t1]).to_pydict()
    assert d["hits"] == [60] and d["samples"] == [200] and d["windows"] == [8] and d["near"] == [10]
    st = AnchorStats(hits=60, samples=200, counted_s=2.0, windows=8)
    assert st.entries(10_000) == pytest.approx(3000.0) and st.confidence == "high"
    # The samples where traps return, tallied apart, are left out on both sides: 60 entries per
    # 190 samples elsewhere in the windows, times the profile's 10,000 - 500 samples elsewhere.
    near = AnchorStats(hits=60, samples=200, counted_s=2.0, windows=8, near=10)
    assert near.entries(10_000, 500) == pytest.approx(60 / 190 * 9_500)
    assert AnchorStats(hits=6, samples=4, counted_s=1.0, windows=1, near=4).entries(100, 4) is None
    assert AnchorStats(0, 0, 0.0, 0).entries(100) is None


def test_calc_takes_the_entry_count_from_an_anchor() -> None:
    """The committed `work` (tests/data/inl): its entry block runs once a call. With an anchor the
    block's count is the measured one, and the flow carries it to the exit."""
    from cyclescope.analysis.calc import calc_procedure
    from cyclescope.images.disasm import read_code
    from tests.unit.test_listing import DATA

    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    counts = {0x11A7: np.array([100.0]), 0x11AA: np.array([100.0]), 0x11B8: np.array([100.0]),
              0x1190: np.array([1.0]), 0x11BD: np.array([1.0])}
    total = 302.0
    anchor = AnchorStats(hits=500, samples=151, counted_s=1.0, windows=10)  # 500 entries per 151 samples
    c = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                       anchor=anchor)
    entry = next(b for b in c.cfg.blocks if b.start == 0x1190)
    assert c.freq.block_method[entry.id] == "anchor" and c.freq.block_confidence[entry.id] == "medium"
    assert c.executions(entry.id) == pytest.approx(500 / 151 * total, rel=0.01)
    few = AnchorStats(hits=3, samples=151, counted_s=1.0, windows=1)
    c2 = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0,
                        mcpu=MCPU, anchor=few)
    assert c2.freq.block_method[entry.id] != "anchor" and any("too little seen" in n for n in c2.notes)
    # Entries of about 300 cycles each (50,000 of them per 151 samples of 10^6 cycles): each trap's
    # own time inflates the procedure's samples in the windows, so the count is used in low confidence.
    short = AnchorStats(hits=50_000, samples=151, counted_s=1.0, windows=10)
    c3 = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0,
                        mcpu=MCPU, anchor=short)
    assert c3.freq.block_method[entry.id] == "anchor" and c3.freq.block_confidence[entry.id] == "low"
    assert c3.executions(entry.id) == pytest.approx(50_000 / 151 * total, rel=0.01)


def test_stop_ends_every_window_and_closes_every_probe() -> None:
    s, probes, clock = make(per_task=False, rate=100_000.0)  # costly: counted in windows of WINDOW_S
    s.place(1, 0x2000, 0x2100, "/bin/x", 0x2000)
    for _ in range(200):
        s.tick()
        s.close_pending()
        clock[0] += 50 * MS
    clock[0] += 10 * MS
    s.stop()
    assert all(a.window is None and not a.fds for a in s.anchors.values())
    assert len(probes.closed) == len(probes.open_at)


def test_anchors_are_off_system_wide_unless_asked_and_loop_counts_on() -> None:
    import argparse

    from cyclescope.cli.sampling import processors

    def names(system_wide: bool, anchors: bool = False, no_anchors: bool = False, loops: bool = False,
              no_loops: bool = False) -> list[str]:
        args = argparse.Namespace(no_loop_counts=no_loops, loop_counts=loops, no_anchors=no_anchors, anchors=anchors,
                                  anchor_budget=None, call_graph=None)
        return [p.name for p in processors(args, None, system_wide=system_wide)]

    assert names(False) == ["timeline", "loops", "anchors", "trips"]
    assert names(False, no_anchors=True) == ["timeline", "loops"] and names(False, no_loops=True) == ["timeline"]
    # System-wide: loop counts on (the eBPF program sends the samples of watched procedures:
    # collect/loopwatch.py), anchors off unless asked (they count almost nothing there:
    # bench/anchors.py); anchors need the loop counter.
    assert names(True) == ["timeline", "loops"] and names(True, loops=True) == ["timeline", "loops"]
    assert names(True, no_loops=True) == ["timeline"]
    assert names(True, anchors=True) == ["timeline", "loops", "anchors", "trips"]
    quiet = argparse.Namespace(no_loop_counts=False, loop_counts=False, no_anchors=False, anchors=False,
                               anchor_budget=None, call_graph=None, no_trip_windows=True)
    assert [p.name for p in processors(quiet, None)] == ["timeline", "loops", "anchors"]


def test_the_budget_left_by_rare_entries_goes_to_the_frequent_ones() -> None:
    from cyclescope.analysis.anchors import Anchor

    rare, busy, other, new = (Anchor(1, s, s + 16, "/bin/x", s) for s in (0x10, 0x20, 0x30, 0x40))
    rare.rate, busy.rate, other.rate = 100.0, 1e6, 2e6  # the rare one costs 100 x HIT_COST_S of a CPU
    rare.seen, busy.seen, other.seen, new.seen = 999, 2999, 999, 999  # weights: samples + 1
    parts = allocate(0.01, [busy, rare, other])
    assert parts[id(rare)] == pytest.approx(1.25 * 100 * HIT_COST_S)  # a quarter in hand
    left = 0.01 - 1.25 * 100 * HIT_COST_S
    # The rest by the procedures' samples: the one with three times the samples, three times the part.
    assert parts[id(busy)] == pytest.approx(0.75 * left) and parts[id(other)] == pytest.approx(0.25 * left)
    assert sum(parts.values()) == pytest.approx(0.01)
    assert allocate(0.01, [new, busy])[id(new)] == pytest.approx(0.0025)  # no rate yet: its proportional part


def test_windows_are_short_enough_to_open_every_few_seconds() -> None:
    assert window_length(1e-3, 1) == pytest.approx(TICK_S)  # at least a tick
    assert window_length(0.05, 1) == pytest.approx(0.05 * 2.0)  # one every WINDOWS_EVERY_S
    assert window_length(0.5, 1) == pytest.approx(WINDOW_S)  # at most WINDOW_S
    assert window_length(1e-3, 3) == pytest.approx(2 * CLOSE_S)  # system-wide: as long as the closes trap


def test_costly_anchors_count_in_short_windows_weighted_by_their_samples() -> None:
    """Eight procedures entered 500,000 times a second, one holding 75% of the samples (xz's
    hc_find_func and the match finder's others): each first window lasts FIRST_WINDOW_S and gives
    back the time it registered and did not count, the windows are short enough to open every few
    seconds, and the hot procedure gets most of the budget. Before, each had its first window and
    nothing more in a minute: the first windows (10 ms, charged as 0.2 s) spent the budget."""
    clock = [10_000 * MS]
    s = AnchorSet(True, lambda i: f"img{i}", 0.01, FakeProbes(clock, 500_000.0), cpus=(0, 1),
                  clock=lambda: clock[0], rng=random.Random(1))
    for k in range(8):
        s.place(1, 0x1000 + 0x100 * k, 0x1080 + 0x100 * k, "/bin/x", 0x1000 + 0x100 * k)
    hot, *rest = s.anchors.values()
    hot.seen = 7500
    for a in rest:
        a.seen = 350

    def ran_lately() -> None:  # the thread keeps sampling every procedure
        for a in s.anchors.values():
            a.tids = {42: clock[0]}

    ran_lately()
    run_by_steps(s, clock, 2, ran_lately)
    first = [a.windows[0] for a in s.anchors.values() if a.windows]
    assert len(first) >= 4 and all(w.end is not None and (w.end - w.start) / 1e9 < TICK_S for w in first)
    # One costly window at a time: none opened while another was open (closes serialize).
    spans = sorted((w.start, w.end) for a in s.anchors.values() for w in a.windows)
    assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(spans))
    run_by_steps(s, clock, 60, ran_lately)
    assert hot.total_windows >= 10 and all(a.total_windows >= 1 for a in rest)
    assert hot.cost_s > 5 * max(a.cost_s for a in rest)
    assert sum(a.cost_s for a in s.anchors.values()) <= 0.01 * 62 + ALLOWANCE  # within the budget


def test_near_samples_are_those_in_the_entrys_first_bytes() -> None:
    from cyclescope.analysis.anchors import NEAR_BYTES, near_samples

    addrs = [0x1000, 0x1002, 0x1000 + NEAR_BYTES - 1, 0x1000 + NEAR_BYTES, 0xFFF]
    assert near_samples(addrs, np.array([5.0, 7.0, 1.0, 100.0, 50.0]), 0x1000) == 13.0
    assert near_samples([], np.zeros(0), 0x1000) == 0.0


def test_an_anchor_placed_late_gets_the_budget_since_the_start() -> None:
    """An anchor placed at the first drain, a second into the run (difference.c's mix, 2,500 entries
    a second: 60% of the time within the default budget): once its first window has measured the
    rate, its share of the time since the first tick pays for the next window at once. Before, it
    waited a third of a second, past the end of a program of 1.3 s."""
    clock = [10_000 * MS]
    s = AnchorSet(True, lambda i: f"img{i}", 0.01, FakeProbes(clock, 2500.0), cpus=(0, 1),
                  clock=lambda: clock[0], rng=random.Random(1))
    s.tick()  # the ticker starts with the recording: no anchor yet
    clock[0] += 1000 * MS
    s.place(1, 0x1000, 0x1100, "/bin/x", 0x1000)
    a = s.anchors[(1, 0x1000)]

    def ran_lately() -> None:
        a.tids = {42: clock[0]}

    ran_lately()
    run_by_steps(s, clock, 0.1, ran_lately)
    assert a.rate == pytest.approx(2500.0, rel=0.05) and a.total_windows >= 2
    assert a.cost_s <= 0.01 * 1.1 + ALLOWANCE  # within the budget of the time since the start


def test_a_machine_whose_traps_cost_more_gives_anchors_less_time() -> None:
    """The hit's cost is measured per machine (collect/clock.uprobe_hit_cost): a Xeon with AMX traps
    in 16-17 us against Zen 3's 5.8, and a budget charged Zen 3's cost there was spent 2.5 times
    over. Shares and parts follow the cost they are given."""
    from cyclescope.analysis.anchors import Anchor

    a = Anchor(1, 0x10, 0x20, "/bin/x", 0x10)
    a.rate = 100_000.0
    dear = 2.5 * HIT_COST_S
    assert a.share(0.01, dear) == pytest.approx(a.share(0.01) / 2.5)
    rare = Anchor(1, 0x30, 0x40, "/bin/x", 0x30)
    rare.rate = 100.0
    assert allocate(0.01, [rare, a], dear)[id(rare)] == pytest.approx(1.25 * 100 * dear)


def test_a_scale_point_is_an_anchor_of_its_own_keyed_by_where_it_probes() -> None:
    """A scale point (analysis/trips.py, "Scale windows") of an anchored procedure: probed at its own
    file offset, its samples the whole procedure's, those in its own first bytes tallied apart, its
    row keyed by its address; it does not count against the procedures' MAX_ANCHORS."""
    from cyclescope.analysis.anchors import MAX_ANCHORS

    s, probes, clock = make(per_task=False, rate=100.0)
    assert not s.place_point(1, 0x2000, 0x2040, 0x2040)  # no such anchored procedure
    assert s.place_point(1, 0x1000, 0x1080, 0x1080)
    assert not s.place_point(1, 0x1000, 0x1080, 0x1080)  # once
    p = s.anchors[(1, 0x1080)]
    assert (p.start, p.end, p.at, p.probed, p.file_offset, p.path) == (0x1000, 0x1100, 0x1080, 0x1080, 0x1080, "/bin/x")
    assert s.entries == 1 and s.want(1, 0x3000)
    s2, _, _ = make(per_task=False, rate=100.0)
    s2.place_point(1, 0x1000, 0x1080, 0x1080)
    for k in range(MAX_ANCHORS - 1):
        s2.place(1, 0x4000 + 0x100 * k, 0x4080 + 0x100 * k, "/bin/x", 0x4000 + 0x100 * k)
    assert s2.entries == MAX_ANCHORS and len(s2.anchors) == MAX_ANCHORS + 1 and not s2.want(1, 0x9000)
    # Its windows are the trip windows' (open_point, close_point), never probes of its own.
    for _ in range(5):
        s.tick()
        s.close_pending()
        clock[0] += 50 * MS
    start = clock[0]
    assert s.open_point(1, 0x1080) and not s.open_point(1, 0x1080)
    clock[0] += 20 * MS
    # Samples in the procedure during the window: at the entry's first bytes, at the point's, elsewhere;
    # and one after it.
    t = np.array([start + k * MS for k in range(1, 7)] + [start + 30 * MS], np.int64)
    off = np.array([0x1002, 0x1002, 0x1084, 0x1050, 0x1050, 0x10f0, 0x1050], np.uint64)
    s.add(np.zeros(6), t[:6], np.ones(6, np.int64), off[:6])  # drained while the window is open
    s.close_point(1, 0x1080, 40)
    s.add(np.zeros(1), t[6:], np.ones(1, np.int64), off[6:])  # and after
    d = s.take().to_pydict()
    row = {e: (n, sm, nr) for e, n, sm, nr in zip(d["entry"], d["hits"], d["samples"], d["near"], strict=True)}
    assert row[0x1080] == (40, 6, 1)  # the point's near bytes: 0x1084 only
    assert d["windows"][d["entry"].index(0x1080)] == 1
    # Its windows go once old, as an entry's do (the ticker keeps them for late samples).
    from cyclescope.analysis.anchors import KEEP_NS

    assert len(p.windows) == 1
    clock[0] += KEEP_NS + MS
    s.tick()
    assert not p.windows
    # A window whose count was lost (the run ended during it) is dropped, samples and all.
    assert s.open_point(1, 0x1080)
    s.add(np.zeros(1), np.array([clock[0] + 1], np.int64), np.ones(1, np.int64), np.array([0x1050], np.uint64))
    s.close_point(1, 0x1080, None)
    assert 0x1080 not in s.take().to_pydict()["entry"]
    # Per task, a point's window counts the samples of the process the trip windows counted.
    t2, _, _ = make(per_task=True, rate=100.0)
    t2.place_point(1, 0x1000, 0x1080, 0x1080)
    assert t2.open_point(1, 0x1080, pid=7)
    now = t2.clock()
    t2.add(np.array([7, 8, 9]), np.array([now + 1, now + 2, now + 3], np.int64), np.ones(3, np.int64),
           np.array([0x1050] * 3, np.uint64), np.array([7, 8, 7]))
    t2.close_point(1, 0x1080, 10)
    assert t2.take().to_pydict()["samples"] == [2]
    # The point never had probes of its own: those the set opened were the entry's, which counts on.
    assert all(fd in probes.open_at for fd in probes.targets) and p.fds == {}
    s.fail_point(1, 0x1080, "refused")
    assert p.failed == "refused" and not s.open_point(1, 0x1080)
    s.stop()


def test_a_hold_keeps_costly_windows_shut_and_quiet_says_since_when_nothing_trapped() -> None:
    """The trip windows' local rates need samples no trap slowed (analysis/trips.py,
    TripWindows._quiet_before): while a hold lasts no window of an anchor that traps often opens,
    and quiet_ns is the time since the last such window's probes closed (0 while one is open or
    closing). A cheap anchor's window (a rare entry, counted all the time) does not count."""
    held, probes, clock = make(per_task=False, rate=100_000.0)
    twin, tprobes, tclock = make(per_task=False, rate=100_000.0)
    for s, c in ((held, clock), (twin, tclock)):
        s.tick()  # the first window, measuring the rate: not quiet
        assert s.quiet_ns() == 0
        c[0] += 50 * MS
        s.tick()
        s.close_pending()
        c[0] += 20 * MS
    assert held.quiet_ns() == 20 * MS
    held.hold(clock[0] + 70_000 * MS)
    for _ in range(3_000):  # a minute: the twin's windows open, the held one's do not
        for s, c in ((held, clock), (twin, tclock)):
            c[0] += 20 * MS
            s.tick()
            s.close_pending()
    assert len(tprobes.open_at) > 1 and len(probes.open_at) == 1
    assert held.quiet_ns() >= 60_000 * MS
    held.hold(0)
    for _ in range(3_000):
        clock[0] += 20 * MS
        held.tick()
        held.close_pending()
    assert len(probes.open_at) > 1  # released: its windows open again
    # A rare entry's anchor: its window open all the time, hold or not, and quiet all the same.
    rare, _, rclock = make(per_task=False, rate=10.0)
    rare.tick()
    rclock[0] += 50 * MS
    rare.tick()
    rare.close_pending()
    rare.hold(rclock[0] + 1_000 * MS)
    rclock[0] += 50 * MS
    rare.tick()
    assert any(a.window is not None for a in rare.anchors.values())
    rclock[0] += 50 * MS
    assert rare.quiet_ns() >= 50 * MS
