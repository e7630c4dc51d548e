"""Call frame information tables and the stack-snapshot unwinder, on synthetic frames and on a real
library's .eh_frame (checked against binutils' readelf)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from cyclescope.cli.sampling import call_graph_arg
from cyclescope.collect.unwind import BP, IP, PENDING, SP, DwarfStacks, Unwinder, user_chain
from cyclescope.images import cfi
from cyclescope.images.cfi import CFA_EXPR, CFA_REG, SAVED_AT, SAVED_NONE, CfiTable, Row
from cyclescope.perf.abi import PERF_CONTEXT_KERNEL, PERF_CONTEXT_USER

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


# --- two decoders of the same table ---------------------------------------------------------------
def rule_at(t: CfiTable, pc: int) -> tuple[object, ...] | None:
    r = t.lookup(pc)
    if r is None:
        return None
    return (r.cfa_kind, r.cfa_reg, r.cfa_off, r.ra_kind, r.ra_off, r.bp_kind, r.bp_off,
            t.exprs[r.expr] if r.expr >= 0 else None)


@pytest.mark.skipif(shutil.which("readelf") is None or not Path(LIBC).exists(),
                    reason="needs binutils' readelf and libc")
def test_readelfs_decoding_of_libc_is_pyelftools(tmp_path: Path) -> None:
    """build_from_path reads readelf's decoded tables (C, ten times faster); pyelftools decodes
    the CFA programs itself: the same rule at every address either table names, on libc (its PLT
    expression, a signal frame's registers kept in other registers) and a program of ours."""
    from elftools.elf.elffile import ELFFile

    exe = tmp_path / "cg"
    subprocess.run(["gcc", "-O2", "-g", "-fomit-frame-pointer", "-o", str(exe),
                    str(Path(__file__).parents[1] / "programs" / "callgraph.c")], check=True)
    for path in (LIBC, str(exe)):
        fast = cfi.build_readelf(path)
        with open(path, "rb") as f:
            slow = cfi.build(ELFFile(f))
        assert fast is not None and len(fast) == len(slow)
        for pc in sorted(set(fast.pcs) | set(slow.pcs)):
            assert rule_at(fast, pc) == rule_at(slow, pc), hex(pc)
    assert len(fast.exprs) == 1  # the PLT's
    # Addresses past an FDE's end, before the next one, are gaps.
    t = cfi.build_from_path(LIBC)
    ends = [pc for pc, row in zip(t.pcs, t.rows, strict=True) if row.cfa_kind == cfi.CFA_NONE]
    assert ends and all(t.lookup(e) is None for e in ends[:50])


def test_readelfs_tables_parsed() -> None:
    """The parts of readelf's output the parser meets: a CIE's initial row for an FDE without
    rows, registers kept in other registers, and "exp" with its expression from -wf."""
    interp = """Contents of the .eh_frame section:


00000000 0000000000000014 00000000 CIE "zR" cf=1 df=-8 ra=16
   LOC           CFA      ra
0000000000000000 rsp+8    u

00000018 0000000000000014 0000001c FDE cie=00000000 pc=00000000000010c0..00000000000010e2

00000030 0000000000000014 00000000 CIE "zR" cf=1 df=-8 ra=16
   LOC           CFA      ra
0000000000000000 rsp+8    c-8

00000048 0000000000000024 0000001c FDE cie=00000030 pc=0000000000001020..0000000000001050
   LOC           CFA      ra
0000000000001020 rsp+16   c-8
0000000000001030 exp      c-8

00000070 0000000000000030 00000044 FDE cie=00000030 pc=0000000000002000..0000000000002010
   LOC           CFA      rbp   r8    ra
0000000000002000 rsp+8    u     u     c-8
0000000000002004 rdi+0    c+16  r9 (r9) c+0

00000098 ZERO terminator
"""
    fdes = cfi._parse_interp(interp)
    assert fdes[0x10C0] == (0x10E2, [(0x10C0, "rsp+8", "u", None)])  # _start: the CIE's row, ra undefined
    assert fdes[0x2000][1][1] == (0x2004, "rdi+0", "c+0", "c+16")
    raw = """Contents of the .eh_frame section:

00000048 0000000000000024 0000001c FDE cie=00000030 pc=0000000000001020..0000000000001050
  DW_CFA_def_cfa_offset: 16
  DW_CFA_def_cfa_expression (DW_OP_breg7 (rsp): 8; DW_OP_breg16 (rip): 0; DW_OP_lit15; DW_OP_and; \
DW_OP_lit11; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus)
"""
    ex = cfi._parse_expressions(raw)
    assert ex[0x1020] == [[("DW_OP_breg7", [8]), ("DW_OP_breg16", [0]), ("DW_OP_lit15", []), ("DW_OP_and", []),
                           ("DW_OP_lit11", []), ("DW_OP_ge", []), ("DW_OP_lit3", []), ("DW_OP_shl", []),
                           ("DW_OP_plus", [])]]
    assert cfi._row("rsp+8", "u", None, -1) == Row(CFA_REG, cfi.DW_RSP, 8, SAVED_NONE, 0, SAVED_NONE, 0, -1)
    assert cfi._row("rdi+0", "c+0", "c+16", -1).cfa_reg == 5
    assert cfi._row("exp", "c-8", None, -1).cfa_kind == cfi.CFA_NONE  # an expression we do not have


def test_cfi_table_round_trips_through_the_cache_form() -> None:
    t = CfiTable([0x1000, 0x1004, 0x1010], [Row(CFA_REG, 7, 8, SAVED_AT, -8, SAVED_NONE, 0, -1),
                                            Row(CFA_EXPR, 0, 0, SAVED_AT, -8, SAVED_AT, -16, 0),
                                            Row(cfi.CFA_NONE, 0, 0, 2, 0, 0, 0, -1)],
                 [[("DW_OP_breg7", [8]), ("DW_OP_lit3", [])]])
    back = CfiTable.from_arrow(t.to_arrow())
    assert back.pcs == t.pcs and back.rows == t.rows and back.exprs == t.exprs
    assert back.lookup(0x0FFF) is None and back.lookup(0x1003) == t.rows[0] and back.lookup(0x1010) is None


def test_cfi_of_a_file_that_is_not_elf_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "x"
    p.write_bytes(b"not an elf file at all")
    from cyclescope.errors import DataError

    with pytest.raises(DataError, match="not an ELF file"):
        cfi.build_from_path(str(p))


def test_plt_cfa_expression() -> None:
    # A PLT entry: CFA = rsp + 8, plus 8 once the entry has pushed (rip & 15 >= 11).
    ops = [("DW_OP_breg7", [8]), ("DW_OP_breg16", [0]), ("DW_OP_lit15", []), ("DW_OP_and", []),
           ("DW_OP_lit11", []), ("DW_OP_ge", []), ("DW_OP_lit3", []), ("DW_OP_shl", []), ("DW_OP_plus", [])]
    assert cfi.evaluate(ops, {7: 0x7000, 16: 0x1036}, lambda a: None) == 0x7008
    assert cfi.evaluate(ops, {7: 0x7000, 16: 0x103B}, lambda a: None) == 0x7010
    assert cfi.evaluate(ops, {16: 0x103B}, lambda a: None) is None  # rsp unknown
    assert cfi.evaluate([("DW_OP_breg7", [16]), ("DW_OP_deref", [])], {7: 0x100}, {0x110: 0xAB}.get) == 0xAB
    assert cfi.evaluate([("DW_OP_call_frame_cfa", [])], {}, lambda a: None) is None


# --- the walk, on a hand-made stack -----------------------------------------------------------
BIAS = 0x400000
A_LEAF, A_MID, A_ROOT, A_GAP = 0x1000, 0x2000, 0x3000, 0x5000


def table() -> CfiTable:
    leaf = Row(CFA_REG, cfi.DW_RSP, 8, SAVED_AT, -8, SAVED_NONE, 0, -1)  # no frame: RA at [rsp]
    mid = Row(CFA_REG, cfi.DW_RBP, 16, SAVED_AT, -8, SAVED_AT, -16, -1)  # push rbp; mov rsp,rbp
    mid_body = Row(CFA_REG, cfi.DW_RSP, 32, SAVED_AT, -8, SAVED_NONE, 0, -1)  # sub $16,rsp
    root = Row(CFA_REG, cfi.DW_RSP, 8, SAVED_NONE, 0, SAVED_NONE, 0, -1)  # RA undefined: outermost
    gap = Row(cfi.CFA_NONE, 0, 0, 2, 0, 0, 0, -1)
    return CfiTable([A_LEAF, A_LEAF + 0x100, A_MID, A_MID + 0x100, A_ROOT, A_ROOT + 0x100],
                    [leaf, gap, mid, mid_body, root, gap], [])


def full(image: int, pid: int = 0) -> CfiTable:
    return table()


def loading(image: int, pid: int = 0) -> object:
    return PENDING


def no_table(image: int, pid: int = 0) -> None:
    return None


def proc(image: int = 1) -> SimpleNamespace:
    return SimpleNamespace(starts=[BIAS + 0x1000], ends=[BIAS + 0x6000], biases=[BIAS], images=[image])


def regs(ip: int, sp: int, bp: int) -> list[int]:
    r = [0] * 20
    r[IP], r[SP], r[BP] = ip, sp, bp
    return r


def snapshot(sp: int, words: dict[int, int], size: int = 256) -> bytes:
    b = bytearray(size)
    for addr, v in words.items():
        b[addr - sp : addr - sp + 8] = v.to_bytes(8, "little")
    return bytes(b)


def three_frames(size: int = 256) -> tuple[list[int], bytes]:
    """leaf (no frame) <- mid (rbp frame, CFA = rbp + 16) <- mid (body rule, CFA = rsp + 32) <- root."""
    sp = 0x7FF000
    # leaf: RA (into mid, first instance) at [sp]
    # mid #1: rbp = sp + 0x20; saved rbp at rbp, RA at rbp + 8; its CFA = rbp + 16 = sp + 0x30
    # mid #2 (called from mid #1's body at A_MID + 0x150): CFA = sp' + 32 where sp' = sp + 0x30
    # root: RA rule undefined
    words = {sp: BIAS + A_MID + 0x10, sp + 0x20: 0x7FF100, sp + 0x28: BIAS + A_MID + 0x150,
             sp + 0x30 + 24: BIAS + A_ROOT + 0x20}
    return regs(BIAS + A_LEAF + 0x40, sp, sp + 0x20), snapshot(sp, words, size)


def test_walk_follows_rsp_and_rbp_rules_to_the_outermost_frame() -> None:
    u = Unwinder(full)
    r, st = three_frames()
    frames, reason = u.unwind(proc(), r, st)  # type: ignore[misc]
    assert frames == [BIAS + A_LEAF + 0x40, BIAS + A_MID + 0x10, BIAS + A_MID + 0x150, BIAS + A_ROOT + 0x20]
    assert reason == "end"


def test_walk_stops_where_the_information_ends() -> None:
    r, st = three_frames()
    # The snapshot is too short for the third frame's return address.
    assert Unwinder(full).unwind(proc(), r, st[:0x40]) == (
        [BIAS + A_LEAF + 0x40, BIAS + A_MID + 0x10, BIAS + A_MID + 0x150], "stack")
    # No table for the image, a PC outside every mapping, a PC in a gap of the table.
    assert Unwinder(no_table).unwind(proc(), r, st) == ([BIAS + A_LEAF + 0x40], "no-cfi")
    assert Unwinder(full).unwind(proc(), regs(0x99, 0x7FF000, 0), st) == ([0x99], "no-mapping")
    assert Unwinder(full).unwind(proc(-3), r, st) == ([BIAS + A_LEAF + 0x40], "no-mapping")
    assert Unwinder(full).unwind(proc(), regs(BIAS + A_LEAF + 0x180, 0x7FF000, 0), st)[1] == "no-cfi"
    # A table still loading: wait (None), or stop there when told to.
    assert Unwinder(loading).unwind(proc(), r, st) is None
    assert Unwinder(loading).unwind(proc(), r, st, loading_stops=True) == ([BIAS + A_LEAF + 0x40], "loading")
    # The depth limit.
    assert Unwinder(full, max_depth=2).unwind(proc(), r, st) == (
        [BIAS + A_LEAF + 0x40, BIAS + A_MID + 0x10], "depth")


def test_a_return_address_is_looked_up_at_its_call() -> None:
    """A call as the last instruction of a function: its return address is the next function's
    first byte, but the caller's rule applies (lookup at RA - 1)."""
    sp = 0x7FF000
    # leaf returns to A_LEAF + 0x100 (= where leaf's table row ends): the caller is leaf's own code
    # just before, whose rule is leaf's.
    words = {sp: BIAS + A_LEAF + 0x100, sp + 8: BIAS + A_ROOT + 0x10}
    frames, reason = Unwinder(full).unwind(proc(), regs(BIAS + A_LEAF, sp, 0), snapshot(sp, words))  # type: ignore[misc]
    assert frames == [BIAS + A_LEAF, BIAS + A_LEAF + 0x100, BIAS + A_ROOT + 0x10] and reason == "end"


# --- chains and the waiting queue -------------------------------------------------------------
def test_user_chain_keeps_the_kernels_part_and_replaces_its_user_part() -> None:
    k = (PERF_CONTEXT_KERNEL, 0xFFFF1, 0xFFFF2, PERF_CONTEXT_USER, 0x10, 0x20)
    assert user_chain(k, [0x11, 0x22, 0x33]) == (PERF_CONTEXT_KERNEL, 0xFFFF1, 0xFFFF2, PERF_CONTEXT_USER,
                                                 0x11, 0x22, 0x33)
    assert user_chain((), [0x11]) == (PERF_CONTEXT_USER, 0x11)


class Loader:
    def __init__(self) -> None:
        self.ready = False

    def __call__(self, image: int, pid: int = 0) -> object:
        return table() if self.ready else PENDING


def test_samples_wait_for_their_tables_and_are_released_in_order() -> None:
    import numpy as np

    loader = Loader()
    ds = DwarfStacks(loader, max_pending=100)  # type: ignore[arg-type]
    r, st = three_frames()
    mapper = SimpleNamespace(procs={7: proc()})
    regs_a = np.array([r, r], np.uint64)
    stack = np.frombuffer(st * 2, np.uint8).reshape(2, len(st))
    out = ds.chains(mapper, [7, 7], [1, 2], [0, 0], [3, 4], [None, None], [0, 1], regs_a, stack,
                    np.array([len(st)] * 2))
    assert out.pids == [] and len(ds.waiting) == 2
    loader.ready = True
    out = ds.chains(mapper, [], [], [], [], [], [], None, None, None)
    assert out.pids == [7, 7] and out.ips == [1, 2] and out.comms == [3, 4] and not ds.waiting
    assert out.chains[0] == (PERF_CONTEXT_USER, BIAS + A_LEAF + 0x40, BIAS + A_MID + 0x10, BIAS + A_MID + 0x150,
                         BIAS + A_ROOT + 0x20)
    assert ds.stats.samples == 2 and ds.stats.stops["end"] == 2


def test_a_full_queue_unwinds_the_oldest_samples_without_the_missing_tables() -> None:
    import numpy as np

    ds = DwarfStacks(Loader(), max_pending=3)  # type: ignore[arg-type]
    r, st = three_frames()
    n = 5
    out = ds.chains(SimpleNamespace(procs={7: proc()}), [7] * n, list(range(n)), [0] * n, [0] * n, [None] * n,
                    list(range(n)), np.array([r] * n, np.uint64),
                    np.frombuffer(st * n, np.uint8).reshape(n, len(st)), np.array([len(st)] * n))
    assert out.ips == [0, 1] and len(ds.waiting) == 3
    assert ds.stats.truncated_loading == 2 and ds.stats.stops["loading"] == 2
    # A sample without user registers (a kernel thread) keeps its kernel frames and never waits.
    out = ds.chains(SimpleNamespace(procs={}), [0], [9], [0], [0], [(PERF_CONTEXT_KERNEL, 0xFFFF1)], [-1], None, None,
                    None, force=True)
    assert (PERF_CONTEXT_KERNEL, 0xFFFF1) in out.chains and not ds.waiting


def test_call_graph_option() -> None:
    assert call_graph_arg("fp").mode == "fp"
    assert call_graph_arg("dwarf").stack_size == 8192
    assert call_graph_arg("dwarf,16384").stack_size == 16384
    for bad in ("dwarf,100", "dwarf,0", "dwarf,x", "lbr", "fp,8"):
        with pytest.raises(argparse.ArgumentTypeError):
            call_graph_arg(bad)
