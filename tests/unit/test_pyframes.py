"""Python frames without the kernel: the location table against CPython's own co_lines(), code
objects named from this very process's memory, and the splice into native stacks."""

from __future__ import annotations

import dis
import os
import sys
from types import SimpleNamespace

import pytest

from cyclescope.collect.pyframes import OFFSETS, SLOT_BITS, PythonFrames, line_ranges, splice
from cyclescope.images.registry import ImageTable


def sample_function(n: int) -> int:  # several lines, a loop, a call: a varied location table
    total = 0
    for i in range(n):
        if i % 3:
            total += i
        else:
            total -= len(str(i))
    return total


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
    bpf = SimpleNamespace(set_python=lambda pid, cfg: described.__setitem__(pid, cfg), forget_python=lambda pid: None)
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
    frames = pf.frames(os.getpid(), (id(code), instr, id(_codes.__code__), 0))
    assert len(frames) == 2
    (img, off), (img2, off2) = frames
    assert img == img2 and table[img].kind == "python"
    assert off & ((1 << SLOT_BITS) - 1) == target.positions.lineno
    assert off2 & ((1 << SLOT_BITS) - 1) == _codes.__code__.co_firstlineno  # no instruction: the first line
    syms = pf.symbols(table[img].key)
    assert syms is not None
    names = [syms.names[int(i)] for i in syms.lookup(__import__("numpy").array([off, off2], "uint64")).tolist()]
    assert names == [f"py::sample_function:{__file__}", f"py::_codes:{__file__}"]
    pf.forget(os.getpid())
    assert pf.symbols(table[img].key) is not None  # kept for the flush after the process is gone
    pf.flushed()
    assert pf.symbols(table[img].key) is None


def test_python_frames_replace_the_interpreter_from_its_innermost_loop() -> None:
    EV, LIB, PY = 3, 4, 9
    py = ((PY, 1 << SLOT_BITS | 12), (PY, 5))  # innermost first
    native = ((LIB, 0x10), (EV, 0x1005), (LIB, 0x20), (EV, 0x1008), (LIB, 0x30))
    assert splice(native, py, EV, (0x1000, 0x2000)) == ((LIB, 0x10), (EV, 0x1005), *py)
    # The native walk never reached the loop (no frame pointers): the sampled frame, then Python.
    assert splice(((LIB, 0x10), (0, 0)), py, EV, (0x1000, 0x2000)) == ((LIB, 0x10), *py)
