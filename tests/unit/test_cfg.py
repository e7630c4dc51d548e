"""CFG construction and cycle equivalence (checked against the definition on random graphs)."""

from __future__ import annotations

import contextlib
import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import networkx as nx
import pytest

from cyclescope.analysis.cfg import CFG, ENTRY, EXIT, Block, Edge, build_cfg
from cyclescope.analysis.equivalence import cycle_equivalence
from cyclescope.images.disasm import disassemble, insn_info, read_code
from cyclescope.images.elf import apply_relative, read_load_info, read_symbols, relative_relocations


def make_cfg(nblocks: int, arcs: list[tuple[int, int]]) -> CFG:
    """A CFG from arcs between block numbers (ENTRY=-1, EXIT=-2) without instructions."""
    blocks = [Block(b, b, b, 16 * b, 16 * b + 16) for b in range(nblocks)]
    edges = []
    for i, (s, d) in enumerate(arcs):
        e = Edge(i, s, d, "jump")
        edges.append(e)
        if s >= 0:
            blocks[s].succs.append(i)
        if d >= 0:
            blocks[d].preds.append(i)
    reach: set[int] = set()
    stack = [d for s, d in arcs if s == ENTRY and d >= 0]
    while stack:
        b = stack.pop()
        if b not in reach:
            reach.add(b)
            stack += [edges[i].dst for i in blocks[b].succs if edges[i].dst >= 0]
    return CFG([], blocks, edges, False, [], {b for b in range(nblocks) if b not in reach}, list(range(nblocks)))


def truth(cfg: CFG, extra_exits: list[int]) -> tuple[dict[int, frozenset], dict[int, frozenset]]:
    """Per CFG edge and per block: the set of simple cycles through it (the definition)."""
    g = nx.MultiDiGraph()
    ein = lambda b: ("in", b)  # noqa: E731
    eout = lambda b: ("out", b)  # noqa: E731
    node = lambda x, out: "ENTRY" if x == ENTRY else "EXIT" if x == EXIT else (eout(x) if out else ein(x))  # noqa: E731
    for e in cfg.edges:
        if (e.src >= 0 and e.src in cfg.unreachable) or (e.dst >= 0 and e.dst in cfg.unreachable):
            continue
        g.add_edge(node(e.src, True), node(e.dst, False), key=("e", e.id))
    for b in range(len(cfg.blocks)):
        if b not in cfg.unreachable:
            g.add_edge(ein(b), eout(b), key=("b", b))
    for b in extra_exits:
        g.add_edge(eout(b), "EXIT", key=("v", b))
    g.add_edge("EXIT", "ENTRY", key=("r", 0))
    cycles_of: dict[tuple[str, int], set[int]] = {}
    for ci, cyc in enumerate(nx.simple_cycles(nx.DiGraph(g))):
        # Expand each node cycle into all parallel-edge choices.
        choices = [[k for k in g.get_edge_data(cyc[i], cyc[(i + 1) % len(cyc)])] for i in range(len(cyc))]
        combos = [[]]
        for ch in choices:
            combos = [[*c, k] for c in combos for k in ch]
        for j, combo in enumerate(combos):
            for k in combo:
                cycles_of.setdefault(k, set()).add(ci * 1000 + j)
    edges = {e.id: frozenset(cycles_of.get(("e", e.id), set())) for e in cfg.edges}
    blocks = {b: frozenset(cycles_of.get(("b", b), set())) for b in range(len(cfg.blocks))}
    return edges, blocks


def random_cfg(rng: random.Random) -> CFG:
    n = rng.randint(1, 7)
    arcs = [(ENTRY, 0)]
    for b in range(n):
        k = rng.choice([1, 1, 2, 2, 3])
        for _ in range(k):
            d = rng.choice([*range(n), EXIT, EXIT])
            arcs.append((b, d))
    return make_cfg(n, arcs)


@pytest.mark.parametrize("seed", range(300))
def test_cycle_equivalence_matches_the_definition(seed: int) -> None:
    cfg = random_cfg(random.Random(seed))
    cls = cycle_equivalence(cfg)
    te, tb = truth(cfg, cls.virtual_exits)
    items = [("e", i, cls.edge[i], te[i]) for i in te if te[i]] + [
        ("b", b, cls.block[b], tb[b]) for b in tb if b not in cfg.unreachable]
    for x in items:
        for y in items:
            same_truth = x[3] == y[3]
            assert (x[2] == y[2]) == same_truth, (seed, x[:3], y[:3])


def test_loops_chains_and_diamonds() -> None:
    # entry -> 0 -> {1, 2} -> 3 -> (0 | exit): a diamond inside a loop
    cfg = make_cfg(4, [(ENTRY, 0), (0, 1), (0, 2), (1, 3), (2, 3), (3, 0), (3, EXIT)])
    c = cycle_equivalence(cfg)
    assert c.block[0] == c.block[3]  # loop head and latch run equally often
    assert c.block[1] != c.block[2] != c.block[0]
    assert c.edge[0] == c.edge[6]  # entering and leaving the loop: once each
    assert c.edge[1] == c.block[1] and c.edge[3] == c.block[1]


def test_infinite_loops_get_a_virtual_exit() -> None:
    cfg = make_cfg(3, [(ENTRY, 0), (0, 1), (1, 2), (2, 1)])  # never returns
    c = cycle_equivalence(cfg)
    assert c.virtual_exits == [2]
    assert c.block[1] == c.block[2] and all(x >= 0 for x in c.block)


def test_missing_edges_give_every_block_and_edge_its_own_class() -> None:
    cfg = make_cfg(2, [(ENTRY, 0), (0, 1), (1, EXIT)])
    cfg.missing_edges = True
    c = cycle_equivalence(cfg)
    assert len(set(c.block) | set(c.edge)) == 2 + 3


def cfg_of(exe: Path, name: str, relocate: bool = True) -> CFG:
    """The CFG of function ``name``, reading tables as the loaded program sees them (``relocate``:
    with the file's RELATIVE relocations applied, as calc does)."""
    syms = read_symbols(str(exe))
    i = syms.names.index(name)
    start, end = int(syms.starts[i]), int(syms.ends[i])
    info = read_load_info(str(exe))
    code = read_code(str(exe), start, end, info)

    def read(addr: int, n: int) -> bytes | None:
        try:
            data = read_code(str(exe), addr, addr + n, info)
        except Exception:
            return None
        return apply_relative(str(exe), addr, data) if relocate else data

    def name_at(addr: int) -> str | None:
        j = int(syms.lookup(__import__("numpy").array([addr], "uint64"))[0])
        return syms.names[j] if j >= 0 else None

    return build_cfg(disassemble(code, start), start, end, name_at, read, insn_info(code, start))


SWITCH = r"""
#include <stdlib.h>
__attribute__((noinline)) long sw(long x, long s) {
    switch (x) {
    case 0: return s + 1;  case 1: return s * 3;  case 2: return s ^ 7;  case 3: return s - 9;
    case 4: return s << 2; case 5: return s >> 1; case 6: return s | 5;  case 7: return s & 0xff;
    case 8: return s * s;  case 9: return ~s;     default: return 0;
    }
}
int main(int argc, char **argv) {
    long s = 1;
    for (long i = 0; i < 1000; i++) s = sw(i % 12, s);
    if (s == 42) abort();
    return (int)(s & 1);
}
"""


def test_a_real_loop_and_a_jump_table(compile_c: Callable[..., Path]) -> None:
    exe = compile_c("hotcold")
    cfg = cfg_of(exe, "hot")
    assert not cfg.missing_edges
    for b in cfg.unreachable:  # only alignment padding is unreachable
        blk = cfg.blocks[b]
        assert all(i.mnemonic in ("nop", "xchg", "int3") for i in cfg.insns[blk.first : blk.last + 1])
    backs = [e for e in cfg.edges if e.src >= 0 and e.dst >= 0 and cfg.blocks[e.dst].start <= cfg.blocks[e.src].start]
    assert len(backs) == 1  # the loop
    assert any(e.dst == EXIT and e.kind == "return" for e in cfg.edges)
    sw = compile_c("switch", "-O2", "-g", source=SWITCH)
    c2 = cfg_of(sw, "sw")
    tables = [e for e in c2.edges if e.kind == "table"]
    assert not c2.missing_edges and len({e.dst for e in tables}) >= 10
    m = cfg_of(sw, "main")
    assert any(e.kind == "tail" for e in m.edges)  # GCC moved the abort() path out, to main.cold
    cold = cfg_of(sw, "main.cold")
    assert [e.kind for e in cold.edges if e.src == 0] == ["noreturn"]  # call abort@plt ends its block


def test_objdump_agrees_on_block_boundaries(compile_c: Callable[..., Path]) -> None:
    exe = compile_c("hotcold")
    cfg = cfg_of(exe, "hot")
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(exe)], capture_output=True, text=True).stdout
    targets = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1].startswith("j"):
            with contextlib.suppress(ValueError):
                targets.add(int(parts[2], 16))
    starts = {b.start for b in cfg.blocks}
    inside = {t for t in targets if cfg.blocks[0].start <= t < cfg.blocks[-1].end}
    assert inside <= starts


DISPATCH = r"""
#include <stdio.h>
#include <stdlib.h>
/* A small bytecode interpreter dispatching with computed goto, as Lua and CPython do. */
enum { PUSH, ADD, SUB, MUL, DUP, SWAP, JNZ, DEC, PRINT, HALT };
__attribute__((noinline)) long run(const int *code, long n) {
    static const void *const table[] = { &&op_push, &&op_add, &&op_sub, &&op_mul, &&op_dup, &&op_swap,
                                         &&op_jnz, &&op_dec, &&op_print, &&op_halt };
    long stack[64]; long sp = 0; const int *pc = code; long acc = n;
#define NEXT() goto *table[*pc++ & 15]
    NEXT();
op_push: stack[sp++] = *pc++; NEXT();
op_add: sp--; stack[sp - 1] += stack[sp]; NEXT();
op_sub: sp--; stack[sp - 1] -= stack[sp]; NEXT();
op_mul: sp--; stack[sp - 1] *= stack[sp]; NEXT();
op_dup: stack[sp] = stack[sp - 1]; sp++; NEXT();
op_swap: { long t = stack[sp - 1]; stack[sp - 1] = stack[sp - 2]; stack[sp - 2] = t; } NEXT();
op_jnz: { int off = *pc++; if (acc) pc += off; } NEXT();
op_dec: acc--; NEXT();
op_print: printf("%ld\n", stack[sp - 1]); NEXT();
op_halt: return stack[sp - 1] + acc;
}
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    static const int prog[] = { PUSH, 1, PUSH, 3, ADD, DUP, MUL, PUSH, 2, SUB, DEC, JNZ, -10, PRINT, HALT };
    return (int)(run(prog, n) & 1);
}
"""


def assert_dispatch_resolved(cfg: CFG) -> None:
    assert not cfg.missing_edges, cfg.notes
    handlers = {e.dst for e in cfg.edges if e.kind == "table"}
    assert len(handlers) == 10  # every opcode's handler, from every dispatch point
    sources = {e.src for e in cfg.edges if e.kind == "table"}
    assert len(sources) >= 8  # clang and GCC both copy the dispatch into each handler
    assert not handlers & cfg.unreachable


def test_a_computed_goto_dispatch_is_resolved_gcc(compile_c: Callable[..., Path]) -> None:
    # GCC: mov rax, qword ptr [r12 + rax*8]; jmp rax, the table's address set once in r12.
    exe = compile_c("dispatch", "-O2", "-g", source=DISPATCH)
    assert_dispatch_resolved(cfg_of(exe, "run"))
    assert_dispatch_resolved(cfg_of(exe, "run", relocate=False))  # GNU ld writes the addends in the file too


def test_a_computed_goto_dispatch_is_resolved_clang(tmp_path: Path) -> None:
    # clang: jmp qword ptr [rbp + rdx*8], the table's register copied and reloaded between handlers.
    clang = shutil.which("clang-14") or shutil.which("clang")
    if clang is None:
        pytest.skip("clang is not installed (scripts/setup installs clang-14)")
    src = tmp_path / "dispatch.c"
    src.write_text(DISPATCH)
    exe = tmp_path / "dispatch"
    subprocess.run([clang, "-O2", "-g", "-o", str(exe), str(src)], check=True, capture_output=True)
    assert_dispatch_resolved(cfg_of(exe, "run"))


def test_a_table_left_zero_in_the_file_is_read_through_its_relocations(compile_c: Callable[..., Path],
                                                                        tmp_path: Path) -> None:
    """lld leaves a PIE's tables of code addresses zero in the file (unless --apply-dynamic-relocs)
    and puts the addresses in R_X86_64_RELATIVE relocations only: zero the table of a real binary
    the same way, and the CFG must still find every handler."""
    exe = compile_c("dispatch", "-O2", "-g", source=DISPATCH)
    syms = read_symbols(str(exe))
    i = syms.names.index("run")
    start, end = int(syms.starts[i]), int(syms.ends[i])
    offs, vals = relative_relocations(str(exe))
    slots = [int(o) for o, v in zip(offs, vals, strict=True) if start <= int(v) < end]
    assert len(slots) == 10
    info = read_load_info(str(exe))
    data = bytearray(exe.read_bytes())
    for o in slots:
        off = info.file_offset(o)
        assert off is not None
        data[off : off + 8] = bytes(8)
    zeroed = tmp_path / "dispatch-zeroed"
    zeroed.write_bytes(bytes(data))
    relative_relocations.cache_clear()
    assert cfg_of(zeroed, "run", relocate=False).missing_edges  # the file alone no longer says where
    assert_dispatch_resolved(cfg_of(zeroed, "run"))
