"""`stats` and `diff`: the statistics, the test and the false-discovery control."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cyclescope.db.layout import Database
from cyclescope.db.segment import EventMeta, SegmentMeta, build_table, write_segment
from cyclescope.db.symbols import write_symbols
from cyclescope.images.elf import SymbolTable
from cyclescope.images.registry import ImageInfo
from cyclescope.report.compare import benjamini_hochberg, build_diff, build_stats, two_proportion_z
from tests.unit.cli_helpers import run


def test_stats_follow_dcpistats_definitions() -> None:
    # Eight runs shaped like Figure 3's smooth_: min 38155, max 88075, sum 441040.
    smooth = [38155, 88075, 52468, 52468, 52468, 52468, 52468, 52470]
    other = [9000, 9100, 8900, 9050, 8950, 9000, 9020, 8980]
    per_set = [{("smooth_", "wave5"): s, ("fftb_", "wave5"): o} for s, o in zip(smooth, other, strict=True)]
    report = build_stats("cycles", [f"set {i}" for i in range(1, 9)], per_set)
    top = report.rows[0]
    assert top.key == ("smooth_", "wave5")
    assert round(100 * top.range_share, 2) == 11.32  # (88075 - 38155) / 441040, as in the paper
    assert top.total == 441040 and top.n == 8 and top.mean == 55130
    assert top.std == pytest.approx(float(np.std(smooth, ddof=1)))
    assert (top.lo, top.hi) == (38155, 88075)
    assert top.share == pytest.approx(441040 / (441040 + sum(other)))
    assert top.dispersion == pytest.approx(top.std / (top.mean ** 0.5)) and top.dispersion > 50
    assert report.rows[1].dispersion < 2  # fftb_-like counts: sampling noise
    assert report.rows[1].range_share == pytest.approx((9100 - 8900) / sum(other))


def test_stats_normalization_compares_shares() -> None:
    # The second run is twice as long, with the same mix: normalized, nothing varies.
    per_set = [{("a", "x"): 100, ("b", "x"): 300}, {("a", "x"): 200, ("b", "x"): 600}]
    assert build_stats("c", ["1", "2"], per_set).rows[0].range_share > 0.3
    norm = build_stats("c", ["1", "2"], per_set, normalize=True)
    assert all(r.range_share == pytest.approx(0.0) for r in norm.rows)


def test_z_test_matches_the_normal_distribution() -> None:
    z, p = two_proportion_z(np.array([500.0]), np.array([500.0]), 10000, 10000)
    assert z[0] == 0 and p[0] == pytest.approx(1.0)
    # A change of 1.96 standard errors is significant at 5%.
    na = nb = 100000
    pa_ = 0.1
    se = math.sqrt(pa_ * (1 - pa_) * 2 / na)
    b = (pa_ + 1.96 * se) * nb
    z, p = two_proportion_z(np.array([pa_ * na]), np.array([b]), na, nb)
    pooled = (pa_ * na + b) / (na + nb)
    assert z[0] == pytest.approx((b / nb - pa_) / math.sqrt(pooled * (1 - pooled) * 2 / na))
    assert 1.9 < z[0] < 1.96 and p[0] == pytest.approx(math.erfc(z[0] / math.sqrt(2)))
    assert 0.05 < p[0] < 0.06


def test_benjamini_hochberg_is_monotone_and_bounded() -> None:
    p = np.array([0.01, 0.04, 0.03, 0.2, 0.001])
    q = benjamini_hochberg(p)
    order = np.argsort(p)
    assert (np.diff(q[order]) >= -1e-12).all() and (q >= p).all() and (q <= 1).all()
    assert q[4] == pytest.approx(0.005)  # the smallest: p * n / 1


def test_diff_flags_real_changes_and_not_noise() -> None:
    rng = np.random.default_rng(7)
    procs = [f"p{i}" for i in range(50)]
    shares = rng.dirichlet(np.ones(50))
    a = dict(zip([(p, "img") for p in procs], rng.multinomial(200000, shares).tolist(), strict=True))
    moved = shares.copy()
    moved[0] *= 1.5
    moved /= moved.sum()
    b = dict(zip([(p, "img") for p in procs], rng.multinomial(200000, moved).tolist(), strict=True))
    report = build_diff("cycles", "A", "B", a, b)
    flagged = {r.key[0] for r in report.flagged}
    assert "p0" in flagged
    assert len(flagged) <= 3  # the renormalization moves the others a little; noise must not flood the report
    # Two samples of the same distribution: nothing is flagged.
    c = dict(zip([(p, "img") for p in procs], rng.multinomial(200000, shares).tolist(), strict=True))
    assert not build_diff("cycles", "A", "C", a, c).flagged


def test_diff_min_change_ignores_tiny_significant_moves() -> None:
    a = {("x", "i"): 10_000_000, ("y", "i"): 10_000_000}
    b = {("x", "i"): 10_020_000, ("y", "i"): 9_980_000}  # 0.1 points, hugely significant
    assert build_diff("c", "A", "B", a, b, min_change=0.002).flagged == []
    assert len(build_diff("c", "A", "B", a, b, min_change=0.0005).flagged) == 2


def make_db(root: Path) -> Database:
    db = Database.create_or_open(root)
    write_symbols(db, "k", SymbolTable.build([(0x0, 0x100, "fast"), (0x100, 0x100, "slow"), (0x200, 0x10, "x")]))
    for mult in (1, 1, 2, 1):  # epoch 3 spends twice as long in slow
        e = db.new_epoch()
        rows = np.array([(1, 0x10, 0, 1, 5000), (1, 0x110, 0, 1, 3000 * mult), (1, 0x200, 0, 1, 100)], np.int64)
        t = build_table(["[unknown]", "k"], rows[:, 0], rows[:, 1].astype(np.uint64), ["cpu-clock"], rows[:, 2],
                        ["[unknown]", "p"], rows[:, 3], rows[:, 4].astype(np.uint64))
        m = SegmentMeta("h", e)
        m.events["cpu-clock"] = EventMeta("cpu-clock", samples=int(rows[:, 4].sum()))
        m.images = {"k": ImageInfo("k", "[kernel.kallsyms]", "kernel", offsets="kernel").to_json()}
        write_segment(db, e, "h", t, m)
    return db


def test_stats_and_diff_commands(tmp_path: Path) -> None:
    db = make_db(tmp_path / "db")
    doc = json.loads(run("stats", "--db", str(db.root), "--json"))
    assert [s["name"] for s in doc["sets"]] == ["epoch 1", "epoch 2", "epoch 3", "epoch 4"]
    top = doc["rows"][0]
    assert top["procedure"] == "slow" and top["min"] == 3000 and top["max"] == 6000 and top["n"] == 4
    assert top["range_percent"] == pytest.approx(100 * 3000 / 15000)
    text = run("stats", "--db", str(db.root))
    assert text.splitlines()[3].startswith("range%") and "slow" in text.splitlines()[4]
    assert "disp" in text.splitlines()[3]
    hidden = run("stats", "--db", str(db.root), "--min-percent", "2")  # x holds 1.1% of the samples
    assert [ln.split()[-2] for ln in hidden.splitlines()[4:6]] == ["slow", "fast"]
    assert "1 procedures under 2% of the samples are not shown" in hidden
    d = json.loads(run("diff", "2", "3", "--db", str(db.root), "--json"))
    flagged = {r["procedure"]: r["delta_percent_points"] for r in d["rows"] if r["significant"]}
    # slow grew; the others' shares fell with it (shares are normalized by each set's total).
    assert set(flagged) == {"slow", "fast", "x"} and flagged["slow"] > 0 > max(flagged["fast"], flagged["x"])
    same = json.loads(run("diff", "1", "2", "--db", str(db.root), "--json"))
    assert not any(r["significant"] for r in same["rows"])
    assert "did not change significantly" in run("diff", "1", "2", "--db", str(db.root))


def test_erfc_keeps_a_small_relative_error_far_into_the_tail() -> None:
    from cyclescope.report.compare import erfc

    x = np.linspace(0, 9, 9001)  # erfc(9) is 4e-37: the p-value of z = 12.7
    ref = np.array([math.erfc(v) for v in x])
    assert np.max(np.abs(erfc(x) - ref) / ref) < 1.2e-7
