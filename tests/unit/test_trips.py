"""Trip windows (analysis/trips.py) and calc's use of their ratios, with synthetic inputs."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from cyclescope.analysis import trips as tw
from cyclescope.analysis.anchors import AnchorStats
from cyclescope.analysis.calc import calc_procedure
from cyclescope.db.tallies import TRIPS, build, merge
from cyclescope.images.disasm import read_code
from tests.unit.test_calc import MCPU
from tests.unit.test_listing import DATA

# The committed `work` (tests/data/inl): entry block 0x1190, a loop headed at 0x11A0, its samples
# all on one instruction (a stall the model cannot explain: its count is in low confidence), a few
# before and after it.
COUNTS = {0x11B8: np.array([300.0]), 0x1190: np.array([1.0]), 0x1197: np.array([1.0]), 0x11BD: np.array([1.0])}


def work(**kw: Any) -> Any:
    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    return calc_procedure("work", 0x1190, 0x11C6, code, COUNTS, ["cpu-clock"], "cpu-clock", 1_000_000.0,
                          mcpu=MCPU, **kw)


def block(c: Any, start: int) -> int:
    return next(b.id for b in c.cfg.blocks if b.start == start)


def test_a_loop_header_takes_its_entry_count_times_the_windows_ratio() -> None:
    """The entry's count comes from an anchor (500 entries per 151 window samples); the windows
    counted the loop's header 3,750 times per entry: the header's count is the entry's times that,
    no surer than the anchor (medium)."""
    anchor = AnchorStats(hits=500, samples=151, counted_s=1.0, windows=10)
    c = work(anchor=anchor, trips={0x1190: (400, 6, 400), 0x11A0: (1_500_000, 6, 400)})
    entry, loop = block(c, 0x1190), block(c, 0x11A0)
    assert c.freq.block_method[entry] == "anchor"
    assert c.freq.block_method[loop] == "trip-window" and c.freq.block_confidence[loop] == "medium"
    assert c.executions(loop) == pytest.approx(c.executions(entry) * 3750, rel=0.01)
    # What the count rests on, in the JSON and under the block's line.
    from cyclescope.report.calc import calc_table, calc_to_json, summarize

    doc = calc_to_json(c, summarize(c))
    why = next(b["evidence"] for b in doc["blocks"] if b["start"] == 0x11A0)
    assert why.startswith("3,750 runs per run of 0x1190") and "anchor (medium confidence)" in why
    rows = [r[1] for r in calc_table(c, summarize(c)).rows]
    assert any(r.strip() == f"evidence: {why}" for r in rows)
    # Its back branch runs 3,750 times an entry: not a mispredict candidate (culprits).
    from cyclescope.analysis.calc import _loops, _steady_branches

    steady = _steady_branches(c.cfg, _loops(c.cfg, c.infos), c.freq, {})
    assert set(steady) == {0x11BB} and steady[0x11BB] == {loop}
    # A header counted in half the windows only (a block near the share that makes it a point, in
    # one run and not the next): its runs per entry in those, not against all the entry's hits.
    half = work(anchor=anchor, trips={0x1190: (400, 6, 400), 0x11A0: (750_000, 3, 200)})
    assert half.executions(block(half, 0x11A0)) == pytest.approx(half.executions(entry) * 3750, rel=0.01)
    # A tally older than the entry's hits beside each point's: the entry's own hits.
    old = work(anchor=anchor, trips={0x1190: (400, 6, 0), 0x11A0: (1_500_000, 6, 0)})
    assert old.executions(block(old, 0x11A0)) == pytest.approx(old.executions(entry) * 3750, rel=0.01)
    # Without trips, the loop's count is the model's.
    plain = work(anchor=anchor)
    assert plain.freq.block_method[block(plain, 0x11A0)] != "trip-window"
    assert plain.freq.block_confidence[block(plain, 0x11A0)] == "low"


def test_ratios_need_a_measured_point_and_enough_hits() -> None:
    # No point has a measured count: nothing to scale the ratio by; calc says so.
    c = work(trips={0x1190: (400, 6, 400), 0x11A0: (15_000, 6, 400)})
    assert c.freq.block_method[block(c, 0x11A0)] != "trip-window"
    assert any("none of them has a measured count" in n for n in c.notes)
    # Too few entries in the windows: the ratio is not used.
    anchor = AnchorStats(hits=500, samples=151, counted_s=1.0, windows=10)
    n = tw.MIN_HITS - 1
    few = work(anchor=anchor, trips={0x1190: (n, 1, n), 0x11A0: (71_000, 1, n)})
    assert few.freq.block_method[block(few, 0x11A0)] != "trip-window"
    # Between MIN_HITS and MEDIUM_HITS: used, in low confidence.
    low = work(anchor=anchor, trips={0x1190: (50, 2, 50), 0x11A0: (187_500, 2, 50)})
    assert low.freq.block_method[block(low, 0x11A0)] == "trip-window"
    assert low.freq.block_confidence[block(low, 0x11A0)] == "low"
    # Hits enough for high confidence, but all from two windows: one phase of the run, low.
    one = work(anchor=anchor, trips={0x1190: (1_500, 2, 1_500), 0x11A0: (5_625_000, 2, 1_500)})
    assert one.freq.block_method[block(one, 0x11A0)] == "trip-window"
    assert one.freq.block_confidence[block(one, 0x11A0)] == "low"


def test_points_are_the_entry_then_outer_loops_first() -> None:
    headers = np.array([0x1300, 0x1200, 0x1100, 0x1000], np.uint64)
    depth = np.array([2, 1, 3, 1], np.int32)
    points, offsets = tw.points_of(0x1000, 0x5000, headers, depth)
    assert points == [0x1000, 0x1200, 0x1300, 0x1100]  # the entry heading a loop counts once
    assert offsets == [0x5000, 0x5200, 0x5300, 0x5100]
    # Then the blocks holding 2% of the samples or more, most first (a header's block counts once).
    blocks = np.array([0x1000, 0x1040, 0x1080, 0x1200, 0x1400], np.uint64)
    samples = np.array([10, 300, 1, 500, 100], np.float64)
    points, _ = tw.points_of(0x1000, 0x5000, headers, depth, blocks, samples)
    assert points == [0x1000, 0x1200, 0x1300, 0x1100, 0x1040, 0x1400]
    many = np.arange(0x2000, 0x2000 + 40 * 16, 16, dtype=np.uint64)
    points, _ = tw.points_of(0x1000, 0x1000, many, np.ones(40, np.int32))
    assert len(points) == 1 + tw.MAX_HEADERS


class FakeCounter:
    """PointCounter's interface: each window counts ``per_window`` hits per point."""

    def __init__(self, per_window: list[int]) -> None:
        self.per_window = per_window
        self.attached: list[tuple[str, list[int], int]] = []
        self.skip = 0

    def zero(self, n: int, skip: int = 0, whole: bool = False) -> None:
        self.skip = skip
        self.whole = whole

    def set_skip(self, skip: int) -> None:
        self.skip = skip

    def end_at_entry(self) -> None:
        """The next entry shuts the gate (the counts already hold it: the window's last entry)."""
        from cyclescope.collect.pointcount import GATE

        self.skip = GATE
        self.ends = getattr(self, "ends", 0) + 1

    def skip_left(self) -> int:
        from cyclescope.collect.pointcount import GATE

        return GATE if self.skip == GATE else 0  # nothing passes while gated; a window's skip is used up

    def attach(self, path: str, offsets: list[int], pid: int = 0) -> int:
        self.attached.append((path, offsets, pid))
        return os.open(os.devnull, os.O_RDONLY)  # a link's fd, closed by the window

    def counts(self, n: int) -> np.ndarray:
        return np.array(self.per_window[:n], np.uint64)

    def detach(self, link: int) -> None:
        os.close(link)


def test_windows_keep_to_the_budget_and_tally_by_addition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tw, "WINDOW_S", 0.0)
    t = tw.TripWindows(anchors=None, loops=None, budget=0.01)
    t.hit_cost_s = 1e-5
    t.counter = FakeCounter([10, 400])
    t.image_key = lambda i: f"img{i}"
    t.targets[(1, 0x1000)] = tw.Target(1, 0x1000, "/bin/x", [0x1000, 0x1010], [0x400, 0x410], pid=42,
                                       hits=np.zeros(2, np.uint64))
    # Windows open while the traps spent stay under the allowance plus the budget's share of the
    # time; each costs 410 hits x 10 us = 4.1 ms, so the allowance pays for five.
    n = 0
    while t._step() == tw.MIN_GAP_S and n < 100:
        n += 1
    assert n == int(tw.ALLOWANCE / 4.1e-3) + 1
    assert t.counter.attached[0] == ("/bin/x", [0x400, 0x410], 42)
    assert t._step() > tw.MIN_GAP_S  # owed: waits for the budget
    table = t.take()
    d = merge(TRIPS, [table, table]).to_pydict()
    # Each window ended at an entry: its 10 entries are 9 whole runs, the other points' hits their ratio's
    assert d["point"] == [0x1000, 0x1010] and d["hits"] == [18 * n, 800 * n] and d["windows"] == [2 * n, 2 * n]
    assert d["entry_hits"] == [18 * n, 18 * n]  # the entry's runs beside each point
    assert t.take().num_rows == 0  # taken: nothing since
    empty = build(TRIPS, {"image": [], "entry": np.zeros(0, np.uint64), "point": np.zeros(0, np.uint64),
                          "hits": np.zeros(0, np.uint64), "windows": np.zeros(0, np.uint64),
                          "entry_hits": np.zeros(0, np.uint64)})
    assert empty.schema == TRIPS.schema
    # A link refused (an instruction uprobes cannot take) before any window counted: the sampled
    # blocks go, the entry and the loop headers are tried again; refused again, the target fails.
    from cyclescope.errors import CycleScopeError

    class Refusing(FakeCounter):
        def attach(self, path: str, offsets: list[int], pid: int = 0) -> int:
            self.attached.append((path, offsets, pid))
            raise CycleScopeError("uprobe_multi refused /bin/y (Invalid argument)")

    r = tw.TripWindows(anchors=None, loops=None, budget=0.01)
    r.counter = Refusing([1, 1, 1])
    r.targets[(2, 0x3000)] = tw.Target(2, 0x3000, "/bin/y", [0x3000, 0x3010, 0x3080], [0, 0x10, 0x80], pid=7,
                                       hits=np.zeros(3, np.uint64), core=2)
    r._step()
    t2 = r.targets[(2, 0x3000)]
    assert t2.points == [0x3000, 0x3010] and t2.failed is None and len(t2.hits) == 2
    r.spent_s = 0.0
    r._step()
    assert t2.failed is not None and r.counter.attached[-1][1] == [0, 0x10]
    # A target whose process is gone (forget) waits for the next sample to name one.
    t.forget(42, 42)
    assert t.targets[(1, 0x1000)].pid == 0 and t._step() == tw.IDLE_S


def test_windows_go_to_procedures_as_their_samples_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tw, "WINDOW_S", 0.0)
    t = tw.TripWindows(anchors=None, loops=None, budget=0.01)
    t.hit_cost_s = 1e-5
    t.counter = FakeCounter([10, 400])
    hot = tw.Target(1, 0x1000, "/bin/x", [0x1000, 0x1010], [0x400, 0x410], pid=42, hits=np.zeros(2, np.uint64),
                    seen=900.0)
    cold = tw.Target(1, 0x2000, "/bin/x", [0x2000, 0x2010], [0x800, 0x810], pid=42, hits=np.zeros(2, np.uint64),
                     seen=100.0)
    t.targets[(1, 0x1000)], t.targets[(1, 0x2000)] = hot, cold
    for _ in range(50):
        t.spent_s = 0.0  # the budget is not what is tested here
        t._step()
    # Each window costs the same: the hot procedure, nine times the samples, gets nine in ten of them
    # (each got one first: a procedure with nothing spent goes first).
    assert cold.total_windows >= 1 and hot.total_windows + cold.total_windows == 50
    assert hot.total_windows == pytest.approx(45, abs=1)
    assert hot.spent_s / hot.seen == pytest.approx(cold.spent_s / cold.seen, rel=0.25)


def test_a_block_held_at_its_floor_shows_its_cpi_and_stall_as_upper_bounds() -> None:
    """A block the repair holds at its floor has a lower bound for a count (analysis/frequency.py's
    sample_floors), so its CPI and dynamic stalls are upper bounds: the listing says "at least" of
    the one and "at most" of the others (they read 600-1,500 CPI where the count is thousands of
    times low)."""
    from cyclescope.analysis.culprits import Stall
    from cyclescope.report.calc import calc_table, summarize

    c = work()
    loop = block(c, 0x11A0)
    c.freq.block_method[loop] = "floor"
    k = next(i for i, ins in enumerate(c.cfg.insns) if ins.address == 0x11B8)  # its 300 samples
    c.dyn[k], c.culprits[k] = 600.0, Stall("d", 600.0, {"d": [0x11B8]})
    sections: dict[str, list[list[str]]] = {}
    for r in calc_table(c, summarize(c)).rows:
        if r[1].startswith("block "):
            at = r[1].split(":")[0].split()[1]
        sections.setdefault(at, []).append(r)
    head, *body = sections["11a0"]
    assert "at least" in head[1] and "actual at most" in head[1]
    cpis = [r[4] for r in body if r[0] and r[4] not in ("", "(0)")]
    stalls = [r[1] for r in body if "cy dynamic stall" in r[1]]
    assert cpis and all(x.startswith("<=") for x in cpis)
    assert stalls and all(" at most " in x for x in stalls)
    # The other blocks keep plain figures.
    assert not any("at most" in r[1] or r[4].startswith("<=") for r in sections["1190"])


def scale_windows(*windows: tuple[int, int]) -> tw.ScaleStats:
    """A SCALE tally's sums from windows of (point hits, entry hits)."""
    p = np.array([w[0] for w in windows], np.float64)
    e = np.array([w[1] for w in windows], np.float64)
    return tw.ScaleStats(int(p.sum()), int(e.sum()), len(windows), float(p @ p), float(e @ e), float(p @ e))


def test_a_scale_ratios_error_comes_from_how_far_its_windows_agree() -> None:
    steady = scale_windows((30, 300), (40, 400), (35, 350))
    assert steady.ratio == pytest.approx(10.0) and steady.ratio_error == pytest.approx(0.0, abs=1e-9)
    assert steady.confidence == "medium"  # 105 hits in 3 windows that agree
    bursty = scale_windows((2, 300), (90, 400), (13, 350))  # as many hits, all in one window
    assert bursty.ratio == pytest.approx(10.0) and (bursty.ratio_error or 0.0) > tw.SCALE_ERROR_LOW
    assert bursty.confidence is None
    assert scale_windows((200, 2000)).ratio_error is None  # one window: no spread to go by
    many = scale_windows(*[(100 + k % 3, 1000 + 10 * (k % 3)) for k in range(12)])
    assert many.confidence == "high"


def test_a_scale_point_carries_its_count_to_a_short_entry() -> None:
    """`work`'s instruction 0x1197 runs once per ten entries (say): its anchor counts 400 runs per
    300 of the procedure's window samples (750,000 cycles a run: undisturbed), and six scale
    windows of the entry and 0x1197 alone counted 2,000 entries beside 200 runs, each ten a run.
    The entry's count is the point's times ten, medium (the ratio's hits), and replaces the
    entry's own anchor, low (short)."""
    point = AnchorStats(hits=400, samples=300, counted_s=1.0, windows=5)
    total = sum(float(v[0]) for v in COUNTS.values())
    runs = 400 / 300 * total
    six = scale_windows(*[(33, 330)] * 4, (34, 340), (34, 340))
    c = work(scale={0x1197: (point, six)})
    entry = block(c, 0x1190)
    assert c.freq.block_method[entry] == "anchor" and c.freq.block_confidence[entry] == "medium"
    assert c.executions(entry) == pytest.approx(runs * 10, rel=0.01)
    assert c.evidence[entry].startswith("10 entries per run of 0x1197 (2,000 against 200 in 6 windows")
    # The entry's own anchor, short (100 cycles an entry: its traps make it low), gives way.
    short = AnchorStats(hits=3_000_000, samples=300, counted_s=1.0, windows=5)
    assert work(anchor=short).freq.block_confidence[entry] == "low"
    both = work(anchor=short, scale={0x1197: (point, six)})
    assert both.executions(entry) == pytest.approx(runs * 10, rel=0.01)
    # In two windows the ratio is low: used where nothing else counts the entry, or over an anchor as
    # unsure whose entries took under a tenth of a point's run (100 cycles against 750,000); not
    # over a surer anchor (high: 375,000 cycles an entry), nor over a low one nearly as long.
    two = scale_windows((25, 250), (25, 250))
    low = work(scale={0x1197: (point, two)})
    assert low.freq.block_confidence[entry] == "low" and low.executions(entry) == pytest.approx(runs * 10, rel=0.01)
    assert work(anchor=short, scale={0x1197: (point, two)}).executions(entry) == pytest.approx(runs * 10, rel=0.01)
    sure = AnchorStats(hits=800, samples=300, counted_s=1.0, windows=5)
    kept = work(anchor=sure, scale={0x1197: (point, two)})
    assert kept.freq.block_confidence[entry] == "high"
    assert kept.executions(entry) != pytest.approx(runs * 10, rel=0.1)
    assert any("the entry's own count stands" in n for n in kept.notes)
    busy = AnchorStats(hits=400_000, samples=300, counted_s=1.0, windows=5)  # 750 cycles a run
    near = work(anchor=short, scale={0x1197: (busy, two)})
    assert near.executions(entry) != pytest.approx(400_000 / 300 * total * 10, rel=0.1)
    # Too few runs beside the entries, windows that disagree, or a point whose windows saw too
    # little: not used, and said.
    few = work(anchor=short, scale={0x1197: (point, scale_windows((9, 90), (10, 100)))})
    assert few.executions(entry) != pytest.approx(runs * 10, rel=0.1)
    assert any("too few for the ratio" in n for n in few.notes)
    torn = work(anchor=short, scale={0x1197: (point, scale_windows((2, 300), (90, 400), (13, 350)))})
    assert any("which disagree" in n for n in torn.notes)
    blind = work(scale={0x1197: (AnchorStats(hits=5, samples=3, counted_s=0.1, windows=1), six)})
    assert blind.freq.block_method[entry] != "anchor"
    assert any("too little seen in its anchor's windows" in n for n in blind.notes)


class OffsetCounter(FakeCounter):
    """Each window counts ``rates[offset]`` hits at each attached offset."""

    def __init__(self, rates: dict[int, int]) -> None:
        super().__init__([])
        self.rates = rates

    def counts(self, n: int) -> np.ndarray:
        return np.array([self.rates.get(o, 0) for o in self.attached[-1][1][:n]], np.uint64)


class FakeAnchors:
    def __init__(self) -> None:
        self.placed: list[tuple[int, int, int, int]] = []
        self.windows: list[list[int | None]] = []
        self.set = self

    def place_point(self, img: int, start: int, at: int, file_offset: int) -> bool:
        self.placed.append((img, start, at, file_offset))
        return True

    def open_point(self, img: int, at: int, pid: int = 0) -> bool:
        self.windows.append([at, None])
        return True

    def close_point(self, img: int, at: int, hits: int | None) -> None:
        self.windows[-1][1] = hits


def test_a_short_entry_surveys_rare_blocks_and_keeps_one_to_scale_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scale windows of a procedure whose entry runs 500,000 times a second: surveys of its other
    blocks, the least sampled first, drop those run as often as the entry (2,000 hits beside 1,000
    entries) and those never run (after SCALE_MAX_RATIO entries), and keep the rare ones as one
    point once together they run once in SCALE_AIM_RATIO entries; then windows of the entry and that
    point alone, every other one, tallied as SCALE rows, each followed by a window of the point alone
    for the point's anchor."""
    from cyclescope.db.tallies import SCALE

    monkeypatch.setattr(tw, "WINDOW_S", 0.0)
    monkeypatch.setattr(tw, "SCALE_BATCH", 2)
    anchors = FakeAnchors()
    t = tw.TripWindows(anchors=anchors, loops=None, budget=0.01)
    t.image_key = lambda i: f"img{i}"
    # Entry 0x1000 (offset 0x400), a header 0x1010; candidates 0x1100 (frequent), 0x1200 (never runs),
    # 0x1300 (one run in 100 entries), 0x1400 (one in 500). A window ends at an entry: 1,001 entries
    # are 1,000 whole runs.
    rates = {0x400: 1001, 0x410: 3000, 0x500: 2000, 0x600: 0, 0x700: 10, 0x800: 2}
    t.counter = OffsetCounter(rates)
    target = tw.Target(1, 0x1000, "/bin/x", [0x1000, 0x1010], [0x400, 0x410], pid=42, hits=np.zeros(2, np.uint64),
                       emulated=[True, True])
    for st in (0x1100, 0x1200, 0x1300, 0x1400):
        target.candidates[st] = (st - 0xC00, True, (st - 0x1000) // 0x100)
        target.scale_pool.append(st)
    target.blocks = np.array([0x1000, 0x1100, 0x1200, 0x1300, 0x1400], np.uint64)
    target.block_samples = np.array([50.0, 2.0, 0.0, 3.0, 1.0])  # surveyed 0x1200, 0x1400, 0x1100, 0x1300
    t.targets[(1, 0x1000)] = target
    t._window(target)  # the entry's rate not known yet: a window of every point
    assert t.counter.attached[-1][1] == [0x400, 0x410] and target.total_windows == 1
    target.entry_rate = 500_000.0
    for _ in range(tw.SCALE_AFTER - 1):  # windows of every point come first: their ratios
        t._window(target)
    assert target.total_windows == tw.SCALE_AFTER and target.scale_windows == 0

    def survey() -> list[int]:
        """The next scale window's offsets (then every other window is one of all the points)."""
        t._window(target)
        got = t.counter.attached[-1][1]
        t._window(target)
        assert t.counter.attached[-1][1] == [0x400, 0x410]
        return got

    assert survey() == [0x400, 0x600, 0x800]  # the least sampled two
    assert 0x1200 in target.scale_pool and target.scale_at is None  # 0 in 1,000 entries: not yet
    assert survey() == [0x400, 0x600, 0x800]
    assert 0x1200 not in target.scale_pool and 0x1400 in target.scale_pool  # never runs; 4 hits so far
    assert survey() == [0x400, 0x800, 0x500]
    assert target.scale_pool == [0x1300] and 0x1100 not in target.scale  # as often as the entry: dropped
    assert target.scale_at is None  # 0x1400 alone runs once in 500 entries: too rare to scale by
    t._window(target)
    assert t.counter.attached[-1][1] == [0x400, 0x700]
    # The point: both rare blocks, counted as one (keyed by the one run most), its tallies from the
    # windows that count the set whole.
    assert target.scale_at == 0x1300 and target.scale_sites == [0x1300, 0x1400]
    assert anchors.placed == [(1, 0x1000, 0x1300, 0x700)]
    assert t.take_scale().num_rows == 0
    before = len(t.counter.attached)
    for _ in range(4):
        t._window(target)
    kinds = [a[1] for a in t.counter.attached[before:]]
    # Each window of the entry and the point is followed by one of the point alone, which the
    # anchors count against the procedure's samples.
    assert kinds == [[0x400, 0x410], [0x400, 0x700, 0x800], [0x700, 0x800], [0x400, 0x410], [0x400, 0x700, 0x800],
                     [0x700, 0x800]]
    assert anchors.windows == [[0x1300, 12], [0x1300, 12]]
    d = t.take_scale().to_pydict()
    assert d["entry"] == [0x1000] and d["point"] == [0x1300]
    assert d["hits"] == [24] and d["entry_hits"] == [2000] and d["windows"] == [2]
    assert d["hits_sq"] == [288.0] and d["entry_sq"] == [2e6] and d["cross"] == [24_000.0]
    assert t.take_scale().num_rows == 0 and t.take_scale().schema == SCALE.schema
    assert "beside rare blocks" in (t.summary() or "")


def test_a_point_run_too_often_is_thinned_to_its_rarer_sites() -> None:
    """A window of the point alone whose runs came under SCALE_ENTRY_S of the process's time apart
    (beside their traps): the site run most leaves the set, which is counted anew under a key not
    used before, with an anchor of its own; a set of one site, or runs far enough apart, stay."""
    anchors = FakeAnchors()
    t = tw.TripWindows(anchors=anchors, loops=None, budget=0.01)
    t.hit_cost_s = t.emulated_hit_s = 1e-6
    target = tw.Target(1, 0x1000, "/bin/x", [0x1000], [0x400], hits=np.zeros(1, np.uint64))
    target.candidates = {0x1300: (0x700, True, 3), 0x1400: (0x800, True, 4)}
    target.scale_at, target.scale_sites, target.used_keys = 0x1300, [0x1300, 0x1400], {0x1300}
    target.scale = {0x1300: tw.ScalePoint(hits=5, windows=1)}
    t._thin(target, [0x1300, 0x1400], np.array([3000, 1000], np.uint64), 0.05)  # 12.5 us a run: stays
    assert target.scale_at == 0x1300 and not anchors.placed
    t._thin(target, [0x1300, 0x1400], np.array([9000, 1000], np.uint64), 0.05)  # 4 us a run beside a 1 us trap
    assert target.scale_at == 0x1400 and target.scale_sites == [0x1400] and 0x1300 in target.scale
    assert anchors.placed == [(1, 0x1000, 0x1400, 0x800)] and target.scale[0x1400].windows == 0
    t._thin(target, [0x1400], np.array([9000], np.uint64), 0.05)  # one site: nothing rarer to keep
    assert target.scale_sites == [0x1400]


def test_windows_count_whole_runs_unless_a_run_did_not_fit() -> None:
    """A window of all the points counts whole runs of the procedure: its other points from the
    first entry on, and it ends at an entry (the counting program shuts it there), so that its
    entries but one are the runs its other points' hits are a ratio to (pointcount.program). A
    procedure whose windows held no whole run, EMPTY_RUNS in a row (entered once a run: a
    program's loop nest), gets windows of fixed length from then on, those not counted."""
    t = tw.TripWindows(anchors=None, loops=None, budget=1.0)
    t.hit_cost_s = 1e-6
    t.counter = FakeCounter([101, 4_000])
    hot = tw.Target(1, 0x1000, "/bin/x", [0x1000, 0x1010], [0x400, 0x410], pid=42, hits=np.zeros(2, np.uint64))
    t.targets[(1, 0x1000)] = hot
    t._window(hot)
    assert t.counter.whole and getattr(t.counter, "ends", 0) == 1
    assert hot.hits.tolist() == [100, 4_000] and not hot.fixed
    d = t.take().to_pydict()
    assert d["entry_hits"] == [100, 100]
    t.counter = FakeCounter([1, 4_000])
    once = tw.Target(1, 0x2000, "/bin/x", [0x2000, 0x2010], [0x800, 0x810], pid=42, hits=np.zeros(2, np.uint64))
    for _ in range(tw.EMPTY_RUNS):
        assert not once.fixed
        t._window(once)
        assert once.windows == 0 and once.hits.tolist() == [0, 0]
    assert once.fixed
    t._window(once)
    assert not t.counter.whole and once.windows == 1 and once.hits.tolist() == [1, 4_000]
