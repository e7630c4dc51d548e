"""Entry counts from arguments that move forward (analysis/progress.py), with synthetic inputs:
the copy propagation over hand-assembled code, the probe sites, the pairs of samples, the
windows' moves, the estimate and its confidence, and calc's use of it."""

from __future__ import annotations

import numpy as np
import pytest

from cyclescope.analysis import progress as pg
from cyclescope.analysis import trips as tw
from cyclescope.analysis.loopcount import LoopCounter, loop_table, table_arrays, table_from_arrays
from cyclescope.analysis.progress import ProgressStats, entries_from_progress
from cyclescope.db.tallies import PROGRESS, merge
from cyclescope.images.disasm import uprobe_emulated
from cyclescope.perf.abi import GPRS
from tests.unit.test_loops import FakeBinary, FakeSource
from tests.unit.test_trips import FakeCounter, block, work

COL = {r: i for i, r in enumerate(GPRS)}
AT = 0x1000
# f(rdi, rsi, rdx):        push rbx; mov ebx, esi; mov rax, rdi
# 0x1006 (loop):            add rax, 1; cmp rax, rdx; jne 0x1006
# 0x100f:                   call 0x2000; pop rbx; ret
CODE = bytes.fromhex("53" "89f3" "4889f8" "4883c001" "4839d0" "75f7" "e8ec0f0000" "5b" "c3")


def table():  # type: ignore[no-untyped-def]
    return loop_table(CODE, AT, AT + len(CODE))


def held(t, addr: int, arg: str) -> str | None:  # type: ignore[no-untyped-def]
    k = int(np.searchsorted(t.addrs, addr))
    c = int(t.args[k, pg.ARGS.index(arg)])
    return None if c < 0 else GPRS[c % pg.W32] + ("/32" if c >= pg.W32 else "")


def test_entry_values_are_followed_through_copies_until_written_or_clobbered() -> None:
    t = table()
    assert not t.empty and [int(h) for h in t.headers] == [0x1006]
    assert held(t, 0x1000, "rsi") == "rsi" and held(t, 0x1000, "rdi") == "rdi"
    # In the loop rsi still holds itself (preferred to rbx's low half); rdi too (rax is its copy,
    # then written); rdx is read only.
    assert held(t, 0x100A, "rsi") == "rsi" and held(t, 0x100A, "rdi") == "rdi" and held(t, 0x100A, "rdx") == "rdx"
    # After the call the caller-saved registers are gone; rbx keeps the low half of rsi.
    assert held(t, 0x1014, "rsi") == "rbx/32"
    assert held(t, 0x1014, "rdi") is None and held(t, 0x1014, "rdx") is None
    # An argument a 32-bit copy holds somewhere is taken modulo 2**32 everywhere.
    assert t.argwidth[: pg.NARGS].tolist() == [64, 32, 64, 64, 64, 64]
    # No value of its own is held in the loop (rax is a copy, then written in it): no progress point.
    assert t.point == 0 and (t.args[:, pg.NARGS :] < 0).all()
    # The cache's arrays give the same table back.
    again = table_from_arrays(table_arrays(t))
    assert again is not None and np.array_equal(again.args, t.args) and np.array_equal(again.sites, t.sites)
    # A cached table of another version, or arrays that do not make one, is analyzed again.
    assert table_from_arrays({**table_arrays(t), "version": np.array([1])}) is None
    broken = table_arrays(t)
    del broken["sites"]
    assert table_from_arrays(broken) is None


# f(this, end):             push rbx; mov ecx, [rdi+0x34]; mov rbx, [rdi+0x10]; add rbx, rcx;
#                           mov eax, 0; jmp 0x2012
# 0x2012 (loop):            movzx edx, byte [rbx+rax]; add rax, 1; cmp rdx, rsi; jne 0x2012
# 0x201f:                   pop rbx; ret
MEMBER = bytes.fromhex("53" "8b4f34" "488b5f10" "4801cb" "b800000000" "eb00" "0fb61403" "4883c001" "4839f2" "75f3"
                       "5b" "c3")


def test_a_value_loaded_before_the_loops_is_followed_from_the_progress_point() -> None:
    """A position read from a structure (lzip's match finder: ``this->pos``) and the pointer into
    the buffer made from it are no argument: the progress point is where the registers hold them
    before the loop, at the jump (the kernel emulates it) rather than the constant's load before."""
    at = 0x2000
    t = loop_table(MEMBER, at, at + len(MEMBER))
    assert t.point == 0x2010
    rbx, rcx = pg.NARGS + COL["rbx"], pg.NARGS + COL["rcx"]
    k = {int(a): i for i, a in enumerate(t.addrs)}
    # held from the point through the loop, and not before it
    assert t.args[k[0x2010], rbx] == COL["rbx"] and t.args[k[0x2012], rbx] == COL["rbx"]
    assert t.args[k[0x201a], rcx] == COL["rcx"] and t.args[k[0x2008], rbx] < 0
    # rax holds a constant there (not a value of its own); the arguments are still followed
    assert (t.args[:, pg.NARGS + COL["rax"]] < 0).all() and t.args[k[0x201a], pg.ARGS.index("rsi")] == COL["rsi"]
    assert pg.value_name(rbx, t.point) == "rbx at the progress point 0x2010"
    again = table_from_arrays(table_arrays(t))
    assert again is not None and again.point == t.point and np.array_equal(again.args, t.args)


# f(rdi, rsi, rdx):        push rbx; sub rsp, 0x20; mov [rsp+8], rsi; mov [rsp+0x10], edx;
#                           lea rax, [rsp+0x18]; mov [rsp+0x18], rdi; xor edi, edi; xor esi, esi;
#                           xor edx, edx
# 0x401e (loop):            add rsi, 1; mov ecx, [rax]; cmp rsi, 100; jne 0x401e
# 0x402a:                   mov rcx, [rsp+8]; call 0x4034; add rsp, 0x20; pop rbx; ret
SPILL_AT = 0x4000
SPILL = bytes.fromhex("53" "4883ec20" "4889742408" "89542410" "488d442418" "48897c2418" "31ff" "31f6" "31d2"
                      "4883c601" "8b08" "4883fe64" "75f4" "488b4c2408" "e800000000" "4883c420" "5b" "c3")


def test_values_spilled_to_the_stack_are_followed_in_its_words() -> None:
    """zstd's match finder stores its position argument at [rsp + 0x48] and holds nothing of it in
    a register through its loops: the stack words above rsp are followed as the registers are
    (columns 16 and up), the samples carrying them (perf/abi.STACK_WORDS)."""
    t = loop_table(SPILL, SPILL_AT, SPILL_AT + len(SPILL))
    k = {int(a): i for i, a in enumerate(t.addrs)}
    word = lambda w, half=False: 16 + w + (pg.W32 if half else 0)  # noqa: E731
    rdi, rsi, rdx = (pg.ARGS.index(r) for r in ("rdi", "rsi", "rdx"))
    # in the loop: rsi in word 1 (rsp + 8, after the push and the sub), rdx's low half in word 2
    assert t.args[k[0x4022], rsi] == word(1) and t.args[k[0x4022], rdx] == word(2, True)
    # rdi went to rsp + 0x18, at and above a local whose address was taken (lea rax, [rsp+0x18]): a
    # store through rax may change it unseen, so it holds nothing
    assert t.args[k[0x4022], rdi] < 0
    # loaded back into rcx; then the call ends both (rcx is the caller's to save, and rsp + 8 is where
    # a callee's stack arguments are)
    assert t.args[k[0x402f], rsi] == COL["rcx"] and t.args[k[0x4034], rsi] < 0
    assert t.argwidth[rdx] == 32 and t.argwidth[rsi] == 64
    # Where the procedure copies rsp (a frame pointer), no stack word is followed.
    g = bytes.fromhex("55" "4889e5" "4883ec10" "4889742408" "4883c701" "4839d7" "75f7" "c9" "c3")
    tg = loop_table(g, 0x5000, 0x5000 + len(g))
    assert not tg.empty and ((tg.args < 0) | (tg.args % pg.W32 < 16)).all()


def test_blocks_are_probed_where_the_kernel_emulates_the_hit() -> None:
    emulated = {"41 57": True, "55": True, "75 10": True, "0f 85 00 00 00 00": True, "e8 00 00 00 00": True,
                "eb 05": True, "90": True, "f2 e9 00 00 00 00": True,
                "48 89 e5": False, "0f 1f 40 00": False, "66 90": False, "c3": False, "f3 0f 1e fa": False,
                "ff e0": False, "48 50": False, "f3 90": False, "66 e8 00 00": False}
    for raw, want in emulated.items():
        assert uprobe_emulated(bytes.fromhex(raw.replace(" ", ""))) is want, raw
    t = table()
    sites = dict(zip(t.blocks.tolist(), zip(t.sites.tolist(), t.site_emulated.tolist(), strict=True), strict=True))
    # the entry at its push, the loop at its jne (its first instruction is not emulated), the
    # last block at its call
    assert sites[0x1000] == (0x1000, True) and sites[0x1006] == (0x100D, True) and sites[0x100F] == (0x100F, True)
    from cyclescope.analysis.loopcount import block_site
    from cyclescope.images.disasm import disassemble

    # Nothing emulated before a call (whose callee may not return): the block's first instruction.
    insns = disassemble(bytes.fromhex("4889e5" "ffd0" "55"), 0x3000)  # mov rbp, rsp; call rax; push rbp
    assert block_site(insns) == (0x3000, False)


def counter() -> LoopCounter:
    return LoopCounter(FakeSource(FakeBinary(CODE, AT)), lambda i: f"img{i}", True, background=False,
                       analyze_after=1)


def regs(rdi: int, rsi: int, rbx: int = 0) -> list[int]:
    r = [0] * 16
    r[COL["rdi"]], r[COL["rsi"]], r[COL["rbx"]], r[COL["rdx"]] = rdi, rsi, rbx, 77
    return r


def add(lc: LoopCounter, rows: list[tuple[int, int, int, list[int]]], period: float = 1000.0) -> None:
    lc.add(np.array([r[0] for r in rows]), np.array([r[1] for r in rows], np.uint64), np.zeros(len(rows), np.int64),
           np.ones(len(rows), np.int64), np.array([r[2] for r in rows], np.uint64), np.full(len(rows), period),
           np.array([r[3] for r in rows], np.uint64))


def test_pairs_of_samples_add_up_an_arguments_moves_across_drains() -> None:
    lc = counter()
    # Thread 7 in the procedure at positions 10, 40 (rsi; rbx's low half after the call), a sample
    # elsewhere between (image 1 has nothing at 0x5000: it counts in the thread's time only), 70.
    add(lc, [(7, 1, 0x100A, regs(5, 10)), (7, 2, 0x5000, regs(0, 0)), (7, 3, 0x1014, regs(5, 999, rbx=40))])
    add(lc, [(7, 4, 0x100A, regs(5, 70)),
             (7, 5, 0x100A, regs(5, 20)),  # back: a new stream; its move is not known
             (8, 5, 0x1006, regs(9, 1 << 40))])  # another thread: its own sequence
    lc.finish()
    assert not lc.moving(1, AT)  # two moves forward: too few for windows to be spent on it
    d = merge(PROGRESS, [lc.take_progress()]).to_pydict()
    rows = {a: i for i, a in enumerate(d["arg"])}
    rsi = rows[pg.ARGS.index("rsi")]
    # 10 -> 40 over two periods (the sample elsewhere between), 40 -> 70 over one; 70 -> 20 back
    assert d["pairs"][rsi] == 2 and d["delta"][rsi] == 60 and d["pair_period"][rsi] == 3000.0
    assert d["back"][rsi] == 1 and d["back_period"][rsi] == 1000.0
    # rdi (a struct pointer, say) does not move; no register holds it after the call (0x1014): its
    # pairs are of the samples that know it, the first to the fourth (across the drains, over the
    # third) and the fourth to the fifth, their time the thread's between them
    rdi = rows[pg.ARGS.index("rdi")]
    assert d["pairs"][rdi] == 2 and d["delta"][rdi] == 0 and d["pair_period"][rdi] == 4000.0
    assert lc.take_progress().num_rows == 0  # taken
    # The total: known moves, and the unknown one at the rate of the others.
    st = ProgressStats(pairs=2, delta=60, pair_period=3000.0, back=1, back_period=1000.0)
    assert st.total == pytest.approx(80.0)


def test_a_values_last_known_sample_is_its_own_threads() -> None:
    """Each value's pairs run between the samples of one thread that know it, across drains: a
    thread whose first drain knew no rdi (its samples after the call, 0x1014) starts rdi's pairs
    at its next sample that knows it, not at another thread's."""
    lc = counter()
    add(lc, [(7, 1, 0x100A, regs(5, 10)), (8, 2, 0x1014, regs(0, 999, rbx=50))])
    add(lc, [(8, 3, 0x100A, regs(9, 60)), (8, 4, 0x100A, regs(9, 70))])
    lc.finish()
    d = merge(PROGRESS, [lc.take_progress()]).to_pydict()
    rows = {a: i for i, a in enumerate(d["arg"])}
    rdi, rsi = rows[pg.ARGS.index("rdi")], rows[pg.ARGS.index("rsi")]
    # thread 8's rdi: its third and fourth samples only (9 -> 9); thread 7's 5 is not its start
    assert d["pairs"][rdi] == 1 and d["delta"][rdi] == 0 and d["back"][rdi] == 0
    # rsi (rbx's low half after the call): 50 -> 60 -> 70 in thread 8
    assert d["pairs"][rsi] == 2 and d["delta"][rsi] == 20


def test_the_samples_stack_words_give_a_spilled_values_moves() -> None:
    """The loop counter reads a value held in a stack word from the samples' stack snapshots, and
    only where the snapshot reaches that word; a thread's last sample carries its words into the
    next drain."""
    lc = LoopCounter(FakeSource(FakeBinary(SPILL, SPILL_AT)), lambda i: f"img{i}", True, background=False,
                     analyze_after=1)
    positions = [(1, 100, 4), (2, 130, 4), (3, 999, 1), (4, 170, 4)]  # (time, word 1, words carried)
    for part in (positions[:2], positions[2:]):  # two drains
        stack = np.zeros((len(part), 4), np.uint64)
        stack[:, 1] = [p for _, p, _ in part]
        lc.add(np.full(len(part), 7), np.array([t for t, _, _ in part], np.uint64),
               np.zeros(len(part), np.int64), np.ones(len(part), np.int64),
               np.full(len(part), 0x4022, np.uint64), np.full(len(part), 1000.0),
               np.zeros((len(part), 16), np.uint64), stack, np.array([n for _, _, n in part]))
    lc.finish()
    d = merge(PROGRESS, [lc.take_progress()]).to_pydict()
    rsi = {a: i for i, a in enumerate(d["arg"])}[pg.ARGS.index("rsi")]
    # 100 -> 130, then 130 -> 170 over the third sample, whose snapshot ends before word 1
    assert d["pairs"][rsi] == 2 and d["delta"][rsi] == 70 and d["pair_period"][rsi] == 3000.0


def test_a_jump_far_ahead_is_not_taken_as_a_move() -> None:
    lc = counter()
    rows = [(7, i, 0x100A, regs(5, 100 * i)) for i in range(1, 21)]
    rows.append((7, 21, 0x100A, regs(5, 1_000_000)))  # a new buffer far above: 16 times the rate or more
    add(lc, rows)
    lc.finish()
    assert lc.moving(1, AT)
    d = merge(PROGRESS, [lc.take_progress()]).to_pydict()
    rsi = d["arg"].index(pg.ARGS.index("rsi"))
    assert d["pairs"][rsi] == 19 and d["delta"][rsi] == 1_900 and d["back"][rsi] == 1


def windows(moves: list[tuple[int, float]]) -> dict[str, float]:
    """The trip windows' sums of a PROGRESS tally from each window's (steps, move)."""
    s = np.array([m[0] for m in moves], np.float64)
    d = np.array([m[1] for m in moves], np.float64)
    return {"windows": len(moves), "window_steps": float(s.sum()), "window_delta": float(d.sum()),
            "window_delta_sq": float(d @ d), "window_steps_sq": float(s @ s), "window_cross": float(d @ s)}


def stats(**kw: float) -> ProgressStats:
    # 12 windows of 200 steps, 7.2 per step, within 5% of each other
    base: dict[str, float] = {"pairs": 500, "delta": 6_000_000.0, "pair_period": 1e9,
                              **windows([(200, 1440.0 * (1.05 if k % 2 else 0.95)) for k in range(12)])}
    return ProgressStats(**{**base, **kw})  # type: ignore[arg-type]


def test_the_estimate_is_the_total_move_over_the_move_per_entry() -> None:
    est, why = entries_from_progress({1: stats()})
    assert why is None and est is not None
    assert est.entries == pytest.approx(6_000_000 / 7.2) and est.confidence == "high" and est.arg == 1
    assert "argument rsi moved 6,000,000" in est.why and "7.2 per entry in 12 trip windows" in est.why
    # Three windows: low (too few to trust the stride's error). Two, or too few entries: not used.
    three = entries_from_progress({1: stats(**windows([(100, 700.0), (150, 1_110.0), (150, 1_070.0)]))})[0]
    assert three is not None and three.confidence == "low" and "too few windows" in three.why
    # Three windows that agree exactly (one move an entry in each: lzip's match finder), with local
    # rates beside them that do not: the stride's count, in medium confidence, before the local rates'.
    same = stats(**windows([(100, 720.0), (150, 1_080.0), (150, 1_080.0)]), local_windows=3,
                 local_rate=0.021, local_rate_sq=0.021**2 / 3 * 1.001)
    assert same.local_entries is not None and same.local_error is not None and same.local_error < 0.3
    steady = entries_from_progress({1: same})[0]
    assert steady is not None and not steady.local and steady.confidence == "medium"
    assert steady.entries == pytest.approx(6_000_000 / 7.2) and "the same in every window" in steady.why
    assert entries_from_progress({1: stats(windows=2)})[0] is None
    none, why = entries_from_progress({1: stats(window_steps=50)})
    assert none is None and why is not None and "rsi" in why
    # An argument that goes back too often (a hash, a chain link) is not used; the other one is.
    est, _ = entries_from_progress({0: stats(back=200), 2: stats(delta=3_000_000.0)})
    assert est is not None and est.arg == 2
    assert entries_from_progress({0: stats(window_back=3)})[0] is None
    # One that does not move (a struct pointer) has no stride.
    assert entries_from_progress({0: stats(window_delta=0.0)})[0] is None
    assert entries_from_progress({}) == (None, None)


def test_windows_that_disagree_on_the_stride_lower_its_confidence_or_leave_it_out() -> None:
    # The stride's relative standard error: windows within 5% of each other give about 1.5%.
    assert stats().stride_error == pytest.approx(0.05 / np.sqrt(11), rel=0.05)
    # One window in twelve that held a long gap (the argument moved by 20 times as much): 7.2 per
    # step elsewhere, and the stride rests on that one window; not used.
    gap = stats(**windows([(200, 1440.0)] * 11 + [(200, 28_800.0)]))
    err = gap.stride_error
    assert err is not None and err > pg.MEDIUM_ERROR
    none, why = entries_from_progress({1: gap})
    assert none is None and why is not None and "disagree" in why and "rsi" in why
    # ... and says what it would have given: the move over the run over the windows' stride.
    assert f"it would give {gap.total / (gap.stride or 1):,.0f} entries" in why and "runs high" in why
    # Between the two bounds: medium. Tallies older than the sums of squares: low (not known).
    mid = stats(**windows([(200, 1440.0 * (1.2 if k % 2 else 0.8)) for k in range(12)]))
    assert pg.HIGH_ERROR < (mid.stride_error or 0) <= pg.MEDIUM_ERROR
    est = entries_from_progress({1: mid})[0]
    assert est is not None and est.confidence == "medium" and "relative standard error" in est.why
    old = stats(window_delta_sq=0.0, window_steps_sq=0.0, window_cross=0.0)
    est = entries_from_progress({1: old})[0]
    assert old.stride_error is None and est is not None and est.confidence == "low"


def test_calc_takes_the_entry_count_from_a_moving_argument() -> None:
    # 6,000,000 / 7.2 entries; the loop's header counted 3,750 times per entry in the windows.
    c = work(progress={1: stats()}, trips={0x1190: (400, 12, 400), 0x11A0: (1_500_000, 12, 400)})
    entry, loop = block(c, 0x1190), block(c, 0x11A0)
    assert c.freq.block_method[entry] == "progress" and c.freq.block_confidence[entry] == "high"
    assert c.executions(entry) == pytest.approx(6_000_000 / 7.2, rel=0.01)
    assert c.freq.block_method[loop] == "trip-window"
    assert c.executions(loop) == pytest.approx(6_000_000 / 7.2 * 3750, rel=0.01)
    assert c.evidence[entry].startswith("argument rsi moved")
    # A surer anchor keeps the entry; a low-confidence one gives way.
    from cyclescope.analysis.anchors import AnchorStats

    weak = work(progress={1: stats(**windows([(100, 700.0), (150, 1_110.0), (150, 1_070.0)]))},
                anchor=AnchorStats(hits=500, samples=151, counted_s=1.0, windows=10))
    assert weak.freq.block_method[block(weak, 0x1190)] == "anchor"  # medium against low: the anchor's
    # The count it did not take is said beside the one kept.
    kept = [n for n in weak.notes if n.startswith("entry count from moving arguments: argument rsi gives")]
    assert len(kept) == 1 and f"{6_000_000 / 7.2:,.0f} entries (low confidence)" in kept[0]
    assert "the anchor's" in kept[0] and "is kept" in kept[0] and "runs high" in kept[0]
    # Not enough: a note says why, the count is the model's.
    few = work(progress={1: stats(windows=2)})
    assert few.freq.block_method[block(few, 0x1190)] != "progress"
    assert any("moving arguments" in n for n in few.notes)


class RegsCounter(FakeCounter):
    """A PointCounter whose first point's hits saw rsi go from 1,000 to 1,000 + 7 * (hits - 1), the
    last of them after the window's time (TripWindows._end_at_entry asks for it)."""

    @property
    def tails(self) -> int:
        return getattr(self, "ends", 0)

    def first_regs(self) -> tuple[np.ndarray, np.ndarray]:
        first, last = np.zeros(16, np.uint64), np.zeros(16, np.uint64)
        first[COL["rbx"]], last[COL["rbx"]] = 1_000, 1_000 + 7 * (self.per_window[0] - 1)
        first[COL["rdi"]] = last[COL["rdi"]] = 0xABC
        return first, last


class Moving:
    """The loop counter's side: the procedure's arguments move; the windows of the entry alone
    it is handed (their local rates: LoopCounter.stride_window)."""

    def __init__(self) -> None:
        self.strides: list[tuple[int, int, int, int, int, list[float]]] = []

    def moving(self, img: int, start: int) -> bool:
        return True

    def stride_window(self, img: int, entry: int, opened_ns: int, closed_ns: int, steps: int,
                      moves: np.ndarray) -> None:
        self.strides.append((img, entry, opened_ns, closed_ns, steps, moves.tolist()))


def test_windows_of_the_entry_alone_measure_the_move_per_entry() -> None:
    loops = Moving()
    t = tw.TripWindows(anchors=None, loops=type("L", (), {"counter": loops})(), budget=1.0)
    t.hit_cost_s, t.emulated_hit_s = 1e-5, 5e-7
    t.counter = RegsCounter([101, 4_000])
    t.image_key = lambda i: f"img{i}"
    holders = np.full(6, -1, np.int8)
    holders[pg.ARGS.index("rsi")] = COL["rbx"] + pg.W32  # rsi's low half in rbx where the entry is probed
    holders[pg.ARGS.index("rdi")] = COL["rdi"]
    target = tw.Target(1, 0x1000, "/bin/x", [0x1000, 0x1010], [0x400, 0x41D], pid=42, hits=np.zeros(2, np.uint64),
                       emulated=[True, True], argwidth=np.array([64, 32, 64, 64, 64, 64], np.int8), site_args=holders)
    t.targets[(1, 0x1000)] = target
    for _ in range(4):
        t._window(target)
    # Every other window counts the entry alone (first), the others every point: only those count
    # in the ratios, and only the entry's own windows, which end at an entry, measure the moves.
    assert [a[1] for a in t.counter.attached] == [[0x400], [0x400, 0x41D]] * 2
    assert target.stride_windows == 2 and target.windows == 2 and target.hits.tolist() == [200, 8_000]  # runs
    assert t.counter.tails == 4  # every window ends at an entry
    d = merge(PROGRESS, [t.take_progress()]).to_pydict()
    rsi, rdi = d["arg"].index(pg.ARGS.index("rsi")), d["arg"].index(pg.ARGS.index("rdi"))
    assert d["windows"][rsi] == 2 and d["window_steps"][rsi] == 200 and d["window_delta"][rsi] == 1_400
    assert d["window_delta"][rdi] == 0 and d["windows"][rdi] == 2  # held, not moving
    assert [d["windows"][i] for i, a in enumerate(d["arg"]) if a not in (0, 1)] == [0, 0, 0, 0]
    # Each window of the entry alone goes to the loop counter too, with its times and moves.
    assert [(w[0], w[1], w[4]) for w in loops.strides] == [(1, 0x1000, 100)] * 2
    assert all(w[2] < w[3] and w[5][1] == 700 for w in loops.strides)
    # Charged at the emulated hit's cost, with the lighter per-window charge.
    assert t.spent_s == pytest.approx(2 * 101 * 5e-7 + 2 * 4_101 * 5e-7 + 4 * tw.EMULATED_WINDOW_COST_S)


class PointRegsCounter(RegsCounter):
    """RegsCounter with a progress point beside the entry: the point ran at 99 of the 101 entries,
    r12 there going from 50 to 50 + 3 * 98."""

    def counts(self, n: int) -> np.ndarray:
        got = super().counts(n)
        return np.array([got[0], 99][:n], np.uint64) if n == 2 else got

    def first_regs(self, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        if slot == 0:
            return super().first_regs()
        first, last = np.zeros(16, np.uint64), np.zeros(16, np.uint64)
        first[COL["r12"]], last[COL["r12"]] = 50, 50 + 3 * 98
        return first, last


def test_windows_of_the_entry_alone_probe_its_progress_point_beside_it() -> None:
    """A procedure with a progress point (a value it loads before its loops): its windows of the
    entry alone count the point too, the point's registers give that value's move, taken per
    entry (the point may not run at every entry: 99 runs of 101 entries), the arguments' moves
    still come from the entry's registers, and the values the windows held are tallied."""
    loops = Moving()
    t = tw.TripWindows(anchors=None, loops=type("L", (), {"counter": loops})(), budget=1.0)
    t.hit_cost_s, t.emulated_hit_s = 1e-5, 5e-7
    t.counter = PointRegsCounter([101, 4_000])
    t.image_key = lambda i: f"img{i}"
    r12 = pg.NARGS + COL["r12"]
    holders = np.full(pg.NVALUES, -1, np.int8)
    holders[pg.ARGS.index("rsi")] = COL["rbx"] + pg.W32
    at_point = np.full(pg.NVALUES, -1, np.int8)
    at_point[r12] = COL["r12"]
    target = tw.Target(1, 0x1000, "/bin/x", [0x1000, 0x1010], [0x400, 0x41D], pid=42, hits=np.zeros(2, np.uint64),
                       emulated=[True, True], argwidth=np.full(pg.NVALUES, 64, np.int8), site_args=holders,
                       point_offset=0x408, point_emulated=False, point_args=at_point)
    t.targets[(1, 0x1000)] = target
    t._window(target)
    assert t.counter.attached[0][1] == [0x400, 0x408]  # the entry and its point
    (w,) = loops.strides
    moves = w[5]
    assert w[4] == 100 and moves[pg.ARGS.index("rsi")] == 700
    # 294 over the point's 99 runs but one, in the window's 100 whole runs of the procedure (it ended
    # at its 101st entry): 2.97 an entry, 297 over the 100 steps
    assert moves[r12] == pytest.approx(3 * 98 * 99 / 98)
    d = merge(PROGRESS, [t.take_progress()]).to_pydict()
    assert r12 in d["arg"] and d["windows"][d["arg"].index(r12)] == 1
    assert sorted(a for a in d["arg"] if a >= pg.NARGS) == [r12]  # only the values held
    # Charged as the two probes: the entry's emulated hits, the point's single-stepped ones.
    assert t.spent_s == pytest.approx(101 * 5e-7 + 99 * 1e-5 + tw.WINDOW_COST_S)
    # A point the kernel refuses to probe: its windows count the entry alone from then on.
    from cyclescope.errors import CycleScopeError

    class Refusing(PointRegsCounter):
        def attach(self, path: str, offsets: list[int], pid: int = 0) -> int:
            if 0x408 in offsets:
                raise CycleScopeError("uprobe_multi refused /bin/x")
            return super().attach(path, offsets, pid)

    t.counter = Refusing([101, 4_000])
    target.turns = 0
    t._window(target)
    assert target.point_offset is None and target.failed is None and not t.counter.attached
    target.turns = 0
    t._window(target)
    assert t.counter.attached[-1][1] == [0x400] and target.stride_windows == 2


def test_windows_entry_rates_come_from_the_samples_around_them() -> None:
    """A stride window's entries per unit of the thread's time: the argument's move rate sampled
    around it (LOCAL_AROUND_NS each side, no trap there) times the window's entries per move."""
    import time

    from cyclescope.analysis import loopcount as lcm

    base = time.monotonic_ns()
    ms = 1_000_000

    def run(lc: LoopCounter, ks: range, tid: int = 7, step: int = 70) -> None:
        # a sample a millisecond, each a period of 1,000 (event units); rsi 70 further each time
        add(lc, [(tid, base + k * ms, 0x100A, regs(5, 1_000 + step * k)) for k in ks])

    lc = counter()
    run(lc, range(1, 8))  # a first drain: the argument moves (its samples are kept from now on)
    lc.finish()
    assert lc.moving(1, AT)
    lc.take_progress()
    # 99 entries after the first, rsi 693 further: 7 a call, in a window 20.5-22.5 ms in
    lc.stride_window(1, AT, base + 20 * ms + ms // 2, base + 22 * ms + ms // 2, 99, np.array([0, 693.0, 0, 0, 0, 0]))
    lc.stride_window(1, AT, base + 50 * ms, base + 52 * ms, 99, np.array([0, 693.0, 0, 0, 0, 0]))
    run(lc, range(8, 40))
    lc.finish()
    got = merge(PROGRESS, [lc.take_progress()]).to_pydict()
    rsi = got["arg"].index(pg.ARGS.index("rsi"))
    # 0.07 of a position per unit of time, 1/7 of an entry per position: 0.01 entries a unit
    assert got["local_windows"][rsi] == 1 and got["local_rate"][rsi] == pytest.approx(0.01)
    assert got["local_rate_sq"][rsi] == pytest.approx(1e-4)
    # The second window's samples after it come in the next drain: it waits for them.
    assert len(lc._strides) == 1
    run(lc, range(40, 70))
    lc.finish()
    got = merge(PROGRESS, [lc.take_progress()]).to_pydict()
    assert got["local_windows"][got["arg"].index(pg.ARGS.index("rsi"))] == 1 and not lc._strides
    # Two threads in the procedure around a window: whose entries it counted is not known.
    two = counter()
    add(two, [(t, base + k * ms + t, 0x100A, regs(5, 1_000 + 70 * k)) for k in range(1, 8) for t in (7, 8)])
    two.finish()
    two.stride_window(1, AT, base + 20 * ms, base + 22 * ms, 99, np.array([0, 693.0, 0, 0, 0, 0]))
    add(two, [(t, base + k * ms + t, 0x100A, regs(5, 1_000 + 70 * k)) for k in range(8, 40) for t in (7, 8)])
    two.finish()
    assert two.moving(1, AT) and not two._strides  # resolved: not counted
    d = merge(PROGRESS, [two.take_progress()]).to_pydict()
    assert not any(d["local_windows"])
    # A window whose samples never come is dropped after LOCAL_KEEP_NS.
    old = counter()
    old.stride_window(1, AT, base - lcm.LOCAL_KEEP_NS - 3 * ms, base - lcm.LOCAL_KEEP_NS - ms, 99,
                      np.array([0, 693.0, 0, 0, 0, 0]))
    run(old, range(1, 20))
    old.finish()
    assert not old._strides


def test_the_local_rates_give_the_entry_count_where_the_windows_are_few() -> None:
    # Four windows at 0.0095-0.0105 entries a unit of time over the pairs' 1e9 units: 1e7 entries.
    rates = np.array([0.0095, 0.0105, 0.0098, 0.0102])
    st = stats(local_windows=4, local_rate=float(rates.sum()), local_rate_sq=float(rates @ rates))
    assert st.local_entries == pytest.approx(1e9 * 0.01)
    assert st.local_error == pytest.approx(rates.std(ddof=1) / 2 / 0.01)
    est = entries_from_progress({1: st})[0]
    assert est is not None and est.local and est.confidence == "low" and est.entries == pytest.approx(1e7)
    assert "move rate sampled around 4 trip windows" in est.why and "too few windows" in est.why
    # Rates that disagree by more than LOCAL_MAX_ERROR: the stride's count as before.
    wide = np.array([0.001, 0.03, 0.002])
    st = stats(local_windows=3, local_rate=float(wide.sum()), local_rate_sq=float(wide @ wide))
    est = entries_from_progress({1: st})[0]
    assert est is not None and not est.local and est.entries == pytest.approx(6_000_000 / 7.2)
    # calc: at equal (low) confidence the local rates' count replaces a short entry's anchor, which
    # runs low; not an anchor that is surer, nor one of a long entry at the same confidence.
    from cyclescope.analysis.anchors import AnchorStats

    few = {1: stats(**windows([(100, 700.0), (150, 1_110.0), (150, 1_070.0)]), local_windows=4,
                    local_rate=float(rates.sum()), local_rate_sq=float(rates @ rates))}
    short = AnchorStats(hits=10_000, samples=100, counted_s=1.0, windows=10)  # 10,000 cycles an entry
    alone = work(anchor=short)
    assert alone.freq.block_method[block(alone, 0x1190)] == "anchor"
    assert alone.freq.block_confidence[block(alone, 0x1190)] == "low"
    c = work(progress=few, anchor=short)
    entry = block(c, 0x1190)
    assert c.freq.block_method[entry] == "progress" and c.executions(entry) == pytest.approx(1e7, rel=0.01)
    stride_only = {1: stats(**windows([(100, 700.0), (150, 1_110.0), (150, 1_070.0)]))}  # low, from the stride
    assert work(progress=stride_only, anchor=short).freq.block_method[entry] == "anchor"
    surer = AnchorStats(hits=500, samples=151, counted_s=1.0, windows=10)  # medium
    c = work(progress=few, anchor=surer)
    assert c.freq.block_method[block(c, 0x1190)] == "anchor"
    assert any(n.startswith("entry count from moving arguments: argument rsi gives 10,000,000") for n in c.notes)
