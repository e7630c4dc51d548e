"""Loops, their counter registers, and iterations counted between samples (synthetic samples)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cyclescope.analysis.cfg import build_cfg
from cyclescope.analysis.loopcount import LoopCounter, LoopStats, analyze_procedure, loop_executions, loop_table
from cyclescope.analysis.loops import GPRS, find_loops
from cyclescope.db.layout import Database
from cyclescope.db.tallies import LOOPS, build, compact_tallies, load_tally, merge, tally_files, write_tally
from cyclescope.images.disasm import disassemble, insn_info

# gcc -O2 of tests/programs/kernels.c: chain (one loop, counter rdx) and nested (an outer loop
# counted by rsi, an inner one by rax, its bound r9 set by the outer loop).
CHAIN = bytes.fromhex("4885ff7e2b31d2b8010000000f1f40004889c148c1e1054829c14889d04883c20148c1f8024831c84839d775e3c3"
                      "6690b801000000c3")
CHAIN_AT = 0x1340
NESTED = bytes.fromhex("4885ff7e4331f64531c0660f1f4400004989f131c931c04183e10f4983c101904889f24829c2a801480f45d148"
                       "83c0014801f14901d04c39c875e54883c6014839f775cc4c89c0c34531c04c89c0c3")
NESTED_AT = 0x1470
COL = {r: i for i, r in enumerate(GPRS)}


def loops_of(code: bytes, at: int):  # type: ignore[no-untyped-def]
    insns, infos = disassemble(code, at), insn_info(code, at)
    cfg = build_cfg(insns, at, at + len(code), infos=infos)
    return find_loops(cfg, infos)


def test_a_counted_loop_has_its_counter_its_step_and_the_offset_at_each_instruction() -> None:
    (lp,) = loops_of(CHAIN, CHAIN_AT)
    assert lp.header == 0x1350 and not lp.calls and lp.depth == 1
    (c,) = lp.counters
    assert (c.reg, c.step, c.width) == ("rdx", 1, 64)
    assert c.offsets[0x1350] == 0 and c.offsets[0x135d] == 0 and c.offsets[0x1361] == 1 and c.offsets[0x136b] == 1
    assert "rdi" in lp.invariants and "rsp" in lp.invariants and "rax" not in lp.invariants


def test_nested_loops_each_count_and_the_outer_counter_is_an_invariant_of_the_inner() -> None:
    outer, inner = loops_of(NESTED, NESTED_AT)
    assert (outer.header, inner.header) == (0x1480, 0x1490)
    assert inner.parent == outer.id and inner.depth == 2 and inner.blocks < outer.blocks
    assert [(c.reg, c.step) for c in outer.counters] == [("rsi", 1)]
    assert [(c.reg, c.step) for c in inner.counters] == [("rax", 1)]  # rcx grows by rsi: not a constant
    assert "rsi" in inner.invariants and "r9" in inner.invariants
    assert outer.counters[0].offsets[0x1490] == 0  # the inner loop does not move the outer counter


def test_a_counters_start_and_end_give_each_executions_trip_count() -> None:
    """nested's inner loop: j starts at 0 (xor eax, eax before it) and leaves when it reaches r9
    ((i & 15) + 1, set by the outer loop); chain's i runs from 0 to rdi."""
    from cyclescope.analysis.loops import Term

    _outer, inner = loops_of(NESTED, NESTED_AT)
    (c,) = inner.counters
    assert c.init == Term(None, 0) and c.limit == Term("r9", -1)
    (lp,) = loops_of(CHAIN, CHAIN_AT)
    assert lp.counters[0].init == Term(None, 0) and lp.counters[0].limit == Term("rdi", -1)


# gcc -O2 of: for (long i = 0; i < n; i += 3) s += a[i] * 7;  (cmp rsi, rdx; jg back)
STRIDE = bytes.fromhex("4885f67e2331d231c00f1f8000000000488b0cd74883c203488d04c84829c84839d67fecc3")


def test_a_loop_that_leaves_on_passing_its_bound_gives_its_trip_count() -> None:
    from cyclescope.analysis.loopcount import _trips
    from cyclescope.analysis.loops import Term

    (lp,) = loops_of(STRIDE, 0)
    (c,) = lp.counters
    assert (c.reg, c.step, c.init, c.limit) == ("rdx", 3, Term(None, 0), Term("rsi", -3, "cross"))
    t = loop_table(STRIDE, 0, len(STRIDE))
    spec = t.trips[0]
    assert spec is not None
    k = int(np.searchsorted(t.addrs, 0x10))
    rows = []
    for n, i in [(300, 0), (300, 297), (301, 300), (2, 0)]:
        r = [0] * 16
        r[COL["rsi"]], r[COL["rdx"]] = n, i
        rows.append(r)
    got, inv = _trips(spec, np.array(rows, np.uint64), np.full(4, k))
    # 100, 100, 101 and 1 header runs: i = 0, 3, ... while below n
    assert got == 4 and inv == pytest.approx(1 / 100 + 1 / 100 + 1 / 101 + 1)


def test_samples_say_the_mean_trip_count_per_execution() -> None:
    """Executions of 4 and 12 iterations, sampled in proportion to their iterations (1 sample in the
    short one for every 3 in the long one): the mean per execution is 8, not the samples' 10."""
    from cyclescope.analysis.loopcount import _trips

    t = loop_table(NESTED, NESTED_AT, NESTED_AT + len(NESTED))
    spec = t.trips[1]
    assert spec is not None
    k = int(np.searchsorted(t.addrs, 0x1490))  # the inner header: j as it is
    rows = []
    for r9, j in [(4, 2), (12, 0), (12, 5), (12, 11)]:
        r = [0] * 16
        r[COL["r9"]], r[COL["rax"]] = r9, j
        rows.append(r)
    bad = [0] * 16
    bad[COL["r9"]], bad[COL["rax"]] = 4, 9  # a counter past its limit: not this loop's execution
    regs_ = np.array([*rows, bad], np.uint64)
    n, inv = _trips(spec, regs_, np.full(5, k))
    assert n == 4 and n / inv == pytest.approx(4 / (1 / 4 + 3 / 12))
    assert n / inv == pytest.approx(8.0)


@dataclass
class FakeBinary:
    """binaries.code.Binary over one procedure's bytes."""

    code_bytes: bytes
    at: int

    def procedure(self, start: int):  # type: ignore[no-untyped-def]
        from cyclescope.binaries.code import Procedure

        return Procedure(self.at, self.at + len(self.code_bytes), "f") if start == self.at else None

    def code(self, start: int, end: int) -> bytes:
        return self.code_bytes[start - self.at : end - self.at]

    def name_at(self, addr: int) -> str | None:
        return None

    def read(self, addr: int, n: int) -> bytes | None:
        return None


@dataclass
class FakeSource:
    """analysis.loopcount.Source: image 1 is one procedure."""

    b: FakeBinary

    def bounds(self, img: int) -> tuple[np.ndarray, np.ndarray] | None:
        if img != 1:
            return None
        return np.array([self.b.at], np.uint64), np.array([self.b.at + len(self.b.code_bytes)], np.uint64)

    def analyze(self, img: int, start: int):  # type: ignore[no-untyped-def]
        return analyze_procedure(self.b, start)


def counter(per_task: bool = True) -> LoopCounter:
    return LoopCounter(FakeSource(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", per_task, background=False,
                       analyze_after=1)


def regs(rdx: int, rdi: int = 1000, rsp: int = 0x7FFF0000) -> list[int]:
    r = [0] * 16
    r[COL["rdx"]], r[COL["rdi"]], r[COL["rsp"]] = rdx, rdi, rsp
    return r


def add(lc: LoopCounter, rows: list[tuple[int, int, int, list[int]]], cpu: int = 0, period: float = 1000.0) -> None:
    """rows: (tid, time, offset, registers)."""
    lc.add(np.array([r[0] for r in rows]), np.array([r[1] for r in rows], np.uint64), np.full(len(rows), cpu),
           np.ones(len(rows), np.int64), np.array([r[2] for r in rows], np.uint64), np.full(len(rows), period),
           np.array([r[3] for r in rows], np.uint64))


def stats(lc: LoopCounter) -> dict[str, float]:
    t = lc.take().to_pydict()
    assert t["header"] == [0x1350]
    return {k: v[0] for k, v in t.items()}


def test_pairs_in_one_execution_count_iterations_across_drains() -> None:
    lc = counter()
    # rdx before 0x1361 is one ahead of its value at the header: the offsets take it back.
    add(lc, [(7, 1, 0x1357, regs(100)), (7, 2, 0x1361, regs(351)), (8, 2, 0x1350, regs(5))])
    add(lc, [(7, 3, 0x1368, regs(601)), (8, 3, 0x1350, regs(505))])
    lc.finish()
    s = stats(lc)
    # thread 7: 100 -> 350 -> 600 iterations at the header; thread 8: 5 -> 505
    assert s["pairs"] == 3 and s["iterations"] == 250 + 250 + 500
    assert s["own"] == 5 and s["pair_period"] == 3000.0 and s["mismatched"] == 0 and s["rejected"] == 0


def test_other_executions_are_told_apart_by_invariants_and_backward_counters() -> None:
    lc = counter()
    add(lc, [(7, 1, 0x1350, regs(100)), (7, 2, 0x1350, regs(900, rdi=2000)),  # another bound: another execution
             (7, 3, 0x1350, regs(40, rdi=2000)),  # the counter went back: a new execution, same invariants
             (7, 4, 0x1350, regs(90, rdi=2000))])
    lc.finish()
    s = stats(lc)
    assert s["mismatched"] == 1 and s["rejected"] == 1 and s["pairs"] == 1 and s["iterations"] == 50


def test_system_wide_pairs_need_one_cpu_and_no_gap() -> None:
    lc = counter(per_task=False)
    add(lc, [(7, 1000, 0x1350, regs(0)), (7, 2000, 0x1350, regs(10))], cpu=0)  # one period later: counts
    add(lc, [(7, 9000, 0x1350, regs(20))], cpu=0)  # 7 periods later: the thread did not run throughout
    add(lc, [(7, 10000, 0x1350, regs(30))], cpu=1)  # another CPU
    lc.finish()
    s = stats(lc)
    assert s["pairs"] == 1 and s["iterations"] == 10 and s["pair_period"] == 1000.0


def test_samples_wait_for_their_binary_and_procedure_in_the_worker(tmp_path: Path) -> None:
    """The worker process opens the binary and analyzes it; the recording's samples wait for it."""
    import shutil
    import subprocess

    from cyclescope.images.elf import read_load_info
    from cyclescope.images.registry import ImageInfo

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    src = Path(__file__).parents[1] / "programs" / "kernels.c"
    exe = tmp_path / "kernels"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(src)], check=True)
    nm = subprocess.run(["nm", str(exe)], capture_output=True, text=True).stdout
    chain = next(int(ln.split()[0], 16) for ln in nm.splitlines() if ln.endswith(" chain"))
    bid = read_load_info(str(exe)).build_id
    info = ImageInfo(bid or "k", str(exe), "elf", bid)
    lc = LoopCounter(None, lambda i: "img", True, background=True, analyze_after=1, info_of=lambda i: info)
    try:
        # the loop's header is where the function's code jumps back to: ask the analysis for it
        from cyclescope.analysis.loopcount import analyze_procedure
        from cyclescope.binaries.code import open_binary
        from cyclescope.binaries.symbolize import Symbolizer

        table, _ = analyze_procedure(open_binary(info, Symbolizer(None)), chain)
        header = int(table.headers[0])
        add(lc, [(7, 1, header, regs(0)), (7, 2, header, regs(10))])
        lc.finish(timeout_s=60)
    finally:
        lc.close()
    t = lc.take().to_pydict()
    assert t["header"] == [header] and t["iterations"] == [10] and lc.skipped == 0


def test_executions_from_the_rate_and_the_sampled_time() -> None:
    st = LoopStats(own=100, own_period=100 * 200.0, followed=100, next_own=99, pairs=99, iterations=99 * 50.0,
                   pair_period=99 * 200.0)
    est = loop_executions(st, 100, 210.0, calls=False)
    assert est is not None and est.confidence == "high"
    assert est.executions == pytest.approx(100 * 200.0 * 0.25)  # the loop's own periods, not the run's mean
    # A loop that calls out: own samples are the share followed by another of its own.
    st2 = LoopStats(own=100, own_period=20000.0, followed=100, next_own=50, pairs=50, iterations=50 * 50.0,
                    pair_period=50 * 200.0)
    est2 = loop_executions(st2, 100, 200.0, calls=True)
    assert est2 is not None and est2.confidence == "medium" and est2.executions == pytest.approx(2 * 100 * 200 * 0.25)
    # Executions shorter than a period: pairs in one execution are rare and biased; not used.
    assert loop_executions(LoopStats(own=100, followed=100, next_own=100, pairs=10, iterations=500.0,
                                     pair_period=2000.0), 100, 200.0, False) is None


def test_a_procedure_is_analyzed_once_it_has_enough_samples() -> None:
    lc = LoopCounter(FakeSource(FakeBinary(CHAIN, CHAIN_AT)), lambda i: "img", True, background=False,
                     analyze_after=3)
    add(lc, [(7, 1, 0x1350, regs(0)), (7, 2, 0x1350, regs(10))])  # two samples in the image: not opened yet
    add(lc, [(7, 3, 0x1350, regs(20)), (7, 4, 0x1350, regs(30))])  # opened; two in the procedure: not yet
    add(lc, [(7, 5, 0x1350, regs(40)), (7, 6, 0x1350, regs(50))])  # analyzed: counted from here
    lc.finish()
    s = stats(lc)
    assert s["pairs"] == 2 and s["iterations"] == 20 and lc.skipped == 2


def test_loop_table_arrays_match_the_loops() -> None:
    t = loop_table(NESTED, NESTED_AT, NESTED_AT + len(NESTED))
    assert [hex(h) for h in t.headers.tolist()] == ["0x1480", "0x1490"]
    k = int(np.searchsorted(t.addrs, 0x1493))
    assert t.inner[k] == 1 and t.anc[1, 1] == 0 and t.anc[1, 2] == 1
    # The CFG's block starts (trip windows count the blocks that hold samples).
    assert {0x1480, 0x1490}.issubset(set(t.blocks.tolist())) and (np.diff(t.blocks.astype(np.int64)) > 0).all()


def _tally(image: str, header: int, pairs: int) -> object:
    cols = {n: [0] for n in LOOPS.schema.names}
    cols.update(image=[image], header=[header], pairs=[pairs], own=[pairs + 1], iterations=[10 * pairs],
                own_period=[1.0], pair_period=[2.0])
    return build(LOOPS, cols)


def test_tallies_merge_by_addition_and_compaction_skips_a_corrupt_file(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    ep = db.new_epoch()
    write_tally(db, ep, "h", LOOPS, _tally("a", 1, 3))  # type: ignore[arg-type]
    write_tally(db, ep, "h", LOOPS, _tally("a", 1, 4))  # type: ignore[arg-type]
    bad = write_tally(db, ep, "h", LOOPS, _tally("b", 2, 1))  # type: ignore[arg-type]
    bad.write_bytes(b"not parquet")
    write_tally(db, ep, "h", LOOPS, _tally("a", 1, 5))  # type: ignore[arg-type]
    sel = load_tally(db, LOOPS, [ep], images={"a"})
    assert sel.table.to_pydict()["pairs"] == [12] and len(sel.corrupt) == 1
    r = compact_tallies(db, ep, "h", LOOPS)
    assert r is not None and r.merged == 2 and r.skipped_corrupt == [bad.name]
    names = [f.name for f in tally_files(db, ep, "h", LOOPS)]
    assert bad.name in names and len(names) == 3  # merged 1-2, the corrupt 3, and 4
    assert load_tally(db, LOOPS, [ep]).table.to_pydict()["iterations"] == [120]
    m = merge(LOOPS, [_tally("a", 1, 1), _tally("b", 1, 1)])  # type: ignore[list-item]
    assert m.num_rows == 2


def test_loop_tables_round_trip_through_the_cache(tmp_path: Path) -> None:
    from cyclescope.analysis.loopcount import table_arrays, table_from_arrays
    from cyclescope.images.cache import Cache

    t = loop_table(NESTED, NESTED_AT, NESTED_AT + len(NESTED))
    cache = Cache(tmp_path)
    cache.save_arrays("bid", "loops-1470", table_arrays(t))
    got = table_from_arrays(cache.load_arrays("bid", "loops-1470") or {})
    assert got is not None
    assert (got.addrs == t.addrs).all() and (got.inner == t.inner).all() and (got.anc == t.anc).all()
    assert [list(x) for x in got.invariants] == [list(x) for x in t.invariants]
    every = np.arange(len(t.addrs))
    for a, b in zip(got.counters, t.counters, strict=True):
        assert [(c[0], c[1], c[2], c[3][every].tolist(), c[4][every].tolist()) for c in a] == [
            (c[0], c[1], c[2], c[3][every].tolist(), c[4][every].tolist()) for c in b]
        assert all(c[4][every].any() for c in a)
    assert [(*x[:7], x[9]) if x else None for x in got.trips] == [(*x[:7], x[9]) if x else None for x in t.trips]
    assert got.blocks.tolist() == t.blocks.tolist() and len(got.blocks)
    bad = table_arrays(t)
    bad["version"] = bad["version"] + 1
    assert table_from_arrays(bad) is None  # another version's table is not used


def test_a_window_reads_as_the_whole_array() -> None:
    """A counter's offsets and validity are kept over its loop's instructions only, and read as the
    per-instruction arrays they stand for (zero and False outside)."""
    from cyclescope.analysis.loopcount import Window

    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 60))
        valid = np.zeros(n, bool)
        lo, hi = sorted(rng.integers(0, n, 2).tolist())
        valid[lo : hi + 1] = rng.random(hi + 1 - lo) < 0.7
        offs = np.where(valid, rng.integers(-8, 8, n), 0)
        wo, wv = Window.pair(offs, valid)
        ix = rng.integers(-3, n + 3, 40)
        inside = (ix >= 0) & (ix < n)
        assert (wv[ix] == np.where(inside, valid[np.clip(ix, 0, n - 1)], False)).all()
        assert (wo[ix] == np.where(inside, offs[np.clip(ix, 0, n - 1)], 0)).all()
        assert wv.indices().tolist() == np.flatnonzero(valid).tolist()
        assert wo.nbytes <= offs.nbytes + 16


def test_dominators_agree_with_networkx_on_random_graphs() -> None:
    import random

    import networkx as nx

    from cyclescope.analysis.cfg import ENTRY, Edge
    from cyclescope.analysis.loops import dominators

    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 30)
        edges = [Edge(0, ENTRY, 0, "entry")]
        for _k in range(rng.randint(n - 1, 3 * n)):
            edges.append(Edge(len(edges), rng.randrange(n), rng.randrange(n), "jump"))

        class G:
            pass

        cfg = G()
        cfg.edges = edges  # type: ignore[attr-defined]
        g = nx.DiGraph()
        g.add_node(ENTRY)
        g.add_edges_from((e.src, e.dst) for e in edges)
        want = {b: d for b, d in nx.immediate_dominators(g, ENTRY).items() if b >= 0}
        assert dominators(cfg) == want  # type: ignore[arg-type]


def test_loop_tables_past_their_budget_go_least_recently_used_first() -> None:
    """A daemon keeps at most max_table_bytes of loop tables: the least recently used goes, and a
    procedure sampled again is analyzed again (from the cache, in a real run) and counts on."""

    class TwoImages(FakeSource):
        def bounds(self, img: int) -> tuple[np.ndarray, np.ndarray] | None:
            return super().bounds(1)

    lc = LoopCounter(TwoImages(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", True, background=False,
                     analyze_after=1)
    lc.max_table_bytes = 1  # room for one table: the newest always stays

    def add_in(img: int, tid: int, rows: list[tuple[int, int]]) -> None:
        lc.add(np.full(len(rows), tid), np.array([t for t, _ in rows], np.uint64), np.zeros(len(rows), np.int64),
               np.full(len(rows), img, np.int64), np.full(len(rows), 0x1350, np.uint64),
               np.full(len(rows), 1000.0), np.array([regs(v) for _, v in rows], np.uint64))

    add_in(1, 7, [(1, 0), (2, 10)])
    assert set(lc._tables) == {(1, CHAIN_AT)} and lc.evicted == 0
    add_in(2, 8, [(1, 0), (2, 10)])
    assert set(lc._tables) == {(2, CHAIN_AT)} and lc.evicted == 1
    add_in(1, 7, [(3, 20), (4, 30)])
    assert set(lc._tables) == {(1, CHAIN_AT)} and lc.evicted == 2
    assert lc._held_bytes == next(iter(lc._held.values()))
    lc.finish()
    t = lc.take().to_pydict()
    assert sorted(t["image"]) == ["img1", "img2"] and sum(t["pairs"]) >= 3, t


def test_the_loop_counter_imports_no_analysis_until_it_analyzes() -> None:
    """A recording whose loop tables are cached never builds a CFG: the loop counter's module leaves
    the disassembler, the CFG and the loop finder unimported (14 ms of start-up) until it analyzes."""
    code = ("import sys; import cyclescope.analysis.loopcount, cyclescope.analysis.anchors;"
            "print(sorted(m for m in ('cyclescope.analysis.cfg', 'cyclescope.analysis.loops',"
            " 'cyclescope.images.disasm', 'capstone') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_analyses_budget_grants_an_allowance_at_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """ANALYSIS_BUDGET of a CPU over the run, beyond ANALYSIS_ALLOWANCE_S at the start: the first
    image opened on a fresh cache (0.2-0.3 s of the worker's CPU) no longer holds the first
    procedure's analysis back for seconds."""
    import cyclescope.analysis.loopcount as lcm

    lc = counter(per_task=False)
    now = [lc._started + 1.0]
    monkeypatch.setattr(lcm.time, "monotonic", lambda: now[0])
    lc.analysis_s = 0.3  # one second in: over the 10% share, within the allowance
    assert not lc._over_budget()
    lc.analysis_s = lcm.ANALYSIS_BUDGET * 1.0 + lcm.ANALYSIS_ALLOWANCE_S + 0.01
    assert lc._over_budget()
    now[0] += 10.0  # the share of the time since pays for it
    assert not lc._over_budget()
