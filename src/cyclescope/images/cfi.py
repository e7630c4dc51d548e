"""Call frame information (.eh_frame) as a flat unwind table: for each address, how to find the
caller's frame.

binutils' readelf decodes the CIEs and FDEs and runs their CFA programs (`--debug-dump=frames-interp`,
in C: libc's 3.7k FDEs in 0.05 s), and we parse its table; where readelf is missing or its output
is not what we expect, pyelftools does the same (get_decoded: 1.8 s for libc, 4-6 s for
libpython, in Python). Either way we flatten the result into sorted rows, one per change of rule,
with a gap row where no FDE covers the code, and keep them as Parquet in the per-user cache by
build-id (a cached table loads in milliseconds). A first load matters where the eBPF program
walks live stacks (collect/bpfunwind.py): until an image's rows are in, walks stop there.

Each row says, for addresses from its pc up to the next row's:
- the CFA (canonical frame address: the stack pointer before the call) as register + offset, or a
  DWARF expression (PLT stubs: rsp + 8, plus 8 past the push of the stub's second half);
- where the return address was saved (CFA + offset), or that there is none (the outermost frame,
  DW_CFA_undefined on the return address column);
- where rbp was saved (CFA + offset), if it was: the only callee-saved register a CFA rule of
  compiled x86-64 code refers to after the first frame.

pyelftools 0.33 does not decode DW_CFA_GNU_args_size (0x2e, found in libc): it only matters for
exception landing pads, so it is dropped before decoding (as other unwinders do).
"""

from __future__ import annotations

import bisect
import io
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from elftools.common.exceptions import DWARFError, ELFError
from elftools.dwarf.callframe import FDE, CFARule, RegisterRule
from elftools.dwarf.dwarf_expr import DWARFExprParser
from elftools.elf.elffile import ELFFile

from cyclescope.errors import DataError

# DWARF register numbers on x86-64 (System V psABI, figure 3.36).
DW_RBP = 6
DW_RSP = 7
DW_RA = 16

# cfa_kind
CFA_NONE = 0  # no FDE covers the address (a gap) or a rule we cannot evaluate
CFA_REG = 1  # register + offset
CFA_EXPR = 2  # DWARF expression (index into exprs)
# ra_kind / bp_kind
SAVED_NONE = 0  # rbp: unchanged (same value); return address: outermost frame, stop
SAVED_AT = 1  # saved at CFA + offset
SAVED_UNKNOWN = 2  # a rule we do not follow (in a register, an expression)

GNU_ARGS_SIZE = 0x2E
CACHE_NAME = "cfi-v1"


@dataclass(frozen=True)
class Row:
    cfa_kind: int
    cfa_reg: int
    cfa_off: int
    ra_kind: int
    ra_off: int
    bp_kind: int
    bp_off: int
    expr: int  # index into CfiTable.exprs, or -1


class CfiTable:
    """Unwind rows sorted by address (the image's link-time virtual addresses)."""

    def __init__(self, pcs: list[int], rows: list[Row], exprs: list[list[tuple[str, list[int]]]]) -> None:
        self.pcs = pcs
        self.rows = rows
        self.exprs = exprs

    def __len__(self) -> int:
        return len(self.rows)

    def lookup(self, vaddr: int) -> Row | None:
        i = bisect.bisect_right(self.pcs, vaddr) - 1
        if i < 0:
            return None
        r = self.rows[i]
        return r if r.cfa_kind != CFA_NONE else None

    # --- the cache form ------------------------------------------------------------
    def to_arrow(self) -> pa.Table:
        cols: dict[str, Any] = {"pc": pa.array(self.pcs, pa.uint64())}
        for name in ("cfa_kind", "cfa_reg", "ra_kind", "bp_kind"):
            cols[name] = pa.array([getattr(r, name) for r in self.rows], pa.int8())
        for name in ("cfa_off", "ra_off", "bp_off"):
            cols[name] = pa.array([getattr(r, name) for r in self.rows], pa.int64())
        cols["expr"] = pa.array([r.expr for r in self.rows], pa.int32())
        meta = {b"exprs": repr(self.exprs).encode()}
        return pa.table(cols).replace_schema_metadata(meta)

    @staticmethod
    def from_arrow(t: pa.Table) -> CfiTable:
        import ast

        d = {k: t.column(k).to_pylist() for k in t.column_names}
        rows = [Row(*v) for v in zip(d["cfa_kind"], d["cfa_reg"], d["cfa_off"], d["ra_kind"], d["ra_off"],
                                     d["bp_kind"], d["bp_off"], d["expr"], strict=True)]
        meta = t.schema.metadata or {}
        exprs = ast.literal_eval(meta.get(b"exprs", b"[]").decode())
        return CfiTable(d["pc"], rows, [[(op, list(args)) for op, args in e] for e in exprs])


def _reg_rule(rule: RegisterRule | None, missing: int) -> tuple[int, int]:
    if rule is None:
        return missing, 0
    if rule.type == RegisterRule.OFFSET and isinstance(rule.arg, int):
        return SAVED_AT, rule.arg
    if rule.type in (RegisterRule.SAME_VALUE, RegisterRule.UNDEFINED):
        return SAVED_NONE, 0
    return SAVED_UNKNOWN, 0


def build(elf: ELFFile) -> CfiTable:
    """The unwind table of an ELF file's .eh_frame (or .debug_frame when there is none)."""
    try:
        dwarf_info = elf.get_dwarf_info(relocate_dwarf_sections=False)
        if dwarf_info.has_EH_CFI():
            entries = dwarf_info.EH_CFI_entries()
        elif dwarf_info.has_CFI():
            entries = dwarf_info.CFI_entries()
        else:
            return CfiTable([], [], [])
    except (DWARFError, ELFError, ValueError, KeyError) as e:
        raise DataError(f"cannot read call frame information: {e}") from e
    parser = DWARFExprParser(dwarf_info.structs)
    exprs: list[list[tuple[str, list[int]]]] = []
    spans: list[tuple[int, int, list[tuple[int, Row]]]] = []
    for fde in entries:
        if not isinstance(fde, FDE):
            continue
        lo = int(fde.header["initial_location"])
        hi = lo + int(fde.header["address_range"])
        if hi <= lo:
            continue
        fde.instructions = [i for i in fde.instructions if i.opcode != GNU_ARGS_SIZE]
        try:
            table = fde.get_decoded().table
        except (DWARFError, ValueError, KeyError, IndexError, AssertionError):
            continue  # one undecodable FDE: its code stays a gap
        rows: list[tuple[int, Row]] = []
        for line in table:
            cfa: CFARule = line["cfa"]
            expr = -1
            if cfa.expr is not None:
                try:
                    ops = [(op.op_name, [int(a) for a in op.args]) for op in parser.parse_expr(cfa.expr)]
                except (DWARFError, KeyError, ValueError, TypeError):
                    ops = None
                if ops is None:
                    kind, reg, off = CFA_NONE, 0, 0
                else:
                    exprs.append(ops)
                    expr = len(exprs) - 1
                    kind, reg, off = CFA_EXPR, 0, 0
            elif cfa.reg is not None:
                kind, reg, off = CFA_REG, int(cfa.reg), int(cfa.offset or 0)
            else:
                kind, reg, off = CFA_NONE, 0, 0
            ra_rule = line.get(DW_RA)
            if ra_rule is None:
                ra_kind, ra_off = SAVED_UNKNOWN, 0
            else:
                ra_kind, ra_off = _reg_rule(ra_rule, SAVED_UNKNOWN)
            bp_kind, bp_off = _reg_rule(line.get(DW_RBP), SAVED_NONE)
            rows.append((int(line["pc"]), Row(kind, reg, off, ra_kind, ra_off, bp_kind, bp_off, expr)))
        if rows:
            spans.append((lo, hi, rows))
    return _flatten(spans, exprs)


def _flatten(spans: list[tuple[int, int, list[tuple[int, Row]]]], exprs: list[list[tuple[str, list[int]]]]) -> CfiTable:
    """Each FDE's rows (lo, hi, [(pc, row)]) as one sorted table, with a gap row where none covers."""
    spans.sort(key=lambda s: s[0])
    pcs: list[int] = []
    out: list[Row] = []
    gap = Row(CFA_NONE, 0, 0, SAVED_UNKNOWN, 0, SAVED_NONE, 0, -1)
    for k, (lo, hi, rows) in enumerate(spans):
        for pc, r in rows:
            if pc < lo or pc >= hi:
                continue
            if pcs and pcs[-1] == pc:
                out[-1] = r
            else:
                pcs.append(pc)
                out.append(r)
        nxt = spans[k + 1][0] if k + 1 < len(spans) else None
        if nxt is None or nxt > hi:
            pcs.append(hi)
            out.append(gap)
    return CfiTable(pcs, out, exprs)


def build_from_path(path: str) -> CfiTable:
    """The table of the binary at path: through readelf where it can, else pyelftools."""
    t = build_readelf(path)
    if t is not None:
        return t
    try:
        with open(path, "rb") as f:
            return build(ELFFile(f))
    except ELFError as e:
        raise DataError(f"{path}: not an ELF file ({e})") from e


def build_from_bytes(data: bytes) -> CfiTable:
    return build(ELFFile(io.BytesIO(data)))


def load(path: str, key: str | None, cache: Any | None = None) -> CfiTable:
    """The table of the binary at path, through the cache when it has a build-id key."""
    if cache is not None and key:
        t = cache.load(key, CACHE_NAME)
        if t is not None:
            try:
                return CfiTable.from_arrow(t)
            except (KeyError, ValueError, SyntaxError, pa.ArrowException):
                pass  # an old or damaged entry: rebuild it
    table = build_from_path(path)
    if cache is not None and key:
        cache.save(key, CACHE_NAME, table.to_arrow())
    return table


# --- through readelf ----------------------------------------------------------------------------
# DWARF numbers of readelf's x86-64 register names.
_DW_REGS = {n: i for i, n in enumerate(("rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10",
                                        "r11", "r12", "r13", "r14", "r15", "rip"))}
_HEADER = re.compile(r"^[0-9a-f]+ [0-9a-f]+ ([0-9a-f]+) (CIE|FDE)(?: cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+))?")
_REG_OFF = re.compile(r"^([a-z0-9]+)([+-]\d+)$")
_SAVED = re.compile(r"^c([+-]\d+)$")
_IN_REG = re.compile(r"(r\d+) \((\w+)\)")
_OP = re.compile(r"^(DW_OP_\w+)(?: \([^)]*\))?(?::\s*(.*))?$")
READELF_TIMEOUT_S = 120.0


def build_readelf(path: str) -> CfiTable | None:
    """The table from binutils' readelf (`-wF`, and `-wf` for the expressions of CFAs it prints as
    "exp"), or None where readelf is not installed, fails, or prints what we do not parse."""
    exe = shutil.which("readelf")
    if exe is None:
        return None

    def dump(flag: str) -> str | None:
        try:
            # no-follow-links: a .gnu_debuglink's separate file has no .eh_frame contents
            r = subprocess.run([exe, "--debug-dump=no-follow-links", flag, path], capture_output=True, text=True,
                               timeout=READELF_TIMEOUT_S, env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    text = dump("--debug-dump=frames-interp")
    if text is None:
        return None
    try:
        fdes = _parse_interp(text)
        by_fde: dict[int, list[list[tuple[str, list[int]]]]] = {}
        if any(r[1] == "exp" for _, rows in fdes.values() for r in rows):
            raw = dump("--debug-dump=frames")
            if raw is None:
                return None
            by_fde = _parse_expressions(raw)
    except (ValueError, IndexError, KeyError):
        return None
    exprs: list[list[tuple[str, list[int]]]] = []
    memo: dict[tuple[str, str | None, str | None, int], Row] = {}
    spans: list[tuple[int, int, list[tuple[int, Row]]]] = []
    for lo, (hi, table) in fdes.items():
        found = by_fde.get(lo, [])
        expr = -1
        if found and len({repr(e) for e in found}) == 1:  # one expression in the FDE: its "exp" rows
            exprs.append(found[0])
            expr = len(exprs) - 1
        rows = []
        for pc, cfa, ra, bp in table:
            key = (cfa, ra, bp, expr if cfa == "exp" else -1)
            r = memo.get(key)
            if r is None:
                r = memo[key] = _row(cfa, ra, bp, key[3])
            rows.append((pc, r))
        spans.append((lo, hi, rows))
    return _flatten(spans, exprs)


def _row(cfa: str, ra: str | None, bp: str | None, expr: int) -> Row:
    if cfa == "exp":
        kind, reg, off = (CFA_EXPR, 0, 0) if expr >= 0 else (CFA_NONE, 0, 0)
    else:
        m = _REG_OFF.match(cfa)
        if m is None or m.group(1) not in _DW_REGS:
            kind, reg, off, expr = CFA_NONE, 0, 0, -1
        else:
            kind, reg, off, expr = CFA_REG, _DW_REGS[m.group(1)], int(m.group(2)), -1

    def rule(v: str | None, missing: int) -> tuple[int, int]:
        if v is None:
            return missing, 0
        if v == "u":  # undefined: for the return address, the outermost frame; rbp: unchanged
            return SAVED_NONE, 0
        m = _SAVED.match(v)
        return (SAVED_AT, int(m.group(1))) if m else (SAVED_UNKNOWN, 0)

    ra_kind, ra_off = rule(ra, SAVED_UNKNOWN)
    bp_kind, bp_off = rule(bp, SAVED_NONE)
    return Row(kind, reg, off, ra_kind, ra_off, bp_kind, bp_off, expr)


def _first_section(text: str) -> str:
    """readelf's dump of the first frame section only (.eh_frame, else .debug_frame, as build()
    reads them): it prints one "Contents of the ..." block per section."""
    second = text.find("Contents of the ", text.find("Contents of the ") + 1)
    return text[:second] if second >= 0 else text


def _parse_interp(text: str) -> dict[int, tuple[int, list[tuple[int, str, str | None, str | None]]]]:
    """readelf -wF: FDE start -> (end, rows (pc, CFA, return address rule, rbp rule)), an FDE
    without rows taking its CIE's initial row. Only the first section dumped (.eh_frame, else
    .debug_frame, as build() reads them)."""
    cies: dict[str, tuple[str, str | None, str | None]] = {}
    fdes: dict[int, tuple[int, list[tuple[int, str, str | None, str | None]]]] = {}
    text = _first_section(text)
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        m = _HEADER.match(lines[0])
        if m is None:
            continue
        rows: list[tuple[int, str, str | None, str | None]] = []
        if len(lines) > 2 and lines[1].split()[:2] == ["LOC", "CFA"]:
            cols = lines[1].split()[2:]
            ra = cols.index("ra") + 2 if "ra" in cols else -1
            bp = cols.index("rbp") + 2 if "rbp" in cols else -1
            width = len(cols) + 2
            for line in lines[2:]:
                p = line.split()
                if len(p) != width:  # "r9 (r9)": a register kept in another register
                    p = _IN_REG.sub(r"\1(\2)", line).split()
                    if len(p) != width:
                        raise ValueError(line)
                rows.append((int(p[0], 16), p[1], p[ra] if ra >= 0 else None, p[bp] if bp >= 0 else None))
        if m.group(2) == "CIE":
            if rows:
                cies[lines[0].split()[0]] = rows[0][1:]
            continue
        lo, hi = int(m.group(4), 16), int(m.group(5), 16)
        if not rows and m.group(3) in cies:
            rows = [(lo, *cies[m.group(3)])]
        if hi > lo and rows:
            fdes[lo] = (hi, rows)
    return fdes


_EXPR_SCAN = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.|"
                        r"^\s*DW_CFA_def_cfa_expression \((.*)\)$", re.M)


def _parse_expressions(text: str) -> dict[int, list[list[tuple[str, list[int]]]]]:
    """readelf -wf: FDE start -> the expressions of its DW_CFA_def_cfa_expression, in order."""
    text = _first_section(text)
    out: dict[int, list[list[tuple[str, list[int]]]]] = {}
    lo: int | None = None
    for m in _EXPR_SCAN.finditer(text):
        if m.group(1) is not None:
            lo = int(m.group(1), 16)
            continue
        if lo is None:
            continue
        ops: list[tuple[str, list[int]]] = []
        for part in m.group(2).split(";"):
            om = _OP.match(part.strip())
            if om is None:
                raise ValueError(part)
            ops.append((om.group(1), [int(a, 0) for a in om.group(2).split(",")] if om.group(2) else []))
        out.setdefault(lo, []).append(ops)
    return out


# --- evaluation of CFA expressions -------------------------------------------------------
_BINOPS: dict[str, Callable[[int, int], int]] = {
    "DW_OP_and": lambda a, b: a & b,
    "DW_OP_or": lambda a, b: a | b,
    "DW_OP_xor": lambda a, b: a ^ b,
    "DW_OP_plus": lambda a, b: a + b,
    "DW_OP_minus": lambda a, b: a - b,
    "DW_OP_mul": lambda a, b: a * b,
    "DW_OP_shl": lambda a, b: a << b,
    "DW_OP_shr": lambda a, b: a >> b,
    "DW_OP_ge": lambda a, b: int(a >= b),
    "DW_OP_gt": lambda a, b: int(a > b),
    "DW_OP_le": lambda a, b: int(a <= b),
    "DW_OP_lt": lambda a, b: int(a < b),
    "DW_OP_eq": lambda a, b: int(a == b),
    "DW_OP_ne": lambda a, b: int(a != b),
}
MASK64 = (1 << 64) - 1
# DWARF register number -> perf's x86-64 user register index (X86Reg)
DWARF_TO_PERF = {0: 0, 1: 3, 2: 2, 3: 1, 4: 4, 5: 5, 6: 6, 7: 7, 8: 16, 9: 17, 10: 18, 11: 19, 12: 20, 13: 21,
                 14: 22, 15: 23, 16: 8}


def evaluate(ops: list[tuple[str, list[int]]], regs: dict[int, int], read: Any) -> int | None:
    """A DWARF stack-machine expression over known registers (DWARF numbering, 16 = rip) and memory
    (read(address) -> 8 bytes as int, or None). None when it uses what we cannot know."""
    st: list[int] = []
    try:
        for name, args in ops:
            if name.startswith("DW_OP_breg"):
                r = regs.get(int(name[10:]))
                if r is None:
                    return None
                st.append((r + args[0]) & MASK64)
            elif name.startswith("DW_OP_lit"):
                st.append(int(name[9:]))
            elif name.startswith("DW_OP_const"):
                st.append(args[0] & MASK64)
            elif name == "DW_OP_plus_uconst":
                st.append((st.pop() + args[0]) & MASK64)
            elif name == "DW_OP_deref":
                v = read(st.pop())
                if v is None:
                    return None
                st.append(v)
            elif name == "DW_OP_dup":
                st.append(st[-1])
            elif name == "DW_OP_drop":
                st.pop()
            elif name in _BINOPS:
                b, a = st.pop(), st.pop()
                st.append(_BINOPS[name](a, b) & MASK64)
            else:
                return None
    except IndexError:
        return None
    return st[-1] if st else None

