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

import functools
import importlib
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from cyclescope.db.hotlist import PER_CALL_SITE
from cyclescope.errors import UsageError
from cyclescope.values import DEFAULT_MODULES as _DEFAULT_MODULES
from cyclescope.values.api import (
    BaseModule,
    BatchEmit,
    BatchModule,
    Capture,
    FormatContext,
    Kinds,
    StepBatch,
    Value,
    ValueModule,
)
from cyclescope.values.insn import REG_VIEWS, ROW_COL, InsnDetail, RegView

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

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


def _gp_views(which: Callable[[InsnDetail], Sequence[RegView]]) -> Callable[[InsnDetail], list[RegView]]:
    return lambda insn: [r for r in which(insn) if r.full not in _SKIP_INPUTS and r.full in ROW_COL]


def _register_values(batch: StepBatch, which: Callable[[InsnDetail], Sequence[RegView]], prefix: str,
                     regs: np.ndarray, known: np.ndarray | None, skip: np.ndarray | None = None
                     ) -> tuple[Kinds, np.ndarray, np.ndarray]:
    """The registers ``which`` names for each step's instruction, as (kinds, step rows, values)
    taken from ``regs`` (the batch's input or output rows) where ``known``, on rows not ``skip``."""
    rows, idx, views = batch.per_insn(_gp_views(which))
    if skip is not None:
        keep = ~skip[rows]
        rows, idx = rows[keep], idx[keep]
    col = np.array([ROW_COL[r.full] for r in views], np.int64)[idx]
    if known is not None:
        k = known[rows, col]
        rows, idx, col = rows[k], idx[k], col[k]
    shift = np.array([r.shift for r in views], np.uint64)[idx]
    mask = np.array([r.mask for r in views], np.uint64)[idx]
    return Kinds([prefix + r.name for r in views], idx), rows, (regs[rows, col] >> shift) & mask


class Operands(BatchModule):
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
                out.append(Capture(f"in:{r.name}{PER_CALL_SITE}", "reg", r, with_ctx=True))
        return out

    def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
        # The sampled instruction's operands were taken at the interrupt.
        kind, rows, v = _register_values(batch, lambda i: i.reads, "in:", batch.regs_in, batch.in_known,
                                         skip=batch.sampled)
        if not len(rows):
            return
        yield BatchEmit(kind, rows, v)
        if self.per_call_site:
            has = batch.ctx_img[rows] >= 0
            r = rows[has]
            yield BatchEmit(Kinds([k + PER_CALL_SITE for k in kind.names], kind.codes[has]), r, v[has],
                            batch.ctx_v0[r], batch.ctx_img[r])

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if not kind.startswith("in:"):
            return None
        text = fmt_int(value.v0, _bits_of(kind))
        if kind.endswith(PER_CALL_SITE):
            site = ctx.symbolize(value.image, value.v1) if value.image >= 0 else "?"
            return f"{text} from {site}"
        return text


class Addresses(BatchModule):
    name = "addresses"
    description = "effective addresses (addr), loaded and stored values (load, store)"

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        m = insn.mem
        if m is None or m.constant or m.segment or insn.kind in ("call", "icall", "ret"):
            return ()
        return (Capture("addr", "addr"),)

    def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
        mem = batch.of_insn(lambda i: i.mem is not None, bool)
        const = batch.of_insn(lambda i: i.mem is not None and i.mem.constant, bool)
        reads = batch.of_insn(lambda i: i.mem is not None and i.mem.read, bool)
        writes = batch.of_insn(lambda i: i.mem is not None and i.mem.write, bool)
        addr = np.flatnonzero(mem & batch.has_ea & ~batch.sampled & ~const)
        yield BatchEmit("addr", addr, batch.ea[addr])
        suffix = [("." + i.fp if i.fp else "") for i in batch.insns]
        for flag, has, vals, name in ((reads, batch.has_loaded, batch.loaded, "load"),
                                      (writes, batch.has_stored, batch.stored, "store")):
            rows = np.flatnonzero(flag & has)
            if len(rows):
                yield BatchEmit(Kinds([name + x for x in suffix], batch.group[rows]), rows, vals[rows])

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind == "addr":
            return hex(value.v0)
        if kind.startswith(("load", "store")):
            if kind.endswith((".f64", ".f32")):
                return fmt_float(value.v0, kind)
            return fmt_int(value.v0)
        return None


class Context(BatchModule):
    name = "context"
    description = "the call site that led to the sampled procedure (ctx, at its entry)"

    def plan(self, insn: InsnDetail) -> Sequence[Capture]:
        return (Capture("ctx", "ctx"),)

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind != "ctx":
            return None
        return ctx.symbolize(value.image, value.v0) if value.image >= 0 else hex(value.v0)


class Results(BatchModule):
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
            out.append(Capture("out:rax", "prev", REG_VIEWS["rax"]))
        return out

    def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
        kind, rows, v = _register_values(batch, lambda i: i.writes, "out:", batch.regs_out, batch.out_known)
        if len(rows):
            yield BatchEmit(kind, rows, v)

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if not kind.startswith("out:"):
            return None
        return fmt_int(value.v0, _bits_of(kind))


class Edges(BatchModule):
    name = "edges"
    description = "branch outcomes (edge: the address control went to)"

    def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
        rows = np.flatnonzero(batch.of_insn(lambda i: i.kind in ("branch", "ijump", "icall"), bool)
                              & batch.has_next)
        yield BatchEmit("edge", rows, batch.next_pc[rows], 0, MAP_CODE)

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if kind != "edge":
            return None
        return "-> " + (ctx.symbolize(value.image, value.v0) if value.image >= 0 else hex(value.v0))


class VReplay(BatchModule):
    name = "vreplay"
    description = "pairs of instructions touching one address or addresses 4 KiB apart in a window (alias)"

    def emit_batch(self, batch: StepBatch) -> Iterable[BatchEmit]:
        size = batch.of_insn(lambda i: i.mem.size if i.mem is not None else 0, np.int64)
        write = batch.of_insn(lambda i: i.mem is not None and i.mem.write, bool)
        m = np.flatnonzero((size > 0) & batch.has_ea)  # memory steps, in sequence order
        if len(m) < 2:
            return
        run = batch.run[m]
        lo = batch.ea[m].astype(np.int64)  # wraps for kernel-half addresses: both sides alike
        hi = lo + size[m]
        wr = write[m]
        # Each memory step against each earlier one of its sequence: the one d memory steps before.
        for d in range(1, len(m)):
            s, t = np.arange(d, len(m)), np.arange(len(m) - d)
            together = run[s] == run[t]
            if not together.any():
                break  # no sequence has more than d memory steps
            pair = together & (wr[s] | wr[t])  # two loads neither forward nor alias
            s, t = s[pair], t[pair]
            same = (lo[t] < hi[s]) & (lo[s] < hi[t])
            h2 = np.where(hi[s] & 0xFFF, hi[s] & 0xFFF, 0x1000)
            h1 = np.where(hi[t] & 0xFFF, hi[t] & 0xFFF, 0x1000)
            alias = ~same & ((lo[t] & 0xFFF) < h2) & ((lo[s] & 0xFFF) < h1) & ((lo[t] >> 12) != (lo[s] >> 12))
            for sel, v1 in ((same, 0), (alias, 1)):
                if sel.any():
                    yield BatchEmit("alias", m[s[sel]], batch.pc[m[t[sel]]], v1, MAP_CODE)

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


@functools.cache
def _plugins() -> dict[str, EntryPoint]:
    """The entry points of the group, by name (the first of a name wins), scanned once per process
    and only when a name is not a built-in's: importing importlib.metadata and reading every
    installed distribution's metadata costs about 30 ms of each command's start."""
    from importlib.metadata import entry_points

    out: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, ep)
    return out


def available() -> dict[str, str]:
    """Module names, the built-ins' and the entry-point group's, with where they come from (a plugin
    named like a built-in is listed but not used: the built-in wins)."""
    out = {name: ep.value for name, ep in _plugins().items()}
    out.update({name: f"cyclescope.values.modules:{cls.__name__}" for name, cls in BUILTIN.items()})
    return out


def load_module(spec: str) -> ValueModule:
    """A module by name (a built-in's, else an entry point's), or ``package.module:Class``."""
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"value module '{spec}': {e}") from None
    elif spec in BUILTIN:
        obj = BUILTIN[spec]
    elif spec == "goal":  # ours, but a module of its own (values/goal.py imports this one)
        from cyclescope.values.goal import GoalModule

        obj = GoalModule
    else:
        ep = _plugins().get(spec)
        if ep is None:
            raise UsageError(f"unknown value module '{spec}'; available: {', '.join(sorted(available()))}")
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not take the daemon down
            raise UsageError(f"value module '{spec}' failed to load: {e}") from None
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
