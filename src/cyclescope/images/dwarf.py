"""DWARF line tables, inlined frames and function ranges, decoded lazily and cached.

Only the compilation units holding the addresses asked about are decoded:
.debug_aranges (or, without it, each CU's top DIE) says which CU holds an
address, and that CU's line program and DIE tree are decoded once and cached
per build-id (see cache.py). pyelftools does the parsing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from cyclescope.errors import DataError
from cyclescope.images.cache import Cache

if TYPE_CHECKING:
    from elftools.dwarf.compileunit import CompileUnit
    from elftools.dwarf.die import DIE
    from elftools.dwarf.dwarfinfo import DWARFInfo


@dataclass(frozen=True)
class LineTable:
    """Rows of a line program, sorted by address; ``end`` marks end_sequence rows."""

    address: np.ndarray
    file: np.ndarray
    line: np.ndarray
    column: np.ndarray
    discriminator: np.ndarray
    end: np.ndarray
    files: tuple[str, ...]

    @staticmethod
    def empty() -> LineTable:
        z = np.zeros(0, np.int64)
        return LineTable(np.zeros(0, np.uint64), z, z, z, z, np.zeros(0, bool), ())

    def lookup(self, addrs: np.ndarray) -> np.ndarray:
        """Row index describing each address, -1 where none does."""
        if not len(self.address):
            return np.full(len(addrs), -1, np.int64)
        i = np.searchsorted(self.address, addrs.astype(np.uint64), side="right").astype(np.int64) - 1
        ok = i >= 0
        safe = np.where(ok, i, 0)
        ok &= ~self.end[safe]
        return np.where(ok, i, -1)

    def to_arrow(self) -> pa.Table:
        return pa.table({
            "address": pa.array(self.address, pa.uint64()), "file": pa.array(self.file, pa.int32()),
            "line": pa.array(self.line, pa.int32()), "column": pa.array(self.column, pa.int32()),
            "discriminator": pa.array(self.discriminator, pa.int32()), "end": pa.array(self.end, pa.bool_()),
        }).replace_schema_metadata({b"files": "\0".join(self.files).encode()})

    @staticmethod
    def from_arrow(t: pa.Table) -> LineTable:
        raw = (t.schema.metadata or {}).get(b"files", b"")
        files = tuple(raw.decode().split("\0")) if raw else ()
        return LineTable(
            t.column("address").to_numpy().astype(np.uint64), t.column("file").to_numpy().astype(np.int64),
            t.column("line").to_numpy().astype(np.int64), t.column("column").to_numpy().astype(np.int64),
            t.column("discriminator").to_numpy().astype(np.int64), t.column("end").to_numpy().astype(bool), files,
        )


@dataclass(frozen=True)
class Scope:
    """An inlined call or a function: an address range with a name and a source position."""

    low: int
    high: int
    depth: int  # 0 for functions, 1.. for inlined calls, nested
    name: str
    file: str  # functions: where declared; inlined calls: the call site's file
    line: int  # functions: DW_AT_decl_line; inlined calls: DW_AT_call_line
    inlined: bool
    linkage: str = ""  # the (inlined) function's linkage name, not demangled: how compilers' profiles name it
    decl_line: int = 0  # the (inlined) function's own DW_AT_decl_line
    discriminator: int = 0  # inlined calls: DW_AT_GNU_discriminator of the call site


@dataclass(frozen=True)
class Scopes:
    items: tuple[Scope, ...]

    def functions(self) -> list[Scope]:
        return [s for s in self.items if not s.inlined]

    def stack_at(self, addr: int) -> list[Scope]:
        """Function, then inlined calls from outermost to innermost, that contain ``addr``."""
        hit = [s for s in self.items if s.low <= addr < s.high]
        return sorted(hit, key=lambda s: (s.depth, s.high - s.low))

    def to_arrow(self) -> pa.Table:
        it = self.items
        return pa.table({
            "low": pa.array([s.low for s in it], pa.uint64()), "high": pa.array([s.high for s in it], pa.uint64()),
            "depth": pa.array([s.depth for s in it], pa.int32()), "name": pa.array([s.name for s in it]),
            "file": pa.array([s.file for s in it]), "line": pa.array([s.line for s in it], pa.int32()),
            "inlined": pa.array([s.inlined for s in it], pa.bool_()), "linkage": pa.array([s.linkage for s in it]),
            "decl_line": pa.array([s.decl_line for s in it], pa.int32()),
            "discriminator": pa.array([s.discriminator for s in it], pa.int64()),
        })

    @staticmethod
    def from_arrow(t: pa.Table) -> Scopes:
        cols = [t.column(c).to_pylist() for c in ("low", "high", "depth", "name", "file", "line", "inlined",
                                                   "linkage", "decl_line", "discriminator")]
        return Scopes(tuple(Scope(*row) for row in zip(*cols, strict=True)))


@dataclass(frozen=True)
class SourcePos:
    file: str
    line: int
    column: int = 0
    discriminator: int = 0


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


class DwarfIndex:
    """Lazy, cached access to one image's DWARF."""

    def __init__(self, path: str, key: str, cache: Cache | None = None) -> None:
        self.path = path
        self.key = key
        self.cache = cache if cache is not None else Cache()
        self._elf: Any = None
        self._file: Any = None
        self._dwarf: DWARFInfo | None = None
        self._ranges: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._lines: dict[int, LineTable] = {}
        self._scopes: dict[int, Scopes] = {}
        self.decoded_cus = 0

    # --- opening ---------------------------------------------------------------------
    def _info(self) -> DWARFInfo | None:
        if self._dwarf is None:
            from elftools.common.exceptions import ELFError
            from elftools.elf.elffile import ELFFile

            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open while decoding
                self._elf = ELFFile(self._file)
                if not self._elf.has_dwarf_info() or self._elf.get_section_by_name(".debug_info") is None:
                    return None
                self._dwarf = self._elf.get_dwarf_info()
            except (OSError, ELFError, ValueError) as e:
                raise DataError(f"{self.path}: unreadable DWARF ({e})") from None
        return self._dwarf

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # --- which CU holds an address --------------------------------------------------------
    def cu_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(starts, ends, cu offsets), sorted by start."""
        if self._ranges is not None:
            return self._ranges
        t = self.cache.load(self.key, "cu_ranges")
        if t is None:
            rows = self._decode_cu_ranges()
            rows.sort()
            t = pa.table({"start": pa.array([r[0] for r in rows], pa.uint64()),
                          "end": pa.array([r[1] for r in rows], pa.uint64()),
                          "cu": pa.array([r[2] for r in rows], pa.uint64())})
            self.cache.save(self.key, "cu_ranges", t)
        self._ranges = (t.column("start").to_numpy().astype(np.uint64), t.column("end").to_numpy().astype(np.uint64),
                        t.column("cu").to_numpy().astype(np.int64))
        return self._ranges

    def _decode_cu_ranges(self) -> list[tuple[int, int, int]]:
        info = self._info()
        if info is None:
            return []
        rows: list[tuple[int, int, int]] = []
        ar = info.get_aranges() if info.has_debug_info else None
        if ar is not None and ar.entries:
            for e in ar.entries:
                if e.length:
                    rows.append((int(e.begin_addr), int(e.begin_addr + e.length), int(e.info_offset)))
            return rows
        for cu in info.iter_CUs():  # no .debug_aranges (clang's default): each CU's top DIE
            top = cu.get_top_DIE()
            for lo, hi in self._die_ranges(top, cu):
                rows.append((lo, hi, int(cu.cu_offset)))
        return rows

    def cu_at(self, addrs: np.ndarray) -> np.ndarray:
        starts, ends, cus = self.cu_ranges()
        if not len(starts):
            return np.full(len(addrs), -1, np.int64)
        i = np.searchsorted(starts, addrs.astype(np.uint64), side="right").astype(np.int64) - 1
        ok = i >= 0
        safe = np.where(ok, i, 0)
        ok &= addrs.astype(np.uint64) < ends[safe]
        return np.where(ok, cus[safe], -1)

    # --- line tables ---------------------------------------------------------------------
    def lines(self, cu_offset: int) -> LineTable:
        lt = self._lines.get(cu_offset)
        if lt is not None:
            return lt
        t = self.cache.load(self.key, f"lines-{cu_offset}")
        if t is not None:
            lt = LineTable.from_arrow(t)
        else:
            lt = self._decode_lines(cu_offset)
            self.decoded_cus += 1
            self.cache.save(self.key, f"lines-{cu_offset}", lt.to_arrow())
        self._lines[cu_offset] = lt
        return lt

    def _cu(self, cu_offset: int) -> CompileUnit:
        info = self._info()
        assert info is not None
        return info.get_CU_at(cu_offset)

    def _file_names(self, lp: Any, cu: CompileUnit) -> list[str]:
        hdr = lp.header
        version = int(hdr["version"])
        top = cu.get_top_DIE()
        comp_dir = _s(top.attributes["DW_AT_comp_dir"].value) if "DW_AT_comp_dir" in top.attributes else ""
        dirs = [_s(d) for d in hdr["include_directory"]]
        names = []
        for fe in hdr["file_entry"]:
            name = _s(fe.name)
            di = int(fe.dir_index)
            if version >= 5:
                d = dirs[di] if di < len(dirs) else ""
            else:
                d = comp_dir if di == 0 else (dirs[di - 1] if di - 1 < len(dirs) else "")
            if d and not os.path.isabs(d) and comp_dir:
                d = os.path.join(comp_dir, d)
            names.append(os.path.normpath(os.path.join(d, name)) if d and not os.path.isabs(name) else name)
        return names

    def _decode_lines(self, cu_offset: int) -> LineTable:
        cu = self._cu(cu_offset)
        info = self._info()
        assert info is not None
        lp = info.line_program_for_CU(cu)
        if lp is None:
            return LineTable.empty()
        files = self._file_names(lp, cu)
        base = 0 if int(lp.header["version"]) >= 5 else 1
        addr: list[int] = []
        fil: list[int] = []
        lin: list[int] = []
        col: list[int] = []
        dis: list[int] = []
        end: list[bool] = []
        for entry in lp.get_entries():
            st = entry.state
            if st is None:
                continue
            addr.append(st.address)
            fil.append(st.file - base)
            lin.append(st.line)
            col.append(st.column)
            dis.append(st.discriminator)
            end.append(st.end_sequence)
        a = np.array(addr, np.uint64)
        order = np.lexsort((~np.array(end, bool), a))  # at equal addresses a new sequence's row wins
        lt = LineTable(a[order], np.array(fil, np.int64)[order], np.array(lin, np.int64)[order],
                       np.array(col, np.int64)[order], np.array(dis, np.int64)[order],
                       np.array(end, bool)[order], tuple(files))
        return _dedupe_addresses(lt)

    def positions(self, addrs: np.ndarray) -> list[SourcePos | None]:
        """Source position of each address (None without line information)."""
        out: list[SourcePos | None] = [None] * len(addrs)
        cus = self.cu_at(addrs)
        for cu in np.unique(cus[cus >= 0]).tolist():
            sel = np.flatnonzero(cus == cu)
            lt = self.lines(int(cu))
            rows = lt.lookup(addrs[sel])
            for k, r in zip(sel.tolist(), rows.tolist(), strict=True):
                if r >= 0:
                    f = int(lt.file[r])
                    name = lt.files[f] if 0 <= f < len(lt.files) else "?"
                    out[k] = SourcePos(name, int(lt.line[r]), int(lt.column[r]), int(lt.discriminator[r]))
        return out

    # --- functions and inlined calls --------------------------------------------------------------
    def scopes(self, cu_offset: int) -> Scopes:
        sc = self._scopes.get(cu_offset)
        if sc is not None:
            return sc
        t = self.cache.load(self.key, f"scopes2-{cu_offset}")
        if t is not None:
            sc = Scopes.from_arrow(t)
        else:
            sc = self._decode_scopes(cu_offset)
            self.cache.save(self.key, f"scopes2-{cu_offset}", sc.to_arrow())
        self._scopes[cu_offset] = sc
        return sc

    def scopes_at(self, addr: int) -> list[Scope]:
        cu = int(self.cu_at(np.array([addr], np.uint64))[0])
        return self.scopes(cu).stack_at(addr) if cu >= 0 else []

    def _decode_scopes(self, cu_offset: int) -> Scopes:
        from cyclescope.images.elf import demangle_name

        cu = self._cu(cu_offset)
        info = self._info()
        assert info is not None
        lp = info.line_program_for_CU(cu)
        files = self._file_names(lp, cu) if lp is not None else []
        base = 0 if lp is not None and int(lp.header["version"]) >= 5 else 1
        names: dict[int, str] = {}  # DIE offset -> linkage name
        demangled: dict[str, str] = {}
        out: list[Scope] = []

        def file_of(idx: int) -> str:
            i = idx - base
            return files[i] if 0 <= i < len(files) else ""

        def walk(die: DIE, depth: int) -> None:
            for child in die.iter_children():
                tag = child.tag
                if tag == "DW_TAG_subprogram" or tag == "DW_TAG_inlined_subroutine":
                    inlined = tag == "DW_TAG_inlined_subroutine"
                    ranges = self._die_ranges(child, cu)
                    if ranges:
                        raw = self._die_name(child, names)
                        name = demangled.get(raw)
                        if name is None:
                            name = demangled[raw] = demangle_name(raw)
                        a = child.attributes
                        df, decl = self._decl(child, file_of)
                        disc = 0
                        if inlined:
                            f = file_of(int(a["DW_AT_call_file"].value)) if "DW_AT_call_file" in a else ""
                            ln = int(a["DW_AT_call_line"].value) if "DW_AT_call_line" in a else 0
                            if "DW_AT_GNU_discriminator" in a:
                                disc = int(a["DW_AT_GNU_discriminator"].value)
                        else:
                            f, ln = df, decl
                        for lo, hi in ranges:
                            out.append(Scope(lo, hi, depth + 1 if inlined else 0, name, f, ln, inlined, raw, decl,
                                             disc))
                    walk(child, depth + 1 if inlined else depth)
                elif tag in ("DW_TAG_lexical_block", "DW_TAG_namespace", "DW_TAG_class_type",
                             "DW_TAG_structure_type", "DW_TAG_try_block", "DW_TAG_catch_block"):
                    walk(child, depth)

        walk(cu.get_top_DIE(), 0)
        return Scopes(tuple(out))

    def _decl(self, die: DIE, file_of: Any) -> tuple[str, int]:
        d: DIE | None = die
        for _ in range(4):  # follow DW_AT_specification / abstract_origin to the declaration
            if d is None:
                break
            a = d.attributes
            if "DW_AT_decl_line" in a:
                f = file_of(int(a["DW_AT_decl_file"].value)) if "DW_AT_decl_file" in a else ""
                return f, int(a["DW_AT_decl_line"].value)
            nxt = "DW_AT_specification" if "DW_AT_specification" in a else (
                "DW_AT_abstract_origin" if "DW_AT_abstract_origin" in a else None)
            d = d.get_DIE_from_attribute(nxt) if nxt else None
        return "", 0

    def _die_name(self, die: DIE, memo: dict[int, str]) -> str:
        """The DIE's linkage name (else its name), through abstract origins; not demangled."""
        got = memo.get(die.offset)
        if got is not None:
            return got
        d: DIE | None = die
        name = "?"
        for _ in range(4):
            if d is None:
                break
            a = d.attributes
            for attr in ("DW_AT_linkage_name", "DW_AT_MIPS_linkage_name", "DW_AT_name"):
                if attr in a:
                    name = _s(a[attr].value)
                    break
            else:
                nxt = "DW_AT_abstract_origin" if "DW_AT_abstract_origin" in a else (
                    "DW_AT_specification" if "DW_AT_specification" in a else None)
                d = d.get_DIE_from_attribute(nxt) if nxt else None
                continue
            break
        memo[die.offset] = name
        return name

    def _die_ranges(self, die: DIE, cu: CompileUnit) -> list[tuple[int, int]]:
        a = die.attributes
        if "DW_AT_low_pc" in a and "DW_AT_high_pc" in a:
            lo = int(a["DW_AT_low_pc"].value)
            hp = a["DW_AT_high_pc"]
            hi = int(hp.value) if hp.form == "DW_FORM_addr" else lo + int(hp.value)
            return [(lo, hi)] if hi > lo else []
        if "DW_AT_ranges" in a:
            info = self._info()
            assert info is not None
            rl = info.range_lists()
            if rl is None:
                return []
            try:
                entries = rl.get_range_list_at_offset(int(a["DW_AT_ranges"].value), cu=cu)
            except Exception:  # pyelftools raises several types on malformed lists
                return []
            top = cu.get_top_DIE()
            base = int(top.attributes["DW_AT_low_pc"].value) if "DW_AT_low_pc" in top.attributes else 0
            out = []
            from elftools.dwarf.ranges import BaseAddressEntry

            for e in entries:
                if isinstance(e, BaseAddressEntry):
                    base = int(e.base_address)
                    continue
                lo = int(e.begin_offset) if e.is_absolute else base + int(e.begin_offset)
                hi = int(e.end_offset) if e.is_absolute else base + int(e.end_offset)
                if hi > lo:
                    out.append((lo, hi))
            return out
        if "DW_AT_low_pc" in a and die.tag == "DW_TAG_compile_unit":
            return []
        return []


def _dedupe_addresses(lt: LineTable) -> LineTable:
    """Where several rows share an address, the last one describes the instruction there."""
    a = lt.address
    if len(a) < 2:
        return lt
    keep = np.ones(len(a), bool)
    keep[:-1] = a[1:] != a[:-1]
    return LineTable(a[keep], lt.file[keep], lt.line[keep], lt.column[keep], lt.discriminator[keep], lt.end[keep],
                     lt.files)


def dwarf_source(path: str, key: str | None = None, cache: Cache | None = None) -> str | None:
    """The file that holds the DWARF of ``path``: itself, or its separate debug file.

    Remembered per image in the cache: answering it parses the section headers
    with pyelftools, whose import alone costs a warm `list` 0.1 s.
    """
    import json

    cache = cache if cache is not None else Cache()
    memo = cache.path(key, "dwarf-source").with_suffix(".json") if key and cache.enabled else None
    if memo is not None:
        try:
            got = json.loads(memo.read_text())
            if got.get("binary") == path and (got["source"] is None or os.path.exists(got["source"])):
                return got["source"]  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError):
            pass
    from cyclescope.images.elf import find_debug_file, read_elf_info

    try:
        info = read_elf_info(path)
    except (OSError, DataError):
        return None
    src = path if info.has_debug_info else find_debug_file(info)
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text(json.dumps({"binary": path, "source": src}))
        except OSError:
            pass
    return src
