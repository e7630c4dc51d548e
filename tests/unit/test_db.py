"""The profile database: layout, atomic segments, compaction, selection, corruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cyclescope.db.compact import compact
from cyclescope.db.layout import Database, SegmentRef, live_segments, segment_name
from cyclescope.db.query import Selection, match_images, open_profile, parse_epochs, query_counts
from cyclescope.db.segment import EventMeta, SegmentMeta, build_table, read_meta, write_segment
from cyclescope.errors import DataError, NotFoundError, UsageError

IMAGES = ["[unknown]", "aaaa1111bbbb2222", "cccc3333dddd4444"]
INFO = {
    "aaaa1111bbbb2222": {"key": "aaaa1111bbbb2222", "path": "/usr/bin/prog", "kind": "elf",
                         "build_id": "aaaa1111bbbb2222", "size": 10, "mtime": 1, "offsets": "vaddr"},
    "cccc3333dddd4444": {"key": "cccc3333dddd4444", "path": "/lib/libc.so.6", "kind": "elf",
                         "build_id": "cccc3333dddd4444", "size": 20, "mtime": 2, "offsets": "vaddr"},
}


def put(db: Database, epoch: int, rows: list[tuple[int, int, int, int, int]], host: str = "h1",
        events: tuple[str, ...] = ("cpu-clock", "cycles")) -> Path:
    """rows: (image, offset, event, comm, count)."""
    a = np.array(rows, dtype=np.int64).reshape(-1, 5)
    t = build_table(IMAGES, a[:, 0], a[:, 1].astype(np.uint64), list(events), a[:, 2], ["[unknown]", "prog", "sh"],
                    a[:, 3], a[:, 4].astype(np.uint64))
    meta = SegmentMeta(host, epoch, start_time=1000.0, end_time=1010.0, targets=["test"])
    for i, e in enumerate(events):
        n = int(a[a[:, 2] == i, 4].sum())
        meta.events[e] = EventMeta(e, samples=n, period_sum=n * 200_000, nominal_period=200_000)
    meta.images = {k: v for k, v in INFO.items()}
    return write_segment(db, epoch, host, t, meta)


def test_create_open_and_refuse_strangers(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    assert Database.open(tmp_path / "db").root == db.root
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("hi")
    with pytest.raises(UsageError, match="not empty"):
        Database.create_or_open(tmp_path / "other")
    with pytest.raises(DataError, match="not a cyclescope database"):
        Database.open(tmp_path / "other")
    with pytest.raises(NotFoundError):
        Database.open(tmp_path / "missing")
    (db.root / "cyclescope.json").write_text(json.dumps({"format": "cyclescope-db", "version": 99}))
    with pytest.raises(DataError, match="newer"):
        Database.open(db.root)


def test_epochs_are_sequential_and_selectable(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path)
    assert [db.new_epoch() for _ in range(5)] == [1, 2, 3, 4, 5]
    assert db.epoch_info(2)["id"] == 2
    av = db.epochs()
    assert parse_epochs("latest", av) == [5]
    assert parse_epochs("all", av) == av
    assert parse_epochs("2-4", av) == [2, 3, 4]
    assert parse_epochs("1,5", av) == [1, 5]
    assert parse_epochs("-2", av) == [4]
    with pytest.raises(NotFoundError, match="no epoch 9"):
        parse_epochs("9", av)
    with pytest.raises(UsageError):
        parse_epochs("x", av)
    with pytest.raises(NotFoundError, match="no epochs"):
        parse_epochs("latest", [])


def test_segments_get_increasing_names_and_never_overwrite(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path)
    e = db.new_epoch()
    p1 = put(db, e, [(1, 0x10, 0, 1, 5)])
    p2 = put(db, e, [(1, 0x10, 0, 1, 5)])
    assert (p1.name, p2.name) == (segment_name(1, 1), segment_name(2, 2))
    tmp = db.temp_path(p1.parent)
    tmp.write_bytes(b"x")
    with pytest.raises(FileExistsError):
        db.link_new(tmp, p1.parent, 1, 1)
    assert read_meta(p1).rows == 1


def test_live_segments_ignore_ranges_a_compaction_covers() -> None:
    s = [SegmentRef(1, 1, Path("a")), SegmentRef(2, 2, Path("b")), SegmentRef(1, 2, Path("c")),
         SegmentRef(3, 3, Path("d"))]
    assert [x.path.name for x in live_segments(s)] == ["c", "d"]


def test_queries_sum_over_segments_and_filter(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path)
    e = db.new_epoch()
    put(db, e, [(1, 0x10, 0, 1, 5), (1, 0x20, 0, 1, 1), (2, 0x30, 1, 2, 7)])
    put(db, e, [(1, 0x10, 0, 1, 2), (2, 0x30, 0, 2, 4), (0, 1, 0, 1, 3)])
    put(db, e, [(1, 0x10, 0, 1, 100)], host="h2")
    profile_set = open_profile(db, Selection())
    assert profile_set.hosts == ["h1", "h2"]
    assert profile_set.events["cpu-clock"].samples == 6 + 9 + 100 and profile_set.events["cycles"].samples == 7
    got = {(r["image"], r["event"], r["offset"]): r["count"] for r in query_counts(profile_set).to_pylist()}
    assert got == {
        ("aaaa1111bbbb2222", "cpu-clock", 0x10): 107, ("aaaa1111bbbb2222", "cpu-clock", 0x20): 1,
        ("cccc3333dddd4444", "cycles", 0x30): 7, ("cccc3333dddd4444", "cpu-clock", 0x30): 4,
        ("[unknown]", "cpu-clock", 1): 3,
    }
    only = open_profile(db, Selection(hosts=("h1",), processes=("sh",), events=("cpu-clock",)))
    assert [(r["image"], r["count"]) for r in query_counts(only).to_pylist()] == [("cccc3333dddd4444", 4)]
    libc = open_profile(db, Selection(images=("libc.so.6",)))
    assert match_images(libc, ["libc.so.6"]) == ["cccc3333dddd4444"]
    assert sum(r["count"] for r in query_counts(libc).to_pylist()) == 11
    with pytest.raises(NotFoundError, match="no image matches"):
        query_counts(open_profile(db, Selection(images=("nosuch",))))
    with pytest.raises(NotFoundError, match="host"):
        open_profile(db, Selection(hosts=("h9",)))


def test_counts_are_weighted_by_the_periods_the_samples_stood_for(tmp_path: Path) -> None:
    """Two procedures sampled 100 times each, one while the period was 150 us, the other 250 us: it
    ran 5/3 as long, and the counts say so (their total stays the samples'). A segment from before
    weights counts its rows as plain samples; compaction gives them their segment's mean period."""
    db = Database.create_or_open(tmp_path / "db")
    e = db.new_epoch()
    t = build_table(IMAGES, np.array([1, 1]), np.array([0x10, 0x20], np.uint64), ["cpu-clock"], np.array([0, 0]),
                    ["[unknown]", "prog"], np.array([1, 1]), np.array([100, 100], np.uint64),
                    np.array([100 * 150_000, 100 * 250_000], np.uint64))
    meta = SegmentMeta("h1", e, start_time=1000.0, end_time=1010.0)
    meta.events["cpu-clock"] = EventMeta("cpu-clock", samples=200, period_sum=200 * 200_000, nominal_period=250_000)
    meta.images = dict(INFO)
    write_segment(db, e, "h1", t, meta)
    got = {r["offset"]: (r["count"], r["raw"]) for r in query_counts(open_profile(db, Selection())).to_pylist()}
    assert got == {0x10: (75, 100), 0x20: (125, 100)}
    put(db, e, [(1, 0x30, 0, 1, 40)], events=("cpu-clock",))  # no weights: 40 plain samples
    assert {r["offset"]: r["count"] for r in query_counts(open_profile(db, Selection())).to_pylist()}[0x30] == 40
    assert compact(db, e, "h1") is not None
    after = {r["offset"]: r["count"] for r in query_counts(open_profile(db, Selection())).to_pylist()}
    assert after == {0x10: 75, 0x20: 125, 0x30: 40}


def test_compaction_merges_and_size_follows_distinct_keys(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path)
    e = db.new_epoch()
    rows = [(1, 0x1000 + 4 * i, 0, 1, 1) for i in range(2000)]
    for _ in range(10):
        put(db, e, rows)
    before = query_counts(open_profile(db, Selection())).to_pylist()
    r = compact(db, e, "h1")
    assert r is not None and r.merged == 10 and r.rows_before == 20000 and r.rows_after == 2000
    segs = db.segments(e, "h1", live_only=False)
    assert [s.name for s in segs] == [segment_name(1, 10)]
    after = query_counts(open_profile(db, Selection())).to_pylist()
    assert after == before and sum(x["count"] for x in after) == 20000
    assert open_profile(db, Selection()).events["cpu-clock"].samples == 20000
    size_once = segs[0].path.stat().st_size
    # Ten times the samples on the same keys: still the same size.
    for _ in range(10):
        put(db, e, [(1, 0x1000 + 4 * i, 0, 1, 10) for i in range(2000)])
    compact(db, e, "h1")
    (seg,) = db.segments(e, "h1")
    assert seg.path.stat().st_size <= size_once * 1.2
    assert seg.path.stat().st_size / 2000 <= 16  # bytes per distinct (image, offset, event)
    assert compact(db, e, "h1") is None  # one segment: nothing to do


def test_a_crash_after_linking_a_compaction_counts_nothing_twice(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path)
    e = db.new_epoch()
    paths = [put(db, e, [(1, 0x10, 0, 1, 1)]) for _ in range(3)]
    saved = [p.read_bytes() for p in paths]
    compact(db, e, "h1")
    for p, data in zip(paths, saved, strict=True):  # as if the crash came before the deletes
        p.write_bytes(data)
    profile_set = open_profile(db, Selection())
    assert [r["count"] for r in query_counts(profile_set).to_pylist()] == [3]
    compact(db, e, "h1")  # the leftovers are cleaned up
    assert len(db.segments(e, "h1", live_only=False)) == 1


def test_corrupt_segments_are_skipped_with_a_warning_and_kept(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path)
    e = db.new_epoch()
    put(db, e, [(1, 0x10, 0, 1, 1)])
    bad = put(db, e, [(1, 0x10, 0, 1, 5)])
    put(db, e, [(1, 0x10, 0, 1, 2)])
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    profile_set = open_profile(db, Selection())
    assert len(profile_set.warnings) == 1 and "corrupt segment" in profile_set.warnings[0]
    assert [r["count"] for r in query_counts(profile_set).to_pylist()] == [3]
    r = compact(db, e, "h1")
    assert r is None or bad.name in r.skipped_corrupt
    assert bad.exists()  # compaction never destroys data it could not read
    assert [r["count"] for r in query_counts(open_profile(db, Selection())).to_pylist()] == [3]


WRITER = r"""
import sys, numpy as np
from cyclescope.db.layout import Database
from cyclescope.db.segment import SegmentMeta, EventMeta, build_table, write_segment
db = Database.create_or_open(sys.argv[1])
e = db.ensure_epoch()
n = 200000
off = np.arange(n, dtype=np.uint64) * 4
while True:
    t = build_table(["[unknown]", "img"], np.ones(n, np.int64), off, ["cpu-clock"], np.zeros(n, np.int64),
                    ["p"], np.zeros(n, np.int64), np.ones(n, np.uint64))
    m = SegmentMeta("h", e)
    m.events["cpu-clock"] = EventMeta("cpu-clock", samples=n)
    write_segment(db, e, "h", t, m)
    print("ok", flush=True)
"""


def test_kill_9_in_the_middle_of_writing_never_corrupts_what_is_on_disk(tmp_path: Path) -> None:
    dbp = tmp_path / "db"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    completed = 0
    rng = np.random.default_rng(0)
    for _ in range(6):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(dbp)], stdout=subprocess.PIPE, env=env, text=True)
        assert p.stdout is not None
        p.stdout.readline()  # at least one whole flush is on disk
        completed += 1
        time.sleep(float(rng.uniform(0.0, 0.4)))
        os.kill(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        completed += out.count("ok")
    db = Database.open(dbp)
    segs = db.segments(1, "h")
    for s in segs:
        read_meta(s.path)  # every visible segment is whole
    profile_set = open_profile(db, Selection())
    assert not profile_set.warnings
    total = sum(r["count"] for r in query_counts(profile_set).to_pylist())
    # Each reported flush is there; a flush killed after linking but before printing may add one more.
    assert completed * 200000 <= total <= (completed + 6) * 200000
    assert total == len(segs) * 200000


def test_a_stored_binarys_symbols_are_read_by_a_child_as_the_daemon_runs_it(tmp_path: Path) -> None:
    """The daemon keeps pyelftools out of its own memory: the vdso it copied into the database gets
    its symbol table from ``python -m cyclescope.db.symbols DB --stored KEY NAME`` (here a compiled
    program stands for the vdso), the same table the collector would have read itself."""
    from cyclescope.db.symbols import read_symbols, write_binary
    from cyclescope.images.elf import symbols_from_bytes

    data = Path(sys.executable).resolve().read_bytes()
    db = Database.create_or_open(tmp_path / "db")
    write_binary(db, "vdso:test", data)
    cmd = [sys.executable, "-m", "cyclescope.db.symbols", str(db.root), "--stored", "vdso:test", "[vdso]"]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    got, want = read_symbols(db, "vdso:test"), symbols_from_bytes(data, "[vdso]")
    assert got is not None and len(want.names) > 0 and got.names == want.names
    assert got.starts.tolist() == want.starts.tolist()
    # Nothing stored under the key: a failure, said by the status, and nothing written.
    cmd[-2] = "vdso:missing"
    assert subprocess.run(cmd, capture_output=True).returncode == 1 and read_symbols(db, "vdso:missing") is None


def test_kernel_symbols_are_parsed_once_per_boot_and_copied_into_each_new_database(tmp_path: Path) -> None:
    from cyclescope.db.symbols import read_symbols, shared_kernel_symbols, store_kernel_symbols
    from cyclescope.images.elf import SymbolTable

    made: list[int] = []

    def make() -> SymbolTable:  # stands for parsing /proc/kallsyms
        made.append(1)
        return SymbolTable.build([(0x0, 0x10, "_text"), (0x100, 0x40, "schedule"), (0x200, 0, "do_idle")], 0x300)

    shared = shared_kernel_symbols(tmp_path / "cache", "boot1", "kbuildid")
    assert shared is not None and shared_kernel_symbols(tmp_path / "cache", None, "kbuildid") is None
    first, second = Database.create_or_open(tmp_path / "a"), Database.create_or_open(tmp_path / "b")
    assert store_kernel_symbols(first, "kbuildid", make, shared) and shared.exists()
    assert store_kernel_symbols(second, "kbuildid", make, shared)
    assert made == [1]  # the second database got the copy
    a, b = read_symbols(first, "kbuildid"), read_symbols(second, "kbuildid")
    assert a is not None and b is not None and b.names == a.names == ("_text", "schedule", "do_idle")
    assert b.starts.tolist() == a.starts.tolist() and b.ends.tolist() == a.ends.tolist() == [0x10, 0x140, 0x300]
    # A damaged copy is not trusted: the symbols are made again, and the copy replaced.
    shared.write_bytes(b"PAR1 not a parquet file")
    third = Database.create_or_open(tmp_path / "c")
    assert store_kernel_symbols(third, "kbuildid", make, shared) and made == [1, 1]
    t = read_symbols(third, "kbuildid")
    assert t is not None and t.names == a.names
    assert store_kernel_symbols(Database.create_or_open(tmp_path / "d"), "kbuildid", make, shared) and made == [1, 1]
    # No kallsyms (kptr_restrict): nothing stored, nothing shared.
    assert not store_kernel_symbols(Database.create_or_open(tmp_path / "e"), "other", lambda: None,
                                    shared_kernel_symbols(tmp_path / "cache", "boot1", "other"))
    assert not list((tmp_path / "cache" / "kernel-symbols").glob("*other*"))
