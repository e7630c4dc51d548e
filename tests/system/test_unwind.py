""".eh_frame unwinding of user stack snapshots (--call-graph dwarf), checked against the kernel's
frame-pointer walk on a binary built with frame pointers, and on one built without them."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cyclescope.collect.daemon import Collector, CollectorConfig, child_done
from cyclescope.collect.events import parse_events
from cyclescope.collect.session import CallGraph, Command, Session
from cyclescope.collect.stacks import StackProcessor, split_chain
from cyclescope.collect.unwind import DwarfStacks
from cyclescope.db.layout import Database
from tests.system.helpers import cs
from tests.system.test_export import folded

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]
SRC = Path(__file__).parents[1] / "programs" / "callgraph.c"


def build(d: Path, name: str, *flags: str, cc: str = "gcc") -> Path:
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not installed (scripts/setup installs it)")
    exe = d / name
    subprocess.run([cc, "-O2", "-g", *flags, "-o", str(exe), str(SRC)], check=True, capture_output=True)
    return exe


def test_unwinder_agrees_with_the_kernels_frame_pointer_walk(tmp_path: Path, monkeypatch: Any) -> None:
    """One run records both: the kernel walks the frame pointers (kernel_user) and we unwind the same
    sample's stack snapshot with .eh_frame. Within the program (leaf to main) they must agree, except
    where the frame-pointer walk is known to be wrong: a sample in a prologue or epilogue, where rbp
    still or again holds the caller's frame and the kernel skips the caller."""
    # clang: gcc 12 gives leaf no frame at -O2 even with -mno-omit-leaf-frame-pointer, and then the
    # kernel's walk misses leaf's caller in most samples.
    exe = build(tmp_path, "cg_fp", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", cc="clang-14")
    pairs: list[tuple[list[int], list[int], Any]] = []
    orig = DwarfStacks._one

    def spy(self: DwarfStacks, w: Any, force: bool) -> tuple[int, ...] | None:
        ch = orig(self, w, force)
        if ch is not None and w.regs and w.proc is not None:
            fp = [a for a, k, _ in split_chain(w.kernel_chain, w.ip) if not k]
            ours = [a for a, k, _ in split_chain(ch, w.ip) if not k]
            pairs.append((fp, ours, w.proc))
        return ch

    monkeypatch.setattr(DwarfStacks, "_one", spy)
    session = Session(parse_events(["cpu-clock"]), Command((str(exe), "8000000")), rate_hz=2000,
                      call_graph=CallGraph("dwarf", 8192, kernel_user=True))
    db = Database.create_or_open(tmp_path / "db")
    assert session.call_graph is not None
    stacks = StackProcessor(session.call_graph)
    c = Collector(session, db, CollectorConfig(host="test", archive="none", processors=[stacks]))
    c.start()
    c.run(until=child_done(session))
    assert len(pairs) > 300

    def in_program(frames: list[int], proc: Any) -> list[int]:
        """The frames in the test binary, leaf first, up to main's."""
        import bisect

        out = []
        for a in frames:
            i = bisect.bisect_right(proc.starts, a) - 1
            if i < 0 or a >= proc.ends[i] or c.table[proc.images[i]].path != str(exe):
                break
            out.append(a)
        return out

    agree = longer = 0
    for fp, ours, proc in pairs:
        a, b = in_program(fp, proc), in_program(ours, proc)
        if a == b:
            agree += 1
        elif len(b) == len(a) + 1 and [x for x in b if x not in a] and set(a) <= set(b):
            longer += 1  # the frame-pointer walk skipped one caller (prologue/epilogue)
    n = len(pairs)
    assert agree >= 0.9 * n, (agree, longer, n)
    assert agree + longer >= 0.98 * n, (agree, longer, n)
    st = stacks.dwarf.stats if stacks.dwarf is not None else None
    assert st is not None and st.stops["end"] >= 0.95 * st.samples, st.stops


def test_dwarf_stacks_of_code_without_frame_pointers(tmp_path: Path) -> None:
    """-fomit-frame-pointer: the kernel's walk cannot find callers, .eh_frame can."""
    exe = build(tmp_path, "cg_nofp", "-fomit-frame-pointer")
    db = tmp_path / "db"
    p = cs("record", "--db", str(db), "-g", "dwarf", "--", str(exe), "300000", timeout=300)
    assert "unwound" in p.stderr and "stopped at: end" in p.stderr, p.stderr
    stacks = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    total = sum(stacks.values())
    assert total > 300
    full = Counter({s: n for s, n in stacks.items() if s.startswith("_start;__libc_start_main;")})
    assert sum(full.values()) >= 0.95 * total, stacks.most_common(5)
    # The program's own stacks, whole: leaf under inner under outer (or under outer directly).
    paths = Counter()
    for s, n in full.items():
        f = s.split(";")
        if "main" in f:
            paths[";".join(x for x in f[f.index("main"):] if x in ("main", "outer", "inner", "leaf"))] += n
    leafy = sum(n for s, n in paths.items() if s.endswith("leaf"))
    good = paths["main;outer;inner;leaf"] + paths["main;outer;leaf"]
    assert good >= 0.95 * leafy, paths
    # about two thirds of leaf's calls are under inner (2 of its 3 calls per outer)
    assert 0.5 < paths["main;outer;inner;leaf"] / leafy < 0.8, paths
    # The kernel's frame-pointer walk on the same binary loses callers.
    db2 = tmp_path / "db2"
    cs("record", "--db", str(db2), "-q", "-g", "fp", "--", str(exe), "300000", timeout=300)
    fp = folded(cs("export", "collapsed", "--db", str(db2)).stdout)
    fp_inner = sum(n for s, n in fp.items() if ";inner;leaf" in s)
    assert fp_inner < 0.5 * paths["main;outer;inner;leaf"] * sum(fp.values()) / total


def test_the_ebpf_program_walks_stacks_without_frame_pointers(tmp_path: Path) -> None:
    """-g dwarf on the eBPF path: the program walks the live stack with unwind rows from
    .eh_frame, and finds the program's stacks in their exact shares; the same program built with
    frame pointers, walked by the kernel, finds the same stacks, in shares it is known to bend."""
    from cyclescope.collect.ebpf import BpfUnavailable, load

    try:
        load(1 << 10, 1 << 10, 1 << 10, 4).close()
    except (BpfUnavailable, OSError) as e:
        pytest.skip(f"the eBPF path cannot run here: {e}")
    # One compiler for both, the same code but for the frame pointer (gcc 12 gives leaf no frame
    # even with -mno-omit-leaf-frame-pointer: the unwinder test above).
    nofp = build(tmp_path, "cg_nofp", "-fomit-frame-pointer", cc="clang-14")
    withfp = build(tmp_path, "cg_fp", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", cc="clang-14")
    # The first sight of an image builds its rows (libc: a quarter to half a second, walks stopping
    # there meanwhile); a second run finds them in the cache.
    cs("record", "--db", str(tmp_path / "warm"), "-q", "--collector", "bpf", "--no-loop-counts", "-g", "dwarf", "--",
       str(nofp), "1000000", timeout=300)
    paths = {}
    # Two seconds or so each: on a busy machine the drain that describes the command may come late,
    # and the stacks before it (frame-pointer walks) must stay a small share. At 4 kHz, about 6,000
    # samples of leaf each: a share's standard deviation from sampling alone is about 0.006.
    for name, exe, graph in (("dwarf", nofp, "dwarf"), ("fp", withfp, "fp")):
        db = tmp_path / name
        p = cs("record", "--db", str(db), "--collector", "bpf", "--no-loop-counts", "-g", graph, "-F", "4000", "--",
               str(exe), "60000000", timeout=300)
        stacks = folded(cs("export", "collapsed", "--db", str(db)).stdout)
        total = sum(stacks.values())
        assert total > 2000
        full = Counter({s: n for s, n in stacks.items() if s.startswith("_start;__libc_start_main;")})
        ours = Counter()
        for s, n in stacks.items():  # frame-pointer walks end in libc, built without them: from main
            f = s.split(";")
            if "main" in f:
                ours[";".join(x for x in f[f.index("main"):] if x in ("main", "outer", "inner", "leaf"))] += n
        leafy = sum(n for s, n in ours.items() if s.endswith("leaf"))
        paths[name] = ours["main;outer;inner;leaf"] / leafy
        if name == "dwarf":
            assert "in the kernel with .eh_frame" in p.stderr, p.stderr
            # Whole stacks, but for the start: samples before the first drain describes the
            # process to the program (a tenth of a second or so) are walked by frame pointer.
            assert sum(full.values()) >= 0.8 * total, (stacks.most_common(5), p.stderr)
            assert ours["main;outer;inner;leaf"] + ours["main;outer;leaf"] >= 0.97 * leafy, ours
    # Exactly two thirds of leaf's calls are under inner (2 of its 3 calls per outer), and every call
    # runs the same loop: the .eh_frame walk finds about that share (0.637-0.662 in 16 runs, quiet
    # and beside two busy loops, about 6,000 samples of leaf each). The frame-pointer walk finds
    # less (0.612-0.644): in leaf's first two instructions (push rbp; mov rsp, rbp) and its last
    # (ret), rbp still or again holds the caller's frame and the kernel's walk skips inner, and
    # clang's leaf is short (its 200 steps folded into 25 of four instructions). The two were once
    # compared with each other within 0.06, as if the frame-pointer walk were the truth: they
    # differ by 0.01-0.05.
    assert abs(paths["dwarf"] - 2 / 3) < 0.05 and 2 / 3 - 0.09 < paths["fp"] < 2 / 3 + 0.02, paths


def test_each_description_of_a_process_has_its_own_generation() -> None:
    """The program caches the row found at each address per (slot, generation): a process
    described again (its mappings changed, or the rows moved) must never meet the old entries."""
    import ctypes

    import numpy as np

    from cyclescope.collect.ebpf import UW_PROC_DTYPE, BpfUnavailable, load

    try:
        bpf = load(1 << 10, 1 << 10, 1 << 10, 4)
    except (BpfUnavailable, OSError) as e:
        pytest.skip(f"the eBPF path cannot run here: {e}")
    try:
        gens = []
        for _ in range(3):
            bpf.describe_unwind(1, 2, np.zeros(1, UW_PROC_DTYPE))
            back = np.zeros(1, UW_PROC_DTYPE)
            key = ctypes.c_uint32(2)
            assert bpf._l.lib.bpf_map_lookup_elem(bpf.fds["uw_procs"], ctypes.byref(key), back.ctypes.data) == 0
            gens.append(int(back["gen"][0]))
        assert len(set(gens)) == 3 and 0 not in gens
    finally:
        bpf.close()
