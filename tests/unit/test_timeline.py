"""Timelines without the kernel: rows from samples, the processor's flush, the report over steps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cyclescope.collect.processor import Drain
from cyclescope.collect.timeline import TimelineProcessor, rows_of_samples
from cyclescope.db.tallies import TIMELINE, build, compact_tallies, load_tally, write_tally
from cyclescope.errors import NotFoundError, UsageError
from cyclescope.perf.records import SAMPLE_DTYPE
from tests.unit.cli_helpers import run
from tests.unit.test_prof import make_db

W = 100_000_000  # a window, ns


def test_samples_fold_into_one_row_per_thread_window_and_event() -> None:
    pid = np.array([7, 7, 7, 7, 8])
    tid = np.array([7, 7, 9, 7, 8])
    t = np.array([W + 1, W + 5, W + 6, 2 * W, 3 * W + 1], np.uint64)
    rows, first = rows_of_samples(pid, tid, t, np.array([0, 0, 0, 0, 1]), np.array([1.0, 2, 4, 8, 16]))
    got = {(int(r["pid"]), int(r["tid"]), int(r["window_ns"]), int(r["event"])): (int(r["count"]), r["period"])
           for r in rows}
    assert got == {(7, 7, W, 0): (2, 3.0), (7, 9, W, 0): (1, 4.0), (7, 7, 2 * W, 0): (1, 8.0),
                   (8, 8, 3 * W, 1): (1, 16.0)}
    assert sorted(first.tolist()) == [0, 2, 3, 4]  # the first sample of each row


def drain_of(pid: list[int], tid: list[int], t: list[int], comm: list[int]) -> Drain:
    s = np.zeros(len(pid), SAMPLE_DTYPE)
    s["pid"], s["tid"], s["time"] = pid, tid, t
    n = len(pid)
    z = np.zeros(n, np.int64)
    return Drain(s, z, np.full(n, 1e6), z, np.zeros(n, np.uint64), np.array(comm, np.int64))


def test_the_processor_writes_wall_clock_windows_with_the_commands(tmp_path: Path) -> None:
    from cyclescope.db.layout import Database

    db = Database.create_or_open(tmp_path / "db")
    e = db.new_epoch()
    names = ["[unknown]", "prog", "sh"]
    ctx = SimpleNamespace(mapper=SimpleNamespace(comms=SimpleNamespace(names=names),
                                                 procs={5: SimpleNamespace(comm=2)}), events=("cpu-clock",))
    tp = TimelineProcessor()
    tp._to_wall_ns = 1_700_000_000 * 10**9  # monotonic 0 is this wall-clock time
    tp.bind(ctx)  # type: ignore[arg-type]
    tp.process(drain_of([4, 4, 4], [4, 4, 4], [W + 1, W + 2, 2 * W], [1, 1, 1]))
    # The eBPF path: rows counted in the kernel; the command comes from the process's state.
    from cyclescope.collect.timeline import TIMELINE_DTYPE

    tl = np.zeros(1, TIMELINE_DTYPE)
    tl[0] = (5, 6, W, 0, 10, 1e7)
    d = drain_of([5], [5], [W], [0])
    tp.process(Drain(d.samples, d.event, d.period, d.image, d.offset, d.comm, timeline=tl))
    [path] = tp.flush(db, e, "h")
    assert tp.flush(db, e, "h") == []  # nothing since
    t = load_tally(db, TIMELINE, [e]).table.to_pylist()
    assert {(r["process"], r["window_ms"], r["pid"], r["tid"], r["event"], r["samples"]) for r in t} == {
        ("prog", 1_700_000_000_100, 4, 4, "cpu-clock", 2), ("prog", 1_700_000_000_200, 4, 4, "cpu-clock", 1),
        ("sh", 1_700_000_000_100, 5, 6, "cpu-clock", 10)}
    assert path.parent.name == "timeline"


def timeline_db(root: Path) -> Path:
    """make_db's epoch with a timeline: prog busy on one CPU for 3 s, sh for 1 s in the middle,
    two threads of prog; page-faults too."""
    db = make_db(root)
    e = db.current_epoch()
    assert e is not None
    rows: dict[str, list] = {k: [] for k in ("process", "window_ms", "pid", "tid", "event", "samples", "period")}

    def add(proc: str, w: int, pid: int, tid: int, ev: str, n: int, per: float) -> None:
        for k, v in zip(rows, (proc, w, pid, tid, ev, n, per), strict=True):
            rows[k].append(v)

    t0 = 1_700_000_000_000
    for i in range(30):
        add("prog", t0 + 100 * i, 10, 10 + i % 2, "cpu-clock", 500, 1e8)
        if 10 <= i < 20:
            add("sh", t0 + 100 * i, 11, 11, "cpu-clock", 250, 5e7)
    add("prog", t0, 10, 10, "page-faults", 3, 300.0)
    half = len(rows["process"]) // 2
    write_tally(db, e, "testhost", TIMELINE, build(TIMELINE, {k: v[:half] for k, v in rows.items()}))
    write_tally(db, e, "testhost", TIMELINE, build(TIMELINE, {k: v[half:] for k, v in rows.items()}))
    return db.root


def test_the_timeline_report_in_steps_per_process_and_thread(tmp_path: Path, utc: object) -> None:
    root = timeline_db(tmp_path / "db")
    doc = json.loads(run("timeline", "--db", str(root), "--json", "--step", "1000"))
    assert doc["event"] == "cpu-clock" and doc["step_ms"] == 1000 and len(doc["times_ms"]) == 3
    assert doc["total"]["cpus"] == pytest.approx([1.0, 1.5, 1.0])
    assert [(s["name"], s["total"]) for s in doc["series"]] == [("prog", 15000), ("sh", 2500)]
    text = run("timeline", "--db", str(root), "--step", "1000")
    assert text.splitlines()[0] == ("cpu-clock by process, CPUs busy (CPU time of the event over each step), "
                                    "every 1 s from 2023-11-14 (local time)")
    assert text.splitlines()[2:] == ["time      total  prog    sh", "22:13:20   1.00  1.00",
                                     "22:13:21   1.50  1.00  0.50", "22:13:22   1.00  1.00"]
    # By thread, the busiest one shown, the rest summed; the step picked to fit.
    doc = json.loads(run("timeline", "--db", str(root), "--json", "--by", "thread", "--top", "1"))
    assert doc["step_ms"] == 100 and [s["name"] for s in doc["series"]] == ["prog 10/10", "other (2)"]
    assert sum(doc["series"][0]["samples"]) == 7500
    # Another event: samples, not CPUs.
    doc = json.loads(run("timeline", "--db", str(root), "--json", "-e", "page-faults"))
    assert doc["total"]["samples"][0] == 3 and "cpus" not in doc["total"]
    # Selected by process name.
    doc = json.loads(run("timeline", "--db", str(root), "--json", "--process", "sh", "--step", "1000"))
    assert [s["name"] for s in doc["series"]] == ["sh"] and doc["total"]["samples"] == [2500]


def test_timeline_errors_are_one_line(tmp_path: Path) -> None:
    from cyclescope.app.timeline import timeline
    from cyclescope.cli.base import open_profile

    plain = make_db(tmp_path / "plain")
    args = SimpleNamespace(db=str(plain.root), epoch="latest", host=[], process=[], image=[], event=[])
    with pytest.raises(NotFoundError, match="no timeline in this selection"):
        timeline(open_profile(args))  # type: ignore[arg-type]
    root = timeline_db(tmp_path / "db")
    p = open_profile(SimpleNamespace(**{**vars(args), "db": str(root)}))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="multiple of 100"):
        timeline(p, step_ms=150)
    with pytest.raises(NotFoundError, match=r"no samples of event\(s\) cycles"):
        timeline(open_profile(SimpleNamespace(**{**vars(args), "db": str(root), "event": ["cycles"]})))  # type: ignore[arg-type]


def test_timeline_files_compact_into_one_with_the_same_sums(tmp_path: Path) -> None:
    from cyclescope.db.layout import Database

    root = timeline_db(tmp_path / "db")
    db = Database.open(root)
    e = db.current_epoch()
    assert e is not None
    before = load_tally(db, TIMELINE, [e]).table
    r = compact_tallies(db, e, "testhost", TIMELINE)
    assert r is not None and r.merged == 2
    after = load_tally(db, TIMELINE, [e]).table
    assert after.to_pylist() == before.to_pylist()
