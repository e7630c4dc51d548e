"""The built-in customization modules, and finding modules by name.

operands   the registers each instruction reads (kinds ``in:REG``, and ``in:REG@ctx`` per call site)
addresses  effective addresses (``addr``), loaded and stored values (``load``, ``store``; ``.f64``/``.f32``
           for floating-point operands)
context    the call site that led to the sampled procedure (``ctx``, at the procedure's entry)
results    the values instructions produce (``out:REG``)
edges      branch outcomes (``edge``: where control went after a branch)
vreplay    instructions touching the same address, or addresses 4 KiB apart, within one window
           (``alias``: store-forwarding and 4K-aliasing suspects, after the paper's vreplay)
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points

from cyclescope.errors import UsageError
from cyclescope.values import DEFAULT_MODULES as _DEFAULT_MODULES
from cyclescope.values.api import BaseModule, Capture, Emit, FormatContext, Step, Value, ValueModule
from cyclescope.values.insn import InsnDetail

ENTRY_POINT_GROUP = "cyclescope.values"
# A Value whose v0 is an absolute code address: the collector maps it into (image, offset).
MAP_CODE = -2
_SKIP_INPUTS = frozenset({"rsp", "rip"})


def fmt_int(v: int, bits: int = 64) -> str:
    """Small numbers in decimal (signed), the rest in hex."""
    v &= (1 << bits) - 1
    signed = v - (1 << bits) if v >> (bits - 1) else v
    if -100000 < signed < 1000000:
        return str(signed)
    return hex(v)


def fmt_float(v: int, kind: str) -> str:
    if kind.endswith(".f32"):
        return f"{struct.unpack('<f', struct.pack('<I', v & 0xFFFFFFFF))[0]:.7g}"
    return f"{struct.unpack('<d', struct.pack('<Q', v & 0xFFFFFFFFFFFFFFFF))[0]:.10g}"


def _bits_of(kind: str) -> int:
    from cyclescope.values.insn import REG_VIEWS

    reg = kind.split(":", 1)[-1].split("@", 1)[0]
    view = REG_VIEWS.get(reg)
    return view.bits if view is not None else 64


class Operands(BaseModule):
    name = "operands"
    description = "registers each instruction reads (in:REG), and per call site (in:REG@ctx)"

    def __init__(self, per_call_site: bool = True) -> None:
        self.per_call_site = per_call_site

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        out = []
        for r in insn.reads:
            if r.full in _SKIP_INPUTS:
                continue
            out.append(Capture(f"in:{r.name}", "reg", r))
            if self.per_call_site:
                out.append(Capture(f"in:{r.name}@ctx", "reg", r, with_ctx=True))
        return out

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        for s in steps:
            if s.sampled:
                continue  # taken at the interrupt already
            for r in s.insn.reads:
                if r.full in _SKIP_INPUTS:
                    continue
                v = s.regs_in.get(r.full)
                if v is not None:
                    yield Emit(s.pc, f"in:{r.name}", Value(r.extract(v)))
                    if self.per_call_site and s.context is not None:
                        c = s.context
                        yield Emit(s.pc, f"in:{r.name}@ctx", Value(r.extract(v), c.v0, c.image))

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if not kind.startswith("in:"):
            return None
        text = fmt_int(value.v0, _bits_of(kind))
        if kind.endswith("@ctx"):
            site = ctx.symbolize(value.image, value.v1) if value.image >= 0 else "?"
            return f"{text} from {site}"
        return text


class Addresses(BaseModule):
    name = "addresses"
    description = "effective addresses (addr), loaded and stored values (load, store)"

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        m = insn.mem
        if m is None or m.constant or m.segment or insn.kind in ("call", "icall", "ret"):
            return ()
        return (Capture("addr", "addr"),)

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        for s in steps:
            m = s.insn.mem
            if m is None:
                continue
            if s.ea is not None and not s.sampled and not m.constant:
                yield Emit(s.pc, "addr", Value(s.ea))
            suffix = "." + s.insn.fp if s.insn.fp else ""
            if s.loaded is not None and m.read:
                yield Emit(s.pc, "load" + suffix, Value(s.loaded))
            if s.stored is not None and m.write:
                yield Emit(s.pc, "store" + suffix, Value(s.stored))

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind == "addr":
            return hex(value.v0)
        if kind.startswith(("load", "store")):
            if kind.endswith((".f64", ".f32")):
                return fmt_float(value.v0, kind)
            return fmt_int(value.v0)
        return None


class Context(BaseModule):
    name = "context"
    description = "the call site that led to the sampled procedure (ctx, at its entry)"

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        return (Capture("ctx", "ctx"),)

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind != "ctx":
            return None
        return ctx.symbolize(value.image, value.v0) if value.image >= 0 else hex(value.v0)


class Results(BaseModule):
    name = "results"
    description = "values instructions produce (out:REG)"

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        return ()  # the collector asks for the previous instruction's outputs itself (see prev_plan)

    def prev_plan(self, prev: InsnDetail) -> Sequence[Capture]:
        """What to take at PC of the outputs of the instruction before it."""
        out = []
        for r in prev.writes:
            if r.full in _SKIP_INPUTS:
                continue
            out.append(Capture(f"out:{r.name}", "prev", r))
        if prev.kind in ("call", "icall"):
            # At a return point the previous instruction is the call: rax holds what the callee returned.
            from cyclescope.values.insn import REG_VIEWS

            out.append(Capture("out:rax", "prev", REG_VIEWS["rax"]))
        return out

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        from cyclescope.values.insn import REG_VIEWS

        for s in steps:
            for name, v in s.results.items():
                view = REG_VIEWS.get(name)
                if view is None or view.full in _SKIP_INPUTS:
                    continue
                yield Emit(s.pc, f"out:{name}", Value(v & view.mask))

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if not kind.startswith("out:"):
            return None
        return fmt_int(value.v0, _bits_of(kind))


class Edges(BaseModule):
    name = "edges"
    description = "branch outcomes (edge: the address control went to)"

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        for s in steps:
            if s.insn.kind in ("branch", "ijump", "icall") and s.next_pc is not None:
                yield Emit(s.pc, "edge", Value(s.next_pc, 0, MAP_CODE))

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind != "edge":
            return None
        return "-> " + (ctx.symbolize(value.image, value.v0) if value.image >= 0 else hex(value.v0))


class VReplay(BaseModule):
    name = "vreplay"
    description = "pairs of instructions touching one address or addresses 4 KiB apart in a window (alias)"

    def transform(self, steps: Sequence[Step]) -> Iterable[Emit]:
        seen: list[Step] = []
        for s in steps:
            m = s.insn.mem
            if m is None or s.ea is None:
                continue
            for t in seen:
                tm = t.insn.mem
                assert tm is not None and t.ea is not None
                if not (m.write or tm.write):
                    continue  # two loads do not forward or alias
                lo1, hi1 = t.ea, t.ea + tm.size
                lo2, hi2 = s.ea, s.ea + m.size
                if lo1 < hi2 and lo2 < hi1:
                    yield Emit(s.pc, "alias", Value(t.pc, 0, MAP_CODE))
                elif (lo1 & 0xFFF) < (hi2 & 0xFFF or 0x1000) and (lo2 & 0xFFF) < (hi1 & 0xFFF or 0x1000) \
                        and (lo1 >> 12) != (lo2 >> 12):
                    yield Emit(s.pc, "alias", Value(t.pc, 1, MAP_CODE))
            seen.append(s)

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind != "alias":
            return None
        other = ctx.symbolize(value.image, value.v0) if value.image >= 0 else hex(value.v0)
        return ("same address as " if value.v1 == 0 else "4K alias of ") + other


BUILTIN: dict[str, type[BaseModule]] = {
    "operands": Operands, "addresses": Addresses, "context": Context, "results": Results,
    "edges": Edges, "vreplay": VReplay,
}
DEFAULT_MODULES = _DEFAULT_MODULES  # the built-ins, in the order reports show them


def available() -> dict[str, str]:
    """Module names from the entry-point group (and the built-ins), with where they come from."""
    out = {name: f"cyclescope.values.modules:{cls.__name__}" for name, cls in BUILTIN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out[ep.name] = ep.value
    return out


def load_module(spec: str) -> ValueModule:
    """A module by entry-point name, or ``package.module:Class``."""
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"value module '{spec}': {e}") from None
    else:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if eps:
            try:
                obj = eps[0].load()
            except Exception as e:  # a broken plugin must not take the daemon down
                raise UsageError(f"value module '{spec}' failed to load: {e}") from None
        elif spec in BUILTIN:
            obj = BUILTIN[spec]
        else:
            raise UsageError(f"unknown value module '{spec}'; available: {', '.join(sorted(available()))}")
    inst = obj() if isinstance(obj, type) else obj
    if not isinstance(inst, ValueModule):
        raise UsageError(f"value module '{spec}' lacks plan/transform/format")
    return inst


def load_modules(names: Sequence[str]) -> list[ValueModule]:
    out: list[ValueModule] = []
    for n in names:
        n = n.strip()
        if n and all(getattr(m, "name", None) != n for m in out):
            out.append(load_module(n))
    if not out:
        raise UsageError("no value modules selected")
    return out


def format_value(modules: Sequence[ValueModule], kind: str, value: Value, ctx: FormatContext) -> str:
    for m in modules:
        text = m.format(kind, value, ctx)
        if text is not None:
            return text
    return fmt_int(value.v0) if value.image < 0 else ctx.symbolize(value.image, value.v0)
