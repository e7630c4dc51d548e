"""The prof builder (pure) and the whole report, compared with a golden file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from cyclescope.db import symbols as symstore
from cyclescope.db.layout import Database
from cyclescope.db.segment import EventMeta, SegmentMeta, build_table, write_segment
from cyclescope.images.elf import SymbolTable
from cyclescope.images.registry import ImageInfo
from cyclescope.report.prof import NO_SYMBOL, build_prof, build_stack_prof, stack_prof_table
from tests.unit.cli_helpers import golden, run


def syms(*entries: tuple[int, int, str]) -> SymbolTable:
    return SymbolTable.build(list(entries))


def test_build_groups_offsets_by_symbol_and_sorts_by_the_first_event() -> None:
    images = {
        "k": ImageInfo("k", "/bin/a", "elf"),
        "[unknown]": ImageInfo("[unknown]", "[unknown]", "unknown"),
    }
    table = syms((0x100, 0x100, "f"), (0x200, 0x100, "g"))
    per_image = {
        "k": (np.array([0x100, 0x180, 0x200, 0x250, 0x900], np.uint64),
              np.array(["cyc", "cyc", "cyc", "imiss", "cyc"], dtype=object), np.array([5, 5, 20, 3, 2])),
        "[unknown]": (np.array([0, 1], np.uint64), np.array(["cyc", "cyc"], dtype=object), np.array([1, 1])),
    }
    report = build_prof(["cyc", "imiss"], per_image, images, lambda info: table if info.key == "k" else syms())
    assert [(r.procedure, r.counts) for r in report.rows] == [
        ("g", (20, 3)), ("f", (10, 0)), (NO_SYMBOL, (2, 0)), ("[unknown]", (2, 0))]
    assert report.totals == [34, 3]
    assert report.rows[0].start == 0x200
    by_image = build_prof(["cyc", "imiss"], per_image, images, lambda info: table, by_image=True)
    assert [(r.procedure, r.counts) for r in by_image.rows] == [("/bin/a", (32, 3)), ("[unknown]", (2, 0))]


def make_db(root: Path) -> Database:
    db = Database.create_or_open(root)
    e = db.new_epoch()
    keys = ["[unknown]", "kern1", "jit:42:1"]
    rows = np.array([
        # image, offset, event, comm, count
        (1, 0x10, 0, 1, 600), (1, 0x18, 0, 1, 150), (1, 0x40, 0, 2, 120), (1, 0x40, 1, 2, 9),
        (2, 0x7000, 0, 1, 100), (2, 0x7100, 0, 1, 25), (0, 1, 0, 1, 5),
    ], dtype=np.int64)
    t = build_table(keys, rows[:, 0], rows[:, 1].astype(np.uint64), ["cpu-clock", "page-faults"], rows[:, 2],
                    ["[unknown]", "prog", "sh"], rows[:, 3], rows[:, 4].astype(np.uint64))
    m = SegmentMeta("testhost", e, start_time=1_700_000_000.0, end_time=1_700_000_010.0, targets=["./prog"])
    m.events["cpu-clock"] = EventMeta("cpu-clock", samples=1000, period_sum=1000 * 190_000, nominal_period=200_000)
    m.events["page-faults"] = EventMeta("page-faults", time_based=False, samples=9, period_sum=900,
                                        nominal_period=100)
    m.images = {
        "kern1": ImageInfo("kern1", "[kernel.kallsyms]", "kernel", "kern1", offsets="kernel").to_json(),
        "jit:42:1": ImageInfo("jit:42:1", "/tmp/perf-42.map", "jit", offsets="absolute").to_json(),
        "[unknown]": ImageInfo("[unknown]", "[unknown]", "unknown", offsets="reason").to_json(),
    }
    m.unknown = {"no_mapping": 5}
    write_segment(db, e, "testhost", t, m)
    symstore.write_symbols(db, "kern1", syms((0x0, 0x20, "do_syscall_64"), (0x30, 0x20, "clear_page_erms")))
    symstore.write_symbols(db, "jit:42:1", syms((0x7000, 0x80, "jitted_loop")))
    return db


def test_prof_report_matches_the_golden_file(tmp_path: Path, utc: object) -> None:
    db = make_db(tmp_path / "db")
    golden("prof_golden.txt", run("prof", "--db", str(db.root)))


def test_prof_images_and_json(tmp_path: Path, utc: object) -> None:
    db = make_db(tmp_path / "db")
    golden("prof_images_golden.txt", run("prof", "--db", str(db.root), "--images"))
    doc = json.loads(run("prof", "--db", str(db.root), "--json", "--process", "sh"))
    assert doc["totals"] == {"cpu-clock": 120, "page-faults": 9}
    assert [(r["procedure"], r["samples"]) for r in doc["rows"]] == [
        ("clear_page_erms", {"cpu-clock": 120, "page-faults": 9})]
    assert doc["summary"]["unknown_reasons"] == {"no_mapping": 5}
    assert doc["summary"]["mean_period"]["cpu-clock"] == 190_000


def test_limit_hides_rows_and_says_so(tmp_path: Path, utc: object) -> None:
    db = make_db(tmp_path / "db")
    out = run("prof", "--db", str(db.root), "--limit", "1")
    assert "... 4 more procedures with 25.00% of cpu-clock samples (--limit 0 shows all)" in out


def test_functions_from_stacks_count_a_stack_once_and_python_frames_own_their_samples() -> None:
    names = {("a", 1): "leaf", ("a", 2): "mid", ("a", 3): "main", ("p", 1): "py::f:x.py:3", ("p", 2): "py::g:x.py:9",
             ("a", 4): "_PyEval_EvalFrameDefault"}
    stacks = Counter({
        ("cpu-clock", (("a", 1), ("a", 2), ("a", 2), ("a", 3))): 5,  # mid recursing: counted once
        ("cpu-clock", (("a", 2), ("a", 3))): 3,
        # Python: the interpreter's loop is the leaf, f the innermost Python frame, g its caller.
        ("cpu-clock", (("a", 4), ("p", 1), ("p", 2), ("a", 3))): 4,
        ("page-faults", (("a", 1), ("a", 3))): 2,
        ("other", (("a", 1),)): 9,  # not an event of the selection: left out
    })
    r = build_stack_prof(["cpu-clock", "page-faults"], stacks, lambda f: names[f], lambda key: f"/img/{key}")
    assert r.totals == [12, 2]
    got = {row.function: (row.total, row.self_) for row in r.rows}
    assert got["main"] == ((12, 2), (0, 0)) and got["mid"] == ((8, 0), (3, 0))
    assert got["leaf"] == ((5, 2), (5, 2))
    assert got["_PyEval_EvalFrameDefault"] == ((4, 0), (4, 0))
    assert got["py::f:x.py:3"] == ((4, 0), (4, 0)) and got["py::g:x.py:9"] == ((4, 0), (0, 0))
    assert [row.function for row in r.rows][:2] == ["main", "mid"]  # hottest total first
    by_self = build_stack_prof(["cpu-clock", "page-faults"], stacks, lambda f: names[f], lambda key: key, by_self=True)
    assert [row.function for row in by_self.rows][:4] == ["leaf", "_PyEval_EvalFrameDefault", "py::f:x.py:3", "mid"]
    assert r.rows[0].image == "/img/a"
    doc = r.to_json()
    assert doc["rows"][0]["percent_total"] == {"cpu-clock": 100.0, "page-faults": 100.0}
    text = stack_prof_table(r, limit=2)
    assert text.rows[0][:4] == ["12", "100.00%", "0", "0.00%"]
    assert any("4 more functions" in f for f in text.footer)
