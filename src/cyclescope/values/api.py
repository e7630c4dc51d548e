"""The customization-module API (the value-sampling paper's section 2.3).

A module decides three things:

- ``plan(insn)``: what to capture at the sampling interrupt for an instruction, as
  :class:`Capture` specifications. Plans are computed once per instruction and
  evaluated in bulk over all samples of that instruction, so a capture costs no
  Python per sample.
- ``transform(steps)``: turn a tuple sequence (the sampled instruction and the next
  ones, from the interpreter or from exact single-stepping) into (PC, kind, value)
  emissions. Arbitrary logic is allowed here; it runs once per interpreted sample.
- ``format(kind, value, ctx)``: how a value of one of its kinds reads in a report,
  or None to leave it to others.

Modules are found through the ``cyclescope.values`` entry-point group (the
built-in ones are registered there by cyclescope's own package metadata), or
given as ``package.module:Class`` on the command line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from cyclescope.values.insn import InsnDetail, RegView

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
      "stack" the 8-byte word at [rsp + ``offset``] in the stack snapshot.
    with_ctx: record (value, call site) pairs instead of the value alone (kind gets "@ctx").
    """

    kind: str
    source: str
    reg: RegView | None = None
    offset: int = 0
    with_ctx: bool = False


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
