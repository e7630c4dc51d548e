"""Control-flow graphs of procedures, from their disassembly (DCPI 6.1.1).

Blocks end at jumps, returns and traps; calls do not end a block (the
callee returns to the next instruction the same number of times), except
calls to functions that never return. Indirect jumps through a jump table
are resolved by reading the table (GCC's and clang's PIC and absolute
forms, and the computed-goto dispatch of interpreters: a table of code
addresses whose base a register holds); an indirect jump that cannot be
resolved marks the CFG as missing edges.
Virtual ENTRY and EXIT nodes bracket the procedure; returns, tail calls and
jumps out of the procedure go to EXIT.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cyclescope.images.disasm import GPR32, Insn, InsnInfo

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
    infos: Sequence[InsnInfo] | None = None,
) -> CFG:
    """Build the CFG of the procedure [start, end).

    ``name_at`` names a call target (for noreturn functions, through the PLT);
    ``read`` reads bytes at an address of the image as the loaded program sees
    them (for jump tables: relocations applied); ``infos``, the registers each
    instruction writes, lets a table's base be found in a register (the based
    form of resolve_jump_table: the definitions of the register that reach the
    jump are found on the CFG built so far, and each table resolved adds the
    edges that may resolve the next).
    """
    insns = list(insns)
    index = {ins.address: k for k, ins in enumerate(insns)}
    leaders = {0} if insns else set()
    targets: dict[int, list[tuple[int, str]]] = {}  # insn index of a terminator -> [(target addr or EXIT, kind)]
    based: dict[int, tuple[str, int, str, int]] = {}  # unresolved jumps through [rB + rZ*8 + d]: _based_form

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
                    form = _based_form(insns, k) if infos is not None else None
                    if form is not None:
                        based[k] = form
                    outs.append((EXIT, "tail"))  # treated as leaving the procedure, unless resolved below
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

    blocks, edges, block_of = _assemble(insns, index, leaders, targets)
    while based and infos is not None:
        resolved = False
        value = _RegisterValues(insns, infos, blocks, edges, block_of)
        for k, (reg, d, idx, j) in list(based.items()):
            at = value(reg, j)
            table = (resolve_jump_table(insns, k, start, end, read, index, base=at + d, index_at=(idx, j))
                     if at is not None else [])
            if table:
                targets[k] = [(t, "table") for t in sorted(set(table))]
                leaders.update(index[t] for t in table)
                del based[k]
                resolved = True
        if not resolved:
            break
        blocks, edges, block_of = _assemble(insns, index, leaders, targets)

    notes = [f"indirect jump at {insns[k].address:#x} not resolved: the CFG is missing edges"
             for k in sorted(targets) if targets[k] == [(EXIT, "tail")] and insns[k].direct_target is None
             and insns[k].mnemonic == "jmp"]
    reach = _reachable(blocks, edges)
    unreachable = {b.id for b in blocks if b.id not in reach}
    return CFG(insns, blocks, edges, bool(notes), notes, unreachable, block_of)


def _assemble(insns: list[Insn], index: dict[int, int], leaders: set[int],
              targets: dict[int, list[tuple[int, str]]]) -> tuple[list[Block], list[Edge], list[int]]:
    """Blocks from the leaders, edges from the terminators' targets."""
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
    return blocks, edges, block_of


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
                       read: Callable[[int, int], bytes | None], index: dict[int, int],
                       base: int | None = None, index_at: tuple[str, int] | None = None) -> list[int]:
    """Targets of the indirect jump at ``insns[k]``, or [] when its table cannot be read.

    The forms on x86-64:
      PIC:      lea rX, [rip+T]; movsxd rY, dword ptr [rX + rZ*4]; add rY, rX; jmp rY
      absolute: jmp qword ptr [rZ*8 + T]
      based:    jmp qword ptr [rB + rZ*8 (+ d)] (clang), or mov rX, qword ptr [rB +
                rZ*8 (+ d)]; jmp rX (GCC), with rB = T: computed goto (`goto
                *table[op]`, Lua's and CPython's dispatch), the table's address kept
                in a register; the caller finds T (``base``, d included) from the
                definitions of rB that reach the load, and passes ``index_at`` (rZ
                and the load's index) for the mask.
    The number of entries comes from the bounds check before it (cmp rZ, N; ja)
    when found; otherwise entries are read while they land on instructions of
    the procedure (at most 4096, or 2^n after an ``and rZ, 2^n-1``).
    """
    jmp = insns[k]
    op = jmp.op_str.replace(" ", "")
    width = 8 if base is not None else 0
    pic = False
    m = _MEM_RE.search(jmp.op_str)
    if base is not None:
        pass
    elif m and jmp.op_str.startswith("qword ptr"):
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
    limit = n if n is not None else (_mask_bound(insns, *(index_at or ("", k))) or 4096)
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


_BASED_RE = re.compile(r"(r\w+)\+(r\w+)\*8(?:([+-])(0x[0-9a-f]+|\d+))?")
CALL_CLOBBERED = frozenset({"rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"})


def _based_form(insns: Sequence[Insn], k: int) -> tuple[str, int, str, int] | None:
    """(rB, d, rZ, j) of a jump through ``qword ptr [rB + rZ*8 + d]``: clang's ``jmp qword ptr
    [...]`` (j = k), or GCC's ``mov rX, qword ptr [...]; jmp rX`` (j: the load, a few instructions
    before the jump in straight-line code)."""
    jmp = insns[k]
    if jmp.mnemonic != "jmp":
        return None
    cands = [(k, jmp.op_str)] if jmp.op_str.startswith("qword ptr") else []
    if re.fullmatch(r"r\w+", jmp.op_str.strip()):
        reg = jmp.op_str.strip()
        for j in range(k - 1, max(-1, k - 5), -1):
            ins = insns[j]
            if ins.mnemonic.startswith("j") or ins.mnemonic in ("call", "ret"):
                break
            parts = [x.strip() for x in ins.op_str.split(",", 1)]
            if parts[0] == reg:
                if ins.mnemonic == "mov" and len(parts) == 2 and parts[1].startswith("qword ptr"):
                    cands.append((j, parts[1]))
                break
    for j, operand in cands:
        m = _MEM_RE.search(operand)
        mb = _BASED_RE.fullmatch(m.group("inner").replace(" ", "")) if m else None
        if mb and mb.group(1) != "rip":
            d = int(mb.group(4), 0) if mb.group(4) else 0
            return mb.group(1), (-d if mb.group(3) == "-" else d), mb.group(2), j
    return None


class ReachingDefs:
    """Reaching definitions of one register at a time: which writes of ``reg`` may reach an
    instruction along the CFG's edges (-1: the value the procedure was entered with). A call
    writes the registers the ABI lets the callee clobber. Each register's block-entry sets are
    solved once, when first asked for."""

    def __init__(self, insns: list[Insn], infos: Sequence[InsnInfo], blocks: list[Block], edges: list[Edge],
                 block_of: list[int]) -> None:
        self.insns, self.infos, self.blocks, self.edges, self.block_of = insns, infos, blocks, edges, block_of
        self._in: dict[str, list[set[int]]] = {}

    @classmethod
    def of(cls, cfg: CFG, infos: Sequence[InsnInfo]) -> ReachingDefs:
        return cls(cfg.insns, infos, cfg.blocks, cfg.edges, cfg.block_of)

    def _writes(self, j: int, reg: str) -> bool:
        ins = self.insns[j]
        return (j < len(self.infos) and reg in self.infos[j].writes) or (
            ins.mnemonic == "call" and reg in CALL_CLOBBERED)

    def defs(self, reg: str, k: int) -> set[int]:
        """Indices of the instructions whose write of ``reg`` may reach ``insns[k]`` (-1: entry)."""
        b = self.block_of[k]
        for j in range(k - 1, self.blocks[b].first - 1, -1):
            if self._writes(j, reg):
                return {j}
        if reg not in self._in:
            self._in[reg] = self._solve(reg)
        return self._in[reg][b]

    def _solve(self, reg: str) -> list[set[int]]:
        blocks, edges = self.blocks, self.edges
        last_def: list[int | None] = []
        for blk in blocks:
            w = None
            for j in range(blk.first, blk.last + 1):
                if self._writes(j, reg):
                    w = j
            last_def.append(w)
        ins_: list[set[int]] = [set() for _ in blocks]
        if blocks:
            ins_[0].add(-1)
        changed = True
        while changed:
            changed = False
            for blk in blocks:
                cur = ins_[blk.id]
                for eid in blk.preds:
                    src = edges[eid].src
                    if src < 0:
                        continue
                    ld = last_def[src]
                    out = {ld} if ld is not None else ins_[src]
                    if not out <= cur:
                        cur = cur | out
                if cur is not ins_[blk.id]:
                    ins_[blk.id] = cur
                    changed = True
        return ins_


class _RegisterValues(ReachingDefs):
    """The address a register holds at an instruction, when every definition that reaches it on
    the CFG so far is ``lea reg, [rip+T]`` with the same T, or a register copy (``mov reg, rX``)
    of such a value: compilers keep a dispatch table's address in a callee-saved register and
    shuffle it between registers around calls. Blocks reached only through edges not yet known
    contribute nothing; the value the procedure was entered with is unknown."""

    def __call__(self, reg: str, k: int) -> int | None:
        """Constant propagation over copies, on a three-level lattice per definition: no value yet
        (a copy whose sources are not known yet: copies in a cycle add nothing), one address T, or
        unknown. Definitions start as T (lea rip), unknown (any other write, the entry value) or
        no value (copies), and copies take the meet of their sources' definitions until nothing
        changes."""
        unknown = object()
        value: dict[int, object] = {}
        copies: dict[int, str] = {}  # def index -> source register
        todo = [(reg, k)]
        seen: set[tuple[str, int]] = set()
        uses: list[tuple[int, set[int]]] = []  # (copy def, the defs of its source reaching it)
        while todo:
            r, at = todo.pop()
            if (r, at) in seen:
                continue
            seen.add((r, at))
            for j in self.defs(r, at):
                if j in value or j in copies:
                    continue
                if j < 0:
                    value[j] = unknown
                    continue
                ins = self.insns[j]
                o = ins.op_str.replace(" ", "")
                dst = o.split(",")[0]
                src = o.split(",")[1] if "," in o else ""
                if ins.mnemonic == "lea" and o.startswith(dst + ",[rip") and (t := rip_target(ins)) is not None:
                    value[j] = t
                elif ins.mnemonic == "mov" and dst in _FULL64 and src in _FULL64:
                    copies[j] = src
                    todo.append((src, j))
                else:
                    value[j] = unknown
        for j, src in copies.items():
            uses.append((j, self.defs(src, j)))
        changed = True
        while changed:
            changed = False
            for j, ds in uses:
                v = _meet(value.get(j), [value.get(d) for d in ds], unknown)
                if v != value.get(j):
                    value[j] = v
                    changed = True
        v = _meet(None, [value.get(d) for d in self.defs(reg, k)], unknown)
        return v if isinstance(v, int) else None


def _meet(cur: object, values: list[object], unknown: object) -> object:
    """None (no value yet) below any address below ``unknown``."""
    out = cur
    for v in values:
        if v is None:
            continue
        if out is None:
            out = v
        elif v is unknown or out is unknown or v != out:
            return unknown
    return out


_FULL64 = frozenset(GPR32) - {"rsp"}  # registers a table's address can be copied through


def _mask_bound(insns: Sequence[Insn], idx: str, k: int) -> int | None:
    """2^n from an "and rZ, 2^n-1" on the index register ``idx`` shortly before ``insns[k]``."""
    if not idx:
        return None
    names = {idx, GPR32.get(idx, idx)}
    for j in range(k - 1, max(-1, k - 8), -1):
        parts = [x.strip() for x in insns[j].op_str.split(",")]
        if insns[j].mnemonic == "and" and len(parts) == 2 and parts[0] in names:
            try:
                mask = int(parts[1], 0)
            except ValueError:
                return None
            return mask + 1 if mask > 0 and (mask & (mask + 1)) == 0 else None
        if parts and parts[0] in names:
            return None  # the index was written after any mask we could find
    return None


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
