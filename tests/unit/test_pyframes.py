"""Python frames without the kernel: the location table against CPython's own co_lines(), code
objects named from this very process's memory, and the splice into native stacks."""

from __future__ import annotations

import contextlib
import ctypes
import dis
import glob
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from cyclescope.collect import pyframes
from cyclescope.collect.pyframes import (
    OFFSETS,
    PY_ENTRY,
    SLOT_BITS,
    PythonFrames,
    interleave,
    line_at,
    line_ranges,
    line_ranges_310,
    pthread_tid_offset,
    splice,
)
from cyclescope.images.registry import ImageTable


def sample_function(n: int) -> int:  # several lines, a loop, a call: a varied location table
    total = 0
    for i in range(n):
        if i % 3:
            total += i
        else:
            total -= len(str(i))
    return total


def _tagged(code: object) -> int:
    """A code object as the eBPF program keeps it in a frame: its address and its tag."""
    from cyclescope.collect.procmem import ProcessMemory

    o = OFFSETS[(sys.version_info.major, sys.version_info.minor)]
    head = ProcessMemory(os.getpid()).read(id(code), o["code_adaptive"])
    assert head is not None
    return id(code) | pyframes.code_tag(head, o["code_firstlineno"])


def _codes() -> list:
    import json
    import textwrap

    out = [sample_function.__code__, textwrap.dedent.__code__, json.dumps.__code__, _codes.__code__]
    out += [c for c in json.JSONEncoder.iterencode.__code__.co_consts if hasattr(c, "co_lines")]
    return out


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the 3.11+ location table")
def test_location_tables_read_as_cpython_reads_them() -> None:
    for code in _codes():
        ours = [(2 * a, 2 * b, ln) for a, b, ln in line_ranges(code.co_linetable, code.co_firstlineno)]
        theirs = list(code.co_lines())
        # co_lines() merges neighbouring entries of one line; compare line by code unit.
        def per_unit(rs: list) -> dict[int, int | None]:
            return {u: ln for a, b, ln in rs for u in range(a, b, 2)}
        assert per_unit(ours) == per_unit(theirs), code.co_name
        # The binary search over the ranges' starts finds what the scan finds, for every unit.
        rs = line_ranges(code.co_linetable, code.co_firstlineno)
        starts = [a for a, _, _ in rs]
        assert all(rs[i][0] >= rs[i - 1][1] for i in range(1, len(rs)))  # in order, no overlap
        for u in range(-1, (rs[-1][1] if rs else 0) + 2):
            assert line_at(rs, u, 7, starts) == line_at(rs, u, 7), (code.co_name, u)


def test_a_310_line_table_reads_as_its_pairs_say() -> None:
    """PEP 626's 3.10 table: (bytes, line delta) pairs; -128 no line; empty ranges dropped."""
    table = bytes([6, 0, 4, 1, 0, 2, 8, 128, 2, 0xFF])  # +0 over 6 bytes, +1, (0, +2), no line, -1
    assert line_ranges_310(table, 10) == [(0, 3, 10), (3, 5, 11), (5, 9, None), (9, 10, 12)]


def _python310() -> str | None:
    found = sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10"))
    return found[0] if found else None


@pytest.mark.skipif(_python310() is None, reason="no CPython 3.10 here (pyenv's) to compare co_lines() with")
def test_310_line_tables_read_as_cpython_310_reads_them() -> None:
    """Every code object of a 3.10 standard library module: its table read here against the
    co_lines() of a 3.10 interpreter (run as a child: this one is 3.11+)."""
    dump = r"""
import json, sys, types, json.decoder, textwrap, argparse
def walk(c):
    yield c
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            yield from walk(k)
out = []
for mod in (json.decoder, textwrap, argparse):
    src = open(mod.__file__).read()
    for c in walk(compile(src, mod.__file__, "exec")):
        out.append([c.co_linetable.hex(), c.co_firstlineno, len(c.co_code), list(c.co_lines())])
print(json.dumps(out))
"""
    codes = json.loads(subprocess.run([str(_python310()), "-c", dump], capture_output=True, text=True,
                                      check=True).stdout)
    assert len(codes) > 100
    for table, first, size, theirs in codes:
        ours = {u: ln for a, b, ln in line_ranges_310(bytes.fromhex(table), first) for u in range(a, b)}
        ref = {a // 2 + k: ln for a, b, ln in theirs for k in range((b - a) // 2)}
        assert ours == ref and max(ours) < size // 2


def test_glibc_pthread_holds_the_thread_id_where_a_310_walk_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """3.10's thread states name their thread by pthread_t; the tid is read from glibc's struct
    pthread. This thread is the target: a thread state of two fields (next, thread_id) holding
    its pthread_t (threading.get_ident())."""
    state = (ctypes.c_uint64 * 2)(0, threading.get_ident())
    head = ctypes.c_uint64(ctypes.addressof(state))
    o = dict(OFFSETS[(3, 10)], tstate_next=0, tstate_tid=8)
    assert pthread_tid_offset(os.getpid(), ctypes.addressof(head), o) == 0x2D0
    monkeypatch.setattr(pyframes, "PTHREAD_TID", 8)  # another C library's layout: found by the scan
    assert pthread_tid_offset(os.getpid(), ctypes.addressof(head), o) == 0x2D0
    zeros = ctypes.create_string_buffer(0x800)
    state[1] = ctypes.addressof(zeros)  # no tid anywhere in what it points at
    assert pthread_tid_offset(os.getpid(), ctypes.addressof(head), o) is None


@pytest.mark.skipif((sys.version_info.major, sys.version_info.minor) not in OFFSETS,
                    reason="a CPython version cyclescope reads frames of")
def test_code_objects_are_named_from_a_live_process_memory() -> None:
    """This process is the target: id() of a code object is its address in CPython."""
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageResolver

    table = ImageTable()
    mapper = Mapper(ImageResolver(table), None, [])  # type: ignore[arg-type]
    mapper.scan_proc([os.getpid()])
    described: dict[int, bytes] = {}
    bpf = SimpleNamespace(set_python=lambda pid, cfg: described.__setitem__(pid, cfg), forget_python=lambda pid: None,
                          take_codes=_no_codes)
    pf = PythonFrames(table, mapper, bpf)  # type: ignore[arg-type]
    pf.watch([os.getpid()])
    assert not described  # the recorder does not read its own frames
    pf.own = -1  # here it is the target
    pf.watch([os.getpid()])
    assert os.getpid() in described, "this interpreter was not recognized"
    o = OFFSETS[(sys.version_info.major, sys.version_info.minor)]
    code = sample_function.__code__
    # An instruction on the `total -= len(str(i))` line: its code unit, as a frame's pointer.
    target = next(i for i in dis.get_instructions(code) if i.opname == "CALL" and i.positions.lineno is not None
                  and i.positions.lineno > code.co_firstlineno + 4)
    instr = id(code) + o["code_adaptive"] + target.offset
    frames = pf.frames(os.getpid(), (_tagged(code), instr, _tagged(_codes.__code__), 0))
    assert len(frames) == 2
    # The same address with another tag: the object the sample saw there is gone (freed, and
    # another made at its address); not named after the one there now, but kept as a frame, unnamed.
    (gone,) = pf.frames(os.getpid(), (_tagged(code) ^ (1 << 63), instr))
    # An object that is not a code object (a frame read as the interpreter sets it up) is no frame.
    not_code = ["x" * 64] * 64
    assert pf.frames(os.getpid(), (id(not_code), 0)) == () and pf.procs[os.getpid()].code_type
    (img, off), (img2, off2) = frames
    assert img == img2 and table[img].kind == "python"
    assert off & ((1 << SLOT_BITS) - 1) == target.positions.lineno
    assert off2 & ((1 << SLOT_BITS) - 1) == _codes.__code__.co_firstlineno  # no instruction: the first line
    syms = pf.symbols(table[img].key)
    assert syms is not None
    found = syms.lookup(__import__("numpy").array([off, off2, gone[1]], "uint64")).tolist()
    names = [syms.names[int(i)] for i in found]
    assert names == [f"py::sample_function:{__file__}", f"py::_codes:{__file__}", pyframes.UNNAMED]
    pf.forget(os.getpid())
    assert pf.symbols(table[img].key) is not None  # kept for the flush after the process is gone
    pf.flushed()
    assert pf.symbols(table[img].key) is None


def _no_codes():
    import numpy as np

    from cyclescope.collect.ebpf import PY_CKEY_DTYPE, PY_CODE_DTYPE

    return np.zeros(0, PY_CKEY_DTYPE), np.zeros(0, PY_CODE_DTYPE)


def _as_copied_at_exit(pid: int, codes: list, o: dict[str, int]):
    """The rows profile.bpf.c's exit program writes for these code objects (copy_code): the same
    ranges of memory, read here from this process."""
    import numpy as np

    from cyclescope.collect.ebpf import PY_CKEY_DTYPE, PY_CODE_CAPS, PY_CODE_DTYPE
    from cyclescope.collect.procmem import ProcessMemory

    mem = ProcessMemory(pid)

    def u(addr: int, n: int, signed: bool = False) -> int:
        return int.from_bytes(mem.read(addr, n) or b"", "little", signed=signed)

    keys, vals = np.zeros(len(codes), PY_CKEY_DTYPE), np.zeros(len(codes), PY_CODE_DTYPE)
    for row, code in enumerate(codes):
        addr = id(code)
        ranges = [(addr, o["code_adaptive"])]
        for field in ("code_qualname", "code_filename"):
            s = u(addr + o[field], 8)
            state, length = u(s + o["unicode_state"], 4), u(s + o["unicode_length"], 8, True)
            start = o["ascii_size"] if state >> 6 & 1 else o["compact_size"]
            ranges.append((s, max(o["compact_size"], start + length * (state >> 2 & 7))))
        t = u(addr + o["code_linetable"], 8)
        ranges.append((t, o["bytes_sval"] + u(t + o["bytes_size"], 8, True)))
        keys[row]["pid"], keys[row]["code"] = pid, addr
        for i, ((a, n), cap) in enumerate(zip(ranges, PY_CODE_CAPS, strict=True)):
            n = min(n, cap)
            vals[row]["addr"][i], vals[row]["len"][i] = a, n
            vals[row][f"r{i}"][:n] = np.frombuffer(mem.read(a, n) or b"", np.uint8)
    return keys, vals


def _this_process_described() -> tuple[ImageTable, PythonFrames]:
    """PythonFrames with this process described (its own pid not left out), its fake program
    copying nothing."""
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageResolver

    table = ImageTable()
    mapper = Mapper(ImageResolver(table), None, [])  # type: ignore[arg-type]
    mapper.scan_proc([os.getpid()])
    bpf = SimpleNamespace(set_python=lambda pid, cfg: None, forget_python=lambda pid: None, take_codes=_no_codes)
    pf = PythonFrames(table, mapper, bpf)  # type: ignore[arg-type]
    pf.own = -1
    pf.watch([os.getpid()])
    return table, pf


@pytest.mark.skipif((sys.version_info.major, sys.version_info.minor) not in OFFSETS,
                    reason="a CPython version cyclescope reads frames of")
def test_a_process_gone_is_named_from_what_was_copied_at_its_exit() -> None:
    """A process that exited before its code objects were read: the program copied them as it
    exited, and they are read from the copies as from the process (names and lines), until the
    process is forgotten; a name longer than was copied leaves its frame unnamed."""
    from cyclescope.collect.pyframes import CapturedMemory

    table, pf = _this_process_described()
    pid = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    pf.procs[pid] = pf.procs.pop(os.getpid())  # a process whose memory is gone
    o = OFFSETS[(sys.version_info.major, sys.version_info.minor)]

    def short() -> None:
        pass

    # A name of 300 characters: the program copies 256 bytes of a name's object.
    long = short.__code__
    long = long.replace(co_qualname="q" * 300) if hasattr(long, "co_qualname") else long.replace(co_name="q" * 300)
    code = sample_function.__code__
    target = next(i for i in dis.get_instructions(code) if i.opname == "CALL" and i.positions.lineno is not None
                  and i.positions.lineno > code.co_firstlineno + 4)
    keys, vals = _as_copied_at_exit(os.getpid(), [code, long], o)
    keys["pid"] = pid
    pf.captured(keys, vals)
    assert len(pf._captured[pid]) == 7  # four ranges each, the file's str one object
    instr = id(code) + o["code_adaptive"] + target.offset
    frames = pf.frames(pid, (_tagged(code), instr, _tagged(long), 0, _tagged(_codes.__code__), 0))
    # From the copies alone: the long name was cut, and _codes' code object was not copied; their
    # frames stay, unnamed.
    assert len(frames) == 3 and pf.codes_at_exit == 1
    (img, off), cut, missing = frames
    assert off & ((1 << SLOT_BITS) - 1) == target.positions.lineno and cut == missing
    syms = pf.symbols(table[img].key)
    assert syms is not None and list(syms.names) == [f"py::sample_function:{__file__}", pyframes.UNNAMED]
    pf.forget(pid)
    assert pid not in pf._captured
    # The copies read as memory does: inside a range, or not at all.
    m = CapturedMemory()
    m.add(100, b"abcdef")
    m.add(100, b"abc")  # a shorter copy of the same range keeps the longer
    m.add(200, b"xyz")
    assert m.read(101, 3) == b"bcd" and m.read(104, 3) is None and m.read(200, 3) == b"xyz"
    assert m.read(99, 1) is None and m.read(203, 1) is None and len(m) == 2
    # Copies overlap (each is of a fixed size from its object): a short one starting nearer below
    # an address does not hide a longer, earlier one that holds it.
    table = bytes(range(64)) * 16  # 1,024 bytes from 0x1000, as a line table's copy
    m.add(0x1000, table)
    m.add(0x1100, b"s" * 16)  # a name's copy, inside the table's
    assert m.read(0x1200, 16) == table[0x200:0x210] and m.read(0x1104, 8) == b"s" * 8
    assert m.read(0x13F8, 16) is None  # past the end of every range


@pytest.mark.skipif((sys.version_info.major, sys.version_info.minor) not in OFFSETS,
                    reason="a CPython version cyclescope reads frames of")
def test_a_process_that_exits_as_its_frames_are_named_is_named_from_the_late_copies() -> None:
    """The drain took the copies before the process exited, and names its frames after: its
    memory cannot be read, and the copies are looked for again (the drain's stacks stayed in the
    program's map for its exit program to copy from), once per process and drain."""
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageResolver

    table = ImageTable()
    mapper = Mapper(ImageResolver(table), None, [])  # type: ignore[arg-type]
    mapper.scan_proc([os.getpid()])
    queue: list = []
    calls = []

    def take_codes():
        calls.append(1)
        return queue.pop(0) if queue else _no_codes()

    bpf = SimpleNamespace(set_python=lambda pid, cfg: None, forget_python=lambda pid: None, take_codes=take_codes)
    pf = PythonFrames(table, mapper, bpf)  # type: ignore[arg-type]
    pf.own = -1
    pf.watch([os.getpid()])
    gone = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    pf.procs[gone] = pf.procs.pop(os.getpid())  # a process whose memory is gone
    o = OFFSETS[(sys.version_info.major, sys.version_info.minor)]
    code = sample_function.__code__
    pf.take_codes()  # the drain's: nothing copied yet
    keys, vals = _as_copied_at_exit(os.getpid(), [code], o)
    keys["pid"] = gone
    queue.append((keys, vals))  # copied as it exited, after the drain's look
    frames = pf.frames(gone, (_tagged(code), 0, _tagged(_codes.__code__), 0))
    # sample_function from the late copies; _codes was not copied: unnamed, and not looked for twice.
    assert len(frames) == 2 and pf.codes_at_exit == 1 and len(calls) == 2
    unnamed = frames[1]
    assert pf.frames(gone, (_tagged(_codes.__code__), 0)) == (unnamed,) and len(calls) == 2
    # The next drain's take, and one more look for late copies at its first unreadable frame (the
    # copies a process has may be its module bodies', made while it ran).
    pf.take_codes()
    assert pf.frames(gone, (_tagged(_codes.__code__), 0)) == (unnamed,) and len(calls) == 4
    assert pf.frames(gone, (_tagged(_codes.__code__), 0)) == (unnamed,) and len(calls) == 4


@contextlib.contextmanager
def _python_child() -> Iterator[tuple[subprocess.Popen[bytes], Any, dict[int, bytes], PythonFrames]]:
    """A CPython child whose runtime is up, the Mapper that will know it (not scanned yet), what
    PythonFrames describes to a fake eBPF program, and the PythonFrames; the child killed after."""
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageResolver

    child = subprocess.Popen([sys.executable, "-c", "import sys, time; print(1, flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"1"  # its runtime is up
        table = ImageTable()
        mapper = Mapper(ImageResolver(table), None, [])  # type: ignore[arg-type]
        described: dict[int, bytes] = {}
        bpf = SimpleNamespace(set_python=lambda pid, cfg: described.__setitem__(pid, cfg),
                              forget_python=lambda pid: None)
        yield child, mapper, described, PythonFrames(table, mapper, bpf)  # type: ignore[arg-type]
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif((sys.version_info.major, sys.version_info.minor) not in OFFSETS,
                    reason="a CPython version cyclescope reads frames of")
def test_the_collectors_helpers_are_not_described(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flusher's symbol archivers and compactions (collect/helpers.py) are Python processes
    whose frames are not read (a daemon with -g spent most of its CPU naming them); any other
    child, as `record -- CMD`'s command, is."""
    from cyclescope.collect import helpers

    with _python_child() as (child, mapper, described, pf):
        mapper.scan_proc([child.pid])
        monkeypatch.setitem(helpers._pids, child.pid, None)
        pf.watch([child.pid])
        assert not described
        helpers._pids.pop(child.pid)
        pf._checked.clear()
        pf.watch([child.pid])
        assert child.pid in described, "a child that is not a helper was not described"


@pytest.mark.skipif((sys.version_info.major, sys.version_info.minor) not in OFFSETS,
                    reason="a CPython version cyclescope reads frames of")
def test_a_process_looked_at_before_it_mapped_its_interpreter_is_described_when_it_does() -> None:
    """A drain brought by an exec can look at the process before its libpython is mapped (ld.so
    maps it a moment later): the mapping's side record has it looked at again."""
    from cyclescope.perf.records import MmapRecord, SampleId

    with _python_child() as (child, mapper, described, pf):
        pf.watch([child.pid])  # its mappings not known yet: nothing to describe
        mapper.scan_proc([child.pid])
        pf.watch([child.pid])
        assert not described  # looked at already
        with open(f"/proc/{child.pid}/maps") as f:
            lib = next(line.split()[-1] for line in f
                       if "r-xp" in line and pyframes.interpreter_version(line.split()[-1]))
        mm = MmapRecord(child.pid, child.pid, 0x7F0000000000, 4096, 0, lib, None, 5, 2, 1, True, 2, SampleId())
        assert pf.mapped_interpreters([mm]) == [child.pid]
        pf.watch([child.pid])
        assert child.pid in described


def test_a_python_executed_is_watched_until_described_or_for_a_while() -> None:
    """The exec wakers' records name the processes; each is watched (the collector reads the side
    records every few ms) until it is described, waits for its runtime, or EXEC_WATCH_S passed."""
    import struct

    from cyclescope.perf.abi import RecordType

    class Ring:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def pending(self) -> bool:
            return bool(self.data)

        def read(self) -> bytes:
            out, self.data = self.data, b""
            return out

    def execd(pid: int) -> bytes:  # a sample record of the tracepoint: header, pid, tid
        return struct.pack("<IHHII", RecordType.SAMPLE, 0, 16, pid, pid)

    pf = PythonFrames(ImageTable(), SimpleNamespace(procs={}), SimpleNamespace())  # type: ignore[arg-type]
    ring = Ring(b"")
    pf._execs = [(-1, ring)]  # type: ignore[list-item]
    assert pf.take_execs() == 0 and not pf.watching_exec()
    ring.data = execd(4001) + execd(4002) + struct.pack("<IHHQ", RecordType.LOST, 0, 16, 1)
    assert pf.take_execs() == 2 and pf.watching_exec()
    pf.waiting[4001] = 0.0  # its interpreter found, waiting for its runtime
    assert pf.watching_exec() and set(pf._exec_pids) == {4002}
    pf._exec_pids[4002] -= pyframes.EXEC_WATCH_S + 1  # too long: given up (seen at the next side read)
    assert not pf.watching_exec()


def test_helpers_are_known_by_pid_while_they_run_and_a_while_after() -> None:
    from cyclescope.collect import helpers

    before = set(helpers._pids)
    assert helpers.run_helper([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    new = set(helpers._pids) - before
    assert len(new) == 1 and helpers.is_helper(new.pop())  # kept KEEP_S for its late samples
    assert helpers.run_helper(["/nonexistent/helper"]) == -1


def test_python_frames_replace_the_interpreter_from_its_innermost_loop() -> None:
    EV, LIB, PY = 3, 4, 9
    py = ((PY, 1 << SLOT_BITS | 12), (PY, 5))  # innermost first
    native = ((LIB, 0x10), (EV, 0x1005), (LIB, 0x20), (EV, 0x1008), (LIB, 0x30))
    assert splice(native, py, EV, (0x1000, 0x2000)) == ((LIB, 0x10), (EV, 0x1005), *py)
    # The native walk never reached the loop (no frame pointers): the sampled frame, then Python.
    assert splice(((LIB, 0x10), (0, 0)), py, EV, (0x1000, 0x2000)) == ((LIB, 0x10), *py)


def test_each_run_of_the_loop_gets_its_own_python_frames_among_the_native_ones() -> None:
    EV, LIB, PY = 3, 4, 9
    inner, outer = ((PY, 1), (PY, 2)), ((PY, 3),)  # two runs of the loop, innermost first
    native = ((LIB, 0x10), (EV, 0x1005), (LIB, 0x20), (EV, 0x1008), (LIB, 0x30), (LIB, 0x40))
    assert interleave(native, [inner, outer], EV, (0x1000, 0x2000)) == (
        (LIB, 0x10), (EV, 0x1005), *inner, (LIB, 0x20), (EV, 0x1008), *outer, (LIB, 0x30), (LIB, 0x40))
    # Not one native frame of the loop per run (a walk cut short, frame-pointer guesses): none.
    assert interleave(native[:2], [inner, outer], EV, (0x1000, 0x2000)) is None
    assert interleave(native, [], EV, (0x1000, 0x2000)) is None


def test_runs_are_told_by_the_programs_entry_bit_and_fall_back_to_a_splice() -> None:
    EV, LIB = 3, 4
    p = SimpleNamespace(eval_image=EV, eval_range=(0x1000, 0x2000))
    named = {0x100: (9, 1), 0x200: (9, 2), 0x300: (9, 3)}
    pf = object.__new__(PythonFrames)
    pf.procs = {7: p}  # type: ignore[assignment]
    pf.frames_named = 0
    pf._frame = lambda p, pid, tagged, instr, mem: named.get(tagged)  # type: ignore[method-assign]
    native = ((LIB, 0x10), (EV, 0x1005), (LIB, 0x20), (EV, 0x1008), (LIB, 0x30))
    # (code, instruction) pairs innermost first; bit 0 of a code object: the outermost of a run.
    raw = (0x100, 0, 0x200 | PY_ENTRY, 0, 0x300 | PY_ENTRY, 0)
    assert pf.stack(7, native, raw) == (
        (LIB, 0x10), (EV, 0x1005), (9, 1), (9, 2), (LIB, 0x20), (EV, 0x1008), (9, 3), (LIB, 0x30))
    # The last run unfinished (the walk stopped at MAX_PY frames): the splice of old.
    assert pf.stack(7, native, (*raw[:4], 0x300, 0)) == ((LIB, 0x10), (EV, 0x1005), (9, 1), (9, 2), (9, 3))
    # Runs and native loop frames that do not match: the splice too.
    assert pf.stack(7, native[:2], raw) == ((LIB, 0x10), (EV, 0x1005), (9, 1), (9, 2), (9, 3))
    assert pf.stack(8, native, raw) == native  # a process not described
    # A drain's stacks at once, of two processes, in their order; a frame whose object is not a
    # code object (0x400: _frame gives None) is left out of its run.
    pf.procs[9] = p  # type: ignore[index]
    odd = (0x400, 5, 0x100 | PY_ENTRY, 1)
    whole, before = pf.stack(7, native, raw), pf.frames_named
    assert pf.stacks([7, 8, 9, 7, 9], [native, native, native[:2], native[:2], native], [raw, raw, odd, (), odd]) == [
        whole, native, ((LIB, 0x10), (EV, 0x1005), (9, 1)), native[:2], ((LIB, 0x10), (EV, 0x1005), (9, 1))]
    assert pf.frames_named - before == 3 + 1 + 1


def test_a_name_not_readable_again_is_the_one_read_at_its_address_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies made as a process exits can lack a str its finalization released (the module's
    file, shared by all its code objects): the name read at that address of the process before
    stands in; at another address, or in another process, nothing does."""
    readable = {0x5000: "/tmp/prog.py", 0x6000: "spin"}
    monkeypatch.setattr(PythonFrames, "_str", staticmethod(lambda mem, addr, o: readable.get(addr)))
    pf = PythonFrames(ImageTable(), SimpleNamespace(procs={}), SimpleNamespace())  # type: ignore[arg-type]
    p, other = pyframes._Proc((3, 11), 1, 0, (0, 0)), pyframes._Proc((3, 11), 2, 0, (0, 0))
    assert pf._name(p, None, 0x5000, {}) == "/tmp/prog.py"  # type: ignore[arg-type]
    readable.clear()  # the process exited: its copies lack both
    assert pf._name(p, None, 0x5000, {}) == "/tmp/prog.py"  # type: ignore[arg-type]
    assert pf._name(p, None, 0x6000, {}) is None  # type: ignore[arg-type]
    assert pf._name(other, None, 0x5000, {}) is None  # type: ignore[arg-type]


@pytest.mark.skipif((sys.version_info.major, sys.version_info.minor) not in OFFSETS,
                    reason="a CPython version cyclescope reads frames of")
def test_a_live_process_is_named_from_copies_where_its_memory_moved_on_and_from_memory_elsewhere() -> None:
    """The program copies a module body's code object at a sample while it runs; by the drain the
    process's memory holds another object there (here: the copy says first line 1, memory does
    not), and the frame is named from the copy. Code objects not copied are read from the live
    process as before (they were left unnamed while any copy of the process was kept)."""
    import struct

    import numpy as np

    table, pf = _this_process_described()
    pid, o = os.getpid(), OFFSETS[(sys.version_info.major, sys.version_info.minor)]
    code = sample_function.__code__
    keys, vals = _as_copied_at_exit(pid, [code], o)
    at = o["code_firstlineno"]
    vals[0]["r0"][at : at + 8] = np.frombuffer(struct.pack("<ii", 1, 0), np.uint8)  # a module body's
    pf.captured(keys, vals)
    module = pyframes.code_tag(struct.pack("<ii", 1, 0) + bytes(at), 0) | id(code)  # its tag: the value 1
    (img, first), _ = pf.frames(pid, (module, 0, _tagged(_codes.__code__), 0))
    syms = pf.symbols(table[img].key)
    assert syms is not None
    assert list(syms.names) == [f"py::sample_function:{__file__}", f"py::_codes:{__file__}"]
    assert first & ((1 << SLOT_BITS) - 1) == 1 and pf.codes_at_exit == 1  # the copy's first line


def test_a_command_that_runs_cpython_is_known_by_its_name_or_its_hash_bang(tmp_path: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """runs_cpython: an interpreter by its file name (symlinks followed, pyenv's shims are scripts),
    and scripts by their #! line, through env too; anything else is not."""
    from cyclescope.collect.pycommand import is_cpython_process, runs_cpython

    def script(name: str, text: str, mode: int = 0o755) -> str:
        f = tmp_path / name
        f.write_text(text)
        f.chmod(mode)
        return str(f)

    (tmp_path / "python3.12").symlink_to("/bin/true")  # by its name: the version is the eBPF path's to check
    (tmp_path / "tool").symlink_to(sys.executable)  # a virtualenv's python under another name
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert runs_cpython("python3.12") and runs_cpython("tool")
    assert runs_cpython(script("app", "#!/usr/bin/env python3.12\nprint(1)\n"))
    assert runs_cpython(script("app-s", "#!/usr/bin/env -S python3.12 -u\nprint(1)\n"))
    assert runs_cpython(script("console", f"#!{tmp_path / 'tool'}\nimport sys\n"))
    assert not runs_cpython(script("sh-script", "#!/bin/sh\necho\n"))
    assert not runs_cpython(script("plain", "print(1)\n"))
    assert not runs_cpython(script("not-executable", "#!/usr/bin/env python3.12\n", 0o644))
    assert not runs_cpython("true") and not runs_cpython("no-such-command-here")
    assert is_cpython_process(os.getpid())  # the test runner
    child = subprocess.Popen(["sleep", "5"])
    try:
        assert not is_cpython_process(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not is_cpython_process(1 << 30)  # no such process


def test_python_stacks_take_the_ebpf_path_unless_the_options_need_the_rings() -> None:
    """record's python_frames_args: -g and a CPython command per task turn loop counts off (the
    eBPF path reads Python frames, the rings cannot); any option that needs the rings, or no -g,
    or -a, leaves the options as they are."""
    from cyclescope.cli.main import build_parser
    from cyclescope.cli.sampling import python_frames_args

    def lean(*opts: str, cmd: str = "python3") -> bool:
        args = build_parser().parse_args(["record", *opts, "--", cmd, "app.py"])
        out = python_frames_args(args, [cmd, "app.py"], ())
        assert out is None or (out.no_loop_counts and not args.no_loop_counts)  # a copy: args unchanged
        return out is not None

    assert lean("-g", "fp") and lean("-g", "dwarf")
    assert not lean()  # no stacks: no Python frames either way
    assert not lean("-g", "fp", cmd="true")
    for opts in (("--collector", "perf"), ("--collector", "bpf"), ("--loop-counts",), ("--anchors",),
                 ("--anchor-budget", "0.02"), ("--values",), ("-a",), ("--no-loop-counts",)):
        assert not lean("-g", "fp", *opts), opts


def test_a_flat_recording_of_python_says_where_its_functions_are_named() -> None:
    """record without -g of a CPython command: a line saying that its Python functions are named
    in call stacks; none with -g, with -q, or for another command."""
    from cyclescope.cli.main import build_parser
    from cyclescope.cli.sampling import python_flat_hint

    def hint(*opts: str, cmd: str = "python3") -> str | None:
        return python_flat_hint(build_parser().parse_args(["record", *opts, "--", cmd, "app.py"]), [cmd, "app.py"])

    line = hint()
    assert line is not None and line.startswith("python3 runs CPython") and "-g fp" in line
    assert hint("-g", "fp") is None and hint("-q") is None and hint(cmd="true") is None
