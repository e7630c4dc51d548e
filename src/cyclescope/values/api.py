"""The customization-module API (the value-sampling paper's section 2.3).

A module decides three things:

- ``plan(insn)``: what to capture at the sampling interrupt for an instruction, as
  :class:`Capture` specifications. Plans are computed once per instruction and
  evaluated in bulk over all samples of that instruction, so a capture costs no
  Python per sample.
- ``transform(steps)``: turn a tuple sequence (the sampled instruction and the next
  ones, from the interpreter or from exact single-stepping) into (PC, kind, value)
  emissions. Arbitrary logic is allowed here; it runs once per interpreted sample.
  A module may instead (or also) define ``emit_batch(batch)``: the same over a
  :class:`StepBatch`, every sequence of a drain at once as numpy columns; the
  collector then calls only that. The built-in modules do (:class:`BatchModule`
  derives their ``transform`` from it): Python per step and per value cost more
  than the interpretation itself (measured: 58 us per 4-step sequence for the six
  built-ins through ``transform``, against about 6 us for the interpretation).
- ``format(kind, value, ctx)``: how a value of one of its kinds reads in a report,
  or None to leave it to others.

A module whose captures depend on the image as well as the instruction (the goal module: the
candidates of one binary) defines ``plan_in(image_key, insn)``, which the collector then calls
instead of ``plan``. One whose captures depend only on where the instruction is (registers and
addresses formed from them, no memory operand of the instruction, no call context) may define
``plan_at(image_key, address)`` too: when every module has it, the collector decodes nothing, so a
recording with a goal plan alone neither loads the disassembler nor reads the binaries' code.

Modules are found through the ``cyclescope.values`` entry-point group (the
built-in ones are registered there by cyclescope's own package metadata), or
given as ``package.module:Class`` on the command line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np

from cyclescope.images.disasm import MemOperand
from cyclescope.values.insn import REG_VIEWS, ROW_COL, ROW_REGS, InsnDetail, RegView

MASK64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class Capture:
    """One value to take at the interrupt, for one instruction.

    source:
      "reg"   the register ``reg`` (a RegView) as the instruction at PC reads it;
      "prev"  the register ``reg`` as the instruction before PC wrote it (its result),
              recorded at that instruction's address; only when PC is not a branch target;
      "addr"  the effective address of the memory operand of the instruction at PC;
      "ctx"   the call context: the return address into the caller, recorded at the
              procedure's entry;
      "stack" the 8-byte word at [rsp + ``offset``] in the stack snapshot;
      "diff"  ``reg`` minus ``reg2`` as the instruction at PC reads them, in ``reg``'s width
              (the expression a ``cmp reg, reg2`` tests: goal-directed profiling's differences);
      "addrdiff" the address ``mems[0]`` minus the address ``mems[1]``, both formed from the
              registers at PC (two memory accesses' addresses: load avoidance).
    with_ctx: record (value, call site) pairs instead of the value alone (kind gets "@ctx").
    """

    kind: str
    source: str
    reg: RegView | None = None
    offset: int = 0
    with_ctx: bool = False
    reg2: RegView | None = None
    mems: tuple[MemOperand, MemOperand] | None = None


class Value(NamedTuple):
    """A hotlist value: ``v0`` with an optional second component ``v1``; ``image`` >= 0 when v0
    (or, for call-site pairs, v1) is an offset in that image rather than a raw number.
    (NamedTuples, not dataclasses: thousands are made per second.)"""

    v0: int
    v1: int = 0
    image: int = -1


class Emit(NamedTuple):
    """A (PC, value) pair from ``transform``: ``pc`` is an absolute address."""

    pc: int
    kind: str
    value: Value


@dataclass
class Step:
    """One instruction of a tuple sequence: what it read, addressed, loaded and produced."""

    pc: int  # absolute address
    insn: InsnDetail
    regs_in: dict[str, int]  # 64-bit register values before it ran (general-purpose; xmm when known)
    ea: int | None = None  # effective address of its memory operand
    loaded: int | None = None  # the value it read from memory (mem.size bytes)
    stored: int | None = None  # the value it wrote to memory
    results: dict[str, int] = field(default_factory=dict)  # registers it wrote, as written (sized names)
    next_pc: int | None = None  # where control went next (None: the sequence stopped here)
    sampled: bool = False  # the instruction the interrupt hit (step 0)
    context: Value | None = None  # the sample's call site (v0: offset in image ``image``), when known


class Kinds(NamedTuple):
    """Kind names by code, for ``BatchEmit.kind``: the i-th value's kind is ``names[codes[i]]`` (no
    string per value: a drain emits thousands)."""

    names: Sequence[str]
    codes: np.ndarray


def kind_names(kind: str | np.ndarray | Kinds, n: int) -> list[str]:
    """A BatchEmit's kinds, one name per value."""
    if isinstance(kind, str):
        return [kind] * n
    if isinstance(kind, Kinds):
        return [kind.names[c] for c in np.asarray(kind.codes).tolist()]
    return [str(k) for k in kind]


class BatchEmit(NamedTuple):
    """What ``emit_batch`` yields: one value per listed row of the batch (its PC is ``batch.pc[rows]``).
    ``kind``: one name for all, an array of names aligned with ``rows``, or Kinds (codes aligned
    with ``rows``); ``v1`` and ``image``:
    arrays aligned with ``rows``, or one number for all."""

    kind: str | np.ndarray | Kinds
    rows: np.ndarray
    v0: np.ndarray
    v1: np.ndarray | int = 0
    image: np.ndarray | int = -1


T = TypeVar("T")
_U64 = np.uint64


def _column(values: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 values with 0 for None, present mask)."""
    return np.array([v or 0 for v in values], _U64), np.array([v is not None for v in values], bool)


@dataclass
class StepBatch:
    """Many tuple sequences as columns, one row per step; each sequence's rows are contiguous and in
    order. Registers are ROW_REGS rows; ``in_known``/``out_known`` (None: all known) say which of
    them a step's input and output rows hold (sequences built from Steps may lack some)."""

    run: np.ndarray  # int64: which sequence
    sampled: np.ndarray  # bool: the instruction the interrupt hit
    pc: np.ndarray  # uint64 absolute address
    group: np.ndarray  # int64: index into insns
    insns: list[InsnDetail]
    regs_in: np.ndarray  # (n, len(ROW_REGS)) uint64
    regs_out: np.ndarray
    in_known: np.ndarray | None
    out_known: np.ndarray | None
    ea: np.ndarray
    has_ea: np.ndarray
    loaded: np.ndarray
    has_loaded: np.ndarray
    stored: np.ndarray
    has_stored: np.ndarray
    next_pc: np.ndarray
    has_next: np.ndarray
    ctx_v0: np.ndarray  # uint64: the sequence's call site (an offset in image ctx_img)
    ctx_img: np.ndarray  # int64: -1 when unknown
    vres: list[dict[str, int] | None]

    def __len__(self) -> int:
        return len(self.run)

    @classmethod
    def from_steps(cls, seqs: Sequence[Sequence[Step]]) -> StepBatch:
        """From Step lists (exact mode, tests); a step's output row is its input row with its results
        written over it."""
        steps = [(r, s) for r, seq in enumerate(seqs) for s in seq]
        n = len(steps)
        if not n:
            return cls.empty()
        w = len(ROW_REGS)
        rin = np.zeros((n, w), _U64)
        kin = np.zeros((n, w), bool)
        for j, (_, s) in enumerate(steps):
            for name, v in s.regs_in.items():
                c = ROW_COL.get(name)
                if c is not None:
                    rin[j, c] = v & MASK64
                    kin[j, c] = True
        rout = rin.copy()
        kout = np.zeros((n, w), bool)
        vres: list[dict[str, int] | None] = []
        for j, (_, s) in enumerate(steps):
            vec = {}
            for name, v in s.results.items():
                view = REG_VIEWS.get(name)
                if view is None:
                    vec[name] = v
                    continue
                c = ROW_COL[view.full]
                keep = int(rout[j, c]) & ~(view.mask << view.shift) & MASK64
                rout[j, c] = keep | ((v & view.mask) << view.shift)
                kout[j, c] = True
            vres.append(vec or None)
        insns, group = _groups([s.insn for _, s in steps])
        e, he = _column([s.ea for _, s in steps])
        ld, lists = _column([s.loaded for _, s in steps])
        st, hs = _column([s.stored for _, s in steps])
        nx, hn = _column([s.next_pc for _, s in steps])
        cv0, cimg = _contexts([s.context for _, s in steps])
        return cls(np.array([r for r, _ in steps], np.int64), np.array([s.sampled for _, s in steps], bool),
                   np.array([s.pc for _, s in steps], _U64), group, insns, rin, rout, kin, kout,
                   e, he, ld, lists, st, hs, nx, hn, cv0, cimg, vres)

    @classmethod
    def empty(cls) -> StepBatch:
        z = np.zeros(0, _U64)
        b = np.zeros(0, bool)
        r = np.zeros((0, len(ROW_REGS)), _U64)
        return cls(np.zeros(0, np.int64), b, z, np.zeros(0, np.int64), [], r, r, None, None, z, b, z, b, z, b,
                   z, b, z, np.zeros(0, np.int64), [])

    def to_steps(self) -> list[tuple[int, list[Step]]]:
        """Back to Step lists, (run, steps) per run: for modules that only define ``transform``."""
        out: list[tuple[int, list[Step]]] = []
        rin, rout = self.regs_in.tolist(), self.regs_out.tolist()
        for j in range(len(self)):
            insn = self.insns[int(self.group[j])]
            kin = self.in_known[j] if self.in_known is not None else None
            kout = self.out_known[j] if self.out_known is not None else None
            regs = {name: v for c, (name, v) in enumerate(zip(ROW_REGS, rin[j], strict=True))
                    if kin is None or kin[c]}
            results = {wr.name: wr.extract(rout[j][ROW_COL[wr.full]]) for wr in insn.writes
                       if kout is None or kout[ROW_COL[wr.full]]}
            vec = self.vres[j]
            if vec:
                results.update(vec)
            ctx = Value(int(self.ctx_v0[j]), 0, int(self.ctx_img[j])) if self.ctx_img[j] >= 0 else None
            step = Step(int(self.pc[j]), insn, regs,
                        int(self.ea[j]) if self.has_ea[j] else None,
                        int(self.loaded[j]) if self.has_loaded[j] else None,
                        int(self.stored[j]) if self.has_stored[j] else None, results,
                        int(self.next_pc[j]) if self.has_next[j] else None, bool(self.sampled[j]), ctx)
            r = int(self.run[j])
            if not out or out[-1][0] != r:
                out.append((r, []))
            out[-1][1].append(step)
        return out

    def per_insn(self, spec: Callable[[InsnDetail], Sequence[T]]) -> tuple[np.ndarray, np.ndarray, list[T]]:
        """Every (step, item) pair for the items ``spec`` gives for the step's instruction (called once
        per distinct instruction): (step rows, indices into items, items). No Python per step."""
        items: list[T] = []
        starts, counts = [], []
        for insn in self.insns:
            it = spec(insn)
            starts.append(len(items))
            counts.append(len(it))
            items.extend(it)
        cnt = np.array(counts, np.int64)[self.group] if self.insns else np.zeros(0, np.int64)
        start = np.array(starts, np.int64)[self.group] if self.insns else np.zeros(0, np.int64)
        rows = np.repeat(np.arange(len(self), dtype=np.int64), cnt)
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        idx = np.repeat(start, cnt) + (np.arange(len(rows), dtype=np.int64) - first)
        return rows, idx, items

    def of_insn(self, prop: Callable[[InsnDetail], Any], dtype: Any) -> np.ndarray:
        """A property of each step's instruction (computed once per distinct instruction)."""
        return np.array([prop(i) for i in self.insns], dtype)[self.group] if self.insns \
            else np.zeros(0, dtype)


def _groups(insns: Sequence[InsnDetail]) -> tuple[list[InsnDetail], np.ndarray]:
    """Distinct instructions (by identity: the interpreter keeps one object per address) and each
    step's index among them."""
    ids: dict[int, int] = {}
    group = [ids.setdefault(id(x), len(ids)) for x in insns]
    objs = {id(x): x for x in insns}
    return [objs[k] for k in ids], np.array(group, np.int64)


def _contexts(ctx: Sequence[Value | None]) -> tuple[np.ndarray, np.ndarray]:
    v0 = np.array([c.v0 & MASK64 if c is not None else 0 for c in ctx], _U64)
    img = np.array([c.image if c is not None else -1 for c in ctx], np.int64)
    return v0, img


@dataclass
class FormatContext:
    """What a formatter may use: symbolizing (image index, offset) into 'function+0x12'."""

    symbolize: Callable[[int, int], str]


@runtime_checkable
class ValueModule(Protocol):
    name: str
    description: str

    def plan(self, insn: InsnDetail) -> Sequence[Capture]: ...

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]: ...

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None: ...


class BaseModule:
    """Defaults: capture nothing, emit nothing, format nothing."""

    name = "base"
    description = ""

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        return ()

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        return ()

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        return None


class BatchModule(BaseModule):
    """A module written over step batches; its ``transform`` of one sequence follows from
    ``emit_batch``, so the two never disagree."""

    def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
        return ()

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        b = StepBatch.from_steps([steps])
        for e in self.emit_batch(b):
            n = len(e.rows)
            kinds = kind_names(e.kind, n)
            v1 = np.broadcast_to(np.asarray(e.v1), (n,)).tolist()
            img = np.broadcast_to(np.asarray(e.image), (n,)).tolist()
            for pc, kind, a, b1, i in zip(b.pc[e.rows].tolist(), kinds, np.asarray(e.v0).tolist(), v1, img,
                                          strict=True):
                yield Emit(int(pc), kind, Value(int(a) & MASK64, int(b1) & MASK64, int(i)))
