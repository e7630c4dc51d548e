"""`cyclescope list` on programs compiled with -O2 -g and profiled for real."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.system.helpers import cs

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]

HOTCOLD = Path(__file__).parents[1] / "programs" / "hotcold.c"
LOOP_LINE = next(i for i, line in enumerate(HOTCOLD.read_text().splitlines(), 1) if "s += (i * i)" in line)


def listing(db: Path, *args: str) -> dict:
    return json.loads(cs("list", "--db", str(db), "--json", *args).stdout)


def loop_share(doc: dict) -> float:
    """Share of the procedure's samples on the instructions of its innermost backward branch's loop."""
    ins = doc["instructions"]
    best = None
    for i in ins:
        parts = i["instruction"].split()
        if parts[0].startswith("j") and len(parts) > 1 and parts[1].startswith("0x"):
            tgt = int(parts[1], 16)
            if tgt < i["address"] and (best is None or i["address"] - tgt < best[1] - best[0]):
                best = (tgt, i["address"])
    assert best is not None, "no loop found"
    inside = sum(i["samples"]["cpu-clock"] for i in ins if best[0] <= i["address"] <= best[1])
    return inside / max(1, doc["samples"]["cpu-clock"])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("list")
    exe = d / "hotcold"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(HOTCOLD)], check=True)
    db = d / "db"
    cs("record", "--db", str(db), "-q", "-F", "5000", "--", str(exe), "800000000")
    return exe, db


def test_the_hot_loop_carries_the_samples_and_names_its_line(recorded: tuple[Path, Path]) -> None:
    exe, db = recorded
    doc = listing(db, "hot")
    assert doc["image"] == str(exe) and doc["samples"]["cpu-clock"] > 1000
    assert loop_share(doc) > 0.9
    top = max(doc["instructions"], key=lambda i: i["samples"]["cpu-clock"])
    assert top["file"].endswith("hotcold.c") and top["line"] == LOOP_LINE
    src = json.loads(cs("list", "--db", str(db), "--json", "--source", "hotcold.c").stdout)
    assert src["hottest_lines"][0] == LOOP_LINE
    text = cs("list", "--db", str(db), "hot").stdout
    assert f"hotcold.c:{LOOP_LINE}" in text and "s += (i * i) ^ (s >> 3);" in text


def test_stripped_binaries_list_from_dynamic_symbols(tmp_path: Path) -> None:
    exe = tmp_path / "hotcold"
    subprocess.run(["gcc", "-O2", "-g", "-rdynamic", "-o", str(exe), str(HOTCOLD)], check=True)
    subprocess.run(["strip", "--strip-all", str(exe)], check=True)
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "-F", "2000", "--", str(exe), "200000000")
    doc = listing(db, "hot")
    assert loop_share(doc) > 0.9
    assert all(i["line"] is None for i in doc["instructions"])
    assert any("no DWARF" in p for p in doc["problems"])


def test_non_pie_executables_map_to_their_addresses(tmp_path: Path) -> None:
    exe = tmp_path / "hotcold"
    subprocess.run(["gcc", "-O2", "-g", "-no-pie", "-o", str(exe), str(HOTCOLD)], check=True)
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "-F", "2000", "--", str(exe), "200000000")
    doc = listing(db, "hot")
    assert doc["start"] >= 0x400000  # linked at a fixed address: offsets are those addresses
    assert loop_share(doc) > 0.9


def test_a_deleted_binary_gives_a_clear_message(tmp_path: Path, compile_c: Callable[..., Path]) -> None:
    exe = tmp_path / "gone"
    shutil.copy(compile_c("hotcold"), exe)
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "-F", "1000", "--no-archive", "--", str(exe), "100000000")
    exe.unlink()
    p = cs("list", "--db", str(db), "hot", check=False)
    assert p.returncode == 4
    assert p.stderr.strip().startswith("cyclescope list: no procedure named 'hot'")
    rng = cs("list", "--db", str(db), "0x1000+16", "--image", "gone")
    assert "binary not found (deleted or moved since it was profiled)" in rng.stdout
