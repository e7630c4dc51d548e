"""Why instructions stalled: static reasons from the model, dynamic culprits
"guilty until proven innocent" (DCPI 6.3).

For each instruction with a dynamic stall (cycles per execution beyond its
static M_i), every candidate reason is kept unless it can be ruled out:

- i: I-cache miss. Not at a block head: only if the instruction begins a new
  64-byte line. At a block head: only if some frequent predecessor block ends
  in a different line (rarely executed edges are ignored).
- d / t: D-cache or DTLB miss. Only if the instruction (or one the samples
  skidded past) loads or stores, or reads a register that an earlier load in
  its block wrote (the culprit address); not a stack slot, nor an operand its
  block just accessed (_may_miss).
- p: branch mispredict. Only at the head of a block entered from a
  conditional or indirect branch (the culprit address).
- u: long-latency unit. Only if the instruction divides or takes a square
  root, or uses such a result (the divider is not pipelined).
- w: store buffer. Only if the instruction stores and its block stores often.

Where event samples exist for a candidate (cache-misses, branch-misses,
l1i-misses, dtlb-misses), they bound it: no such events near the
instruction rule it out. A stall no candidate explains is "unexplained";
a negative one (fewer samples than the model allows) is "unexplained gain".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cyclescope.analysis.cfg import CFG, Block, is_conditional
from cyclescope.analysis.schedule import ProcedureModel
from cyclescope.images.disasm import InsnInfo

LINE = 64
STEADY_TRIPS = 8.0  # iterations an execution beyond which a loop's branch is not a mispredict candidate
SKID = 3  # samples land up to this many instructions after the instruction the core waited on
RARE_EDGE = 0.05  # predecessors bringing less than this share of a block's executions are ignored

CULPRITS = {
    "i": "I-cache miss", "d": "D-cache miss", "t": "DTLB miss", "p": "branch mispredict",
    "u": "long-latency unit (divide, sqrt)", "w": "store buffer",
}
STATIC = {"dep": "dependency on an earlier result", "res": "execution resources busy", "issue": "issue width"}
EVENT_FOR = {"i": "l1i-misses", "d": "cache-misses", "t": "dtlb-misses", "p": "branch-misses"}


@dataclass
class Stall:
    codes: str  # candidate culprit letters, e.g. "dt"
    cycles: float  # dynamic stall cycles per execution
    culprit_addrs: dict[str, list[int]] = field(default_factory=dict)  # code -> instructions to blame (none: this one)


@dataclass
class StaticStall:
    cycles: float  # per execution, beyond the ideal issue
    reason: str  # dep, res, issue
    producer: int | None  # address of the instruction it waits on


def _line(a: int) -> int:
    return a // LINE


def static_stalls(cfg: CFG, model: ProcedureModel, infos: Sequence[InsnInfo], width: float = 6.0) -> list[StaticStall]:
    out: list[StaticStall] = []
    for blk in cfg.blocks:
        last_writer: dict[str, int] = {}
        bm = model.blocks[blk.id].insns
        for k in range(blk.first, blk.last + 1):
            im = bm[k - blk.first]
            info = infos[k]
            producer = None
            for r in info.reads:
                j = last_writer.get(r)
                if j is not None and (producer is None or j > producer):
                    producer = j
            extra = max(0.0, im.m - 1.0 / width)
            if im.wait_operands >= im.wait_resources and producer is not None:
                reason = "dep"
            elif im.wait_resources > 0:
                reason = "res"
            else:
                reason = "issue"
            out.append(StaticStall(extra, reason, cfg.insns[producer].address if producer is not None else None))
            for r in info.writes:
                last_writer[r] = k
    return out


def _entering_branches(cfg: CFG, blk: Block) -> list[tuple[int, int]]:
    """Conditional or indirect branches that can enter ``blk``: (address, block)."""
    out = []
    for eid in blk.preds:
        edge = cfg.edges[eid]
        if edge.src < 0:
            continue
        last = cfg.insns[cfg.blocks[edge.src].last]
        indirect = last.mnemonic in ("jmp", "call") and last.direct_target is None
        if is_conditional(last.mnemonic) or indirect:
            out.append((last.address, edge.src))
    return out


def _mispredict_sources(cfg: CFG, blk: Block, pos: int) -> list[int]:
    """Branches whose misprediction could stall the instruction ``pos`` into ``blk``."""
    return sorted(_mispredict_paths(cfg, blk, pos))


def _mispredict_paths(cfg: CFG, blk: Block, pos: int) -> dict[int, tuple[int, int]]:
    """Those branches, each with its block and the block its path enters (``blk``, or the short
    block between). (Bounding a branch skidded through by the short block between, rather than by
    its own, ruled out real mispredicts: demo's recall fell from 100% to 54%, on estimates of those
    short blocks' counts.)"""
    if pos > SKID:
        return {}
    found = {a: (b, blk.id) for a, b in _entering_branches(cfg, blk)}
    for eid in blk.preds:
        src = cfg.edges[eid].src
        if src < 0:
            continue
        pb = cfg.blocks[src]
        if pos + (pb.last - pb.first + 1) <= SKID:  # a short block the samples skidded through
            for a, b in _entering_branches(cfg, pb):
                found.setdefault(a, (b, pb.id))
    return found


def _may_miss(infos: Sequence[InsnInfo], first: int, k: int) -> bool:
    """``k``'s memory access can miss the D-cache: not a stack slot ([rsp + disp], no index: the
    spills and saved registers a procedure touches on every call, 24% of bzip2's D-cache blame on
    instructions that never missed in callgrind's simulation), and not what the block just
    accessed (_touched_before)."""
    m = infos[k].mem
    if m is not None and m.base == "rsp" and not m.index:
        return False
    return not _touched_before(infos, first, k)


def _touched_before(infos: Sequence[InsnInfo], first: int, k: int) -> bool:
    """An earlier instruction of the block accessed the same memory operand as ``k``, its registers
    unchanged since: the line is in the cache, so ``k`` cannot miss it (saxpy's store to y[i] after
    its load of y[i]: blamed for the loads' misses, with none of its own)."""
    m = infos[k].mem
    if m is None:
        return False
    regs = {r for r in (m.base, m.index) if r}
    for j in range(k - 1, first - 1, -1):
        if regs & infos[j].writes:
            return False
        mj = infos[j].mem
        if mj is not None and (mj.base, mj.index, mj.scale, mj.disp) == (m.base, m.index, m.scale, m.disp):
            return True
    return False


def _less(f: float | None, bound: float) -> bool:
    """``f`` is known to be below ``bound`` (a model's zero is no knowledge: its branch did run)."""
    return f is not None and 0 < f < bound


def _far_entry(cfg: CFG, blk: Block, fb: float, edge_freq: Sequence[float | None]) -> bool:
    """A block head some frequent predecessor reaches from another cache line (or with no predecessor)."""
    preds = [cfg.edges[e] for e in blk.preds]
    first = cfg.insns[blk.first]
    for e in preds:
        f = edge_freq[e.id]
        if e.src < 0 or (fb and f is not None and f < RARE_EDGE * fb):
            continue
        if _line(cfg.insns[cfg.blocks[e.src].last].address) != _line(first.address):
            return True
    return not preds


def dynamic_culprits(
    cfg: CFG,
    infos: Sequence[InsnInfo],
    stall_cycles: Sequence[float],
    block_freq: Sequence[float | None],
    edge_freq: Sequence[float | None],
    events: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    window: int = 16,
    steady: Mapping[int, frozenset[int]] | None = None,
) -> list[Stall | None]:
    """Candidate culprits per instruction with a positive dynamic stall (None elsewhere).

    ``steady``: loop branches known to go back far more often than out (a loop whose count was
    measured, running at least STEADY_TRIPS iterations an execution), each with its loop's blocks.
    A predictor mispredicts such a branch at most once an execution of the loop, which cannot
    explain a stall on every iteration: it is no mispredict candidate inside the loop. It stays one
    on the way out, where that once is every execution of the exit's first instructions (kernels.c's
    nested: an inner loop of 8.5 trips whose exit callgrind's predictor missed 20 million times of
    20 million, left unblamed while the rule held on both ways)."""
    out: list[Stall | None] = [None] * len(cfg.insns)
    events = events or {}
    steady = steady or {}
    for blk in cfg.blocks:
        fb = block_freq[blk.id] or 0.0
        stores_in_block = sum(1 for k in range(blk.first, blk.last + 1) if infos[k].stores)
        loads_written: dict[str, int] = {}  # register -> index of the load that wrote it
        slow_written: dict[str, int] = {}  # register -> index of a div/sqrt that wrote it
        loads_written_at: dict[int, dict[str, int]] = {}  # per instruction: the map as it stood then
        for k in range(blk.first, blk.last + 1):
            loads_written_at[k] = dict(loads_written)
            info = infos[k]
            dyn = stall_cycles[k]
            if dyn > 0:
                codes = ""
                addrs: dict[str, list[int]] = {}
                # I-cache: this instruction, or one the samples skidded past, starts a new line or
                # heads a block some frequent predecessor reaches from another line.
                suspects = range(max(blk.first, k - SKID), k + 1)
                if any(_line(cfg.insns[j].address) != _line(cfg.insns[j - 1].address) for j in suspects
                       if j > blk.first) or (k - blk.first <= SKID and _far_entry(cfg, blk, fb, edge_freq)):
                    codes += "i"
                # D-cache / DTLB. Samples land up to SKID instructions after what the core waited
                # on (skid.py), so the waiting instruction may be one of the few before this one.
                producers = sorted({loads_written_at[j][r] for j in suspects for r in infos[j].reads
                                    if r in loads_written_at[j]})
                producers = [j for j in producers if k - j <= window and _may_miss(infos, blk.first, j)]
                # A store that misses holds its store-buffer entry until the line comes (a read for
                # ownership); when they are all held, the next store waits to issue: the stall
                # lands just past the stores that missed (bzip2's radix scatter in mainSort: 4.3
                # million write misses in 4.7 million stores, unblamed while only loads counted).
                # Not the stack's pushes and calls.
                direct = [j for j in suspects
                          if (infos[j].loads or infos[j].stores) and _may_miss(infos, blk.first, j)
                          and not cfg.insns[j].mnemonic.startswith(("pop", "ret", "push", "call"))]
                if direct or producers:
                    codes += "dt"
                    # The instruction itself among them where it accesses memory: listed only when
                    # others are, it was left out beside an earlier load that fed it (bzip2's
                    # scatter store, blamed on the load of its index alone).
                    own = k in direct
                    others = sorted({cfg.insns[j].address for j in producers + direct if j != k})
                    addrs["d"] = sorted([*others, cfg.insns[k].address]) if others and own else others
                # Branch mispredict: the refetch after a mispredicted branch shows up on the first
                # instructions of the path taken, up to SKID past it, even across a short block.
                # A branch that runs far less often than this instruction could mispredict on a few of
                # its executions at most: not the cause of a stall on each of them.
                paths = _mispredict_paths(cfg, blk, k - blk.first)
                brs = sorted(a for a, (via, into) in paths.items() if into not in steady.get(a, ())
                             and not (fb > 0 and _less(block_freq[via], fb / STEADY_TRIPS)))
                if brs:
                    codes += "p"
                    addrs["p"] = brs
                # Long-latency units
                slow = [slow_written[r] for r in info.reads if r in slow_written and k - slow_written[r] <= window]
                slow += [j for j in suspects if j != k and infos[j].kind in ("div", "sqrt")]
                if info.kind in ("div", "sqrt") or slow:
                    codes += "u"
                    if slow:
                        addrs["u"] = sorted({cfg.insns[j].address for j in slow})
                # Store buffer
                if any(infos[j].stores for j in suspects) and stores_in_block >= 3:
                    codes += "w"
                # Event samples bound candidates: none nearby rules a candidate out.
                for code, ev in EVENT_FOR.items():
                    if code in codes and ev in events:
                        lo, hi = max(blk.first, k - 3), min(blk.last, k + 1)
                        if sum(events[ev][lo : hi + 1]) == 0 and sum(events[ev]) > 0:
                            codes = codes.replace(code, "")
                            addrs.pop(code, None)
                out[k] = Stall(codes, dyn, addrs)
            if info.loads:
                for r in info.writes:
                    if r not in ("rsp", "flags", "rip"):
                        loads_written[r] = k
            else:
                for r in info.writes:
                    loads_written.pop(r, None)
            if info.kind in ("div", "sqrt"):
                for r in info.writes:
                    if r != "flags":
                        slow_written[r] = k
            else:
                for r in info.writes:
                    slow_written.pop(r, None)
    return out
