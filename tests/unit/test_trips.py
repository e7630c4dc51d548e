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
    c = work(anchor=anchor, trips={0x1190: (400, 6), 0x11A0: (1_500_000, 6)})
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
    # Without trips, the loop's count is the model's.
    plain = work(anchor=anchor)
    assert plain.freq.block_method[block(plain, 0x11A0)] != "trip-window"
    assert plain.freq.block_confidence[block(plain, 0x11A0)] == "low"


def test_ratios_need_a_measured_point_and_enough_hits() -> None:
    # No point has a measured count: nothing to scale the ratio by; calc says so.
    c = work(trips={0x1190: (400, 6), 0x11A0: (15_000, 6)})
    assert c.freq.block_method[block(c, 0x11A0)] != "trip-window"
    assert any("none of them has a measured count" in n for n in c.notes)
    # Too few entries in the windows: the ratio is not used.
    anchor = AnchorStats(hits=500, samples=151, counted_s=1.0, windows=10)
    few = work(anchor=anchor, trips={0x1190: (tw.MIN_HITS - 1, 1), 0x11A0: (71_000, 1)})
    assert few.freq.block_method[block(few, 0x11A0)] != "trip-window"
    # Between MIN_HITS and MEDIUM_HITS: used, in low confidence.
    low = work(anchor=anchor, trips={0x1190: (50, 2), 0x11A0: (187_500, 2)})
    assert low.freq.block_method[block(low, 0x11A0)] == "trip-window"
    assert low.freq.block_confidence[block(low, 0x11A0)] == "low"
    # Hits enough for high confidence, but all from two windows: one phase of the run, low.
    one = work(anchor=anchor, trips={0x1190: (1_500, 2), 0x11A0: (5_625_000, 2)})
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

    def zero(self, n: int, skip: int = 0) -> None:
        self.skip = skip

    def set_skip(self, skip: int) -> None:
        self.skip = skip

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
    assert d["point"] == [0x1000, 0x1010] and d["hits"] == [20 * n, 800 * n] and d["windows"] == [2 * n, 2 * n]
    assert t.take().num_rows == 0  # taken: nothing since
    empty = build(TRIPS, {"image": [], "entry": np.zeros(0, np.uint64), "point": np.zeros(0, np.uint64),
                          "hits": np.zeros(0, np.uint64), "windows": np.zeros(0, np.uint64)})
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
