"""Control-flow graphs of procedures, from their disassembly (DCPI 6.1.1).

Blocks end at jumps, returns and traps; calls do not end a block (the
callee returns to the next instruction the same number of times), except
calls to functions that never return. Indirect jumps through a jump table
are resolved by reading the table (GCC's PIC and absolute forms); an
indirect jump that cannot be resolved marks the CFG as missing edges.
Virtual ENTRY and EXIT nodes bracket the procedure; returns, tail calls and
jumps out of the procedure go to EXIT.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cyclescope.images.disasm import Insn

ENTRY = -1
EXIT = -2

NORETURN = frozenset({
    "exit", "_exit", "_Exit", "abort", "__assert_fail", "__stack_chk_fail", "__cxa_throw", "__cxa_rethrow",
    "longjmp", "_longjmp", "siglongjmp", "__longjmp_chk", "pthread_exit", "err", "errx", "verr", "verrx",
    "__fortify_fail", "__chk_fail", "_Unwind_Resume", "std::terminate()", "__cxa_bad_cast", "quick_exit",
    "error_at_line",  # only when status != 0, but GCC treats the common idiom as noreturn at -O2 rarely
})
CONDITIONAL = ("loop", "loope", "loopne", "jrcxz", "jecxz", "jcxz")
TERMINATORS = ("ret", "retf", "iret", "iretd", "iretq", "hlt", "ud2", "ud1", "sysret", "sysexit")


@dataclass(frozen=True)
class Edge:
    id: int
    src: int  # block index, ENTRY
    dst: int  # block index, EXIT
    kind: str  # entry, fall, taken, jump, table, exit, return, tail, noreturn


@dataclass
class Block:
    id: int
    first: int  # index of the first instruction
    last: int  # index of the last instruction (inclusive)
    start: int  # address
    end: int  # address after the last instruction
    succs: list[int] = field(default_factory=list)  # edge ids
    preds: list[int] = field(default_factory=list)


@dataclass
class CFG:
    insns: list[Insn]
    blocks: list[Block]
    edges: list[Edge]
    missing_edges: bool
    notes: list[str]
    unreachable: set[int]
    block_of: list[int]  # instruction index -> block index

    def out_edges(self, node: int) -> list[Edge]:
        if node == ENTRY:
            return [e for e in self.edges if e.src == ENTRY]
        return [self.edges[i] for i in self.blocks[node].succs]

    def in_edges(self, node: int) -> list[Edge]:
        if node == EXIT:
            return [e for e in self.edges if e.dst == EXIT]
        return [self.edges[i] for i in self.blocks[node].preds]


def is_conditional(m: str) -> bool:
    return (m.startswith("j") and m != "jmp") or m in CONDITIONAL


_MEM_RE = re.compile(r"\[(?P<inner>[^\]]+)\]")
_RIP_RE = re.compile(r"rip\s*([+-])\s*(0x[0-9a-f]+|\d+)")


def rip_target(ins: Insn) -> int | None:
    """The absolute address a RIP-relative memory operand refers to."""
    m = _RIP_RE.search(ins.op_str)
    if not m:
        return None
    disp = int(m.group(2), 0)
    return ins.address + ins.size + (disp if m.group(1) == "+" else -disp)


def build_cfg(
    insns: Sequence[Insn],
    start: int,
    end: int,
    name_at: Callable[[int], str | None] = lambda a: None,
    read: Callable[[int, int], bytes | None] = lambda a, n: None,
) -> CFG:
    """Build the CFG of the procedure [start, end).

    ``name_at`` names a call target (for noreturn functions, through the PLT);
    ``read`` reads bytes at an address of the image (for jump tables).
    """
    insns = list(insns)
    index = {ins.address: k for k, ins in enumerate(insns)}
    notes: list[str] = []
    missing = False
    leaders = {0} if insns else set()
    targets: dict[int, list[tuple[int, str]]] = {}  # insn index of a terminator -> [(target addr or EXIT, kind)]

    def inside(a: int) -> bool:
        return start <= a < end and a in index

    for k, ins in enumerate(insns):
        m = ins.mnemonic
        nxt = k + 1
        if m.startswith("j") or m in CONDITIONAL:
            tgt = ins.direct_target
            outs: list[tuple[int, str]] = []
            if tgt is not None:
                if inside(tgt):
                    outs.append((tgt, "taken" if is_conditional(m) else "jump"))
                    leaders.add(index[tgt])
                else:
                    outs.append((EXIT, "tail"))
            else:
                table = resolve_jump_table(insns, k, start, end, read, index)
                if table:
                    for t in sorted(set(table)):
                        outs.append((t, "table"))
                        leaders.add(index[t])
                else:
                    missing = True
                    notes.append(f"indirect jump at {ins.address:#x} not resolved: the CFG is missing edges")
                    outs.append((EXIT, "tail"))  # treated as leaving the procedure
            if is_conditional(m) and nxt < len(insns):
                outs.append((insns[nxt].address, "fall"))
            targets[k] = outs
            if nxt < len(insns):
                leaders.add(nxt)
        elif m.startswith(TERMINATORS) or m == "int3":
            targets[k] = [(EXIT, "return" if m.startswith("ret") else "exit")]
            if nxt < len(insns):
                leaders.add(nxt)
        elif m == "call":
            tgt = ins.direct_target
            callee = name_at(tgt) if tgt is not None else None
            if callee is not None and callee.split("@")[0] in NORETURN:
                targets[k] = [(EXIT, "noreturn")]
                if nxt < len(insns):
                    leaders.add(nxt)

    order = sorted(leaders)
    blocks: list[Block] = []
    block_of = [0] * len(insns)
    for b, first in enumerate(order):
        last = (order[b + 1] if b + 1 < len(order) else len(insns)) - 1
        blocks.append(Block(b, first, last, insns[first].address, insns[last].address + insns[last].size))
        for k in range(first, last + 1):
            block_of[k] = b
    edges: list[Edge] = []

    def add(src: int, dst: int, kind: str) -> None:
        e = Edge(len(edges), src, dst, kind)
        edges.append(e)
        if src >= 0:
            blocks[src].succs.append(e.id)
        if dst >= 0:
            blocks[dst].preds.append(e.id)

    if blocks:
        add(ENTRY, 0, "entry")
    for blk in blocks:
        found = targets.get(blk.last)
        if found is None:  # falls through into the next block, or off the end of the procedure
            nb = blk.id + 1
            add(blk.id, nb if nb < len(blocks) else EXIT, "fall" if nb < len(blocks) else "exit")
            continue
        for tgt, kind in found:
            add(blk.id, EXIT if tgt == EXIT else block_of[index[tgt]], kind)

    reach = _reachable(blocks, edges)
    unreachable = {b.id for b in blocks if b.id not in reach}
    return CFG(insns, blocks, edges, missing, notes, unreachable, block_of)


def _reachable(blocks: list[Block], edges: list[Edge]) -> set[int]:
    seen: set[int] = set()
    stack = [e.dst for e in edges if e.src == ENTRY and e.dst >= 0]
    while stack:
        b = stack.pop()
        if b in seen:
            continue
        seen.add(b)
        for eid in blocks[b].succs:
            d = edges[eid].dst
            if d >= 0 and d not in seen:
                stack.append(d)
    return seen


def resolve_jump_table(insns: Sequence[Insn], k: int, start: int, end: int,
                       read: Callable[[int, int], bytes | None], index: dict[int, int]) -> list[int]:
    """Targets of the indirect jump at ``insns[k]``, or [] when its table cannot be read.

    GCC's two forms on x86-64:
      PIC:      lea rX, [rip+T]; movsxd rY, dword ptr [rX + rZ*4]; add rY, rX; jmp rY
      absolute: jmp qword ptr [rZ*8 + T]
    The number of entries comes from the bounds check before it (cmp rZ, N; ja)
    when found; otherwise entries are read while they land on instructions of
    the procedure (at most 4096).
    """
    jmp = insns[k]
    op = jmp.op_str.replace(" ", "")
    base: int | None = None
    width = 0
    pic = False
    m = _MEM_RE.search(jmp.op_str)
    if m and jmp.op_str.startswith("qword ptr"):
        inner = m.group("inner").replace(" ", "")
        mm = re.fullmatch(r"(?:(\w+)\*8\+)?(0x[0-9a-f]+)(?:\+(\w+)\*8)?", inner)
        if mm:
            base, width = int(mm.group(2), 16), 8
    elif re.fullmatch(r"r\w+", op):
        # Walk back for "add rY, rX" and "movsxd rY, dword ptr [rX + rZ*4]" and "lea rX, [rip+T]".
        reg = op
        for j in range(k - 1, max(-1, k - 12), -1):
            ins = insns[j]
            o = ins.op_str.replace(" ", "")
            if ins.mnemonic == "movsxd" and o.startswith(reg + ",dwordptr[") and "*4" in o:
                pic, width = True, 4
                continue
            if ins.mnemonic == "lea" and "rip" in o and pic:
                base = rip_target(ins)
                break
    if base is None or not width:
        return []
    n = _table_bound(insns, k)
    limit = n if n is not None else 4096
    raw = read(base, limit * width)
    if not raw:
        return []
    out: list[int] = []
    for i in range(min(limit, len(raw) // width)):
        chunk = raw[i * width : (i + 1) * width]
        v = int.from_bytes(chunk, "little", signed=pic)
        t = base + v if pic else v
        if not (start <= t < end and t in index):
            if n is None:
                break  # past the end of a table whose size we guessed
            return []  # a bounded table with a bad entry: not a table we understand
        out.append(t)
    return out


def _table_bound(insns: Sequence[Insn], k: int) -> int | None:
    """N+1 from a preceding "cmp reg, N" followed by "ja"/"jae" (unsigned bounds check)."""
    for j in range(k - 1, max(-1, k - 16), -1):
        ins = insns[j]
        if ins.mnemonic in ("ja", "jae", "jbe", "jb") and j > 0 and insns[j - 1].mnemonic == "cmp":
            parts = insns[j - 1].op_str.split(",")
            if len(parts) == 2:
                try:
                    n = int(parts[1].strip(), 0)
                except ValueError:
                    return None
                return n + 1 if ins.mnemonic in ("ja", "jbe") else n
    return None
