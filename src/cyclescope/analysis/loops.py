"""Natural loops of a procedure and the registers that count their iterations.

A loop counter is a register that changes by the same constant on every trip around the loop
(``add rdx, 1``, ``sub r12d, 1``, ``lea rsi, [rsi + 8]``) and by nothing else. Where a loop has
one, two samples of the same thread taken in the same execution of the loop give the number of
iterations between them exactly: the difference of the counter's values, each taken back to the
header by the offset the path from the header to the sampled instruction added, divided by the
step. That is an execution count without a cycle model (collect/loopcount.py measures it; calc
uses it): the count DCPI derived from issue points on an in-order Alpha, which an out-of-order core
hides in the shadow of its stalls.

Registers at a sample are those before the sampled instruction runs, so each instruction gets
the counter's offset *before* it: 0 at the header's first instruction by definition.

Registers that the loop never writes (its invariants: a bound, a base pointer, the stack pointer)
tell one execution of the loop from another: two samples whose invariants differ were taken in
different executions. Calls clobber the System V caller-saved registers and keep the others.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from cyclescope.analysis.cfg import CFG, ENTRY
from cyclescope.images.disasm import Insn, InsnInfo
from cyclescope.perf.abi import GPRS

CALLER_SAVED = frozenset({"rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"})

_R32 = {**{f"e{x}": f"r{x}" for x in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp")},
        **{f"r{n}d": f"r{n}" for n in range(8, 16)}}
_R64 = {r: r for r in GPRS}
_IMM = r"(0x[0-9a-f]+|\d+)"
_LEA = re.compile(r"^(?:qword ptr |dword ptr )?\[(?P<base>[a-z0-9]+)(?:\s*(?P<sign>[+-])\s*" + _IMM + r")?\]$")


@dataclass(frozen=True)
class Term:
    """A value known at every instruction of a loop: ``reg`` (a register the loop never writes, or
    None for a constant) plus ``add``. A limit says how the loop leaves at it: on reaching it
    exactly (``eq``) or on reaching or passing it in the direction of the step (``cross``)."""

    reg: str | None
    add: int
    how: str = "eq"


@dataclass(frozen=True)
class Counter:
    """A register that counts a loop's iterations: ``step`` per trip, its value before each
    instruction of the body being the value at the header plus ``offsets[address]``.

    ``init``, where known, is its value at the header on entering the loop; ``limit``, where the
    loop has a single exit and that exit tests the counter for equality with a term, is the value
    at the header at which the loop leaves: with both, every sample in the loop knows how many
    times the header runs in its execution, (limit - init) / step + 1, from registers alone."""

    reg: str
    width: int  # 64, or 32 where the register is updated through its 32-bit half (compare modulo 2^32)
    step: int
    offsets: dict[int, int]
    init: Term | None = None
    limit: Term | None = None


@dataclass
class Loop:
    id: int
    header: int  # address of the header's first instruction
    blocks: frozenset[int]
    addresses: frozenset[int]  # every instruction address in the body (inner loops included)
    counters: list[Counter]
    invariants: tuple[str, ...]  # registers no instruction of the body writes
    calls: bool  # the body calls other code (whose time a sample there does not show)
    parent: int | None = None
    depth: int = 1
    exits: list[int] = field(default_factory=list)  # edge ids leaving the body


def dominators(cfg: CFG) -> dict[int, int]:
    """Immediate dominator of each block reachable from the entry (ENTRY for the blocks the
    procedure's entry leads to). Cooper, Harvey and Kennedy's iterative algorithm over a reverse
    postorder: a few lines instead of networkx, whose import alone cost the collector's worker
    0.1 s at every start."""
    succ: dict[int, list[int]] = {ENTRY: []}
    for e in cfg.edges:
        if e.dst >= 0:
            succ.setdefault(e.src, []).append(e.dst)
    order: list[int] = []  # postorder, iteratively
    seen = {ENTRY}
    stack: list[tuple[int, int]] = [(ENTRY, 0)]
    while stack:
        node, i = stack.pop()
        kids = succ.get(node, [])
        if i < len(kids):
            stack.append((node, i + 1))
            k = kids[i]
            if k not in seen:
                seen.add(k)
                stack.append((k, 0))
        else:
            order.append(node)
    rpo = order[::-1]
    index = {n: i for i, n in enumerate(rpo)}
    preds: dict[int, list[int]] = {n: [] for n in rpo}
    for n in rpo:
        for k in succ.get(n, []):
            preds[k].append(n)
    idom: dict[int, int] = {ENTRY: ENTRY}

    def meet(a: int, b: int) -> int:
        while a != b:
            while index[a] > index[b]:
                a = idom[a]
            while index[b] > index[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for n in rpo[1:]:
            new: int | None = None
            for p in preds[n]:
                if p in idom:
                    new = p if new is None else meet(p, new)
            if new is not None and idom.get(n) != new:
                idom[n] = new
                changed = True
    return {b: d for b, d in idom.items() if b >= 0}


def _dominates(idom: dict[int, int], a: int, b: int) -> bool:
    while True:
        if b == a:
            return True
        d = idom.get(b)
        if d is None or d == b or d < 0:
            return False
        b = d


def find_loops(cfg: CFG, infos: Sequence[InsnInfo]) -> list[Loop]:
    """The natural loops of ``cfg`` (back edges to a dominating header; irreducible cycles are
    left out), outermost first, each with its counters and invariants."""
    idom = dominators(cfg)
    bodies: dict[int, set[int]] = {}
    for e in cfg.edges:
        if e.src < 0 or e.dst < 0 or e.src not in idom or e.dst not in idom:
            continue
        if _dominates(idom, e.dst, e.src):
            body = bodies.setdefault(e.dst, {e.dst})
            stack = [e.src]
            while stack:
                b = stack.pop()
                if b in body:
                    continue
                body.add(b)
                stack.extend(cfg.edges[p].src for p in cfg.blocks[b].preds if cfg.edges[p].src >= 0)
    order = sorted(bodies, key=lambda h: -len(bodies[h]))
    loops: list[Loop] = []
    for h in order:
        members = frozenset(bodies[h])
        addrs = frozenset(cfg.insns[k].address for b in members
                          for k in range(cfg.blocks[b].first, cfg.blocks[b].last + 1))
        written, calls = _written(cfg, members, infos)
        inv = tuple(r for r in GPRS if r not in written)
        exits = [eid for b in members for eid in cfg.blocks[b].succs if cfg.edges[eid].dst not in members]
        loop = Loop(len(loops), cfg.blocks[h].start, members, addrs, [], inv, calls, exits=exits)
        for outer in reversed(loops):
            if members <= outer.blocks and outer.blocks != members:
                loop.parent, loop.depth = outer.id, outer.depth + 1
                break
        stepped = _stepped(cfg, members)
        loop.counters = [c for r in GPRS if r in stepped and r != "rsp"
                         for c in [_counter(cfg, h, members, infos, r)] if c is not None]
        loop.counters = [_with_trip(cfg, loop, c, infos) for c in loop.counters]
        loops.append(loop)
    return loops


def _operand(text: str, invariants: tuple[str, ...]) -> tuple[str, Term | None] | None:
    """A compare's operand: ("reg", its 64-bit name) for a register, ("term", Term) for an
    immediate; None for anything else (memory)."""
    t = text.strip()
    reg = _R64.get(t) or _R32.get(t)
    if reg:
        return ("reg", Term(reg, 0) if reg in invariants else None)
    try:
        return ("term", Term(None, int(t, 0)))
    except ValueError:
        return None


def _with_trip(cfg: CFG, loop: Loop, c: Counter, infos: Sequence[InsnInfo]) -> Counter:
    """``c`` with its init and limit where they can be read off the code (Counter's doc)."""
    from dataclasses import replace

    return replace(c, init=_init(cfg, loop, c, infos), limit=_limit(cfg, loop, c, infos))


def _init(cfg: CFG, loop: Loop, c: Counter, infos: Sequence[InsnInfo]) -> Term | None:
    """The counter's value on entering the loop: every edge into the header from outside comes
    from a block that sets it from a constant (``xor r, r``, ``mov r, imm``) or from a register
    the loop never writes (``mov r, R``, ``lea r, [R + imm]``), possibly moved by constants after."""
    header = next(b for b in loop.blocks if cfg.blocks[b].start == loop.header)
    found: set[Term | None] = set()
    for eid in cfg.blocks[header].preds:
        src = cfg.edges[eid].src
        if src < 0 or src in loop.blocks:
            continue
        found.add(_init_in(cfg, src, c, loop.invariants, infos))
        if len(found) > 1:
            return None
    return found.pop() if len(found) == 1 else None


def _init_in(cfg: CFG, b: int, c: Counter, invariants: tuple[str, ...], infos: Sequence[InsnInfo]) -> Term | None:
    blk = cfg.blocks[b]
    extra = 0
    for k in range(blk.last, blk.first - 1, -1):
        ins = cfg.insns[k]
        ops = [o.strip() for o in ins.op_str.split(",")]
        dest = ops[0] if ops else ""
        if ins.mnemonic == "call":
            if c.reg in CALLER_SAVED:
                return None
            continue
        if c.reg not in infos[k].writes:
            continue
        if (_R64.get(dest) or _R32.get(dest)) != c.reg:
            return None  # written some other way (a partial register, xchg, an implicit operand)
        m = ins.mnemonic
        if m in ("add", "sub", "inc", "dec", "lea") and len(ops) <= 2:
            st = _step_text(m, ops, c.reg)
            if st is not None:
                extra += st
                continue
            if m == "lea":
                mm = _LEA.match(ops[1])
                if mm is None:
                    return None
                base = _R64.get(mm.group("base")) or _R32.get(mm.group("base"))
                v = int(mm.group(3), 0) if mm.group(3) else 0
                v = -v if mm.group("sign") == "-" else v
                if base is None or base not in invariants or _written_after(cfg, b, k, base, infos):
                    return None
                return Term(base, v + extra)
            return None
        if m == "xor" and len(ops) == 2 and ops[0] == ops[1]:
            return Term(None, extra)
        if m == "mov" and len(ops) == 2:
            src = ops[1]
            r = _R64.get(src) or _R32.get(src)
            if r is not None:
                if r not in invariants or _written_after(cfg, b, k, r, infos):
                    return None
                return Term(r, extra)
            try:
                return Term(None, int(src, 0) + extra)
            except ValueError:
                return None
        return None
    return None


def _step_text(m: str, ops: list[str], reg: str) -> int | None:
    """The constant an add/sub/inc/dec/lea-of-itself moves ``reg`` by, from the text alone."""
    if m in ("inc", "dec") and len(ops) == 1:
        return 1 if m == "inc" else -1
    if m in ("add", "sub") and len(ops) == 2:
        try:
            v = int(ops[1], 0)
        except ValueError:
            return None
        return v if m == "add" else -v
    if m == "lea" and len(ops) == 2:
        mm = _LEA.match(ops[1])
        if mm is None:
            return None
        base = _R64.get(mm.group("base")) or _R32.get(mm.group("base"))
        if base != reg:
            return None
        v = int(mm.group(3), 0) if mm.group(3) else 0
        return -v if mm.group("sign") == "-" else v
    return None


def _written_after(cfg: CFG, b: int, k: int, reg: str, infos: Sequence[InsnInfo]) -> bool:
    """Is ``reg`` written after instruction ``k`` in block ``b`` (a call clobbering it counts)?"""
    blk = cfg.blocks[b]
    for j in range(k + 1, blk.last + 1):
        if cfg.insns[j].mnemonic == "call":
            if reg in CALLER_SAVED:
                return True
            continue
        if reg in infos[j].writes:
            return True
    return False


_FLAG_SETTERS = ("cmp", "sub", "add", "inc", "dec", "test", "and", "or", "xor")


# The condition a jcc tests after `cmp A, B`, as (relation of A to B, signed): "eq", "ne", "ge"...
_JCC = {"je": ("eq", False), "jne": ("ne", False), "jae": ("ge", False), "jb": ("lt", False),
        "ja": ("gt", False), "jbe": ("le", False), "jge": ("ge", True), "jl": ("lt", True),
        "jg": ("gt", True), "jle": ("le", True)}
_NOT = {"eq": "ne", "ne": "eq", "ge": "lt", "lt": "ge", "gt": "le", "le": "gt"}
_SWAP = {"eq": "eq", "ne": "ne", "ge": "le", "le": "ge", "gt": "lt", "lt": "gt"}


def _limit(cfg: CFG, loop: Loop, c: Counter, infos: Sequence[InsnInfo]) -> Term | None:
    """Where a single-exit loop leaves: its exit branch tests flags that a ``cmp`` of the counter
    with a term set (or a constant step of the counter, tested against zero). The result is the
    counter's value at the header when the loop leaves, for an equality test (``eq``), or the value
    it must reach going in the direction of its step (``cross``): then the header runs
    ceil((limit - init) / step) + 1 times an execution."""
    if len(loop.exits) != 1:
        return None
    e = cfg.edges[loop.exits[0]]
    if e.src < 0:
        return None
    blk = cfg.blocks[e.src]
    jmp = cfg.insns[blk.last]
    test = _JCC.get(jmp.mnemonic)
    if test is None:
        return None
    rel = test[0] if e.kind == "taken" else _NOT[test[0]]  # the relation that takes the exit
    for k in range(blk.last - 1, blk.first - 1, -1):
        ins = cfg.insns[k]
        if "flags" not in infos[k].writes:
            continue
        m = ins.mnemonic
        ops = [o.strip() for o in ins.op_str.split(",")]
        if m == "cmp" and len(ops) == 2:
            a, b = _operand(ops[0], loop.invariants), _operand(ops[1], loop.invariants)
            if a is None or b is None:
                return None
            k_cmp = c.offsets.get(ins.address)
            if k_cmp is None:
                return None
            if a == ("reg", None) and (_R64.get(ops[0]) or _R32.get(ops[0])) == c.reg and b[1] is not None:
                term, r = b[1], rel
            elif b == ("reg", None) and (_R64.get(ops[1]) or _R32.get(ops[1])) == c.reg and a[1] is not None:
                term, r = a[1], _SWAP[rel]
            else:
                return None
            limit = term.add - k_cmp
            # Exit on the counter's reaching the term (equality), or on its crossing it in the
            # direction it moves; other tests (leaving on an inequality) say nothing of the trip.
            if r == "eq":
                return Term(term.reg, limit, "eq")
            if c.step > 0 and r in ("ge", "gt"):
                return Term(term.reg, limit + (1 if r == "gt" else 0), "cross")
            if c.step < 0 and r in ("le", "lt"):
                return Term(term.reg, limit - (1 if r == "lt" else 0), "cross")
            return None
        st = _step_text(m, ops, c.reg) if m in ("add", "sub", "inc", "dec") else None
        dest = ops[0] if ops else ""
        if st is not None and (_R64.get(dest) or _R32.get(dest)) == c.reg and rel == "eq":
            k_at = c.offsets.get(ins.address)
            if k_at is None:
                return None
            return Term(None, -(k_at + st), "eq")  # flags of the new value, tested against zero
        return None
    return None


def _stepped(cfg: CFG, body: frozenset[int]) -> set[str]:
    """Registers some instruction of the body moves by a constant (the candidates for a counter)."""
    out: set[str] = set()
    for b in body:
        blk = cfg.blocks[b]
        for k in range(blk.first, blk.last + 1):
            ins = cfg.insns[k]
            if ins.mnemonic in ("add", "sub", "inc", "dec", "lea"):
                dest = ins.op_str.split(",")[0].strip()
                reg = _R64.get(dest) or _R32.get(dest)
                if reg:
                    out.add(reg)
    return out


def _written(cfg: CFG, body: frozenset[int], infos: Sequence[InsnInfo]) -> tuple[set[str], bool]:
    written: set[str] = set()
    calls = False
    for b in body:
        blk = cfg.blocks[b]
        for k in range(blk.first, blk.last + 1):
            ins, info = cfg.insns[k], infos[k]
            if ins.mnemonic == "call":
                calls = True
                written |= CALLER_SAVED  # the callee's; rsp comes back as it was
                continue
            written |= {r for r in info.writes if r in _R64}
    return written, calls


def _step(ins: Insn, info: InsnInfo, reg: str) -> tuple[int | None, int] | None:
    """How ``ins`` changes ``reg``: None if it does not write it; (delta, width) for a constant
    change; (None, 0) for anything else."""
    if ins.mnemonic == "call":
        return (None, 0) if reg in CALLER_SAVED else None
    if reg not in info.writes:
        return None
    m = ins.mnemonic
    ops = [o.strip() for o in ins.op_str.split(",")]
    dest = ops[0] if ops else ""
    width = 64 if _R64.get(dest) == reg else 32 if _R32.get(dest) == reg else 0
    if not width:
        return (None, 0)
    if m in ("inc", "dec") and len(ops) == 1:
        return (1 if m == "inc" else -1, width)
    if m in ("add", "sub") and len(ops) == 2:
        try:
            v = int(ops[1], 0)
        except ValueError:
            return (None, 0)
        return (v if m == "add" else -v, width)
    if m == "lea" and len(ops) == 2:
        mm = _LEA.match(ops[1])
        if mm is None:
            return (None, 0)
        base = _R64.get(mm.group("base")) or _R32.get(mm.group("base"))
        if base != reg:
            return (None, 0)
        v = int(mm.group(3), 0) if mm.group(3) else 0
        return (v if mm.group("sign") != "-" else -v, width)
    return (None, 0)


_BOTTOM = object()


def _counter(cfg: CFG, header: int, body: frozenset[int], infos: Sequence[InsnInfo], reg: str) -> Counter | None:
    """``reg`` as a counter of the loop at ``header``, or None. Forward dataflow over the body:
    each point holds the register's offset from its value at the header, unknown, or not yet seen."""
    at_in: dict[int, object] = {header: 0}
    offsets: dict[int, int] = {}
    width = 64
    back: list[object] = []
    work = [header]
    visits = 0
    while work:
        visits += 1
        if visits > 50 * len(body) + 100:
            return None  # a lattice of height 3 settles long before; a safety net
        b = work.pop()
        blk = cfg.blocks[b]
        k_off = at_in[b]
        for k in range(blk.first, blk.last + 1):
            ins = cfg.insns[k]
            if isinstance(k_off, int):
                offsets[ins.address] = k_off
            else:
                offsets.pop(ins.address, None)
            st = _step(ins, infos[k], reg)
            if st is None:
                continue
            delta, w = st
            if delta is None or not isinstance(k_off, int):
                k_off = _BOTTOM
            else:
                k_off += delta
                width = min(width, w)
        for eid in blk.succs:
            d = cfg.edges[eid].dst
            if d == header:
                back.append(k_off)
                continue
            if d < 0 or d not in body:
                continue
            old = at_in.get(d)
            new = k_off if old is None or old == k_off else _BOTTOM
            if old is None or (new is _BOTTOM and old is not _BOTTOM):
                at_in[d] = new
                work.append(d)
    if not back or any(not isinstance(x, int) for x in back):
        return None
    steps = set(back)
    if len(steps) != 1:
        return None
    step = steps.pop()
    assert isinstance(step, int)
    if step == 0:
        return None
    # Offsets from a pass that later met an unknown value were dropped above when the block was
    # revisited; blocks never reached keep none.
    return Counter(reg, width, step, offsets)
