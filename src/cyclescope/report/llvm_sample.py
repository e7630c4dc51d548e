"""LLVM's text sample profile (for clang -fprofile-sample-use) from per-instruction execution counts.

The counts come from one of three sources (`export llvm-sample --counts`):
- ``calc`` (default): DCPI's frequency estimates from PC samples and the binary: how often code
  ran rather than where time was spent, without branch records;
- ``samples``: the raw sample count of each instruction, as AutoFDO does without branch records
  (create_llvm_prof --use_lbr=false);
- exact counts from valgrind's callgrind (``--callgrind FILE``): the upper anchor.

The format (llvm/docs/SampleProfile, AutoFDO's text form)::

    function:TOTAL:HEAD
     LINE_OFFSET[.DISCRIMINATOR]: COUNT [callee:COUNT ...]
     LINE_OFFSET[.DISCRIMINATOR]: inlined_callee:TOTAL
      LINE_OFFSET[.DISCRIMINATOR]: COUNT          (the inlined callee's body, one space deeper)

As AutoFDO builds it: LINE_OFFSET is the source line minus the (inlined) function's first line
(DW_AT_decl_line); DISCRIMINATOR is the *base* discriminator decoded from the line table's
(clang's -fdebug-info-for-profiling packs base discriminator, duplication factor and copy id into
one number; LLVM's profile loader looks up the base only); an instruction's count is multiplied by
its duplication factor (an instruction of a loop unrolled 4 times runs a quarter of the
iterations); COUNT is the most any instruction at that location executed; TOTAL is the sum of the
function's instruction counts; code inlined in the profiled binary becomes a nested profile at
its call site (DW_AT_call_line, DW_AT_GNU_discriminator), which lets clang replay the inlining
and keeps the inlinee's own line counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Loc = tuple[int, int]  # (line offset, base discriminator)


def _prefix_decoded(u: int) -> int:
    """LLVM's DILocation::getUnsignedFromPrefixEncoding: one component of an encoded discriminator."""
    if u & 1:
        return 0
    u >>= 1
    return (((u >> 1) & 0xFE0) | (u & 0x1F)) if u & 0x20 else (u & 0x1F)


def base_discriminator(d: int) -> int:
    """The base discriminator of a line table's (encoded) discriminator."""
    return _prefix_decoded(d)


def duplication_factor(d: int) -> int:
    """How many copies of the code unrolling or vectorization made (1 when none is encoded)."""
    if d & 1 == 0:
        d >>= 14 if d & 0x40 else 7
    else:
        d >>= 1
    return _prefix_decoded(d) or 1


@dataclass
class FunctionProfile:
    name: str  # linkage (mangled) name
    head: int = 0
    body: dict[Loc, int] = field(default_factory=dict)  # location -> count
    calls: dict[Loc, dict[str, int]] = field(default_factory=dict)  # location -> callee -> count
    inlined: dict[Loc, dict[str, FunctionProfile]] = field(default_factory=dict)  # location -> callee
    samples: int = 0  # the sum of the instructions' counts (nested profiles included)

    def add(self, offset: int, disc: int, count: int) -> None:
        if offset < 0 or offset > 0xFFFF or count <= 0:
            return  # a line before the function's own: no valid offset
        k = (offset, disc)
        self.body[k] = max(self.body.get(k, 0), count)

    def add_call(self, offset: int, disc: int, callee: str, count: int) -> None:
        if offset < 0 or offset > 0xFFFF or count <= 0:
            return
        d = self.calls.setdefault((offset, disc), {})
        d[callee] = max(d.get(callee, 0), count)
        self.add(offset, disc, count)

    def callee(self, offset: int, disc: int, name: str) -> FunctionProfile | None:
        """The nested profile of ``name`` inlined at this location (made when first asked)."""
        if offset < 0 or offset > 0xFFFF:
            return None
        d = self.inlined.setdefault((offset, disc), {})
        if name not in d:
            d[name] = FunctionProfile(name)
        return d[name]

    @property
    def total(self) -> int:
        return self.samples or sum(self.body.values())


class InlineFrame(Protocol):
    """An inlined call as images.dwarf.Scope describes it (read-only)."""

    @property
    def line(self) -> int: ...  # the call's line in its caller
    @property
    def discriminator(self) -> int: ...  # the call site's discriminator
    @property
    def linkage(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def decl_line(self) -> int: ...  # the inlined function's first line


@dataclass(frozen=True)
class Executed:
    """One instruction's count and where it comes from in the source."""

    count: int
    line: int
    discriminator: int  # as in the line table (encoded)
    inlined: Sequence[InlineFrame] = ()  # inlined calls containing it, outermost first
    callee: str | None = None  # the target of a direct call


def function_profile(name: str, decl_line: int, executed: Iterable[Executed], head: int = 0) -> FunctionProfile:
    """Fold instruction counts into a function's profile, nested through its inlined calls."""
    fp = FunctionProfile(name, head=head)
    for e in executed:
        c = e.count * duplication_factor(e.discriminator)
        if c <= 0:
            continue
        fp.samples += c
        node, parent_decl = fp, decl_line
        for fr in e.inlined:
            inner = node.callee(fr.line - parent_decl, base_discriminator(fr.discriminator), fr.linkage or fr.name)
            if inner is None:
                break  # a call line before its caller's first line: no valid offset
            node, parent_decl = inner, fr.decl_line
            node.samples += c
        else:
            off, disc = e.line - parent_decl, base_discriminator(e.discriminator)
            node.add(off, disc, c)
            if e.callee:
                node.add_call(off, disc, e.callee.removesuffix("@plt"), c)
    return fp


def _loc(off: int, disc: int) -> str:
    return f"{off}.{disc}" if disc else f"{off}"


def _body(f: FunctionProfile, depth: int, out: list[str]) -> None:
    pad = " " * depth
    for (off, disc), n in sorted(f.body.items()):
        calls = f.calls.get((off, disc), {})
        tail = "".join(f" {c}:{k}" for c, k in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])))
        out.append(f"{pad}{_loc(off, disc)}: {n}{tail}")
    for (off, disc), callees in sorted(f.inlined.items()):
        for g in sorted(callees.values(), key=lambda g: (-g.total, g.name)):
            if g.total > 0:
                out.append(f"{pad}{_loc(off, disc)}: {g.name}:{g.total}")
                _body(g, depth + 1, out)


def render(functions: Iterable[FunctionProfile]) -> str:
    out: list[str] = []
    for f in sorted(functions, key=lambda f: (-f.total, f.name)):
        if f.total <= 0:
            continue
        out.append(f"{f.name}:{f.total}:{f.head}")
        _body(f, 1, out)
    return "\n".join(out) + ("\n" if out else "")
