"""`cyclescope calc` on kernels with known execution counts, profiled for real."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.system.helpers import cs

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]


@pytest.fixture(scope="module")
def kernels_db(tmp_path_factory: pytest.TempPathFactory, compile_c: Callable[..., Path]) -> Path:
    exe = compile_c("kernels", "-O2", "-g", out="kernels")
    db = tmp_path_factory.mktemp("calc") / "db"
    for which in ("chain", "divide", "branchy"):
        cs("record", "--db", str(db), "-q", "-F", "5000", "--append", "--", str(exe), which)
    return db


def calc(db: Path, proc: str) -> dict:
    return json.loads(cs("calc", proc, "--db", str(db), "--json").stdout)


def test_a_stall_free_loop_is_counted_within_a_few_percent(kernels_db: Path) -> None:
    doc = calc(kernels_db, "chain")
    loop = max(doc["blocks"], key=lambda b: b["samples"])
    # chain(300000000) runs its loop body exactly 300M times: its counter register (i) says so
    # between samples, whatever the core's model, clock or skid.
    assert loop["confidence"] == "high" and loop["method"] == "loop-counter"
    assert loop["executions"] == pytest.approx(300e6, rel=0.05)
    # No dynamic stall: the loop runs at the model's best case. The band's low side is wide for LLVM 19's
    # Golden Cove model (sapphirerapids), which gives this 3-cycle chain 5 cycles (xor at 2, the
    # eliminated register moves at 1 each): measured 3.3 on a Xeon with AMX.
    best, actual = doc["summary"]["best_cpi"], doc["summary"]["actual_cpi"]
    assert 0.6 * best <= actual <= 1.25 * best, (doc["mcpu"], best, actual)


def test_loop_counters_count_loops_of_known_trip_counts(kernels_db: Path, compile_c: Callable[..., Path],
                                                        tmp_path: Path) -> None:
    """divide's loop runs 30M - 1 times; nested's outer loop 20M times. The inner loops of branchy
    (65,536 a pass, 1,500 passes) and nested ((i & 15) + 1 a pass) run less than a sampling period
    at a time: no count from pairs, but each sample's registers hold the pass's start and end, and
    the mean trip count times the outer loop's count gives theirs. Without loop counters the counts
    come from the model, never from a counter."""
    loop = max(calc(kernels_db, "divide")["blocks"], key=lambda b: b["samples"])
    assert loop["method"] == "loop-counter" and loop["executions"] == pytest.approx(30e6, rel=0.05)
    inner = next(b for b in calc(kernels_db, "branchy")["blocks"] if b["method"] == "loop-trips")
    assert inner["executions"] == pytest.approx(1500 * 65536, rel=0.10)
    exe = compile_c("kernels", "-O2", "-g", out="kernels")
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "-F", "5000", "--", str(exe), "nested")
    doc = calc(db, "nested")
    outer = [b for b in doc["blocks"] if b["method"] == "loop-counter"]
    assert outer and all(b["executions"] == pytest.approx(20e6, rel=0.05) for b in outer)
    inner = [b for b in doc["blocks"] if b["method"] == "loop-trips"]
    # sum over i < 20M of (i & 15) + 1 = 20M * 8.5. Within 10% on Zen 3; on a Xeon with AMX 4 of 8
    # recordings came out 11-13% high (188-193M: the mean trip weighs short passes too little,
    # where samples around the inner loop's exit land; cause not established), and one CI run 17%
    # high (199M) where ten recordings on the same machine gave 0.97-1.07 of the truth and two
    # recordings merged did no better (six pairs: 0.96-1.10): the error moves between runs, not
    # with the samples, so 20% is what holds (issue 30 has the estimator's bias).
    assert inner and all(b["executions"] == pytest.approx(170e6, rel=0.20) for b in inner), inner
    plain = tmp_path / "plain"
    cs("record", "--db", str(plain), "-q", "-F", "5000", "--no-loop-counts", "--", str(exe), "chain")
    assert not list(plain.glob("epoch=*/host=*/loops/*.parquet"))
    assert all(b["method"] != "loop-counter" for b in calc(plain, "chain")["blocks"])


def test_divides_are_blamed_on_the_divider(kernels_db: Path) -> None:
    doc = calc(kernels_db, "divide")
    loop = max(doc["blocks"], key=lambda b: b["samples"])
    idiv = next(i for i in loop["instructions"] if i["instruction"].startswith("idiv"))
    # Zen's timer samples land on the divide itself; Intel's (Golden Cove class here) on the next
    # instruction, the first that waits for it, whose stall calc then blames on the divider.
    waiting = [i for i in loop["instructions"] if idiv["address"] in i["culprit_addresses"].get("u", [])]
    blamed = idiv["samples"]["cpu-clock"] + sum(i["samples"]["cpu-clock"] for i in waiting)
    assert blamed > 0.5 * loop["samples"], loop["instructions"]
    assert loop["executions"] == pytest.approx(30e6, rel=0.25)


def test_mispredicts_are_candidates_at_the_heads_of_data_dependent_blocks(kernels_db: Path) -> None:
    doc = calc(kernels_db, "branchy")
    culprits = {c for b in doc["blocks"] for i in b["instructions"] for c in i["culprits"]}
    assert "branch mispredict" in culprits
    text = cs("calc", "branchy", "--db", str(kernels_db)).stdout
    assert "*** Best-case" in text and "*** branch mispredict" in text and "block " in text


def test_calc_over_an_image_everything_and_a_missing_procedure(kernels_db: Path) -> None:
    out = cs("calc", "--image", "kernels", "--db", str(kernels_db)).stdout
    assert "chain" in out and "divide" in out and "best CPI" in out
    every = cs("calc", "--db", str(kernels_db), "--epoch", "all").stdout  # no procedure: the hottest ones
    assert "chain" in every and "measured%" in every and "procedures analyzed in" in every
    p = cs("calc", "nosuch", "--db", str(kernels_db), check=False)
    assert p.returncode == 4 and "no procedure named 'nosuch'" in p.stderr


def test_the_clock_is_measured_alike_on_a_machine_busier_than_its_cpus() -> None:
    """calc's cycles are samples x period x the measured clock, and the clock is measured once per
    boot, whatever runs beside it. Four busy loops per CPU here: the best of four runs stays within
    the quiet measurement (3.86-3.91 GHz quiet and busy). What this cannot make is what gave 2.1
    GHz against 3.5 once, in a run of the suite beside two busy loops: the add chain's runs were
    timed by the wall clock, which counts the time the hypervisor takes the CPU away (steal, 15 s
    since this VM booted); the thread's CPU time, which times them now, leaves it out."""
    import os
    import subprocess

    from cyclescope.collect.clock import measure_ghz

    quiet = measure_ghz()
    loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(4 * (os.cpu_count() or 1))]
    try:
        busy = [measure_ghz() for _ in range(3)]
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert quiet is not None and all(b is not None for b in busy)
    # The busy loops may lower the core's clock (turbo shared among busy cores): the measurement
    # follows the clock, not the preemptions (runs' spread here: 3.86-3.91 GHz quiet and busy).
    assert all(0.75 * quiet < b < 1.25 * quiet for b in busy), (quiet, busy)  # type: ignore[operator]


def test_a_samples_cost_is_measured_alike_on_a_busy_machine() -> None:
    """calc takes each sample's cost to the sampled code (the timer's interrupt and the VM's exit
    for it: about 16 us here) out of the cycles it counts, measured once per boot. Timed by the wall
    clock, the measurement beside a busy loop per CPU gave 0 to 59 us (five runs: 17, 40, 24, 18
    and 0; then 18, 9, 16, 35, 59), and once 41 us, cached for the boot, put calc's CPI for the
    stall-free loop at 0.58 of the model's best; timed by the thread's own cpu-clock, 16-17.5 us
    quiet and busy alike on a Xeon. On these VMs the cost itself drifts over seconds with what the
    host runs (on a Zen 3, one measurement of 7 pairs of 50 ms came out at 4.8 us against 11.3 in
    CI, which is why the measurement now takes the median of 35 pairs of 10 ms; and then, in one
    run of the suite, three quiet ones at 9.8, 9.7 and 6.1 us and the three busy ones after them
    at 6.8-8.3). So quiet and busy measurements alternate, each busy one against the quiet one
    before it: the median of the ratios is held near 1, and each busy one to what the wall clock's
    failure (0 and 59 us against 16) would break."""
    import os
    import statistics
    import subprocess

    from cyclescope.collect.clock import measure_sample_overhead

    quiet: list[float] = []
    busy: list[float] = []
    for _ in range(4):
        q = measure_sample_overhead(200_000)
        loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count() or 1)]
        try:
            b = measure_sample_overhead(200_000)
        finally:
            for p in loops:
                p.kill()
                p.wait()
        assert q is not None and q > 0 and b is not None, (quiet, busy, q, b)
        quiet.append(q)
        busy.append(b)
    ratios = [b / q for q, b in zip(quiet, busy, strict=True)]
    assert 0.7 < statistics.median(ratios) < 1.4, (quiet, busy)
    assert all(0.4 < r < 2.0 for r in ratios), (quiet, busy)


def test_a_uprobe_hit_is_measured_on_this_machine() -> None:
    """What a hit costs the probed task, measured once per boot for the anchors' and the goal
    probes' budgets: 5.8 us on Zen 3, 16-17 us on a Xeon with AMX (bench/probecost.py)."""
    from cyclescope.analysis import anchors
    from cyclescope.collect.clock import measure_uprobe_hit_s, uprobe_hit_cost
    from cyclescope.collect.kernel import uprobe_pmu_type
    from cyclescope.images.cache import Cache
    from cyclescope.values import probes

    if uprobe_pmu_type() is None:
        pytest.skip("this kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)")
    measured = measure_uprobe_hit_s()
    assert measured is not None and 1e-6 < measured < 100e-6, measured
    # Each budget charges the boot's measurement (kept, so not this one: the machine may be busier
    # now) plus what follows a hit, at least its constant.
    kept = uprobe_hit_cost(Cache().root)
    assert kept is not None and 1e-6 < kept < 100e-6, kept
    assert anchors.hit_cost() == pytest.approx(max(anchors.HIT_COST_S, kept + anchors.AFTER_TRAP_S))
    assert probes.hit_cost() == pytest.approx(max(probes.HIT_COST_S, kept + probes.SAMPLE_EXTRA_S))


def test_an_anchor_counts_a_procedures_entries(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """entries.c's `mid` is entered 20,000 times; its loop's exit is a value, so nothing but its entry
    can be counted. The default recording counts the entry with a uprobe in windows within the
    anchors' budget, and calc's entry block takes that count; --no-anchors leaves it to the model."""
    from cyclescope.collect.kernel import uprobe_pmu_type

    if uprobe_pmu_type() is None:
        pytest.skip("this kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)")
    exe = compile_c("entries", "-O2", "-g", out="entries")
    db = tmp_path / "db"
    out = cs("record", "--db", str(db), "-F", "5000", "--", str(exe), "20000", "100000")
    assert "anchors: the entries of 1 procedure counted" in out.stderr
    doc = calc(db, "mid")
    entry = next(b for b in doc["blocks"] if b["start"] == doc["start"])
    assert entry["method"] == "anchor" and entry["confidence"] in ("high", "medium")
    # The ratio's error is about 1/sqrt(samples in the windows): several hundred here.
    assert entry["executions"] == pytest.approx(20_000, rel=0.15)
    plain = tmp_path / "plain"
    cs("record", "--db", str(plain), "-q", "-F", "5000", "--no-anchors", "--", str(exe), "2000", "100000")
    doc = calc(plain, "mid")
    assert all(b["method"] != "anchor" for b in doc["blocks"])


def test_a_scale_point_counts_a_short_entry(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """scale.c's `step` is entered about twenty million times a second: under its anchor's probe it
    runs at the traps' pace and its own count comes out low. Its trip windows survey its blocks and
    keep rare ones as a scale point (analysis/trips.py, "Scale windows"): the point's runs per
    sample of the procedure in windows of the point alone, times the procedure's samples, times
    the entries per run in windows of the entry and the point alone, is the entry count. At twenty
    times the default budget, so that a run of seconds gets windows enough: at five times a run got
    one window of each kind (about 35 runs of the point, 80 samples: 20% of error from those alone),
    and the check failed once in a suite's run (0.53 of exact); at twenty, 6-8 of each, 0.88-1.11 in
    four runs. The ratio's own check is against the program's counts of its rare blocks."""
    import pyarrow.parquet as pq

    from cyclescope.collect.kernel import uprobe_pmu_type

    if uprobe_pmu_type() is None:
        pytest.skip("this kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)")
    exe = compile_c("scale", "-O2", "-g", out="scale")
    db = tmp_path / "db"
    out = cs("record", "--db", str(db), "-F", "5000", "--anchor-budget", "0.2", "--", str(exe), "100000000")
    if "trip windows: off" in out.stderr:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    calls, rare1, rare2 = (int(x) for x in out.stdout.split())
    assert "with a scale point)" in out.stderr and "(0 with a scale point)" not in out.stderr, out.stderr
    start, _ = _symbol(exe, "step")

    def summed(kind: str, key: str) -> dict[int, dict[str, float]]:
        rows: dict[int, dict[str, float]] = {}
        for f in db.glob(f"epoch=*/host=*/{kind}/*.parquet"):
            for r in pq.read_table(f).to_pylist():
                if kind == "anchors" or r["entry"] == start:
                    acc = rows.setdefault(r[key], {})
                    for k, v in r.items():
                        if isinstance(v, (int, float)) and k not in ("entry", "point"):
                            acc[k] = acc.get(k, 0) + v
        return rows

    scale, anchors = summed("scale", "point"), summed("anchors", "entry")
    both = [p for p in scale if p in anchors and scale[p]["hits"] > 0 and anchors[p]["samples"] > anchors[p]["near"]]
    assert both, (scale, anchors)
    point = max(both, key=lambda p: scale[p]["hits"])
    ratio = scale[point]["entry_hits"] / scale[point]["hits"]
    # The point is one rare block or both: its exact entries per run are one of these.
    exact = [calls / rare1, calls / rare2, calls / (rare1 + rare2)]
    assert min(abs(ratio / e - 1) for e in exact) < 0.35, (ratio, exact)
    doc = calc(db, "step")
    total = sum(b["samples"] for b in doc["blocks"])
    a = anchors[point]
    entries = a["hits"] / (a["samples"] - a["near"]) * total * ratio
    assert entries == pytest.approx(calls, rel=0.3), (entries, calls, a, scale[point])


def _walk_points(exe: Path) -> tuple[list[int], list[int]]:
    """trips.c's `walk`: its entry and loop headers (outer, inner) and their file offsets."""
    from elftools.elf.elffile import ELFFile

    from cyclescope.analysis.loopcount import loop_table
    from cyclescope.analysis.trips import points_of
    from cyclescope.images.disasm import read_code
    from cyclescope.images.elf import read_load_info

    with open(exe, "rb") as f:
        sym = next(s for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols() if s.name == "walk")
        start, end = sym["st_value"], sym["st_value"] + sym["st_size"]
    table = loop_table(read_code(str(exe), start, end), start, end)
    assert len(table.headers) == 2
    entry_off = read_load_info(str(exe)).file_offset(start)
    assert entry_off is not None
    return points_of(start, entry_off, table.headers, table.depth)


def _point_counter() -> Any:
    from cyclescope.collect.pointcount import PointCounter
    from cyclescope.errors import CycleScopeError

    try:
        return PointCounter()
    except CycleScopeError as e:
        pytest.skip(f"no BPF here: {e}")


def _counted_run(counter: Any, exe: Path, offsets: list[int], skip: int = 0, whole: bool = False,
                 end: bool = False) -> str:
    """``exe 2000`` run once with every offset counted by one link (counts zeroed first, the first
    ``skip`` hits let through; ``whole``, ``end``: PointCounter.zero's and end_at_entry): its
    output."""
    import subprocess

    from cyclescope.errors import CycleScopeError

    counter.zero(len(offsets), skip, whole)
    if end:
        counter.end_at_entry()
    try:
        link = counter.attach(str(exe), offsets, 0)
    except CycleScopeError as e:
        counter.close()
        pytest.skip(f"this kernel has no uprobe_multi links (6.6 or later): {e}")
    try:
        return subprocess.run([str(exe), "2000"], capture_output=True, text=True, check=True).stdout
    finally:
        counter.detach(link)


def test_one_link_counts_the_entry_and_the_loop_headers_exactly(compile_c: Callable[..., Path]) -> None:
    """collect/pointcount.py: one BPF program on one uprobe_multi link counts `walk`'s entry, its
    outer loop's header and its inner loop's, each exactly (the program prints the inner count);
    its gate lets the first hits through, its whole-runs flag keeps the other points from counting
    before the entry does, and asked to end it shuts the gate at the next entry."""

    exe = compile_c("trips", "-O2", "-g", out="trips")
    points, offsets = _walk_points(exe)
    counter = _point_counter()
    try:
        out = _counted_run(counter, exe, offsets)
        got = counter.counts(len(points)).tolist()
        # The gate: the first 500 hits pass uncounted (a window counts only once its probes are in).
        _counted_run(counter, exe, offsets, skip=500)
        gated = counter.counts(len(points)).tolist()
        left = counter.skip_left()
        # Whole runs: the points after the entry count from its first hit on, so with the entry
        # let through by the gate nothing counts; without a gate, all of it.
        _counted_run(counter, exe, offsets, skip=500, whole=True)
        whole_gated = counter.counts(len(points)).tolist()
        _counted_run(counter, exe, offsets, whole=True)
        whole = counter.counts(len(points)).tolist()
        # Asked to end before the run: the first entry is counted, and shuts the gate behind it.
        _counted_run(counter, exe, offsets, whole=True, end=True)
        ended = counter.counts(len(points)).tolist()
        shut = counter.skip_left()
    finally:
        counter.close()
    inner = int(out.split()[0])
    assert got == [1, 2000, inner], (got, out)
    assert sum(gated) == sum(got) - 500 and left == -sum(gated), (gated, left)
    assert whole_gated == [0, 0, 0] and whole == got, (whole_gated, whole)
    assert ended == [1, 0, 0] and shut > 0, (ended, shut)


def _recorded_with_windows(compile_c: Callable[..., Path], tmp_path: Path, name: str,
                           arg: str) -> tuple[Path, Path, Any]:
    """tests/programs/NAME.c built with -O2 -g and recorded at 5 kHz with default settings (trip
    windows on); skipped where the kernel has no uprobe PMU or the windows are off."""
    from cyclescope.collect.kernel import uprobe_pmu_type

    if uprobe_pmu_type() is None:
        pytest.skip("this kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)")
    exe = compile_c(name, "-O2", "-g", out=name)
    db = tmp_path / "db"
    out = cs("record", "--db", str(db), "-F", "5000", "--", str(exe), arg)
    if "trip windows: off" in out.stderr:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    return exe, db, out


def test_trip_windows_count_a_loop_no_register_counts(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """trips.c's inner loop runs until a sum passes a bound: no register counts it, and its samples
    are too few per execution for pairs. Its outer loop's count comes from its counter register;
    the trip windows count both headers together, and calc takes the inner count as the outer's
    times their ratio. --no-trip-windows leaves it to the model."""
    exe, db, out = _recorded_with_windows(compile_c, tmp_path, "trips", "80000000")
    assert "trip windows: the loops and hot blocks of 1 procedure counted beside its entry" in out.stderr, out.stderr
    inner_exact = int(out.stdout.split()[0])
    points, _ = _walk_points(exe)
    blocks = {b["start"]: b for b in calc(db, "walk")["blocks"]}
    outer, inner = blocks[points[1]], blocks[points[2]]
    assert outer["method"] == "loop-counter" and outer["executions"] == pytest.approx(80e6, rel=0.05)
    # The ratio rests on a few hundred outer iterations counted in the windows (about 17 trips each,
    # varying by about 2): four recordings came out 0.99-1.04 of exact.
    assert inner["method"] == "trip-window", inner
    assert inner["executions"] == pytest.approx(inner_exact, rel=0.15)
    plain = tmp_path / "plain"
    cs("record", "--db", str(plain), "-q", "-F", "5000", "--no-trip-windows", "--", str(exe), "20000000")
    assert not list(plain.glob("epoch=*/host=*/trips/*.parquet"))
    assert all(b["method"] != "trip-window" for b in calc(plain, "walk")["blocks"])


def _symbol(exe: Path, name: str) -> tuple[int, int]:
    from elftools.elf.elffile import ELFFile

    with open(exe, "rb") as f:
        sym = next(s for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols() if s.name == name)
        return int(sym["st_value"]), int(sym["st_value"] + sym["st_size"])


def test_the_link_keeps_the_first_points_registers(compile_c: Callable[..., Path]) -> None:
    """collect/pointcount.py: at the first point (a procedure's entry) the program keeps the general
    registers of the first and the last counted hit: progress.c's find() gets positions 0, 1, ...
    in rsi, and the last one before the end."""
    from cyclescope.images.elf import read_load_info
    from cyclescope.perf.abi import GPRS

    exe = compile_c("progress", "-O2", "-g", out="progress")
    start, _ = _symbol(exe, "find")
    off = read_load_info(str(exe)).file_offset(start)
    assert off is not None
    counter = _point_counter()
    try:
        out = _counted_run(counter, exe, [off])
        hits = int(counter.counts(1)[0])
        first, last = counter.first_regs()
    finally:
        counter.close()
    rsi = GPRS.index("rsi")
    assert hits == int(out.split()[0])
    assert int(first[rsi]) == 0 and 1997 <= int(last[rsi]) < 2000, (first[rsi], last[rsi])


def test_the_link_keeps_the_progress_points_registers_too(compile_c: Callable[..., Path]) -> None:
    """collect/pointcount.py: the second point's hits keep their registers as well (a window of an
    entry alone probes its progress point there): progress_member.c's find() loads m->pos into a
    register before its loop, 0 at the first call and just under 2,000 at the last."""
    import numpy as np

    from cyclescope.analysis.loopcount import loop_table
    from cyclescope.analysis.progress import NARGS, W32
    from cyclescope.images.disasm import read_code
    from cyclescope.images.elf import read_load_info
    from cyclescope.perf.abi import GPRS

    exe = compile_c("progress_member", "-O2", "-g", out="progress_member")
    start, end = _symbol(exe, "find")
    table = loop_table(read_code(str(exe), start, end), start, end)
    assert table.point > start, table.point  # after the load, before the loop
    k = int(np.searchsorted(table.addrs, np.uint64(table.point)))
    held = [int(c) for c in table.args[k, NARGS:] if c >= 0]
    assert len(held) == 1, held  # the position, alone worth following there
    off = read_load_info(str(exe)).file_offset(start)
    assert off is not None
    counter = _point_counter()
    try:
        out = _counted_run(counter, exe, [off, off + table.point - start])
        hits = counter.counts(2).tolist()
        first, last = counter.first_regs(1)
    finally:
        counter.close()
    pos = held[0] % W32
    assert hits[0] == hits[1] == int(out.split()[0]), (hits, out)
    assert int(first[pos]) == 0 and 1997 <= int(last[pos]) < 2000, (GPRS[pos], first[pos], last[pos])


def test_an_entry_count_from_an_argument_that_moves(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """progress.c's find() is entered about 50 million times a second, its position argument one
    to three ahead at each call: no anchor can count it, and its loop's exit is a value. calc takes
    its entry count from how far the argument moved over the run (pairs of samples) over how far it
    moves per entry (trip windows of the entry alone), or from its move rate sampled around each of
    those windows over the window's move per entry, and carries it into the loop by the windows'
    ratio. Recordings on the Xeon came out at 0.90-1.07 of exact (the loop 0.92-1.08); the trip
    windows' phases of the run are few (three of the entry alone a run), hence the margin."""
    exe, db, out = _recorded_with_windows(compile_c, tmp_path, "progress", "300000000")
    assert "with moving arguments alone" in out.stderr, out.stderr
    calls, inner = (int(x) for x in out.stdout.split())
    start, _ = _symbol(exe, "find")
    blocks = {b["start"]: b for b in calc(db, "find")["blocks"]}
    entry = blocks[start]
    assert entry["method"] == "progress", entry
    assert entry["executions"] == pytest.approx(calls, rel=0.2)
    # from the move over the run over the move per entry, or (three windows whose entry rates agree)
    # from the move rate sampled around each window over its move per entry
    assert entry["evidence"].startswith(("argument rsi moved", "argument rsi's move rate")), entry["evidence"]
    # The windows' local rates: the windows' CLOCK_MONOTONIC span met the samples' times around them
    # (a window of the entry alone, resolved against the thread's samples 10 ms each side).
    import pyarrow.parquet as pq

    from cyclescope.analysis.progress import ARGS, ProgressStats
    from cyclescope.db.tallies import PROGRESS

    sums: dict[str, float] = {n: 0.0 for n in PROGRESS.sum_names}
    for f in db.glob("epoch=*/host=*/progress/*.parquet"):
        for r in pq.read_table(f).to_pylist():
            if r["entry"] == start and r["arg"] == ARGS.index("rsi"):
                for n in PROGRESS.sum_names:
                    sums[n] += r.get(n) or 0
    st = ProgressStats(**sums)  # type: ignore[arg-type]
    assert st.local_windows >= 1, sums
    assert st.local_entries == pytest.approx(calls, rel=0.3), (st.local_entries, calls, sums)
    loop = max(blocks.values(), key=lambda b: b["executions"] or 0)
    assert loop["method"] == "trip-window" and loop["executions"] == pytest.approx(inner, rel=0.3)


def test_an_entry_count_from_an_argument_spilled_to_the_stack(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """progress_spill.c's find() keeps its position argument in a stack slot through its loop (zstd's
    match finder spills its ip so): no register holds it where the samples fall. The samples carry
    the top of the user stack (perf/abi.STACK_BYTES), the loop table says which word holds it, and
    the samples in the loop give its moves as a register's would. The entry's count within 20% of
    the calls, as for progress.c's argument."""
    import pyarrow.parquet as pq

    from cyclescope.analysis.loopcount import loop_table
    from cyclescope.analysis.progress import ARGS, W32
    from cyclescope.images.disasm import read_code

    exe, db, out = _recorded_with_windows(compile_c, tmp_path, "progress_spill", "200000000")
    calls, _inner = (int(x) for x in out.stdout.split())
    start, end = _symbol(exe, "find")
    table = loop_table(read_code(str(exe), start, end), start, end)
    rsi = ARGS.index("rsi")
    in_loop = table.args[table.inner >= 0, rsi]
    assert len(in_loop) and (in_loop >= 0).all() and (in_loop % W32 >= 16).all(), in_loop  # a stack word
    entry = {b["start"]: b for b in calc(db, "find")["blocks"]}[start]
    assert entry["method"] == "progress", entry
    assert entry["evidence"].startswith(("argument rsi moved", "argument rsi's move rate")), entry["evidence"]
    assert entry["executions"] == pytest.approx(calls, rel=0.2)
    # The pairs are the loop's samples (most of the procedure's), not only the prologue's.
    pairs = sum(r["pairs"] for f in db.glob("epoch=*/host=*/progress/*.parquet") for r in pq.read_table(f).to_pylist()
                if r["entry"] == start and r["arg"] == rsi)
    samples = sum(b["samples"] or 0 for b in calc(db, "find")["blocks"])
    assert pairs > 0.5 * samples, (pairs, samples)


def test_an_entry_count_from_a_position_read_from_a_structure(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """progress_member.c's find(m) reads its position from the structure it is passed (lzip's
    match finder reads this->pos): no argument register moves, but the register the position is
    loaded into before the loop does. The trip windows of the entry alone probe the procedure's
    progress point beside it (analysis/progress.progress_point) and take that register's move per
    entry there; the samples give its move over the run, or its rate around each window. The
    entry's count within 20% of the calls, as for progress.c's argument."""
    from cyclescope.analysis.progress import NARGS

    exe, db, out = _recorded_with_windows(compile_c, tmp_path, "progress_member", "300000000")
    assert "with moving arguments alone" in out.stderr, out.stderr
    calls, _inner = (int(x) for x in out.stdout.split())
    start, _ = _symbol(exe, "find")
    entry = {b["start"]: b for b in calc(db, "find")["blocks"]}[start]
    assert entry["method"] == "progress", entry
    assert entry["executions"] == pytest.approx(calls, rel=0.2)
    assert " at the progress point 0x" in entry["evidence"].split(" moved ")[0].split("'s move rate")[0], entry
    # The value's windows and pairs are tallied under its own number (NARGS and up), not an argument's.
    import pyarrow.parquet as pq

    rows = [r for f in db.glob("epoch=*/host=*/progress/*.parquet") for r in pq.read_table(f).to_pylist()
            if r["entry"] == start and r["arg"] >= NARGS and r["window_steps"]]
    assert rows and all(r["window_delta"] > r["window_steps"] for r in rows), rows  # 1.6 positions a call
