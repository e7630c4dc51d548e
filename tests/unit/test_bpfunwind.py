"""Unwinding in the kernel without the kernel: CFI rows as the eBPF program's rows, and the
descriptions of processes kept in step with their mappings and the rows loading."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cyclescope.collect import bpfunwind as bu
from cyclescope.collect.ebpf import UW_LOADING, UW_MAPS, UW_PROC_DTYPE, UW_ROW_DTYPE
from cyclescope.collect.unwind import PENDING
from cyclescope.images import cfi
from cyclescope.images.maps import ProcessState
from cyclescope.images.registry import ImageInfo, ImageTable

PLT = [("DW_OP_breg7", [8]), ("DW_OP_breg16", [0]), ("DW_OP_lit15", []), ("DW_OP_and", []), ("DW_OP_lit11", []),
       ("DW_OP_ge", []), ("DW_OP_lit3", []), ("DW_OP_shl", []), ("DW_OP_plus", [])]


def row(cfa_kind: int = cfi.CFA_REG, reg: int = cfi.DW_RSP, off: int = 8, ra: int = cfi.SAVED_AT, ra_off: int = -8,
        bp: int = cfi.SAVED_NONE, bp_off: int = 0, expr: int = -1) -> cfi.Row:
    return cfi.Row(cfa_kind, reg, off, ra, ra_off, bp, bp_off, expr)


def test_rows_say_how_to_find_the_caller_as_the_program_reads_them() -> None:
    assert UW_ROW_DTYPE.itemsize == 12 and UW_PROC_DTYPE.itemsize == 8 + 32 * UW_MAPS  # the C structs
    rows = [
        row(),  # entry: CFA = rsp + 8
        row(off=16, bp=cfi.SAVED_AT, bp_off=-16),  # after push rbp
        row(reg=cfi.DW_RBP, off=16, bp=cfi.SAVED_AT, bp_off=-16),  # after mov rbp, rsp
        row(cfi.CFA_EXPR, 0, 0, expr=0),  # the PLT
        row(ra=cfi.SAVED_NONE, ra_off=0),  # _start: the outermost frame
        row(reg=10, off=0),  # a CFA in r10 (stack realignment): not followed
        row(bp=cfi.SAVED_UNKNOWN),  # rbp saved where we cannot follow: lost from here
        row(ra=cfi.SAVED_AT, ra_off=-16),  # a return address elsewhere: not followed
        row(off=1 << 40),  # no int32 offset
        row(cfi.CFA_NONE, 0, 0, cfi.SAVED_UNKNOWN, 0),  # a gap between FDEs
    ]
    pcs = [0x1000 + 16 * k for k in range(len(rows))]
    enc = bu.encode(cfi.CfiTable(pcs, rows, [PLT]))
    assert enc is not None and enc["pc"].tolist() == pcs
    assert enc["cfa"].tolist() == [bu.UW_CFA_RSP, bu.UW_CFA_RSP, bu.UW_CFA_RBP, bu.UW_CFA_PLT, bu.UW_CFA_END,
                                   bu.UW_CFA_NONE, bu.UW_CFA_RSP, bu.UW_CFA_NONE, bu.UW_CFA_NONE, bu.UW_CFA_NONE]
    assert enc["cfa_off"].tolist()[:4] == [8, 16, 16, 8]
    assert enc["bp"].tolist()[:4] == [bu.UW_BP_SAME, bu.UW_BP_SAVED, bu.UW_BP_SAVED, bu.UW_BP_SAME]
    assert enc["bp_off"].tolist()[1:4] == [-16, -16, 11]  # the PLT's threshold rides in bp_off
    assert enc["bp"][6] == bu.UW_BP_LOST
    # Images linked above 4 GiB are not described (32-bit addresses in the rows).
    assert bu.encode(cfi.CfiTable([1 << 32], [row()], [])) is None
    empty = bu.encode(cfi.CfiTable([], [], []))
    assert empty is not None and len(empty) == 0


def test_only_the_plts_expression_is_taken() -> None:
    assert bu.plt_rule(PLT) == (8, 11)
    assert bu.plt_rule([*PLT[:4], ("DW_OP_lit10", []), *PLT[5:]]) == (8, 10)  # .plt.sec stubs
    assert bu.plt_rule([("DW_OP_breg6", [-8]), ("DW_OP_deref", [])]) is None  # DRAP realignment
    assert bu.plt_rule(PLT[:-1]) is None


class FakeBpf:
    def __init__(self, rows: int = 1000, procs: int = 4) -> None:
        self.unwind_rows, self.unwind_procs = rows, procs
        self.rows = np.zeros(rows, UW_ROW_DTYPE)
        self.writes: list[tuple[int, int]] = []
        self.procs: dict[int, tuple[int, np.ndarray]] = {}

    def write_rows(self, first: int, rows: np.ndarray) -> None:
        self.rows[first : first + len(rows)] = rows
        self.writes.append((first, len(rows)))

    def describe_unwind(self, pid: int, slot: int, proc: np.ndarray) -> None:
        self.procs[pid] = (slot, proc.copy())

    def forget_unwind(self, pid: int) -> None:
        del self.procs[pid]

    def maps(self, pid: int) -> list[tuple[int, int, int, int, int]]:
        p = self.procs[pid][1][0]
        return [tuple(int(x) for x in p["m"][k]) for k in range(int(p["n"]))]  # type: ignore[misc]


class FakeLoader:
    def __init__(self, tables: dict[int, Any]) -> None:
        self.tables = tables
        self.failed: dict[int, str] = {}
        self.calls = 0
        self.needs: dict[int, float] = {}

    def __call__(self, image: int, pid: int = 0) -> object:
        self.calls += 1
        return self.tables.get(image, PENDING)

    def need(self, image: int, pid: int, weight: float) -> None:
        self.needs[image] = self.needs.get(image, 0.0) + weight

    def pending(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass


def rows_of(n: int) -> np.ndarray:
    r = np.zeros(n, UW_ROW_DTYPE)
    r["pc"] = np.arange(n) * 4
    r["cfa"] = bu.UW_CFA_RSP
    return r


def setup(bpf: FakeBpf) -> tuple[bu.KernelUnwind, ImageTable, Any]:
    t = ImageTable()
    t.intern(ImageInfo("exe", "/bin/exe", "elf"))
    t.intern(ImageInfo("libc", "/lib/libc.so.6", "elf"))
    t.intern(ImageInfo("jit", "/tmp/perf-1.map", "jit", offsets="absolute"))
    mapper = type("M", (), {})()
    mapper.procs = {}
    loader = FakeLoader({})
    return bu.KernelUnwind(t, mapper, bpf, loader), t, mapper  # type: ignore[arg-type]


def proc(pid: int, maps: list[tuple[int, int, int, int]]) -> ProcessState:
    st = ProcessState(pid, 0)
    for s, e, b, img in maps:
        st.insert(s, e, b, img)
    return st


def test_the_collectors_helpers_are_not_described(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flusher's symbol archivers and compactions (collect/helpers.py) load the collector's
    own libraries: their stacks are not walked with rows."""
    from cyclescope.collect import helpers

    bpf = FakeBpf()
    ku, t, mapper = setup(bpf)
    exe = t.index_of("exe")
    ku.loader.tables = {exe: rows_of(10)}  # type: ignore[attr-defined]
    for pid in (7, 8):
        mapper.procs[pid] = proc(pid, [(0x400000, 0x401000, 0, exe)])
    monkeypatch.setitem(helpers._pids, 7, None)
    ku.watch([7, 8])
    assert sorted(bpf.procs) == [8] and ku.described == 1


def test_processes_are_described_with_their_images_rows_written_once() -> None:
    bpf = FakeBpf()
    ku, t, mapper = setup(bpf)
    exe, libc, jit = t.index_of("exe"), t.index_of("libc"), t.index_of("jit")
    ku.loader.tables = {exe: rows_of(10), libc: rows_of(30)}  # type: ignore[attr-defined]
    mapper.procs[7] = proc(7, [(0x400000, 0x401000, 0, exe), (0x7F0000, 0x7F8000, 0x7E0000, libc),
                               (0x9000, 0xA000, 0, jit)])
    mapper.procs[8] = proc(8, [(0x500000, 0x501000, 0x100000, exe), (0x7F0000, 0x7F8000, 0x7E0000, libc)])
    ku.watch([7, 8, 9])  # 9: not known to the mapper, skipped
    assert sorted(bpf.procs) == [7, 8] and ku.described == 2
    # The JIT mapping is left out: the program steps over its frames by frame pointer.
    assert bpf.maps(7) == [(0x400000, 0x401000, 0, 0, 10), (0x7F0000, 0x7F8000, 0x7E0000, 10, 30)]
    assert bpf.maps(8)[0] == (0x500000, 0x501000, 0x100000, 0, 10)
    assert bpf.writes == [(0, 10), (10, 30)]  # each image once, shared by both processes
    # Nothing changed: nothing described again; a new mapping: described again, same slot.
    ku.watch([7, 8])
    slot = bpf.procs[7][0]
    mapper.procs[7].insert(0x600000, 0x601000, 0x600000, libc)
    ku.watch([7])
    assert bpf.procs[7][0] == slot and len(bpf.maps(7)) == 3 and bpf.writes == [(0, 10), (10, 30)]
    # Exit: the slot is free again.
    ku.forget(7)
    assert 7 not in bpf.procs and slot in ku.free


def test_a_process_waits_for_rows_loading_and_is_described_again_when_they_arrive() -> None:
    bpf = FakeBpf()
    ku, t, mapper = setup(bpf)
    exe, libc = t.index_of("exe"), t.index_of("libc")
    ku.loader.tables = {exe: rows_of(5)}  # type: ignore[attr-defined]  # libc still loading
    mapper.procs[7] = proc(7, [(0x400000, 0x401000, 0, exe), (0x7F0000, 0x7F8000, 0x7E0000, libc)])
    ku.watch([7], [40.0])
    assert ku.waiting and bpf.maps(7)[1][3:] == (UW_LOADING, 0)  # walks stop there, counted as loading
    assert ku.loader.needs[libc] == 40.0  # type: ignore[attr-defined]  # rows wait in order of samples
    ku.loader.tables[libc] = rows_of(8)  # type: ignore[attr-defined]
    ku.watch([])  # not sampled in this drain: described again all the same
    assert not ku.waiting and bpf.maps(7)[1][3:] == (5, 8)


def test_limits_rows_that_do_not_fit_processes_past_the_table_and_many_mappings() -> None:
    bpf = FakeBpf(rows=12, procs=1)
    ku, t, mapper = setup(bpf)
    exe, libc = t.index_of("exe"), t.index_of("libc")
    ku.loader.tables = {exe: rows_of(10), libc: rows_of(30)}  # type: ignore[attr-defined]
    mapper.procs[7] = proc(7, [(0x400000, 0x401000, 0, exe), (0x7F0000, 0x7F8000, 0x7E0000, libc)])
    mapper.procs[8] = proc(8, [(0x400000, 0x401000, 0, exe)])
    ku.watch([7, 8])
    assert bpf.maps(7)[1][3:] == (0, 0) and ku.no_room == {libc}  # libc's rows did not fit: walks end there
    assert 8 not in bpf.procs and ku.no_slot == 1
    assert "no room for the rows of 1 images" in (ku.summary({"uw_walks": 10, "uw_frames": 40}) or "")
    # More executable mappings than the program holds: those with rows are kept.
    bpf2 = FakeBpf(procs=2)
    ku2, t2, mapper2 = setup(bpf2)
    exe2 = t2.index_of("exe")
    none = t2.intern(ImageInfo("x", "/lib/x.so", "elf"))
    ku2.loader.tables = {exe2: rows_of(4), none: np.zeros(0, UW_ROW_DTYPE)}  # type: ignore[attr-defined]
    maps = [(0x10000 * (k + 1), 0x10000 * (k + 1) + 0x1000, 0, none) for k in range(UW_MAPS + 5)]
    mapper2.procs[3] = proc(3, [*maps, (0x7000000, 0x7001000, 0, exe2)])
    ku2.watch([3])
    got = bpf2.maps(3)
    assert len(got) == UW_MAPS and got[-1][4] == 4 and ku2.too_many_maps == 1
    assert [m[0] for m in got] == sorted(m[0] for m in got)


@pytest.mark.parametrize("stats, want", [
    ({"uw_walks": 100, "uw_frames": 650, "uw_complete": 97, "uw_fp": 20, "uw_loading": 3},
     "unwound 100 user stacks in the kernel with .eh_frame, 6.5 frames on average, 97.0% to the outermost frame; "
     "20 frames of code in no image (JIT) by frame pointer; 3 cut short while unwind tables loaded"),
    ({}, None),
])
def test_the_summary_line(stats: dict[str, int], want: str | None) -> None:
    ku, _, _ = setup(FakeBpf())
    assert ku.summary(stats) == want


def test_rows_load_in_order_of_need_not_of_asking() -> None:
    import threading

    t = ImageTable()
    a, b, c = (t.intern(ImageInfo(k, f"/lib/{k}.so", "elf")) for k in "abc")
    go = threading.Event()
    order: list[int] = []

    class Loader(bu.RowLoader):
        def _load(self, image: int) -> object:
            go.wait(5)
            order.append(image)
            return rows_of(image)

    loader = Loader(t, None)
    try:
        assert loader(a, 1) is PENDING  # the worker may take it at once, and wait on go
        assert loader(b, 2) is PENDING and loader(c, 3) is PENDING
        loader.need(c, 3, 50.0)  # c's process has the samples
        loader.need(b, 2, 1.0)
        go.set()
        loader.wait(5)
        assert order.index(c) < order.index(b) and not loader.pending()
        assert len(loader(c)) == c and loader(b) is not PENDING  # type: ignore[arg-type]
    finally:
        loader.close()


def test_rows_of_images_no_process_maps_are_reclaimed_when_rows_run_out() -> None:
    bpf = FakeBpf(rows=50, procs=4)
    ku, t, mapper = setup(bpf)
    exe, libc = t.index_of("exe"), t.index_of("libc")
    new = t.intern(ImageInfo("new", "/bin/new", "elf"))
    tables = {exe: rows_of(15), libc: rows_of(20), new: rows_of(25)}
    ku.loader.tables = dict(tables)  # type: ignore[attr-defined]
    ku.loader.reload = lambda img: tables[img]  # type: ignore[attr-defined,method-assign]
    mapper.procs[7] = proc(7, [(0x400000, 0x401000, 0, exe), (0x7F0000, 0x7F8000, 0x7E0000, libc)])
    mapper.procs[8] = proc(8, [(0x7F0000, 0x7F8000, 0x7E0000, libc)])
    ku.watch([7, 8])
    assert ku.rows == {exe: (0, 15), libc: (15, 20)} and ku.next_row == 35
    ku.forget(7)  # exe is mapped by nobody now: 15 rows, over a quarter of them
    mapper.procs[9] = proc(9, [(0x500000, 0x501000, 0, new)])
    ku.watch([9])  # 25 rows do not fit in the 15 left: no room, for now
    assert ku.no_room == {new} and bpf.maps(9)[0][3:] == (0, 0)
    ku.watch([])  # the next drain compacts: libc's rows move to the start, new's follow
    assert ku.compactions == 1 and ku.rows == {libc: (0, 20), new: (20, 25)} and not ku.no_room
    assert bpf.maps(8)[0][3:] == (0, 20) and bpf.maps(9)[0][3:] == (20, 25)
    assert bpf.rows["pc"][20:45].tolist() == tables[new]["pc"].tolist()
