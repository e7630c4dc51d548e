"""The eBPF collection path without the kernel: the committed object, counted rows as the loop
maps them, stacks counted per row, the choice of path, and the walk through JIT frames."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cyclescope.collect import ebpf
from cyclescope.collect.ebpf import KEY_DTYPE, MAX_KERNEL, VAL_DTYPE, Drained, to_rows
from cyclescope.collect.stacks import StackAggregator
from cyclescope.collect.unwind import BP, FRAME_POINTER, IP, SP, TRAMPOLINE_RETURN, Unwinder
from cyclescope.errors import UsageError
from cyclescope.perf.abi import MISC_KERNEL, MISC_USER, PERF_CONTEXT_KERNEL, PERF_CONTEXT_USER

from .test_stacks import _Mapper


def test_the_committed_object_is_built_from_the_committed_source() -> None:
    d = Path(ebpf.__file__).parent / "bpf"
    want = (d / "SOURCES.sha256").read_text().strip()
    sources = (d / "profile.bpf.c").read_bytes() + (d / "exec.bpf.c").read_bytes()
    assert hashlib.sha256(sources).hexdigest() == want, (
        "profile.bpf.c or exec.bpf.c changed: run scripts/build-bpf and commit the .bpf.o files")
    assert all((d / n).read_bytes()[:4] == b"\x7fELF" for n in ("profile.bpf.o", "profile-unwind.bpf.o", "exec.bpf.o"))
    # The dtypes here are the C structs' layouts.
    assert (KEY_DTYPE.itemsize, VAL_DTYPE.itemsize, ebpf.TRACE_DTYPE.itemsize) == (
        24, 24, 8 + 8 * ebpf.MAX_FRAMES + 8 + 16 * ebpf.MAX_PY + 8)
    from cyclescope.collect.pyframes import PY_PROC

    # struct py_proc: a u64 and 22 u32; py_ckey; py_code: four addresses, four lengths,
    # the ranges.
    assert (PY_PROC.size, ebpf.PY_CKEY_DTYPE.itemsize, ebpf.PY_CODE_DTYPE.itemsize) == (
        96, 16, 32 + 16 + sum(ebpf.PY_CODE_CAPS))


def drained() -> Drained:
    keys = np.zeros(4, KEY_DTYPE)
    vals = np.zeros(4, VAL_DTYPE)
    keys["pid"] = [7, 7, 0, 7]
    keys["kernel"] = [0, 0, 1, 0]
    keys["ip"] = [0x401000, 0x401000, 0xFFFF0010, 0x401100]
    keys["event"] = [0, 0, 0, 1]
    keys["stack"] = [11, 13, 17, 99]  # 13: last drain's; 99: lost
    vals["count"] = [5, 2, 3, 1]
    vals["period"] = [5_000, 2_000, 3_000, 7]
    vals["last_ns"] = [100, 90, 95, 80]
    stacks = {11: ((), (0x401000, 0x402005), (0x7F00, 0x7F10)), 17: ((0xFFFF0010, 0xFFFF0020), (), ())}
    tl = np.zeros(2, ebpf.TIMELINE_DTYPE)
    tl["pid"], tl["tid"], tl["window_ns"], tl["count"] = [7, 7], [7, 8], [100_000_000, 200_000_000], [6, 1]
    return Drained(keys, vals, stacks, tl)


def test_counted_rows_become_samples_with_their_counts_periods_and_callchains() -> None:
    rows = to_rows(drained(), True, {13: ((0xFFFF0010,), (0x401000, 0x403009), ())})
    s = rows.samples
    assert s["pid"].tolist() == s["tid"].tolist() == [7, 7, 0, 7]
    assert s["cpumode"].tolist() == [MISC_USER, MISC_USER, MISC_KERNEL, MISC_USER]
    assert s["time"].tolist() == [100, 90, 95, 80]  # each row's last sample: mmaps before it apply first
    assert (s["regs"] == -1).all() and (s["extra"] == -1).all()
    assert rows.count.tolist() == [5, 2, 3, 1] and rows.period.tolist() == [5e3, 2e3, 3e3, 7.0]
    assert rows.event.tolist() == [0, 0, 0, 1]
    assert rows.chains == [
        (PERF_CONTEXT_USER, 0x401000, 0x402005),
        (PERF_CONTEXT_KERNEL, 0xFFFF0010, PERF_CONTEXT_USER, 0x401000, 0x403009),  # from the last drain
        (PERF_CONTEXT_KERNEL, 0xFFFF0010, 0xFFFF0020),
        None,  # its stack did not fit: the sampled ip alone
    ]
    assert rows.python == [(0x7F00, 0x7F10), (), (), ()]  # the Python frames the program read, per row
    assert to_rows(drained(), False).chains is None


def test_stacks_of_counted_rows_count_as_many_samples() -> None:
    rows = to_rows(drained(), True)
    agg = StackAggregator()
    agg.add(_Mapper(), rows.samples["pid"].astype(np.int64), rows.samples["ip"], rows.event, rows.chains,
            counts=rows.count.tolist())
    sc = agg.take()
    stacks, ev, n, _ = sc.rows()
    got = {(tuple(st), e): c for st, e, c in zip(stacks, ev, n, strict=True)}
    assert got[(((1, 0x1000), (1, 0x2004)), 0)] == 5
    assert got[(((2, 0x10), (2, 0x1F)), 0)] == 3  # kernel frames: the second is a return address
    assert sum(n) == agg.samples == 11


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(collector=kw.pop("collector", "auto"), call_graph=kw.pop("call_graph", None), **kw)


def test_the_path_is_chosen_by_what_the_processors_need(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from cyclescope.analysis.loopcount import LoopCountProcessor
    from cyclescope.cli.sampling import bpf_collector
    from cyclescope.collect.session import CallGraph
    from cyclescope.collect.stacks import StackProcessor

    loops = [LoopCountProcessor()]
    assert bpf_collector(_args(collector="perf"), [], 1000, 2, "record") is None
    assert bpf_collector(_args(), loops, 1000, 2, "record") is None  # loop counts need registers
    with pytest.raises(UsageError, match="--no-loop-counts"):
        bpf_collector(_args(collector="bpf"), loops, 1000, 2, "record")
    # -g dwarf: the program walks the stacks with unwind rows; the processor unwinds nothing itself.
    loaded: list[tuple[int, ...]] = []
    monkeypatch.setattr(ebpf, "load", lambda *a: loaded.append(a) or SimpleNamespace())
    dwarf = StackProcessor(CallGraph("dwarf"))
    assert bpf_collector(_args(call_graph=CallGraph("dwarf")), [dwarf], 1000, 2, "record") is not None
    assert dwarf.in_kernel and loaded[-1][2] > 0 and loaded[-1][3] > 0
    fp = StackProcessor(CallGraph("fp"))
    assert bpf_collector(_args(call_graph=CallGraph("fp")), [fp], 1000, 2, "record") is not None
    assert not fp.in_kernel and len(loaded[-1]) == 2
    monkeypatch.undo()
    # Where the kernel side cannot load: auto falls back and says why; bpf fails in one line.
    monkeypatch.setattr(ebpf, "OBJECT", Path("/nonexistent/profile.bpf.o"))
    assert bpf_collector(_args(call_graph=CallGraph("fp")), [StackProcessor(CallGraph("fp"))], 1000, 2,
                         "daemon") is None
    assert "reading every sample from perf's rings: /nonexistent/profile.bpf.o is missing" in capsys.readouterr().err
    with pytest.raises(ebpf.BpfUnavailable, match="is missing"):
        bpf_collector(_args(collector="bpf"), [], 1000, 2, "record")


def test_the_bpf_collector_says_which_options_leave_out_what_needs_registers() -> None:
    """Anchors and trip windows run only with loop counts: --no-loop-counts takes the three, and
    --anchors (which turns loop counts on system-wide) must go too; values need --values dropped."""
    from cyclescope.cli.sampling import bpf_without

    assert bpf_without(["loops", "anchors", "trips"], _args()) == "add --no-loop-counts"
    assert bpf_without(["loops", "anchors"], _args(anchors=True)) == "add --no-loop-counts and drop --anchors"
    assert bpf_without(["values"], _args()) == "drop --values (or --goal)"
    assert bpf_without(["loops", "values"], _args()) == "add --no-loop-counts and drop --values (or --goal)"


# --- JIT frames: no CFI, stepped over by frame pointer or as CPython's trampolines -------------
JIT, LIB = 0x7F0000001000, 0x7F0000100000


def jit_proc() -> SimpleNamespace:
    return SimpleNamespace(starts=[JIT, LIB], ends=[JIT + 0x1000, LIB + 0x1000], biases=[0, 0], images=[5, 6])


def stack(sp: int, words: dict[int, int]) -> bytes:
    b = bytearray(512)
    for a, v in words.items():
        b[a - sp : a - sp + 8] = v.to_bytes(8, "little")
    return bytes(b)


def regs(ip: int, sp: int, bp: int) -> list[int]:
    r = [0] * 20
    r[IP], r[SP], r[BP] = ip, sp, bp
    return r


def jit_tables(image: int, pid: int = 0) -> object:
    return FRAME_POINTER if image == 5 else None  # the library has no CFI either: the walk ends there


def test_jit_frames_are_walked_by_frame_pointer_or_as_cpython_trampolines() -> None:
    sp = 0x7FFF0000
    # A frame-pointer frame: rbp = sp + 0x10 -> [saved rbp, return address into the library].
    st = stack(sp, {sp + 0x10: 0x1234, sp + 0x18: LIB + 0x20})
    assert Unwinder(jit_tables).unwind(jit_proc(), regs(JIT + 0x40, sp, sp + 0x10), st) == (
        [JIT + 0x40, LIB + 0x20], "no-cfi")
    # CPython's trampoline (sub $8, %rsp; call): rbp holds data, the return address is at sp + 8.
    st = stack(sp, {sp + 8: LIB + 0x30})
    assert Unwinder(jit_tables).unwind(jit_proc(), regs(JIT + 0x6, sp, 0x55AA00), st) == (
        [JIT + 0x6, LIB + 0x30], "no-cfi")
    # Neither guess lands in mapped code: the walk stops at the JIT frame.
    assert Unwinder(jit_tables).unwind(jit_proc(), regs(JIT + 0x6, sp, 0), stack(sp, {sp + 8: 0x42})) == (
        [JIT + 0x6], "no-cfi")


def test_a_cpython_trampoline_is_known_by_its_code_not_by_a_stale_frame_pointer() -> None:
    """A JIT leaf with an rbp frame returns into a CPython trampoline, whose rbp (restored from the
    leaf's frame) points at a frame further up: read as a frame pointer, it would skip the frames
    between. The trampoline's code says how to step over it."""
    sp = 0x7FFF0000
    stale = sp + 0x100
    st = stack(sp, {sp + 0x10: stale, sp + 0x18: JIT + 0x106, sp + 0x28: LIB + 0x30, stale + 8: LIB + 0x50})
    proc = SimpleNamespace(**vars(jit_proc()), pid=4242)
    code = {JIT + 0x104: TRAMPOLINE_RETURN}
    reads: list[tuple[int, int, int]] = []

    def read(pid: int, addr: int, size: int) -> bytes | None:
        reads.append((pid, addr, size))
        return code.get(addr)

    u = Unwinder(jit_tables, code=read)
    assert u.unwind(proc, regs(JIT + 0x40, sp, sp + 0x10), st) == ([JIT + 0x40, JIT + 0x106, LIB + 0x30], "no-cfi")
    assert reads == [(4242, JIT + 0x104, 7)]  # only the caller's frame (a return address) is read
    u.unwind(proc, regs(JIT + 0x40, sp, sp + 0x10), st)
    assert len(reads) == 1  # once per address
    # Code that cannot be read (the process is gone) or is not a trampoline: the frame pointer first.
    assert Unwinder(jit_tables, code=lambda *a: None).unwind(proc, regs(JIT + 0x40, sp, sp + 0x10), st) == (
        [JIT + 0x40, JIT + 0x106, LIB + 0x50], "no-cfi")


def test_max_kernel_matches_the_program() -> None:
    src = (Path(ebpf.__file__).parent / "bpf" / "profile.bpf.c").read_text()
    assert f"#define MAX_KERNEL {MAX_KERNEL}" in src and f"#define MAX_USER {ebpf.MAX_USER}" in src
    assert f"#define MAX_PY {ebpf.MAX_PY} " in src
