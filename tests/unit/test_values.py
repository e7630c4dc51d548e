"""Value capture without the kernel: instruction plans, the interpreter, modules, capture in bulk, storage."""

from __future__ import annotations

import os
import re
import stat
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from cyclescope.db.hotlist import VALUE_DTYPE, HotlistSet
from cyclescope.db.layout import Database
from cyclescope.db.values import KEY_DTYPE, NamedHotlists, ValuesMeta, compact_values, load_values, value_files
from cyclescope.db.values import write_values as write_value_file
from cyclescope.errors import UsageError
from cyclescope.images.registry import ImageInfo, ImageTable
from cyclescope.perf.abi import X86_REGS_USER_MASK, Sample
from cyclescope.perf.records import RecordDecoder, SampleLayout
from cyclescope.values.api import (
    BaseModule,
    BatchEmit,
    BatchModule,
    Capture,
    Emit,
    Step,
    StepBatch,
    Value,
    kind_names,
)
from cyclescope.values.capture import CodeIndex, ProcCode, ValueCapture, ValueOptions
from cyclescope.values.insn import (
    PERF_COLUMNS,
    ROW_REGS,
    ROW_STRUCT,
    InsnDetail,
    RegView,
    decode,
    effective_address,
)
from cyclescope.values.interp import Interpreter
from cyclescope.values.modules import (
    MAP_CODE,
    Addresses,
    Edges,
    Operands,
    Results,
    VReplay,
    _plugins,
    available,
    load_module,
    load_modules,
)
from tests import perfbytes as pb

# --- instructions ---------------------------------------------------------------------------


def test_decode_names_registers_memory_and_kind() -> None:
    d = decode(bytes.fromhex("f20f1004c7") + b"\x90" * 8, 0x1000)  # movsd xmm0, [rdi + rax*8]
    assert d is not None and d.mem is not None
    assert (d.mem.base, d.mem.index, d.mem.scale, d.mem.disp, d.mem.size) == ("rdi", "rax", 8, 0, 8)
    assert d.fp == "f64" and d.vwrites == ("xmm0",) and d.mem.read and not d.mem.write
    assert effective_address(d.mem, {"rdi": 0x1000, "rax": 3}, d.next_address) == 0x1018
    imul = decode(bytes.fromhex("480fafc7") + b"\x90" * 8, 0)  # imul rax, rdi
    assert imul is not None and {r.name for r in imul.reads} == {"rax", "rdi"}
    assert [w.name for w in imul.writes] == ["rax"]
    e = decode(bytes.fromhex("8b4f08") + b"\x90" * 8, 0)  # mov ecx, [rdi + 8]
    assert e is not None and e.writes[0].name == "ecx" and e.writes[0].bits == 32
    assert decode(bytes.fromhex("0f05"), 0).kind == "syscall"  # type: ignore[union-attr]
    assert decode(bytes.fromhex("74fe"), 0x10).target == 0x10  # type: ignore[union-attr]
    tls = decode(bytes.fromhex("64488b042528000000"), 0)  # mov rax, fs:[0x28]
    assert tls is not None and tls.mem is not None and tls.mem.segment == "fs"
    assert effective_address(tls.mem, {}, 9) is None
    nop = decode(bytes.fromhex("0f1f4000"), 0)
    assert nop is not None and not nop.reads and nop.mem is None


# --- the interpreter --------------------------------------------------------------------------

CODE = 0x400000
HEAP = 0x600000
STACK = 0x7FF000


def _memory(code: bytes) -> tuple[bytearray, bytearray]:
    text = bytearray(4096)
    text[: len(code)] = code
    return text, bytearray(range(256)) * 16


def _reader(text: bytearray, heap: bytearray):  # type: ignore[no-untyped-def]
    def make(pid: int):  # type: ignore[no-untyped-def]
        def rd(a: int, n: int) -> bytes | None:
            if a >= CODE and a + n <= CODE + 4096:
                return bytes(text[a - CODE : a - CODE + n])
            if a >= HEAP and a + n <= HEAP + 4096:
                return bytes(heap[a - HEAP : a - HEAP + n])
            if a >= STACK - 4096 and a + n <= STACK + 4096:
                return bytes(n)  # the stack: zeros (the snapshot covers its top)
            return None

        return rd

    return make


def _regs(**kw: int) -> dict[str, int]:
    names = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp",
             "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "flags"]
    r = {n: 0 for n in names}
    r.update(rip=CODE, rsp=STACK)
    r.update(kw)
    return r


def test_string_instructions_are_told_from_sign_extension_and_sse_moves() -> None:
    # The interpreter stops at string instructions; movsx, movsxd and SSE's movsd/movss share
    # their first letters (2,824 movsxd in the SQLite shell stopped half of its interpreted runs).
    pad = b"\x90" * 8
    for hexa, string in (("f3a4", True),  # rep movsb
                         ("a5", True),  # movsd (string: dword [rdi] <- [rsi])
                         ("f348ab", True),  # rep stosq
                         ("4863c7", False),  # movsxd rax, edi
                         ("480fbe07", False),  # movsx rax, byte [rdi]
                         ("f20f1004c7", False),  # movsd xmm0, [rdi + rax*8]
                         ("f30f1007", False),  # movss xmm0, [rdi]
                         ("f20fc2c101", False)):  # cmpltsd xmm0, xmm1
        d = decode(bytes.fromhex(hexa) + pad, 0x1000)
        assert d is not None and d.string_op is string, (hexa, d.mnemonic if d else None)


def test_interpreter_records_results_loads_and_stores_without_side_effects() -> None:
    code = bytes.fromhex("4801d8" "488b0424" "488907" "480fafc7" "0f05")
    text, heap = _memory(code)
    before = bytes(heap)
    it = Interpreter(reader=_reader(text, heap))
    run = it.run(1, _regs(rax=5, rbx=7, rdi=HEAP), struct.pack("<Q", 99) + bytes(56), 8)
    assert run.reason == "syscall" and len(run.steps) == 4
    add, load, store, mul = run.steps
    assert add.results == {"rax": 12} and add.sampled and add.next_pc == CODE + 3
    assert load.ea == STACK and load.loaded == 99 and load.results == {"rax": 99}
    assert store.ea == HEAP and store.stored == 99
    assert mul.regs_in["rdi"] == HEAP and mul.results == {"rax": (99 * HEAP) & (2**64 - 1)}
    assert bytes(heap) == before  # the process's memory is never written
    again = it.run(1, _regs(rax=1, rbx=1, rdi=HEAP), bytes(64), 3)
    # The next run sees the process's memory again, not the previous run's store.
    assert again.steps[1].loaded == 0 and again.reason == "length"
    assert it.stops["syscall"] == 1 and it.stops["length"] == 1
    # Within one drain a data page is read from the process once; each run still starts from that
    # copy, not from the previous run's stores.
    reads: list[int] = []
    text2, heap2 = _memory(bytes.fromhex("488907" "488b0f"))  # mov [rdi], rax; mov rcx, [rdi]
    count = _reader(text2, heap2)

    def counting(pid: int):  # type: ignore[no-untyped-def]
        rd = count(pid)
        return lambda a, n: (reads.append(a & ~4095), rd(a, n))[1]

    it2 = Interpreter(reader=counting)
    it2.next_drain()
    store = ROW_STRUCT.pack(*(_regs(rax=99, rdi=HEAP).get(n, 0) for n in ROW_REGS))
    load = ROW_STRUCT.pack(*(_regs(rax=99, rdi=HEAP, rip=CODE + 3).get(n, 0) for n in ROW_REGS))
    it2.execute(1, store, bytes(64), 2, 0)
    it2.execute(1, load, bytes(64), 1, 1)
    b = it2.take(np.zeros(2, np.uint64), np.full(2, -1))
    assert b.has_stored.tolist() == [True, False, False] and int(b.stored[0]) == 99
    assert int(b.loaded[1]) == 99  # the run sees its own store
    assert int(b.loaded[2]) == int.from_bytes(bytes(range(8)), "little")  # the next run does not
    assert reads.count(HEAP) == 1  # and the heap page was read once for both
    it2.next_drain()
    it2.execute(1, load, bytes(64), 1, 0)
    assert reads.count(HEAP) == 2 and len(it2.take(np.zeros(1, np.uint64), np.full(1, -1))) == 1


def test_an_emulator_that_mapped_many_pages_is_replaced_and_runs_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
    # unicorn's mem_map costs more with every page mapped: a program reading memory widely (the
    # demo's pointer chase) spent 30 s mapping and minutes releasing at exit. Past MAX_PAGES the
    # process gets a fresh emulator; what runs read is still the process's memory.
    import cyclescope.values.interp as interp

    monkeypatch.setattr(interp, "MAX_PAGES", 8)
    text, _ = _memory(bytes.fromhex("488b07"))  # mov rax, [rdi]
    far = 0x10000000

    def make(pid: int):  # type: ignore[no-untyped-def]
        def rd(a: int, n: int) -> bytes | None:
            if a >= CODE and a + n <= CODE + 4096:
                return bytes(text[a - CODE : a - CODE + n])
            if a >= far:  # each page holds its own number
                return b"".join(struct.pack("<Q", (a + i) >> 12) for i in range(0, n, 8))[:n]
            return bytes(n) if STACK - 4096 <= a < STACK + 4096 else None

        return rd

    it = Interpreter(reader=make)
    seen = []
    for k in range(40):
        run = it.run(1, _regs(rdi=far + k * 4096), bytes(64), 1)
        seen.append(run.steps[0].loaded)
        assert len(it._emus[1].pages) <= interp.MAX_PAGES + 3  # code, stack and the page read
    assert seen == [(far >> 12) + k for k in range(40)]
    assert it.stops["length"] == 40


def test_interpreter_stops_cleanly_and_says_why() -> None:
    text, heap = _memory(bytes.fromhex("488b07"))  # mov rax, [rdi]
    it = Interpreter(reader=_reader(text, heap))
    assert it.run(1, _regs(rdi=0x1234000), b"", 4).reason == "unmapped"
    text2, _ = _memory(bytes.fromhex("f20f58c1"))  # addsd xmm0, xmm1: xmm values are not sampled
    assert Interpreter(reader=_reader(text2, heap)).run(2, _regs(), b"", 4).reason == "vector"
    text3, _ = _memory(bytes.fromhex("64488b042528000000"))
    assert Interpreter(reader=_reader(text3, heap)).run(3, _regs(), b"", 4).reason == "tls"
    text4, _ = _memory(bytes.fromhex("f3a4"))  # rep movsb
    assert Interpreter(reader=_reader(text4, heap)).run(4, _regs(), b"", 4).reason == "unsupported"
    assert Interpreter(reader=_reader(text, heap)).run(5, _regs(rip=0x9000), b"", 4).reason == "unmapped"


def test_interpreter_follows_branches_and_calls() -> None:
    # cmp rdi, 3; jne +3; add rax, 1; call +0 (pushes onto the stack); ret would read it back
    code = bytes.fromhex("4883ff03" "7504" "4883c001" "e800000000" "c3")
    text, heap = _memory(code)
    it = Interpreter(reader=_reader(text, heap))
    taken = it.run(1, _regs(rdi=4), bytes(64), 3)
    assert [hex(s.pc) for s in taken.steps] == [hex(CODE), hex(CODE + 4), hex(CODE + 10)]
    fall = it.run(1, _regs(rdi=3, rax=41), bytes(64), 5)
    assert fall.steps[2].results == {"rax": 42}
    call, ret = fall.steps[3], fall.steps[4]
    assert call.next_pc == CODE + 15 and ret.next_pc == CODE + 15  # ret pops what call pushed


# --- modules -----------------------------------------------------------------------------------


def _step(pc: int, hexcode: str, regs: dict[str, int], **kw: object) -> Step:
    d = decode(bytes.fromhex(hexcode) + b"\x90" * 8, pc)
    assert d is not None
    return Step(pc, d, regs, **kw)  # type: ignore[arg-type]


def test_modules_turn_steps_into_values() -> None:
    st = _step(0x10, "488907", {"rdi": 0x5000, "rax": 7}, ea=0x5000, stored=7, next_pc=0x13, sampled=True)
    ld = _step(0x13, "488b4f08", {"rdi": 0x5000}, ea=0x5008, loaded=9, results={"rcx": 9}, next_pc=0x17)
    al = _step(0x17, "8b0f", {"rdi": 0x6000}, ea=0x6000, loaded=1, results={"ecx": 1}, next_pc=0x19)
    br = _step(0x19, "75f5", {}, next_pc=0x10)
    steps = [st, ld, al, br]
    ops = list(Operands(per_call_site=False).transform(steps))
    assert ("in:rdi", 0x5000) in {(e.kind, e.value.v0) for e in ops}
    assert all(e.pc != 0x10 for e in ops)  # the sampled instruction's operands came from the interrupt
    addrs = {(e.pc, e.kind, e.value.v0) for e in Addresses().transform(steps)}
    assert (0x13, "load", 9) in addrs and (0x10, "store", 7) in addrs and (0x13, "addr", 0x5008) in addrs
    res = {(e.pc, e.kind, e.value.v0) for e in Results().transform(steps)}
    assert (0x13, "out:rcx", 9) in res and (0x17, "out:ecx", 1) in res
    edges = list(Edges().transform(steps))
    assert edges == [edges[0]] and edges[0].value == Value(0x10, 0, MAP_CODE)
    # vreplay: the load at 0x17 reads 0x6000, 4 KiB from the store to 0x5000: a 4K-aliasing suspect.
    alias = [(e.pc, e.value.v0, e.value.v1) for e in VReplay().transform(steps)]
    assert (0x17, 0x10, 1) in alias
    same = list(VReplay().transform([st, _step(0x20, "488b07", {"rdi": 0x5000}, ea=0x5000, loaded=7)]))
    assert [(e.pc, e.value.v0, e.value.v1) for e in same] == [(0x20, 0x10, 0)]


def test_a_batch_of_runs_gives_what_each_run_gives_alone() -> None:
    # add; load [rsp]; store [rdi]; load [rdi] (same address); cmp; jne; imul; syscall
    code = bytes.fromhex("4801d8" "488b0424" "488907" "488b0f" "4883f903" "7500" "480fafc7" "0f05")
    text, heap = _memory(code)
    it = Interpreter(reader=_reader(text, heap))
    ctx: list[Value | None] = []
    for r in range(12):
        row = ROW_STRUCT.pack(*(_regs(rax=r, rbx=r % 3, rdi=HEAP + 8 * (r % 2), rip=CODE + 3 * (r % 2)).get(n, 0)
                                for n in ROW_REGS))
        assert it.execute(1, row, struct.pack("<Q", r % 4) + bytes(56), 6, r) in ("length", "syscall")
        ctx.append(Value(0x40 + r % 2, 0, 1) if r % 3 else None)
    cv0 = np.array([c.v0 if c else 0 for c in ctx], np.uint64)
    cimg = np.array([c.image if c else -1 for c in ctx])
    batch = it.take(cv0, cimg)
    assert len(batch) == it.steps and set(batch.run.tolist()) == set(range(12))
    # The same runs in one call (the collector's way) give the same steps.
    rows = np.array([[_regs(rax=r, rbx=r % 3, rdi=HEAP + 8 * (r % 2), rip=CODE + 3 * (r % 2)).get(n, 0)
                      for n in ROW_REGS] for r in range(12)], np.uint64)
    stacks = np.zeros((12, 64), np.uint8)
    stacks[:, 0] = np.arange(12) % 4
    it2 = Interpreter(reader=_reader(text, heap))
    # Six steps each: the syscall is the eighth instruction.
    assert it2.execute_many([1] * 12, rows, stacks, np.full(12, 64), 6) == ["length"] * 12
    b2 = it2.take(cv0, cimg)
    for col in ("run", "pc", "regs_in", "regs_out", "ea", "loaded", "stored", "has_stored", "next_pc", "ctx_v0"):
        assert np.array_equal(getattr(batch, col), getattr(b2, col)), col
    # Past its deadline it starts nothing (the budget), and says so by returning fewer reasons.
    assert it2.execute_many([1] * 12, rows, stacks, np.full(12, 64), 6, deadline=1e-9) == []
    # Two drains' calls into one buffer (the collector takes it later): runs tagged from first_run on.
    it3 = Interpreter(reader=_reader(text, heap))
    it3.execute_many([1] * 5, rows[:5], stacks[:5], np.full(5, 64), 6)
    it3.next_drain()
    it3.execute_many([1] * 7, rows[5:], stacks[5:], np.full(7, 64), 6, first_run=5)
    assert it3.buffered_steps == len(batch)
    b3 = it3.take(cv0, cimg)
    for col in ("run", "pc", "regs_in", "regs_out", "ea", "loaded", "ctx_v0", "ctx_img"):
        assert np.array_equal(getattr(batch, col), getattr(b3, col)), col
    for m in (Operands(), Addresses(), Results(), Edges(), VReplay()):
        together: Counter[tuple[int, str, Value]] = Counter()
        for e in m.emit_batch(batch):
            n = len(e.rows)
            kinds = kind_names(e.kind, n)
            for pc, k, a, b, i in zip(batch.pc[e.rows].tolist(), kinds, np.asarray(e.v0).tolist(),
                                      np.broadcast_to(np.asarray(e.v1), (n,)).tolist(),
                                      np.broadcast_to(np.asarray(e.image), (n,)).tolist(), strict=True):
                together[(pc, k, Value(a, b, i))] += 1
        alone: Counter[tuple[int, str, Value]] = Counter()
        for _, steps in batch.to_steps():
            alone.update((e.pc, e.kind, e.value) for e in m.transform(steps))
        assert together == alone and sum(together.values()) > 0, m.name
    # Pairs stay within their runs: each run pairs its store with the load of it (same address), and
    # the runs with rdi = HEAP also pair the load from [rsp] (STACK, 4 KiB-aligned like HEAP) with the
    # store as a 4K alias; nothing pairs across runs.
    alias = Counter((int(v1), int(batch.run[r])) for e in VReplay().emit_batch(batch)
                    for r, v1 in zip(e.rows, np.broadcast_to(np.asarray(e.v1), (len(e.rows),)), strict=True))
    assert alias == {**{(0, r): 1 for r in range(12)}, **{(1, r): 1 for r in range(0, 12, 2)}}


def test_module_lookup_by_entry_point_and_path() -> None:
    assert load_module("operands").name == "operands"
    assert load_module("cyclescope.values.modules:Edges").name == "edges"
    with pytest.raises(UsageError, match="unknown value module 'nope'; available"):
        load_module("nope")
    with pytest.raises(UsageError, match="lacks plan/transform/format"):
        load_module("cyclescope.values.modules:fmt_int")
    assert [m.name for m in load_modules(["operands", "operands", "results"])] == ["operands", "results"]


def test_plugins_come_from_the_entry_point_group_and_never_replace_a_built_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "myplug.py").write_text(
        "from cyclescope.values.api import BaseModule\n"
        "class Mine(BaseModule):\n    name = 'mine'\n"
        "class Impostor(BaseModule):\n    name = 'impostor'\n")
    info = tmp_path / "myplug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[cyclescope.values]\nmine = myplug:Mine\noperands = myplug:Impostor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _plugins.cache_clear()
    try:
        assert load_module("mine").name == "mine"
        assert load_module("operands").name == "operands"  # the built-in, not the plugin's
        assert available()["mine"] == "myplug:Mine"
        assert available()["operands"] == "cyclescope.values.modules:Operands"
    finally:
        _plugins.cache_clear()


# --- capture in bulk -------------------------------------------------------------------------------

# A procedure at 0x1000: mov rax, rdi; imul rax, rsi; mov rcx, [rdi + 8]; ret
PROC = bytes.fromhex("4889f8" "480fafc6" "488b4f08" "c3")


class _Code(CodeIndex):
    def __init__(self, table: ImageTable) -> None:
        super().__init__(table)
        self._addrs = [0x1000, 0x1003, 0x1007, 0x100B]

    def code(self, img: int, start: int, end: int) -> bytes:
        if img == 2:  # the caller: "call rel32" ending at 0x2005
            return (b"\x90\x90" + bytes.fromhex("e8f6efffff") + b"\x90" * 32)[start - 0x1FFE : end - 0x1FFE]
        return (PROC + b"\x90" * 32)[start - 0x1000 : end - 0x1000] if start >= 0x1000 else b""

    def proc(self, img: int, off: int) -> ProcCode | None:
        if img == 1 and 0x1000 <= off < 0x100C:
            return ProcCode(0x1000, 0x100C, np.array(self._addrs, np.uint64), frozenset())
        return None


class _State:
    def __init__(self) -> None:
        self.comm = 1
        self.parent = 0  # as images/maps.ProcessState: no FORK record seen

    def lookup(self, ips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ips = ips.astype(np.uint64)
        img = np.where((ips >= 0x555000000000) & (ips < 0x555000010000), 1,
                       np.where((ips >= 0x556000000000) & (ips < 0x556000010000), 2, -2)).astype(np.int64)
        base = np.where(img == 1, 0x555000000000, 0x556000000000).astype(np.uint64)
        return img, np.where(img > 0, ips - base, 0).astype(np.uint64)


class _Mapper:
    def __init__(self) -> None:
        self.procs = {os.getpid(): _State()}

    class comms:  # mimics Mapper.comms
        names: ClassVar[list[str]] = ["", "prog", "python"]


def _batch(pcs: list[int], rdi: list[int], rsi: list[int], ret_addr: int) -> tuple[np.ndarray, ...]:
    from cyclescope.perf.records import SAMPLE_DTYPE

    n = len(pcs)
    s = np.zeros(n, SAMPLE_DTYPE)
    s["ip"] = [0x555000000000 + p for p in pcs]
    s["pid"] = os.getpid()
    s["cpumode"] = 2
    s["regs"] = np.arange(n)
    regs = np.zeros((n, len(PERF_COLUMNS)), np.uint64)
    regs[:, PERF_COLUMNS["rdi"]] = rdi
    regs[:, PERF_COLUMNS["rsi"]] = rsi
    regs[:, PERF_COLUMNS["rax"]] = rdi  # as after "mov rax, rdi"
    regs[:, PERF_COLUMNS["rsp"]] = 0x7FFF0000
    regs[:, PERF_COLUMNS["rbp"]] = 1  # no frame pointer
    stack = np.zeros((n, 64), np.uint8)
    stack[:, :8] = np.frombuffer(struct.pack("<Q", ret_addr), np.uint8)
    return s, np.array([1] * n, np.int64), np.array(pcs, np.uint64), regs, stack, np.full(n, 64, np.uint32)


def _capture() -> tuple[ValueCapture, ImageTable]:
    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    table.intern(ImageInfo("caller", "/caller", "elf", offsets="vaddr"))
    vc = ValueCapture(ValueOptions(modules=("operands", "addresses", "context", "results"), length=0, seed=1),
                      _Mapper(), table, code=_Code(table))
    return vc, table


def _rows(vc: ValueCapture) -> dict[tuple[int, str], dict[tuple[int, int, int], int]]:
    (named, meta), = vc.take(0.0, 1.0).values()
    out: dict[tuple[int, str], dict[tuple[int, int, int], int]] = {}
    lists = named.lists
    for i in range(len(lists)):
        k = lists.keys[i]
        out[(int(k["offset"]), named.kinds[int(k["kind"])])] = dict(lists.hotlist(i).counts)  # type: ignore[arg-type]
    assert meta.uid == os.getuid()
    return out


def test_capture_takes_operands_addresses_previous_results_and_context_in_bulk() -> None:
    vc, _ = _capture()
    # 30 samples on "imul rax, rsi" (0x1003): rsi is 3 two times in three; 10 on the load at 0x1007.
    pcs = [0x1003] * 30 + [0x1007] * 10
    rdi = [0x8000] * 40
    rsi = [3, 3, 9] * 10 + [5] * 10
    s, img, off, regs, stack, stack_len = _batch(pcs, rdi, rsi, 0x556000000000 + 0x2005)
    assert vc.process(s, img, off, regs, stack, stack_len) == 40
    rows = _rows(vc)
    assert rows[(0x1003, "in:rsi")] == {(3, 0, -1): 20, (9, 0, -1): 10}
    # At 0x1003 the previous instruction (mov rax, rdi at 0x1000) has just written rax.
    assert rows[(0x1000, "out:rax")] == {(0x8000, 0, -1): 30}
    assert rows[(0x1007, "addr")] == {(0x8008, 0, -1): 10}
    # [rsp] is a return address (a call ends at 0x2005 in image 2): the context, kept at the entry.
    assert rows[(0x1000, "ctx")] == {(0x2005, 0, 2): 40}
    assert rows[(0x1003, "in:rsi@ctx")] == {(3, 0x2005, 2): 20, (9, 0x2005, 2): 10}


def test_drains_wait_for_capture_under_the_maps_they_were_taken_with() -> None:
    pcs = [0x1003] * 30 + [0x1007] * 10
    rdi, rsi = [0x8000] * 40, [3, 3, 9] * 10 + [5] * 10
    ret = 0x556000000000 + 0x2005
    one, _ = _capture()
    one.process(*_batch(pcs, rdi, rsi, ret))
    whole = _rows(one)
    # The same samples in four drains: capture waits for them, then gives the same counts.
    four, _ = _capture()
    for k in range(0, 40, 10):
        assert four.process(*_batch(pcs[k : k + 10], rdi[k : k + 10], rsi[k : k + 10], ret)) == 10
    assert _rows(four) == whole
    # An exec between the drain and the capture: the process's new maps know neither image. The
    # waiting samples are captured first, with the maps they were taken under.
    class Gone(_State):
        def lookup(self, ips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return np.zeros(len(ips), np.int64), np.zeros(len(ips), np.uint64)

    execd, _ = _capture()
    execd.process(*_batch(pcs, rdi, rsi, ret))
    execd.forget(os.getpid())
    execd.mapper.procs[os.getpid()] = Gone()
    assert _rows(execd) == whole


def test_a_process_gone_before_its_samples_are_drained_is_owned_as_its_parent_where_that_is_safe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A short command in a shell loop has exited by the drain: /proc no longer names its owner.
    Its samples go to its parent's owner (the FORK record's) when that is root or the recorder's
    own user, not to "owner unknown". Under a root recorder a parent of another user does not
    vouch for the child (a set-user-ID program between them, sudo, can have made it root's), and
    with no parent known the samples are skipped too."""
    child = subprocess.Popen(["true"])
    child.wait()  # its pid names no process now
    s, img, off, regs, stack, stack_len = _batch([0x1003] * 10, [0x8000] * 10, [7] * 10, 0)
    s["pid"] = child.pid

    def capture(parent_uid: int | None, recorder: int) -> ValueCapture:
        monkeypatch.setattr(os, "geteuid", lambda: recorder)
        vc, _ = _capture()
        state = _State()
        if parent_uid is not None:
            state.parent = 4242
            vc._owners[4242] = parent_uid  # the parent's owner, as read while it lived
        vc.mapper.procs[child.pid] = state
        return vc

    for parent_uid, recorder, kept in ((0, 0, True), (1000, 1000, True), (1000, 0, False), (None, 0, False)):
        vc = capture(parent_uid, recorder)
        assert vc.process(s, img, off, regs, stack, stack_len) == (10 if kept else 0)
        if kept:
            (named, meta), = vc.take(0.0, 1.0).values()
            assert meta.uid == parent_uid and len(named.lists) > 0
        else:
            assert vc.skipped["owner unknown"] == 10


def test_a_goal_plan_captures_from_the_address_alone_without_decoding() -> None:
    """Modules that plan by address (a goal plan) make capture decode nothing: the code index is
    never asked, and the registers and their difference are taken where the plan says."""
    from cyclescope.values.goal import GoalModule, GoalPoint, Plan

    class NoCode:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the code index was asked for {name}")

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    goal = GoalModule(Plan([GoalPoint("prog", "f", "rsi", 0.5, [(0x1003, "rsi")]),
                            GoalPoint("prog", "f", "rdi-rsi", 0.5, [(0x1003, "rdi-rsi")])]))
    vc = ValueCapture(ValueOptions(length=0, seed=1), _Mapper(), table, code=NoCode(),  # type: ignore[arg-type]
                      modules=[goal])
    pcs = [0x1003] * 12 + [0x1007] * 5  # 0x1007: no candidate there, so its samples are dropped first
    rdi, rsi = [0x8000] * 17, [3, 3, 9] * 4 + [5] * 5
    assert vc.process(*_batch(pcs, rdi, rsi, 0)) == 12
    rows = _rows(vc)
    assert rows[(0x1003, "goal:rsi")] == {(3, 0, -1): 8, (9, 0, -1): 4}
    assert rows[(0x1003, "goal:rdi-rsi")] == {(0x8000 - 3, 0, -1): 8, (0x8000 - 9, 0, -1): 4}
    assert set(rows) == {(0x1003, "goal:rsi"), (0x1003, "goal:rdi-rsi")}


def test_capture_takes_stack_words_and_sub_registers_where_the_snapshot_has_them() -> None:
    class Words(BaseModule):  # what a customization module can ask for at the interrupt
        name = "words"

        def plan(self, insn: InsnDetail) -> Sequence[Capture]:
            return (Capture("arg@8", "stack", offset=8), Capture("arg@40", "stack", offset=40),
                    Capture("arg@60", "stack", offset=60), Capture("ah", "reg", reg=RegView("ah", "rax", 8, 8)),
                    Capture("ctx@entry", "ctx"))

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    vc = ValueCapture(ValueOptions(length=0, seed=1), _Mapper(), table, code=_Code(table), modules=[Words()])
    s, img, off, regs, stack, stack_len = _batch([0x1003] * 6, [0x1234] * 6, [0] * 6, 0)
    stack[:, 8:16] = np.frombuffer(struct.pack("<Q", 0xDEADBEEF), np.uint8)
    stack[:, 40:48] = np.frombuffer(struct.pack("<Q", 7), np.uint8)
    stack[:, 60:64] = 0xAB  # a word across the end of the 64-byte snapshot: never taken
    stack_len[4:] = 16  # two samples found only 16 bytes of stack to copy: no word at 40 for them
    assert vc.process(s, img, off, regs, stack, stack_len) == 6
    rows = _rows(vc)
    assert rows[(0x1003, "arg@8")] == {(0xDEADBEEF, 0, -1): 6}
    assert rows[(0x1003, "arg@40")] == {(7, 0, -1): 4}
    assert rows[(0x1003, "ah")] == {(0x12, 0, -1): 6}
    assert (0x1003, "arg@60") not in rows
    assert (0x1000, "ctx@entry") not in rows  # no return address on these stacks


def test_capture_respects_owner_and_command_filters() -> None:
    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    for opts, kept in ((ValueOptions(length=0, users=frozenset({os.getuid() + 1})), 0),
                       (ValueOptions(length=0, commands=frozenset({"other"})), 0),
                       (ValueOptions(length=0, commands=frozenset({"prog"})), 4)):
        vc = ValueCapture(opts, _Mapper(), table, code=_Code(table))
        s, img, off, regs, stack, stack_len = _batch([0x1003] * 4, [1] * 4, [2] * 4, 0)
        assert vc.process(s, img, off, regs, stack, stack_len) == kept
        if not kept:
            assert vc.skipped["not allowed"] == 4
    # One drain may hold samples from before an exec (the forked profiler, "python") and after it
    # ("prog"): the filter goes by each sample's command, not the process's name at the end.
    vc = ValueCapture(ValueOptions(length=0, commands=frozenset({"prog"})), _Mapper(), table, code=_Code(table))
    s, img, off, regs, stack, stack_len = _batch([0x1003] * 6, [1] * 6, [2] * 6, 0)
    assert vc.process(s, img, off, regs, stack, stack_len, np.array([2, 2, 2, 2, 1, 1])) == 2
    assert vc.skipped["not allowed"] == 4


def test_a_failing_module_loses_only_its_own_values() -> None:
    class BrokenBatch(BatchModule):
        name = "broken-batch"

        def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
            raise RuntimeError("bug")

    class Picky(BaseModule):  # transform only: gets Step lists rebuilt from the batch
        name = "picky"

        def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
            if steps[1].regs_in["rdi"] == 0x5001:
                raise ValueError("bug")
            yield Emit(steps[1].pc, "picky", Value(7))

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    vc = ValueCapture(ValueOptions(length=2, exact=True, seed=1), _Mapper(), table, code=_Code(table),
                      modules=[Operands(per_call_site=False), BrokenBatch(), Picky()])
    base = 0x555000000000
    seqs = [([_step(base + 0x1003, "480fafc6", {"rax": 5, "rsi": 3, "rdi": rdi}, next_pc=base + 0x1007,
                    sampled=True),
              _step(base + 0x1007, "488b4f08", {"rdi": rdi}, ea=rdi + 8, loaded=0, results={"rcx": 0},
                    next_pc=base + 0x100B)], "length") for rdi in (0x5001, 0x5002, 0x5003)]
    vc.add_sequences(os.getpid(), seqs)
    assert vc.skipped == {"module broken-batch failed": 3, "module picky failed": 1}
    rows = _rows(vc)
    assert sorted(v[0] for v in rows[(0x1007, "in:rdi")]) == [0x5001, 0x5002, 0x5003]  # operands: all three
    assert sum(rows[(0x1007, "picky")].values()) == 2  # picky: the two runs it did not fail on


def test_interpretation_stays_within_its_cpu_budget_and_counts_what_it_left_out() -> None:
    import time as _time


    class SlowInterpreter:
        runs = 0
        steps = 0
        buffered_steps = 0

        def next_drain(self) -> None:
            pass

        def execute_many(self, pids: list[int], rows: np.ndarray, stacks: np.ndarray, lens: np.ndarray,
                         length: int, deadline: float = 0.0, first_run: int = 0) -> list[str]:
            out = []
            for j in range(len(pids)):  # as the C loop does: the clock every 8 runs
                if deadline and j % 8 == 0 and _time.perf_counter() > deadline:
                    break
                self.runs += 1
                _time.sleep(0.003)
                out.append("length")
            return out

        def take(self, ctx_v0: np.ndarray, ctx_img: np.ndarray) -> StepBatch:
            return StepBatch.empty()

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    slow = SlowInterpreter()
    vc = ValueCapture(ValueOptions(modules=("operands",), length=4, every=1, budget=0.5, seed=3),
                      _Mapper(), table, code=_Code(table), interpreter=slow)  # type: ignore[arg-type]
    vc._last_interp = _time.perf_counter() - 0.02  # 20 ms since the last drain: a 10 ms budget
    s, img, off, regs, stack, stack_len = _batch([0x1003] * 40, [1] * 40, [2] * 40, 0)
    assert vc.process(s, img, off, regs, stack, stack_len) == 40  # every sample still gives its values
    assert 0 < slow.runs < 40
    left = vc.skipped["interpretation over CPU budget"]
    assert slow.runs + left == 40
    (_, meta), = vc.take(0.0, 1.0).values()
    assert meta.interpreted == slow.runs and meta.over_budget == left and meta.samples == 40
    # Without a budget every chosen sample is interpreted.
    slow2 = SlowInterpreter()
    vc2 = ValueCapture(ValueOptions(modules=("operands",), length=4, every=1, budget=0, seed=3),
                       _Mapper(), table, code=_Code(table), interpreter=slow2)  # type: ignore[arg-type]
    vc2.process(*_batch([0x1003] * 10, [1] * 10, [2] * 10, 0))
    assert slow2.runs == 10


# --- records with registers --------------------------------------------------------------------------


def test_samples_with_user_registers_and_stack_decode_in_bulk() -> None:
    st = pb.ST | int(Sample.REGS_USER | Sample.STACK_USER)
    layout = SampleLayout(st, X86_REGS_USER_MASK, stack_user=16)
    regs = [list(range(i, i + 20)) for i in range(50)]
    raw = b"".join(pb.sample_regs_stack(1, 0x400000 + i, 7, 7, i, 0, regs[i], bytes([i]) * 16) for i in range(50))
    # A kernel thread's sample: no user registers (abi 0), a shorter record, decoded alone.
    body = struct.pack("<QQiiQII", 1, 0xFFFF0000, 0, 0, 99, 0, 0) + struct.pack("<QQ", 0, 0)
    raw += pb.record(9, 1, body)
    b = RecordDecoder(layout).decode(raw)
    assert len(b.samples) == 51 and b.regs.shape == (50, 20) and b.stack.shape == (50, 16)
    assert b.samples["regs"].tolist() == [*range(50), -1]
    assert b.regs[7].tolist() == regs[7] and bytes(b.stack[3]) == bytes([3]) * 16 and b.stack_len.tolist() == [16] * 50


# --- storage -------------------------------------------------------------------------------------------


def _named(offsets: list[int], values: list[int]) -> NamedHotlists:
    keys = np.zeros(len(offsets), KEY_DTYPE)
    keys["image"] = 0
    keys["offset"] = offsets
    keys["kind"] = 0
    vals = np.zeros(len(values), VALUE_DTYPE)
    vals["v0"] = values
    vals["vimg"] = -1
    return NamedHotlists(HotlistSet.exact(keys, vals), ["img"], ["in:rdi"])


def test_value_files_are_private_atomic_and_compact(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    ep = db.new_epoch()
    uid = os.getuid()
    write_value_file(db, ep, "h", _named([16, 16, 32], [1, 1, 2]), ValuesMeta(uid, samples=3))
    p2 = write_value_file(db, ep, "h", _named([16], [5]), ValuesMeta(uid, samples=1))
    # The files are their owner's alone; the directory is the writer's, and only it can write it.
    assert stat.S_IMODE(p2.stat().st_mode) == 0o600 and p2.stat().st_uid == uid
    assert p2.parent.stat().st_uid == os.geteuid() and not p2.parent.stat().st_mode & 0o022
    vs = load_values(db, [ep])
    assert vs.files == 2 and vs.meta is not None and vs.meta.samples == 4
    named = vs.hotlists
    got = {int(named.lists.keys[i]["offset"]): dict(named.lists.hotlist(i).counts) for i in range(len(named.lists))}
    assert got == {16: {(1, 0, -1): 2, (5, 0, -1): 1}, 32: {(2, 0, -1): 1}}
    out = compact_values(db, ep, "h", uid)
    assert out is not None and [f.name for f in value_files(db, ep, "h", uid)] == ["vals-00000001-00000002.parquet"]
    again = load_values(db, [ep])
    assert again.meta is not None and again.meta.samples == 4 and len(again.hotlists.lists) == 2


def test_compaction_removes_what_a_crash_left_and_keeps_every_value(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    ep = db.new_epoch()
    uid = os.getuid()
    for v in (1, 2, 3):
        write_value_file(db, ep, "h", _named([16], [v]), ValuesMeta(uid, samples=1))
    d = value_files(db, ep, "h", uid)[0].path.parent
    inputs = {f.name: f.read_bytes() for f in d.iterdir()}
    assert compact_values(db, ep, "h", uid) is not None
    # A crash after linking the merged file but before deleting its inputs: they are back, and a
    # writer killed mid-write left a temporary file (an hour old).
    for name, data in inputs.items():
        (d / name).write_bytes(data)
    tmp = db.temp_path(d)
    tmp.write_bytes(b"partial")
    os.utime(tmp, (0, 0))
    write_value_file(db, ep, "h", _named([16], [4]), ValuesMeta(uid, samples=1))
    before = load_values(db, [ep]).meta  # the covered files are not read twice
    assert before is not None and before.samples == 4
    assert compact_values(db, ep, "h", uid) is not None
    assert sorted(f.name for f in d.iterdir()) == ["vals-00000001-00000004.parquet"]
    vs = load_values(db, [ep])
    assert vs.meta is not None and vs.meta.samples == 4
    assert dict(vs.hotlists.lists.hotlist(0).counts) == {(v, 0, -1): 1 for v in (1, 2, 3, 4)}


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another owner needs root")
def test_value_files_belong_to_the_sampled_processes_owner(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    ep = db.new_epoch()
    p = write_value_file(db, ep, "h", _named([16], [1]), ValuesMeta(65534, samples=1))
    assert p.stat().st_uid == 65534 and stat.S_IMODE(p.stat().st_mode) == 0o600
    # The directory stays the writer's: a user who could write it could swap root's files for links.
    assert p.parent.stat().st_uid == os.geteuid() and not p.parent.stat().st_mode & 0o022


def test_a_corrupt_value_file_is_reported_and_the_rest_kept(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    ep = db.new_epoch()
    write_value_file(db, ep, "h", _named([16], [1]), ValuesMeta(os.getuid(), samples=1))
    bad = write_value_file(db, ep, "h", _named([32], [2]), ValuesMeta(os.getuid(), samples=1))
    bad.write_bytes(b"PAR1 not really")
    vs = load_values(db, [ep])
    assert vs.files == 1 and len(vs.corrupt) == 1 and "corrupt value file" in vs.corrupt[0]
    assert compact_values(db, ep, "h", os.getuid()) is None  # never merges over a damaged file


# --- the interpreter's C loop: building it ----------------------------------------------------------


def test_the_c_loop_reports_a_failed_build_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cyclescope.values import stepper

    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'stepper.c:1:1: error: no compiler here' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    (tmp_path / "out").mkdir()
    with pytest.raises(stepper.StepperError, match=re.escape("failed: stepper.c:1:1: error: no compiler here")):
        stepper.build(tmp_path / "out" / "stepper.so")
    assert not list(tmp_path.glob("out/*"))  # nothing half-built left behind


def test_the_c_loop_is_cached_only_in_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cyclescope.values import stepper

    monkeypatch.setenv("CYCLESCOPE_CACHE", str(tmp_path / "mine"))
    assert stepper.cache_dir() == tmp_path / "mine"  # where decoded binaries are cached too
    monkeypatch.delenv("CYCLESCOPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert stepper.cache_dir() == tmp_path / "cyclescope"
    assert (tmp_path / "cyclescope").stat().st_mode & 0o777 == 0o700
    (tmp_path / "cyclescope").chmod(0o777)  # others could plant a library there: not used
    other = stepper.cache_dir()
    assert other != tmp_path / "cyclescope" and other.stat().st_mode & 0o077 == 0
    assert stepper.cache_dir() == other  # one fallback per process, not one per call


def test_the_private_fallback_cache_is_removed_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("CYCLESCOPE_CACHE", None)
    (tmp_path / "cyclescope").mkdir(mode=0o700)
    (tmp_path / "cyclescope").chmod(0o777)
    code = "from cyclescope.values import stepper; print(stepper.cache_dir()); print(stepper.cache_dir())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    first, second = r.stdout.split()
    assert first == second and first != str(tmp_path / "cyclescope")
    assert not Path(first).exists()  # the process's fallback directory went with it


def test_a_hotlist_whose_estimate_exceeds_the_values_seen_reports_without_failing() -> None:
    """A thinned hotlist's top estimate (count / p) can exceed its total: the report's standard
    error stays a real number (it was the square root of a negative share term)."""
    from cyclescope.report.values import hot_rows
    from cyclescope.values.api import FormatContext
    from cyclescope.values.modules import load_modules

    keys = np.zeros(1, dtype=KEY_DTYPE)
    keys["offset"] = 0x1010
    values = np.zeros(2, dtype=VALUE_DTYPE)
    values["v0"] = [16, 3]
    hs = HotlistSet(keys, np.array([0.5]), np.array([100], np.int64), np.array([0, 0], np.int64), values,
                    np.array([60.0, 2.0]))  # 60 / 0.5 = 120 of 100 values seen

    class Namer:
        def fmt(self) -> FormatContext:
            return FormatContext(lambda img, off: hex(off))

    rows = hot_rows(NamedHotlists(hs, ["img"], ["goal:rcx"]), load_modules(["goal"]), Namer(), 16)  # type: ignore[arg-type]
    top = rows[0].values[0]
    assert top.value.v0 == 16 and top.share == pytest.approx(1.2)
    assert isinstance(top.se, float) and top.se > 0
    assert rows[0].to_json()["hotlist"][0]["se"] == round(top.se, 6)


def test_a_goal_plan_looks_only_at_samples_in_its_live_ranges() -> None:
    from cyclescope.values.goal import GoalModule, GoalPoint, Plan

    class Counting(_Code):
        def __init__(self, table: ImageTable) -> None:
            super().__init__(table)
            self.decoded: list[int] = []

        def insn(self, img: int, off: int) -> InsnDetail | None:
            self.decoded.append(off)
            return super().insn(img, off)

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    code = Counting(table)
    plan = Plan([GoalPoint("prog", "f", "rsi", 0.5, [(0x1003, "rsi")])])
    vc = ValueCapture(ValueOptions(modules=("goal",), length=0, seed=1), _Mapper(), table, code=code,
                      modules=[GoalModule(plan)])
    pcs = [0x1003] * 12 + [0x1007] * 30  # most samples outside the candidate's live range
    assert vc.process(*_batch(pcs, [0x8000] * 42, [16] * 12 + [5] * 30, 0)) == 12
    assert _rows(vc) == {(0x1003, "goal:rsi"): {(16, 0, -1): 12}}
    assert 0x1007 not in code.decoded
    # a point switched off (rule (3)) or probed exactly: nothing is looked at any more
    plan.points[0].exact = True
    vc.replan()
    assert vc.process(*_batch([0x1003] * 5, [0] * 5, [16] * 5, 0)) == 0


def test_a_difference_is_taken_from_both_registers_in_the_compared_width() -> None:
    from cyclescope.values.goal import GoalModule, GoalPoint, Plan

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    plan = Plan([GoalPoint("prog", "f", "rdi-rsi", 0.5, [(0x1003, "rdi-rsi")]),
                 GoalPoint("prog", "f", "edi-esi", 0.5, [(0x1007, "edi-esi")])])
    vc = ValueCapture(ValueOptions(modules=("goal",), length=0, seed=1), _Mapper(), table, code=_Code(table),
                      modules=[GoalModule(plan)])
    # 64-bit: 5 - 7 wraps; 32-bit: the upper halves differ but the compared halves are equal
    rdi = [5] * 4 + [(1 << 32) | 9] * 6
    rsi = [7] * 4 + [9] * 6
    vc.process(*_batch([0x1003] * 4 + [0x1007] * 6, rdi, rsi, 0))
    assert _rows(vc) == {(0x1003, "goal:rdi-rsi"): {((5 - 7) % (1 << 64), 0, -1): 4},
                         (0x1007, "goal:rdi-rsi"): {(0, 0, -1): 6}}


def test_two_addresses_are_formed_from_one_samples_registers_and_subtracted() -> None:
    from cyclescope.images.disasm import MemOperand
    from cyclescope.values.goal import GoalModule, GoalPoint, Plan

    table = ImageTable()
    table.intern(ImageInfo("prog", "/prog", "elf", offsets="vaddr"))
    mems = (MemOperand("rdi", "", 1, 8, 8), MemOperand("rsi", "rdi", 2, -8, 8))
    plan = Plan([GoalPoint("prog", "f", "same-as-1000", 0.5, [(0x1003, "same-as-1000")], mems=mems)])
    vc = ValueCapture(ValueOptions(modules=("goal",), length=0, seed=1), _Mapper(), table, code=_Code(table),
                      modules=[GoalModule(plan)])
    # (rdi + 8) - (rsi + rdi*2 - 8)
    vc.process(*_batch([0x1003] * 3, [0x100, 0x100, 0x100], [-0x100 % (1 << 64), 0x10, 0x10], 0))
    want = {(0x100 + 8 - ((-0x100 + 0x200 - 8) % (1 << 64))) % (1 << 64): 1,
            (0x100 + 8 - (0x10 + 0x200 - 8)) % (1 << 64): 2}
    assert _rows(vc) == {(0x1003, "goal:same-as-1000"): {(v, 0, -1): n for v, n in want.items()}}


def test_capture_loads_the_interpreter_only_where_it_interprets() -> None:
    """--goal and --interpret 0 interpret nothing: value capture does not import the interpreter
    (its stepper and hashlib: about 10 ms of imports)."""
    code = ("import sys; from cyclescope.values.capture import ValueCapture;"
            "sys.exit(3 * ('cyclescope.values.interp' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
