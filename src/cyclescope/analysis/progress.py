"""Entry counts from arguments that progress: a hot procedure's count without a trap per entry.

A procedure entered hundreds of thousands of times a second (a compressor's match finder, a
parser's scanner) cannot be counted all the time (a uprobe hit costs 6-17 us on these machines),
its anchor's windows buy a few samples on runs of seconds, and the model's count of it is off by
factors where its loads stall (docs/benchmarks.md, "calc accuracy"). But such a procedure is often
called with an argument that moves forward through the run: xz's ``hc_find_func(len_limit, pos,
cur, ...)`` gets the stream position and a pointer into the input, one more at every call made for
a new position. Two things then give its entry count:

- How far the argument moves per entry, exactly: the trip windows (analysis/trips.py) count the
  entry alone in every other window; their BPF program (collect/pointcount.py) also keeps the
  argument registers of the window's first and last counted entry, so that a window with E
  entries gives (last - first) / (E - 1). Such a window ends at an entry, so that it keeps the
  long intervals between entries as often as the short ones. Traps slow the program, not the
  argument.
- How far it moved over the whole run, without a trap: every sample carries the user registers
  (the loop counters take them), and at most instructions of the procedure some register still
  holds what an argument register held at entry (``mov ebx, esi`` in the prologue, then never
  written: a copy propagation over the CFG, ``entry_args``). Consecutive samples of one thread in
  the procedure give the argument's move between the two calls they fell in; over the run the
  moves add up to how far it went (the sum telescopes). Where it jumped back or far ahead (a new
  buffer, a reset), the move is not known: the pair's time times the argument's rate elsewhere.

A position need not be an argument: lzip's match finder reads it from ``this`` (``mov ecx, [rdi +
0x34]``), gzip's from a global. The procedure's progress point (``progress_point``) is where, before
its loops, the registers hold most of what it loaded or computed and keeps through them; each
register's value there is followed as an argument's is (NVALUES values in all), the windows of the
entry alone probe the point beside the entry (its registers at the first and last counted runs),
and the samples before the point in a call, which do not know those values, are skipped by the
pairs (each value's pairs are of the samples that know it).

Entries = total move / move per entry. That needs many windows: the move per entry is heavy-tailed
in time (HEAVY_TAIL below), and from a few windows the count runs high. Each window also gives a
local rate (loopcount.LoopCounter._local_rates): its entries per unit of the thread's time, the
argument's move rate sampled around it (no trap slows the samples outside the window) times the
window's entries per move. The entry rate varies less over the run than the move per entry, so
the mean of the local rates times the time the procedure's pairs of samples span is the count
from a few windows (_local_estimate), used before the stride's where three or more agree within
LOCAL_MAX_ERROR; at equal confidence it replaces a short entry's anchor, which runs low.

What the stride's count assumes: the windows, spread over the run at
random, see the run's mean move per entry (its phases weighted by their entries); calc says how
many windows and entries the stride rests on and how far they disagree (its relative standard
error), leaves the count out where they disagree by over MEDIUM_ERROR, and keeps it in low
confidence below TRUST_WINDOWS windows, medium unless both sides rest on many. An argument that
does not move (a struct pointer), or moves both ways (a hash, a chain link), is not used: most of
its windows or pairs go back.

Nothing but sums of moves and counts is stored (db/tallies.py PROGRESS): no value of a register.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cyclescope.analysis.cfg import ENTRY
from cyclescope.analysis.confidence import SURETY
from cyclescope.analysis.loops import _R32, CALLER_SAVED
from cyclescope.perf.abi import GPRS, STACK_BYTES, STACK_WORDS

if TYPE_CHECKING:
    import pyarrow as pa

    from cyclescope.analysis.cfg import CFG
    from cyclescope.images.disasm import Insn, InsnInfo

# The System V argument registers, in order: the ones whose entry values are followed.
ARGS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
NARGS = len(ARGS)
# Beside them, the general registers at the procedure's progress point (progress_point): value
# NARGS + c is what GPR column c held there. So a position the procedure loads from memory or
# computes (lzip's match finder reads its position from ``this``; gzip's, from a global) is followed
# as an argument is. NVALUES values in all (the PROGRESS tally's ``arg``).
NVALUES = NARGS + 16
# Where a value is held: a general register (its GPRS column, 0-15), or a word of the stack above
# the stack pointer (column 16 + w: the 8 bytes at rsp + 8w), for a value the procedure spilled
# (zstd's match finder stores its position argument at [rsp + 0x48] in its prologue and keeps
# nothing of it in a register through its loops). The samples carry the top STACK_BYTES of the user
# stack beside the registers (perf/abi.py, collect/session.py), and the loop counter reads those
# words as it reads the registers (loopcount.LoopCounter: NCOLS columns a sample).
NCOLS = 16 + STACK_WORDS
W32 = 64  # added to a holder's column where it holds only the low 32 bits (``mov ebx, esi``)
_COL = {r: i for i, r in enumerate(GPRS)}
_SLOT = 16  # the first stack word's column
# Stack words a call leaves unknown: the callee owns its stack arguments, stored there before it
_CALL_ARGS_WORDS = 8
# A stack word at or above a local whose address was taken (``lea rdi, [rsp + 0x10]``): a store
# through that pointer may change it unseen, so it holds nothing for the rest of the procedure
# (where paths meet, TAINT wins: _propagate)
TAINT = -2

# A pair whose move per unit of time exceeds this many times the median of its drain's moving pairs
# jumped (a new buffer): its move is not known, like a pair that went back. Real moves stay well
# under it: xz's position between samples of its match finder ran at up to 16-32 times the median
# rate (long matches skipped: pairs past 16 times held 4.8% of the move, none past 32), and at 16
# the rate filled in for them took the run's total down by a tenth.
JUMP = 64.0
# Pairs moving forward (and few back) before the trip windows spend windows on an argument's move
MIN_MOVING = 5
# What a stride and a total need before calc uses them, for medium and high confidence: a window of
# the entry alone (2 ms) holds several hundred entries where the kernel emulates the probed
# instruction, a few dozen where it single-steps it; a run of a second affords a few.
MIN_WINDOWS, HIGH_WINDOWS = 3, 10
MIN_STEPS, HIGH_STEPS = 100, 1000  # entries - 1, summed over the windows that counted two or more
ENOUGH_STEPS = 10_000  # past this, the trip windows count the entry alone less often (trips.STRIDE_LATER)
MIN_PAIRS, HIGH_PAIRS = 20, 200
# The stride's relative standard error (ProgressStats.stride_error) up to which it is used, and up to
# which its count can be high confidence (the total's error is far smaller: hundreds of pairs add up)
MEDIUM_ERROR, HIGH_ERROR = 0.10, 0.04
# ... and the windows it needs before that error is trusted: from three, the error of a heavy-tailed
# stride is itself a guess (xz's suite run: 3 windows, 9.7%, the count 1.30 times exact), and the
# count is low confidence
TRUST_WINDOWS = 10
FEW_WINDOWS = f"; too few windows to trust its error ({TRUST_WINDOWS} are needed)"
# Why a stride from a few windows runs low, and the count from it high: an argument's move per entry
# is heavy-tailed in time as well (xz's match finder on the suite's input, every call's position from
# a uprobe: 5.2-7.5 a call in nine tenths of the calls, 16.6 in the tenth where long matches are
# skipped, 7.2 over the run: bench/stridetime.py), so that a few windows mostly miss the stretches
# that move most. In
# nine sets of three runs of the suite's xz, the count from 3-5 windows came out at 0.99-1.62 of
# exact (1.17 median), the entry's anchor at 0.60-0.84: the two bracketed it every time.
HEAVY_TAIL = ("from a few windows such a count runs high: an argument's move per entry varies over the run, "
              "and a few windows mostly miss the stretches where it moves most")
# The local rates' relative standard error up to which their count is used (low confidence below
# TRUST_WINDOWS windows): bench/stridetime.py's simulated sets of four windows on xz's match finder
# put the count from them at 0.80-1.45 of exact (10th to 90th percentile), the stride's at 0.67-1.44
LOCAL_MAX_ERROR = 0.30
# A stride's relative standard error up to which its windows count as agreeing exactly (the same
# move per entry in each): its count is then used before the local rates', from MIN_WINDOWS
# windows, in medium confidence. The suite's xz, whose move per entry varies, had 3.4% at least
# over eleven sets of three runs (3-5 windows); lzip's match finder 0.04%.
STEADY_ERROR = 0.01
MAX_BACK = 0.10  # of the windows, and of the pairs (with their time), that went back or jumped
HIGH_BACK = 0.02


def entry_args(cfg: CFG, infos: Sequence[InsnInfo], point: int = -1,
               point_cols: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Per instruction and value (NVALUES: the argument registers' entry values, then the general
    registers' values at the progress point), the register (its column in GPRS order) that holds
    the value when the instruction is about to run, -1 where none surely does; W32 added where only
    a 32-bit copy holds it. And each value's width: 32 where a 32-bit copy is all some instruction
    has (its moves are then taken modulo 2**32 everywhere), else 64. ``point``: the progress point's
    instruction index (progress_point; -1: none), where the registers ``point_cols`` take on values
    of their own (NARGS + column) unless they hold an argument.

    A forward copy propagation: at entry each argument register holds itself; ``mov r64, r64``
    copies a holding, ``mov r32, r32`` copies its low half; any other write, and a call for the
    caller-saved registers, ends a holding; where paths meet, a register holds what it holds on
    every path. Written by hand: it is the few lines a reaching-definitions pass would need, and
    cfg.ReachingDefs answers one register at a time.

    The stack words above the stack pointer are followed too (columns 16 and up, ``_transfer``):
    an 8-byte ``mov`` of a holding register to ``[rsp + 8w]`` makes word w hold its value (a 4-byte
    one, its low half), a ``mov`` back copies it; push, pop and an immediate ``sub``/``add`` of rsp
    shift the words, any other write to rsp forgets them, any other store to them ends their
    holdings, and a call ends those of its stack arguments. Where the address of a local is taken
    (``lea rdi, [rsp + 0x10]``), the words from it up hold nothing from there on (TAINT: an array
    grows up from its address, and a store through the pointer could change them unseen); in a
    procedure that copies rsp itself (``mov rbp, rsp``: ``frame_escapes``), none do."""
    n = len(cfg.insns)
    out = np.full((n, NVALUES), -1, np.int8)
    widths = np.full(NVALUES, 64, np.int8)
    if not cfg.blocks or n == 0:
        return out, widths
    start = _start()  # per column: the value it holds (+NVALUES: its low 32 bits), or -1
    at_point = (point, tuple(point_cols))
    stack = not frame_escapes(cfg)
    state_in = _propagate(cfg, start, lambda b, st: _transfer_block(cfg, infos, b, st, None, at_point, stack))
    for b in range(len(cfg.blocks)):
        st = state_in[b]
        if st is not None:
            _transfer_block(cfg, infos, b, list(st), out, at_point, stack)
    for a in range(NVALUES):
        col = out[:, a]
        if ((col >= W32) & (col >= 0)).any():
            widths[a] = 32
    return out, widths


def _start() -> list[int]:
    """The holdings at entry: each argument register holds its own value, nothing else is known."""
    start = [-1] * NCOLS
    for a, r in enumerate(ARGS):
        start[_COL[r]] = a
    return start


_BRACKETS = re.compile(r"\[[^\]]*\]")
_IMMEDIATE = re.compile(r"^-?(0x[0-9a-f]+|\d+)$")
_SP = re.compile(r"\b[re]?sp\b")
_RSP_PLUS = re.compile(r"^\[rsp(?:\s*([+-])\s*(0x[0-9a-f]+|\d+))?\]$")  # lea's [rsp + disp] (else: any word)


def frame_escapes(cfg: CFG) -> bool:
    """Whether the procedure copies its stack pointer (``mov rbp, rsp``) or computes with it: any
    use of rsp but as a memory operand's base (``lea`` of one included: _transfer taints the words
    from it up), push, pop, call and ret, and an immediate ``sub``/``add``/``and`` of rsp itself.
    Its stack words are then not followed (entry_args)."""
    for ins in cfg.insns:
        if "sp" not in ins.op_str:
            continue
        if not _SP.search(_BRACKETS.sub("", ins.op_str)):
            continue
        ops = [o.strip() for o in ins.op_str.split(",")]
        if (ins.mnemonic in ("sub", "add", "and") and len(ops) == 2 and ops[0] == "rsp"
                and _IMMEDIATE.match(ops[1])):
            continue
        return True
    return False


def _propagate(cfg: CFG, start: list[int], transfer: Callable[[int, list[int]], list[int]]) -> list[list[int] | None]:
    """Each block's state on entry (per GPR column: what it holds, -1 unknown), forward from the
    procedure's entry with ``start``, meeting paths by keeping what they agree on."""
    unknown = -1
    entry_blocks = {e.dst for e in cfg.out_edges(ENTRY) if e.dst >= 0} or {0}
    state_in: list[list[int] | None] = [None] * len(cfg.blocks)
    for b in entry_blocks:
        state_in[b] = list(start)
    work = sorted(entry_blocks)
    while work:
        b = work.pop(0)
        st = state_in[b]
        if st is None:
            continue
        cur = transfer(b, list(st))
        for eid in cfg.blocks[b].succs:
            d = cfg.edges[eid].dst
            if d < 0:
                continue
            old = state_in[d]
            # where paths disagree, nothing is known (and a tainted word stays tainted: TAINT < -1)
            new = list(cur) if old is None else [x if x == y else min(x, y, unknown)
                                                 for x, y in zip(old, cur, strict=True)]
            if d in entry_blocks:  # entered from outside too: the entry's holdings meet the loop's
                new = [x if x == y else min(x, y, unknown) for x, y in zip(new, start, strict=True)]
            if new != old:
                state_in[d] = new
                if d not in work:
                    work.append(d)
    return state_in


def _transfer_block(cfg: CFG, infos: Sequence[InsnInfo], b: int, st: list[int], out: np.ndarray | None,
                    at_point: tuple[int, tuple[int, ...]] = (-1, ()), stack: bool = True) -> list[int]:
    blk = cfg.blocks[b]
    point, cols = at_point
    for k in range(blk.first, blk.last + 1):
        if k == point:
            for c in cols:
                if st[c] < 0 or st[c] % NVALUES >= NARGS:  # an argument's holding stays
                    st[c] = NARGS + c
        if out is not None:
            for c, h in enumerate(st):
                if h < 0:
                    continue
                a, half = h % NVALUES, h >= NVALUES
                prev = int(out[k, a])
                # a full copy is preferred to a low half
                if prev < 0 or (prev >= W32 and not half):
                    out[k, a] = c + (W32 if half else 0)
        _transfer(cfg.insns[k], infos[k] if k < len(infos) else None, st, stack=stack)
    return st


def _shift(st: list[int], words: int) -> None:
    """rsp went down by ``words`` words (up, if negative): stack word w is now word w + words; the
    words pushed are unknown, and those come into view too (tainted, where the top one was)."""
    slots = st[_SLOT:]
    if words >= 0:
        slots = [-1] * min(words, STACK_WORDS) + slots[: max(STACK_WORDS - words, 0)]
    else:
        slots = slots[-words:] + [TAINT if slots[-1] == TAINT else -1] * min(-words, STACK_WORDS)
    st[_SLOT:] = slots


def _forget(st: list[int], lo: int = 0, hi: int = STACK_WORDS) -> None:
    """Stack words [lo, hi) hold nothing now (the tainted stay tainted)."""
    for w in range(_SLOT + lo, _SLOT + hi):
        if st[w] != TAINT:
            st[w] = -1


def _half(h: int, scoring: bool) -> int:
    """The holding of a value's low 32 bits (scoring: the value whole)."""
    return h if scoring or h < 0 else (h % NVALUES) + NVALUES


def _transfer(ins: Insn, info: InsnInfo | None, st: list[int], scoring: bool = False,
              written: int | None = None, stack: bool = True) -> None:
    """One instruction's effect on the holdings ``st``. ``scoring`` (progress_point's pass): a
    32-bit copy copies the value whole, and a write other than a copy leaves ``written`` + the
    register's column there (a value of its own; None: nothing known). ``stack``: the stack words
    are followed (entry_args says how)."""
    m = ins.mnemonic
    ops = [o.strip() for o in ins.op_str.split(",")]
    mem = info.mem if info is not None and stack else None
    slot = -1  # the stack word an aligned rsp-based memory operand names
    if mem is not None and mem.base == "rsp" and not mem.index and mem.disp % 8 == 0 and 0 <= mem.disp < STACK_BYTES:
        slot = _SLOT + mem.disp // 8
    if m == "mov" and len(ops) == 2:
        d, s = ops
        if d in _COL and s in _COL:
            st[_COL[d]] = st[_COL[s]]
            return
        if d in _R32 and s in _R32:
            st[_COL[_R32[d]]] = _half(st[_COL[_R32[s]]], scoring)
            return
        if slot >= 0 and info is not None and mem is not None:
            if info.stores and mem.size == 8 and s in _COL:
                if st[slot] != TAINT:
                    st[slot] = st[_COL[s]]
                return
            if info.stores and mem.size == 4 and s in _R32:
                if st[slot] != TAINT:
                    st[slot] = _half(st[_COL[_R32[s]]], scoring)
                return
            if info.loads and mem.size == 8 and d in _COL:
                st[_COL[d]] = max(st[slot], -1)
                return
            if info.loads and mem.size == 4 and d in _R32:
                st[_COL[_R32[d]]] = _half(max(st[slot], -1), scoring)
                return
    if stack and info is not None:
        if m == "lea" and len(ops) == 2 and _SP.search(ops[1]):  # a local's address, taken
            at = _RSP_PLUS.match(ops[1])
            lo = max(int(at.group(2), 0) * (-1 if at.group(1) == "-" else 1), 0) if at and at.group(2) else 0
            for w in range(min(lo // 8, STACK_WORDS), STACK_WORDS):
                st[_SLOT + w] = TAINT
        if m == "push":
            _shift(st, 1)
            st[_SLOT] = max(st[_COL[ops[0]]], -1) if ops[0] in _COL else -1
            return
        if m == "pop" and ops[0] in _COL:
            h = st[_SLOT]
            _shift(st, -1)
            if ops[0] != "rsp":
                st[_COL[ops[0]]] = max(h, -1)
            return
        if mem is not None and info.stores and mem.base == "rsp":  # any other store to the stack words
            lo = max(mem.disp, 0)
            hi = STACK_BYTES if mem.index else min(mem.disp + max(mem.size, 1), STACK_BYTES)
            _forget(st, lo // 8, (hi + 7) // 8)
        if "rsp" in info.writes and m not in ("call", "ret"):
            n = int(ops[1], 0) if len(ops) == 2 and ops[0] == "rsp" and _IMMEDIATE.match(ops[1]) else 1
            if m in ("sub", "add") and n % 8 == 0:
                _shift(st, n // 8 if m == "sub" else -n // 8)
            elif TAINT in st[_SLOT:]:
                st[_SLOT:] = [TAINT] * STACK_WORDS  # where the tainted words went is not known
            else:
                _forget(st)
    if m == "call":
        for r in CALLER_SAVED:
            st[_COL[r]] = -1
        _forget(st, 0, _CALL_ARGS_WORDS)
    if info is not None:
        for r in info.writes:
            c = _COL.get(r)
            if c is not None and r != "rsp":
                st[c] = -1 if written is None else written + c


# progress_point's values of its own: one per instruction and written register (ids from here up)
_OWN = 64
# The values progress_point follows: those held at this share of the loop instructions where the
# most held one is, or more (a value held in a loop or two of many is rarely where the time goes)
MAIN_SHARE = 0.5


def progress_point(cfg: CFG, infos: Sequence[InsnInfo],
                   loop_addresses: Sequence[frozenset[int]]) -> tuple[int, tuple[int, ...]] | None:
    """Where to read a procedure's own values: the instruction (its index) outside the procedure's
    loops (``loop_addresses``: each loop's instruction addresses) before which the general
    registers hold the most of what the procedure loaded or computed outside its loops and keeps
    through them, weighed by the loop instructions where each is held (a position read from a
    structure or a global, a pointer into a buffer: the values whose moves count entries,
    analysis/progress.py), and the registers (GPR columns) holding those there (the values held at
    MAIN_SHARE of the loop instructions of the most held one, or more). At equal weight, an
    instruction the kernel emulates (a probe there costs a trap alone), then the earliest. None
    where the loops hold no such value.

    The same copy propagation as entry_args, each other write outside the loops a value of its own
    (not a constant: a load of an immediate or an address, or a register zeroed; nor one read off
    the stack pointer); the arguments' holdings are entry_args' already."""
    from cyclescope.images.disasm import uprobe_emulated

    n = len(cfg.insns)
    index = {ins.address: k for k, ins in enumerate(cfg.insns)}
    looped = np.zeros(n, bool)
    for addrs in loop_addresses:
        looped[[index[a] for a in addrs if a in index]] = True
    if not cfg.blocks or n == 0 or not looped.any():
        return None

    owns: dict[int, int | None] = {}  # memo: the worklist passes over blocks more than once

    def own(k: int) -> int | None:
        if k in owns:
            return owns[k]
        info = infos[k] if k < len(infos) else None
        ins = cfg.insns[k]
        ops = [o.strip() for o in ins.op_str.split(",")]
        reads = set(info.reads) - {"rip", "rflags"} if info is not None else set()
        if (looped[k] or info is None or "rsp" in reads or "rsp" in info.mem_regs or (not reads and not info.loads)
                or (ins.mnemonic in ("xor", "sub") and len(ops) == 2 and ops[0] == ops[1])):
            owns[k] = None
        else:
            owns[k] = _OWN + 16 * k
        return owns[k]

    stack = not frame_escapes(cfg)

    def step(b: int, st: list[int], seen: Callable[[int, list[int]], None] | None = None) -> list[int]:
        blk = cfg.blocks[b]
        for k in range(blk.first, blk.last + 1):
            if seen is not None:
                seen(k, st)
            _transfer(cfg.insns[k], infos[k] if k < len(infos) else None, st, True, own(k), stack)
        return st

    state_in = _propagate(cfg, _start(), lambda b, st: step(b, st))
    weight: dict[int, int] = {}
    before: dict[int, list[int]] = {}  # the holdings before each instruction outside the loops

    def seen(k: int, st: list[int]) -> None:
        if looped[k]:
            for v in {h for h in st if h >= _OWN}:
                weight[v] = weight.get(v, 0) + 1
        else:
            before[k] = list(st)

    for b in range(len(cfg.blocks)):
        if state_in[b] is not None:
            step(b, list(state_in[b]), seen)  # type: ignore[arg-type]
    if not weight:
        return None
    main = max(weight.values()) * MAIN_SHARE
    best: tuple[tuple[float, bool, int], int, tuple[int, ...]] | None = None
    for k, st in before.items():
        cols = tuple(c for c, h in enumerate(st[:_SLOT]) if h >= _OWN and weight.get(h, 0) >= main
                     and c != _COL["rsp"])
        got = sum(weight[v] for v in {st[c] for c in cols})
        if not got:
            continue
        rank = (got, uprobe_emulated(cfg.insns[k].raw), -k)
        if best is None or rank > best[0]:
            best = (rank, k, cols)
    return (best[1], best[2]) if best is not None else None


def signed_moves(delta: np.ndarray, width: int) -> np.ndarray:
    """Differences of uint64 values as signed numbers of ``width`` bits (float64)."""
    if width == 32:
        d = (delta & np.uint64(0xFFFFFFFF)).astype(np.int64)
        return np.where(d >= 1 << 31, d - (1 << 32), d).astype(np.float64)
    return delta.view(np.int64).astype(np.float64)


def tally(image: list[str], entry: list[int], arg: list[int], sums: dict[str, list[float]]) -> pa.Table:
    """A PROGRESS tally (db/tallies.py) from its keys and the sums one side measured (the loop
    counter's pairs or the trip windows'); the other side's sums are zero."""
    import pyarrow as pa

    from cyclescope.db.tallies import PROGRESS, build

    cols: dict[str, object] = {"image": image, "entry": np.array(entry, np.uint64), "arg": np.array(arg, np.uint32)}
    for name, typ in PROGRESS.sums:
        v = np.array(sums.get(name, np.zeros(len(image))), np.float64)
        cols[name] = v if pa.types.is_floating(typ) else np.rint(v).astype(np.uint64)
    return build(PROGRESS, cols)


@dataclass(frozen=True)
class ProgressStats:
    """One argument's tally (db/tallies.py PROGRESS), summed over the selection."""

    pairs: int = 0  # consecutive samples of a thread in the procedure, the argument known at both, not back
    delta: float = 0.0  # the argument's moves over them
    pair_period: float = 0.0  # their time (event units)
    back: int = 0  # pairs whose move went back or jumped
    back_period: float = 0.0
    windows: int = 0  # trip windows that counted two entries or more
    window_steps: int = 0  # entries - 1 over the windows whose move was forward
    window_delta: float = 0.0  # the move between their first and last entries
    window_back: int = 0
    # over the same windows: sums of squares of their moves and of their steps, and of the products
    # (0 in tallies older than them: the stride's error is then not known)
    window_delta_sq: float = 0.0
    window_steps_sq: float = 0.0
    window_cross: float = 0.0
    # windows of the entry alone whose entries per unit of the thread's time the samples around them
    # gave (loopcount.LoopCounter._local_rates), the sum of those rates and of their squares (0 in
    # tallies older than them)
    local_windows: int = 0
    local_rate: float = 0.0
    local_rate_sq: float = 0.0

    @property
    def stride(self) -> float | None:
        return self.window_delta / self.window_steps if self.window_steps and self.window_delta > 0 else None

    @property
    def stride_error(self) -> float | None:
        """The stride's relative standard error, from how far its windows disagree: the ratio
        estimator's, sum((d_k - R s_k)^2) / (n (n - 1) mean(s)^2), over the n windows whose move
        went forward (d_k their moves, s_k their steps, R the stride). None where not known.

        The moves between entries are heavy-tailed where an argument moves by thousands between
        two calls now and then (xz's match finder is not called while a long match is skipped): one
        window that holds such a gap moves the stride by half, and the count with it."""
        from cyclescope.analysis.confidence import ratio_error

        if self.stride is None:
            return None
        return ratio_error(self.windows - self.window_back, self.window_delta, self.window_steps,
                           self.window_delta_sq, self.window_steps_sq, self.window_cross)

    @property
    def local_entries(self) -> float | None:
        """Entries over the run from the windows' local rates: their mean entries per unit of the
        thread's time, times the time the procedure's pairs of samples span."""
        if self.local_windows <= 0 or self.local_rate <= 0:
            return None
        return (self.pair_period + self.back_period) * self.local_rate / self.local_windows

    @property
    def local_error(self) -> float | None:
        """The local rates' mean's relative standard error, from how far they spread."""
        n = self.local_windows
        if n < 2 or self.local_rate <= 0:
            return None
        mean = self.local_rate / n
        var = max(0.0, (self.local_rate_sq - n * mean * mean) / (n - 1))
        return float(np.sqrt(var / n)) / mean

    @property
    def total(self) -> float:
        """How far the argument moved over the run: the known moves, and the rate times the time
        of the pairs whose move is not known."""
        rate = self.delta / self.pair_period if self.pair_period > 0 else 0.0
        return self.delta + rate * self.back_period


@dataclass(frozen=True)
class ProgressEstimate:
    entries: float
    confidence: str  # low, medium, high
    arg: int
    why: str
    local: bool = False  # from the windows' local rates (unbiased where they are few), not the stride


def point_address(cfg: CFG, infos: Sequence[InsnInfo], loop_addresses: Sequence[frozenset[int]]) -> int | None:
    """The progress point's address (progress_point), from the loops' instruction addresses."""
    got = progress_point(cfg, infos, loop_addresses)
    return cfg.insns[got[0]].address if got is not None else None


def value_name(a: int, point: int | None = None, short: bool = False) -> str:
    """What value ``a`` of a PROGRESS tally is: an argument register's entry value, or a register's
    value at the progress point (at ``point``, its address, where known). ``short``: for a list
    (``rsi``, ``rdi at 0x9906``)."""
    if a < NARGS:
        return ARGS[a] if short else f"argument {ARGS[a]}"
    reg = GPRS[a - NARGS]
    if short:
        return f"{reg} at {point:#x}" if point else f"{reg} at the progress point"
    return f"{reg} at the progress point" + (f" {point:#x}" if point else "")


def _local_estimate(a: int, st: ProgressStats, back_p: float, point: int | None = None) -> ProgressEstimate | None:
    """The entry count from the windows' local rates (enough of them, agreeing within
    LOCAL_MAX_ERROR), or None."""
    n = st.local_entries
    err = st.local_error
    if n is None or err is None or st.local_windows < MIN_WINDOWS or err > LOCAL_MAX_ERROR:
        return None
    high = (st.local_windows >= HIGH_WINDOWS and st.pairs >= HIGH_PAIRS and back_p <= HIGH_BACK
            and err <= HIGH_ERROR)
    trusted = st.local_windows >= TRUST_WINDOWS and err <= MEDIUM_ERROR
    conf = "high" if high else "medium" if trusted else "low"
    why = (f"{value_name(a, point)}'s move rate sampled around {st.local_windows:,} trip windows of the entry alone, "
           f"over its move per entry in each: {n:,.0f} entries over the {st.pairs:,} pairs of samples' time in the "
           f"procedure (relative standard error {err:.0%})"
           + ("" if st.local_windows >= TRUST_WINDOWS else FEW_WINDOWS))
    return ProgressEstimate(n, conf, a, why, local=True)


def entries_from_progress(stats: dict[int, ProgressStats],
                          point: int | None = None) -> tuple[ProgressEstimate | None, str | None]:
    """The procedure's entry count from its best argument (the surest; at equal confidence one from
    the windows' local rates before one from the stride, then most entries in the windows, then
    pairs), or None with the reason none could be used (None when no argument was followed at
    all). Where an argument's local rates agree (_local_estimate), its stride's count is not used,
    unless its windows agree on it exactly (STEADY_ERROR).
    ``point``: the progress point's address, to name its values by."""
    best: tuple[tuple[int, int, int, int], ProgressEstimate] | None = None
    tried = []
    disagree: list[tuple[int, float, float]] = []
    for a, st in stats.items():
        s = st.stride
        allp = st.pairs + st.back
        allw = st.windows
        if s is None or st.pairs < MIN_PAIRS or allw < MIN_WINDOWS or st.window_steps < MIN_STEPS:
            tried.append(a)
            continue
        back_p = st.back / allp if allp else 1.0
        back_w = st.window_back / allw if allw else 1.0
        err = st.stride_error
        if back_p > MAX_BACK or back_w > MAX_BACK or st.delta <= 0:
            tried.append(a)
            continue
        # A move per entry the same in every window (lzip's match finder: one position a call, in
        # each of three windows) does not vary with the run's phases either: its count is surer
        # than the local rates', which a run's few windows take at a few phases (the same set:
        # the stride's count 1.01 of exact, the local rates' 0.72-0.86, at 0.57 s into each run).
        steady = err is not None and err <= STEADY_ERROR
        local = None if steady else _local_estimate(a, st, back_p, point)
        if local is not None:
            rank = (SURETY[local.confidence], 1, st.local_windows, st.pairs)
            if best is None or rank > best[0]:
                best = (rank, local)
            continue
        if err is not None and err > MEDIUM_ERROR:
            disagree.append((a, err, st.total / s))
            continue
        high = (allw >= HIGH_WINDOWS and st.window_steps >= HIGH_STEPS and st.pairs >= HIGH_PAIRS
                and back_p <= HIGH_BACK and back_w <= HIGH_BACK and err is not None and err <= HIGH_ERROR)
        trusted = err is not None and (allw >= TRUST_WINDOWS or steady)
        n = st.total / s
        why = (f"{value_name(a, point)} moved {st.total:,.0f} over the run ({st.pairs:,} pairs of samples in the "
               "procedure"
               + (f", {st.back:,} of them jumping, filled in at its rate" if st.back else "")
               + f") and {s:,.4g} per entry in {allw:,} trip windows ({st.window_steps + allw - st.window_back:,} "
               "entries counted" + (f", relative standard error {err:.0%}" if err is not None else "") + ")"
               + ("; the same in every window" if steady and allw < TRUST_WINDOWS else "" if trusted else FEW_WINDOWS))
        conf = "high" if high else "medium" if trusted else "low"
        est = ProgressEstimate(n, conf, a, why)
        rank = (SURETY[conf], int(steady), st.window_steps, st.pairs)
        if best is None or rank > best[0]:
            best = (rank, est)
    if best is not None:
        return best[1], None
    if not stats:
        return None, None
    if disagree:
        a, err, n = min(disagree, key=lambda x: x[1])
        return None, (f"entry count from moving arguments: the trip windows disagree on how far "
                      f"{value_name(a, point)} moves per entry (relative standard error {err:.0%}; "
                      f"{MEDIUM_ERROR:.0%} at most is used): more windows are needed (it would give {n:,.0f} "
                      f"entries; {HEAVY_TAIL})")
    names = ", ".join(value_name(a, point, short=True) for a in sorted(tried))
    return None, (f"entry count from moving arguments: none of {names} moved steadily forward with enough "
                  "windows and pairs")
