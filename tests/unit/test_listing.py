"""DWARF decoding, `list` and `list --source` on a committed tiny binary (tests/data/inl, from inl.c).

The binary is committed so that the golden outputs do not depend on the
compiler: it was built with `gcc -O2 -g -fdebug-prefix-map=$PWD=. -o inl inl.c`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cyclescope.db.layout import Database
from cyclescope.db.segment import EventMeta, SegmentMeta, build_table, write_segment
from cyclescope.images.cache import Cache
from cyclescope.images.dwarf import DwarfIndex
from cyclescope.images.elf import read_elf_info
from cyclescope.images.registry import ImageInfo
from tests.unit.cli_helpers import DATA, golden, run

WORK_LOOP = [0x11A0, 0x11A3, 0x11A7, 0x11AA, 0x11AD, 0x11B1, 0x11B5, 0x11B8, 0x11BB]


@pytest.fixture
def inl(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(DATA / "inl", d / "inl")
    shutil.copy(DATA / "inl.c", d / "inl.c")
    return d / "inl"


def addr2line(exe: Path, addr: int) -> list[tuple[str, int]]:
    """binutils' answer, innermost frame first: the ground truth for our DWARF decoding."""
    import subprocess

    out = subprocess.run(["addr2line", "-e", str(exe), "-i", hex(addr)], capture_output=True, text=True,
                         check=True).stdout
    frames = []
    for line in out.split():
        f, _, n = line.rpartition(":")
        frames.append((os.path.basename(f), int(n.split()[0])))
    return frames


def test_line_tables_and_inlined_calls_agree_with_addr2line(inl: Path, tmp_path: Path) -> None:
    key = read_elf_info(str(inl)).build_id or ""
    addrs = [0x1190, *WORK_LOOP, 0x11BD]
    dwarf_index = DwarfIndex(str(inl), key, Cache(tmp_path / "c"))
    pos = dwarf_index.positions(np.array(addrs, np.uint64))
    for a, p in zip(addrs, pos, strict=True):
        truth = addr2line(inl, a)
        assert p is not None and (os.path.basename(p.file), p.line) == truth[0], hex(a)
        inlined = [s for s in dwarf_index.scopes_at(a) if s.inlined]
        # addr2line -i lists the inlined frame's line, then the call site of each inlined call.
        assert [s.line for s in reversed(inlined)] == [ln for _, ln in truth[1:]], hex(a)
        assert all(s.name == "step" for s in inlined)
    stack = dwarf_index.scopes_at(0x11A3)
    assert [s.name for s in stack] == ["work", "step"] and stack[0].line == 9  # work is declared on line 9
    assert dwarf_index.decoded_cus == 1
    dwarf_index.close()
    # A second index decodes nothing: everything comes from the cache.
    again = DwarfIndex(str(inl), key, Cache(tmp_path / "c"))
    assert again.positions(np.array(addrs, np.uint64)) == pos
    assert again.decoded_cus == 0 and again.cache.hits >= 2
    again.close()


def make_db(root: Path, inl: Path) -> Database:
    info = read_elf_info(str(inl))
    key = info.build_id or ""
    db = Database.create_or_open(root)
    e = db.new_epoch()
    rows = [(0x11A0, 40), (0x11A3, 120), (0x11AA, 10), (0x11B1, 300), (0x11B8, 25), (0x11BB, 5), (0x1190, 2)]
    off = np.array([r[0] for r in rows], np.uint64)
    cnt = np.array([r[1] for r in rows], np.uint64)
    n = len(rows)
    t = build_table(["[unknown]", key], np.ones(n, np.int64), off, ["cpu-clock"], np.zeros(n, np.int64),
                    ["[unknown]", "inl"], np.ones(n, np.int64), cnt)
    m = SegmentMeta("h", e, start_time=1_700_000_000.0, end_time=1_700_000_002.0)
    m.events["cpu-clock"] = EventMeta("cpu-clock", samples=int(cnt.sum()), period_sum=int(cnt.sum()) * 200_000)
    m.images = {key: ImageInfo(key, str(inl), "elf", key, None, None).to_json()}
    write_segment(db, e, "h", t, m)
    return db


def test_list_golden(inl: Path, tmp_path: Path, utc: object) -> None:
    db = make_db(tmp_path / "db", inl)
    got = run("list", "work", "--db", str(db.root)).replace(str(inl), "<BIN>")
    golden("list_work_golden.txt", got)


def test_list_source_golden(inl: Path, tmp_path: Path, utc: object) -> None:
    db = make_db(tmp_path / "db", inl)
    got = run("list", "--source", "inl.c", "--db", str(db.root), "--source-dir", str(inl.parent))
    golden("list_source_golden.txt", got.replace(str(inl), "<BIN>"))


def test_list_json_and_address_ranges(inl: Path, tmp_path: Path) -> None:
    db = make_db(tmp_path / "db", inl)
    doc = json.loads(run("list", "work", "--db", str(db.root), "--json"))
    assert doc["procedure"] == "work" and doc["start"] == 0x1190 and doc["samples"] == {"cpu-clock": 502}
    by_addr = {i["address"]: i for i in doc["instructions"]}
    assert by_addr[0x11B1]["samples"]["cpu-clock"] == 300 and by_addr[0x11B1]["instruction"] == "sar rax, 2"
    assert by_addr[0x11A3]["inlined"] and by_addr[0x11A3]["inlined"][0].startswith("step")
    assert sum(i["samples"]["cpu-clock"] for i in doc["instructions"]) == 502
    rng = json.loads(run("list", "0x11a0-0x11bd", "--db", str(db.root), "--json", "--no-source"))
    assert [i["address"] for i in rng["instructions"]] == WORK_LOOP
    assert rng["samples"] == {"cpu-clock": 500}


def test_list_errors_are_one_line(inl: Path, tmp_path: Path) -> None:
    from cyclescope.errors import NotFoundError

    db = make_db(tmp_path / "db", inl)
    with pytest.raises(NotFoundError, match=r"no procedure named 'wrok'.*did you mean work"):
        main_raise("list", "wrok", "--db", str(db.root))


def main_raise(*args: str) -> None:
    from cyclescope.cli.main import build_parser

    ns = build_parser().parse_args(list(args))
    ns._cmd.run(ns)


def test_a_stripped_binary_lists_without_source(inl: Path, tmp_path: Path) -> None:
    import subprocess

    stripped = inl.parent / "inl-stripped"
    shutil.copy(inl, stripped)
    subprocess.run(["strip", "--strip-debug", str(stripped)], check=True)
    db_root = tmp_path / "db"
    db = make_db(db_root, inl)
    # Point the image at the stripped copy: same build-id, symbols but no DWARF.
    seg = next(iter(db.all_segment_files()))[2].path
    import pyarrow.parquet as pq

    from cyclescope.db.segment import META_KEY
    from cyclescope.db.segment import SegmentMeta as SM

    t = pq.read_table(seg)
    meta = SM.from_json(t.schema.metadata[META_KEY])
    for v in meta.images.values():
        v["path"] = str(stripped)
    seg.unlink()
    write_segment(db, 1, "h", t.replace_schema_metadata(None), meta)
    doc = json.loads(run("list", "work", "--db", str(db_root), "--json"))
    assert doc["samples"] == {"cpu-clock": 502}
    assert all(i["line"] is None for i in doc["instructions"])
    assert any("no DWARF line information" in p for p in doc["problems"])
