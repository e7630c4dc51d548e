"""Call stacks through the kernel's frame-pointer unwinder, and their export (tests/programs/callgraph.c)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.system.helpers import cs

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    d = tmp_path_factory.mktemp("callgraph")
    exe = d / "callgraph"
    src = Path(__file__).parents[1] / "programs" / "callgraph.c"
    subprocess.run(["gcc", "-O2", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", "-o", str(exe),
                    str(src)], check=True, capture_output=True)
    db = d / "db"
    cs("record", "--db", str(db), "-q", "-g", "fp", "--", str(exe), "400000", timeout=300)
    return db


def folded(text: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for line in text.splitlines():
        stack, n = line.rsplit(" ", 1)
        out[stack] += int(n)
    return out


def test_stacks_are_recorded_and_exported_collapsed(recorded: Path) -> None:
    stacks = folded(cs("export", "collapsed", "--db", str(recorded)).stdout)
    total = sum(stacks.values())
    assert total > 500
    # Every stack under main goes through outer (leaf's own frame is missing when gcc gives it no frame
    # pointer: then leaf appears right under its caller's caller, as perf shows it too).
    under_main = {s: n for s, n in stacks.items() if ";main;" in f";{s};"}
    assert sum(under_main.values()) >= 0.9 * total, stacks.most_common(5)
    assert sum(n for s, n in under_main.items() if ";outer" in s or s.endswith("main;leaf")) >= 0.9 * sum(
        under_main.values())
    top = stacks.most_common(1)[0][0].split(";")
    assert top[-1] == "leaf" and "main" in top
    # Callers are named at their call sites: the frame below leaf is outer or inner, never leaf itself.
    for s in stacks:
        f = s.split(";")
        assert "leaf;leaf" not in ";".join(f)


def test_speedscope_export_follows_the_file_format(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.speedscope.json"
    cs("export", "speedscope", "--db", str(recorded), "-o", str(out))
    doc = json.loads(out.read_text())
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    assert all(isinstance(f["name"], str) for f in frames)
    (prof,) = doc["profiles"]
    assert prof["type"] == "sampled" and prof["unit"] == "none"
    assert len(prof["samples"]) == len(prof["weights"]) and prof["endValue"] == sum(prof["weights"])
    assert all(0 <= i < len(frames) for s in prof["samples"] for i in s)
    names = {f["name"] for f in frames}
    assert {"main", "outer", "leaf"} <= names
    # The same totals as the collapsed export.
    col = folded(cs("export", "collapsed", "--db", str(recorded)).stdout)
    assert sum(col.values()) == prof["endValue"]


def test_without_stacks_export_says_so_and_writes_the_flat_profile(tmp_path: Path) -> None:
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "--", "sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    p = cs("export", "collapsed", "--db", str(db))
    assert "no call stacks recorded" in p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln]
    assert lines and all(";" not in ln.rsplit(" ", 1)[0] for ln in lines)
    bad = cs("export", "perf.data", "--db", str(db), check=False)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_pprof_export_reads_back_and_through_go_tool_pprof(recorded: Path, tmp_path: Path) -> None:
    import gzip

    from cyclescope.report.proto import profile_pb2 as pb

    out = tmp_path / "p.pb.gz"
    cs("export", "pprof", "--db", str(recorded), "-o", str(out))
    prof = pb.Profile()  # type: ignore[attr-defined]
    prof.ParseFromString(gzip.decompress(out.read_bytes()))
    st = list(prof.string_table)
    assert st[0] == "" and [st[t.type] for t in prof.sample_type] == ["cpu-clock"]
    funcs = {f.id: st[f.name] for f in prof.function}
    locs = {loc.id: loc for loc in prof.location}
    maps = {m.id: m for m in prof.mapping}
    assert st[prof.mapping[0].filename].endswith("/callgraph") and st[prof.mapping[0].build_id]
    for loc in locs.values():
        m = maps[loc.mapping_id]
        assert m.memory_start <= loc.address < m.memory_limit
    total = sum(s.value[0] for s in prof.sample)
    col = folded(cs("export", "collapsed", "--db", str(recorded)).stdout)
    assert total == sum(col.values())
    leaf_lines = {loc.line[0].line for loc in locs.values() if funcs[loc.line[0].function_id] == "leaf"}
    src = (Path(__file__).parents[1] / "programs" / "callgraph.c").read_text().splitlines()
    assert any("x * 6364136223846793005UL" in src[n - 1] for n in leaf_lines if n > 0), leaf_lines
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed (scripts/setup installs golang-go): the pprof tool check did not run")
    top = subprocess.run([go, "tool", "pprof", "-top", "-symbolize=none", str(out)], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "HOME": str(tmp_path)})
    assert top.returncode == 0, top.stderr
    rows = {ln.split()[-1]: ln.split() for ln in top.stdout.splitlines() if ln.strip().endswith(("leaf", "main"))}
    assert float(rows["leaf"][1].rstrip("%")) > 80  # flat% of leaf
    assert float(rows["main"][4].rstrip("%")) > 90  # cum% of main
