"""ELF files: build-id, load segments, symbols (pyelftools).

Offsets in profiles are addresses as the ELF file lays them out (its virtual
addresses), so symbols from .symtab/.dynsym apply to them directly.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from cyclescope.errors import DataError

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

# pyelftools is imported where it is used: the recording path needs only
# read_load_info (hand-written), and importing pyelftools costs ~55 ms.

DEBUG_ROOTS = ("/usr/lib/debug",)


@dataclass(frozen=True)
class LoadSegment:
    offset: int  # p_offset
    vaddr: int  # p_vaddr
    filesz: int
    memsz: int
    executable: bool


@dataclass(frozen=True)
class ElfInfo:
    path: str
    build_id: str | None
    elf_type: str  # ET_EXEC, ET_DYN, ...
    machine: str
    loads: tuple[LoadSegment, ...]
    debuglink: str | None
    has_symtab: bool
    has_debug_info: bool

    def vaddr_bias(self, file_offset: int) -> int | None:
        """vaddr - file_offset for the load segment holding ``file_offset``."""
        for seg in self.loads:
            if seg.offset <= file_offset < seg.offset + max(seg.filesz, 1):
                return seg.vaddr - seg.offset
        return None

    def file_offset(self, vaddr: int) -> int | None:
        for seg in self.loads:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return vaddr - seg.vaddr + seg.offset
        return None


_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_ET = {1: "ET_REL", 2: "ET_EXEC", 3: "ET_DYN", 4: "ET_CORE"}


def read_load_info(path: str, stream: BinaryIO | None = None) -> ElfInfo:
    """Build-id and load segments of a 64-bit little-endian ELF, from the program headers only.

    Written by hand rather than with pyelftools because the daemon runs this
    on every newly seen image under process churn: pyelftools' construct-based
    parsing costs 10-20 ms per file, this about 50 us. Symbols, sections and
    DWARF still go through pyelftools (read_elf_info, read_symbols).
    """
    try:
        with (contextlib.nullcontext(stream) if stream is not None else open(path, "rb")) as f:
            head = f.read(4096)
            if len(head) < _EHDR.size or head[:4] != b"\x7fELF":
                raise DataError(f"{path}: not an ELF file")
            if head[4] != 2 or head[5] != 1:
                f.seek(0)
                return read_elf_info(path, f)  # 32-bit or big-endian: let pyelftools handle it
            (_ident, e_type, e_machine, _v, _entry, phoff, _shoff, _flags, _ehsize, phentsize, phnum,
             *_rest) = _EHDR.unpack_from(head)
            if phentsize < _PHDR.size or phnum > 4096:
                raise DataError(f"{path}: malformed program headers")
            need = phoff + phentsize * phnum
            if need > len(head):
                f.seek(0)
                head = f.read(need)
            loads = []
            build_id = None
            for i in range(phnum):
                p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz, p_memsz, _al = _PHDR.unpack_from(
                    head, phoff + i * phentsize
                )
                if p_type == 1:  # PT_LOAD
                    loads.append(LoadSegment(p_offset, p_vaddr, p_filesz, p_memsz, bool(p_flags & 1)))
                elif p_type == 4 and build_id is None and p_filesz < 1 << 16:  # PT_NOTE
                    f.seek(p_offset)
                    build_id = build_id_from_notes(f.read(p_filesz))
    except (OSError, struct.error) as e:
        raise DataError(f"{path}: unreadable ELF headers ({e})") from None
    machine = "EM_X86_64" if e_machine == 62 else str(e_machine)
    return ElfInfo(path, build_id, _ET.get(e_type, str(e_type)), machine, tuple(loads), None, False, False)


def build_id_from_notes(data: bytes) -> str | None:
    """Parse a raw note section (as in /sys/kernel/notes) for NT_GNU_BUILD_ID."""
    off = 0
    while off + 12 <= len(data):
        namesz, descsz, ntype = np.frombuffer(data, dtype="<u4", count=3, offset=off)
        name_start = off + 12
        desc_start = name_start + ((int(namesz) + 3) & ~3)
        name = data[name_start : name_start + int(namesz)].rstrip(b"\0")
        if ntype == 3 and name == b"GNU":
            return data[desc_start : desc_start + int(descsz)].hex()
        off = desc_start + ((int(descsz) + 3) & ~3)
    return None


def _open_elf(stream: BinaryIO, path: str) -> ELFFile:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        return ELFFile(stream)
    except (ELFError, ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable ELF file ({e})") from None


def read_elf_info(path: str, stream: BinaryIO | None = None) -> ElfInfo:
    """Headers and section names (pyelftools): build-id, debuglink, whether symbols and DWARF exist."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.sections import NoteSection

    own = stream is None
    f = stream or open(path, "rb")  # noqa: SIM115 - closed below
    try:
        elf = _open_elf(f, path)
        loads = []
        for seg in elf.iter_segments():
            if seg["p_type"] == "PT_LOAD":
                loads.append(
                    LoadSegment(seg["p_offset"], seg["p_vaddr"], seg["p_filesz"], seg["p_memsz"],
                                bool(seg["p_flags"] & 1))
                )
        build_id = None
        debuglink = None
        has_symtab = False
        has_debug = False
        for sec in elf.iter_sections():
            if isinstance(sec, NoteSection) and build_id is None:
                for note in sec.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        build_id = note["n_desc"]
                        break
            elif sec.name == ".gnu_debuglink":
                raw = sec.data()
                debuglink = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
            elif sec.name == ".symtab":
                has_symtab = True
            elif sec.name in (".debug_info", ".zdebug_info"):
                has_debug = True
        return ElfInfo(
            path, build_id, elf["e_type"], elf["e_machine"], tuple(loads), debuglink, has_symtab, has_debug
        )
    except (ELFError, ValueError, KeyError) as e:
        raise DataError(f"{path}: malformed ELF ({e})") from None
    finally:
        if own:
            f.close()


def read_build_id(path: str) -> str | None:
    try:
        return read_elf_info(path).build_id
    except (OSError, DataError):
        return None


def find_debug_file(info: ElfInfo) -> str | None:
    """Separate debug info: /usr/lib/debug/.build-id/xx/rest.debug, then debuglink."""
    if info.build_id and len(info.build_id) > 2:
        for root in DEBUG_ROOTS:
            cand = os.path.join(root, ".build-id", info.build_id[:2], info.build_id[2:] + ".debug")
            if os.path.exists(cand):
                return cand
    if info.debuglink:
        d = os.path.dirname(os.path.realpath(info.path))
        for cand in (
            os.path.join(d, info.debuglink),
            os.path.join(d, ".debug", info.debuglink),
            *(os.path.join(root + d, info.debuglink) for root in DEBUG_ROOTS),
        ):
            if os.path.exists(cand) and os.path.realpath(cand) != os.path.realpath(info.path):
                return cand
    return None


# --- symbols ------------------------------------------------------------------


@dataclass(frozen=True)
class SymbolTable:
    """Function symbols sorted by start address; ``end`` is exclusive."""

    starts: np.ndarray  # uint64
    ends: np.ndarray  # uint64
    names: tuple[str, ...]

    @staticmethod
    def empty() -> SymbolTable:
        return SymbolTable(np.zeros(0, np.uint64), np.zeros(0, np.uint64), ())

    def __len__(self) -> int:
        return len(self.names)

    def lookup(self, addrs: np.ndarray) -> np.ndarray:
        """Index of the symbol containing each address, -1 where none does."""
        if not len(self.names):
            return np.full(len(addrs), -1, dtype=np.int64)
        a = addrs.astype(np.uint64, copy=False)
        idx = np.searchsorted(self.starts, a, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        ok &= a < self.ends[safe]
        return np.where(ok, idx, -1)

    def find(self, name: str) -> list[int]:
        return [i for i, n in enumerate(self.names) if n == name]

    @staticmethod
    def from_arrays(
        starts: np.ndarray, sizes: np.ndarray, names: list[str], text_end: int | None = None
    ) -> SymbolTable:
        """Vectorized :meth:`build` for large tables (kallsyms has 100k+ entries)."""
        if not len(starts):
            return SymbolTable.empty()
        names_arr = np.array(names, dtype=object)
        underscore = np.fromiter((n.startswith("_") for n in names), dtype=bool, count=len(names))
        lengths = np.fromiter((len(n) for n in names), dtype=np.int64, count=len(names))
        order = np.lexsort((lengths, underscore, -sizes.astype(np.int64), starts))
        st, sz, nm = starts[order].astype(np.uint64), sizes[order].astype(np.uint64), names_arr[order]
        first = np.ones(len(st), dtype=bool)
        first[1:] = st[1:] != st[:-1]
        st, sz, nm = st[first], sz[first], nm[first]
        nxt = np.empty_like(st)
        nxt[:-1] = st[1:]
        last_end = text_end if text_end and text_end > int(st[-1]) else int(st[-1]) + 1
        nxt[-1] = last_end
        ends = np.where(sz > 0, st + sz, nxt)
        return SymbolTable(st, ends, tuple(nm.tolist()))

    @staticmethod
    def build(entries: list[tuple[int, int, str]], text_end: int | None = None) -> SymbolTable:
        """From (start, size, name): dedupe aliases, give zero-size symbols the gap up to the next one."""
        if not entries:
            return SymbolTable.empty()
        entries.sort(key=lambda e: (e[0], -e[1], _name_rank(e[2])))
        starts: list[int] = []
        sizes: list[int] = []
        names: list[str] = []
        for start, size, name in entries:
            if starts and starts[-1] == start:
                if size > sizes[-1]:
                    sizes[-1] = size
                continue  # an alias of the symbol already kept
            starts.append(start)
            sizes.append(size)
            names.append(name)
        ends = []
        for i, (s, z) in enumerate(zip(starts, sizes, strict=True)):
            nxt = starts[i + 1] if i + 1 < len(starts) else None
            if z > 0:
                e = s + z
            elif nxt is not None:
                e = nxt
            else:
                e = text_end if text_end and text_end > s else s + 1
            ends.append(e)
        return SymbolTable(np.array(starts, np.uint64), np.array(ends, np.uint64), tuple(names))


def _name_rank(name: str) -> tuple[int, int, str]:
    # Prefer public, unversioned, short names among aliases at one address.
    return (name.startswith("_"), len(name), name)


# Elf64_Sym, little-endian: the symbol tables of x86-64 binaries, read as one array.
_SYM64 = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
                   ("size", "<u8")])
_STT_FUNC, _STT_GNU_IFUNC = 2, 10


def _iter_func_symbols(elf: ELFFile, section_names: tuple[str, ...], fast: bool = True) -> list[tuple[int, int, str]]:
    """The defined function symbols (address, size, name) of these symbol table sections.

    A 64-bit little-endian table is read as one numpy array, and only the kept symbols' names are
    decoded; pyelftools parses a symbol at a time, which took 2.6 s of CPU for libarrow's 104,000
    symbols (a daemon archives the symbols of every image it samples: bench/collectorcpu.py).
    Other classes and byte orders go through pyelftools. Either way the same list, in table order
    (tests/unit/test_images.py compares them). GNU_IFUNC symbols (libc's strcpy, memcpy...) name
    their resolvers; pyelftools calls their type STT_LOOS, which the check before this one missed."""
    from elftools.elf.sections import SymbolTableSection

    out: list[tuple[int, int, str]] = []
    for secname in section_names:
        sec = elf.get_section_by_name(secname)
        if not isinstance(sec, SymbolTableSection):
            continue
        if fast and elf.elfclass == 64 and elf.little_endian and sec["sh_entsize"] == _SYM64.itemsize:
            out += _func_symbols64(elf, sec)
            continue
        for sym in sec.iter_symbols():
            st = sym["st_info"]["type"]
            if st not in ("STT_FUNC", "STT_GNU_IFUNC", "STT_LOOS"):  # pyelftools names GNU_IFUNC (10) LOOS
                continue
            if sym["st_shndx"] == "SHN_UNDEF" or not sym["st_value"]:
                continue
            name = sym.name
            if not name:
                continue
            out.append((int(sym["st_value"]), int(sym["st_size"]), name))
    return out


def _func_symbols64(elf: ELFFile, sec: Any) -> list[tuple[int, int, str]]:
    data = sec.data()
    syms = np.frombuffer(data, _SYM64, count=len(data) // _SYM64.itemsize)
    kind = syms["info"] & 0xF
    keep = ((kind == _STT_FUNC) | (kind == _STT_GNU_IFUNC)) & (syms["shndx"] != 0) & (syms["value"] != 0)
    keep &= syms["name"] != 0
    syms = syms[keep]
    strtab = elf.get_section(sec["sh_link"]).data()
    out = []
    for off, value, size in zip(syms["name"].tolist(), syms["value"].tolist(), syms["size"].tolist(), strict=True):
        end = strtab.find(b"\0", off)
        name = strtab[off : end if end >= 0 else len(strtab)].decode("utf-8", errors="replace")
        if name:
            out.append((value, size, name))
    return out


def local_function_files(path: str) -> dict[int, tuple[str, str]]:
    """Local (static) function symbols of .symtab: address -> (name, the source file named by the
    FILE symbol before it). Tools that know functions by name qualify these (BOLT: name/file/N)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.sections import SymbolTableSection

    out: dict[int, tuple[str, str]] = {}
    try:
        with open(path, "rb") as f:
            sec = _open_elf(f, path).get_section_by_name(".symtab")
            if not isinstance(sec, SymbolTableSection):
                return out
            file = ""
            for sym in sec.iter_symbols():
                t = sym["st_info"]["type"]
                if t == "STT_FILE":
                    file = sym.name
                elif (t == "STT_FUNC" and sym["st_info"]["bind"] == "STB_LOCAL" and sym.name
                      and sym["st_shndx"] != "SHN_UNDEF"):
                    out.setdefault(int(sym["st_value"]), (sym.name, file))
    except (ELFError, ValueError, KeyError) as e:
        raise DataError(f"{path}: malformed symbol table ({e})") from None
    return out


def _plt_symbols(elf: ELFFile) -> list[tuple[int, int, str]]:
    """Synthetic ``name@plt`` symbols for PLT stubs, as objdump and perf make them.

    With .plt.sec (IBT) stub i is relocation i of .rela.plt; without it, stub
    i+1 of .plt (stub 0 is the resolver trampoline).
    """
    from elftools.elf.relocation import RelocationSection

    rela = elf.get_section_by_name(".rela.plt")
    if not isinstance(rela, RelocationSection):
        return []
    symtab = elf.get_section(rela["sh_link"])
    sec = elf.get_section_by_name(".plt.sec")
    first = 0
    if sec is None:
        sec = elf.get_section_by_name(".plt")
        first = 1
    if sec is None or not hasattr(symtab, "get_symbol"):
        return []
    entsize = 16
    out = []
    for i, r in enumerate(rela.iter_relocations()):
        try:
            name = symtab.get_symbol(r["r_info_sym"]).name
        except (IndexError, KeyError, AttributeError):
            continue
        if name:
            out.append((int(sec["sh_addr"]) + (i + first) * entsize, entsize, name + "@plt"))
    return out


R_X86_64_RELATIVE = 8
_RELA_DTYPE = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])


@lru_cache(maxsize=8)
def relative_relocations(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, values) of the R_X86_64_RELATIVE relocations of ``path``, sorted by address.

    In a position-independent executable or library, a table of code addresses
    (a computed-goto dispatch table, a vtable) may hold zeros in the file (lld
    writes them; GNU ld writes the addends there too): the dynamic loader
    writes base + addend. Reading such a table as the program sees it
    (relative to its own vaddrs) means applying these addends.
    pyelftools finds the sections; the entries are read as one numpy array
    (iterating pyelftools' relocation objects costs ~10 us each, and large
    libraries have hundreds of thousands).
    """
    from elftools.elf.relocation import RelocationSection

    with open(path, "rb") as f:
        elf = _open_elf(f, path)
        if elf["e_machine"] != "EM_X86_64":
            return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
        parts = []
        for sec in elf.iter_sections():
            if isinstance(sec, RelocationSection) and sec.is_RELA() and sec["sh_entsize"] == _RELA_DTYPE.itemsize:
                data = sec.data()
                parts.append(np.frombuffer(data[: len(data) - len(data) % _RELA_DTYPE.itemsize], _RELA_DTYPE))
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    r = np.concatenate(parts)
    r = r[(r["info"] & 0xFFFFFFFF) == R_X86_64_RELATIVE]
    order = np.argsort(r["offset"], kind="stable")
    return r["offset"][order].copy(), r["addend"][order].astype(np.uint64)


def apply_relative(path: str, address: int, data: bytes) -> bytes:
    """``data`` read from the file at vaddr ``address``, with the RELATIVE relocations inside it
    applied as if loaded at the file's own addresses (8-byte slots)."""
    offs, vals = relative_relocations(path)
    if not len(offs):
        return data
    lo = int(np.searchsorted(offs, np.uint64(address)))
    hi = int(np.searchsorted(offs, np.uint64(address + len(data))))
    if lo == hi:
        return data
    out = bytearray(data)
    for o, v in zip(offs[lo:hi].tolist(), vals[lo:hi].tolist(), strict=True):
        k = o - address
        if k + 8 <= len(out):
            out[k : k + 8] = int(v).to_bytes(8, "little")
    return bytes(out)


def read_symbols(path: str, stream: BinaryIO | None = None, demangle: bool = True) -> SymbolTable:
    """.symtab and .dynsym of ``path``, plus those of its separate debug file."""
    from elftools.common.exceptions import ELFError

    own = stream is None
    f = stream or open(path, "rb")  # noqa: SIM115 - closed below
    try:
        elf = _open_elf(f, path)
        entries = _iter_func_symbols(elf, (".symtab", ".dynsym"))
        with contextlib.suppress(ELFError, ValueError, KeyError):  # a bad .rela.plt costs only the PLT names
            entries += _plt_symbols(elf)
        text = elf.get_section_by_name(".text")
        text_end = int(text["sh_addr"] + text["sh_size"]) if text is not None else None
    except (ELFError, ValueError, KeyError) as e:
        raise DataError(f"{path}: malformed symbol tables ({e})") from None
    finally:
        if own:
            f.close()
    if own:
        try:
            info = read_elf_info(path)
            dbg = find_debug_file(info) if not info.has_symtab else None
        except (OSError, DataError):
            dbg = None
        if dbg:
            try:
                with open(dbg, "rb") as g:
                    entries += _iter_func_symbols(_open_elf(g, dbg), (".symtab",))
            except (OSError, DataError, ELFError):
                pass  # a broken debug file: the binary's own symbols still stand
    if demangle:
        entries = [(s, z, demangle_name(n)) for s, z, n in entries]
    return SymbolTable.build(entries, text_end)


def symbols_from_bytes(data: bytes, name: str) -> SymbolTable:
    return read_symbols(name, io.BytesIO(data))


def info_from_bytes(data: bytes, name: str) -> ElfInfo:
    return read_load_info(name, io.BytesIO(data))


@lru_cache(maxsize=65536)
def demangle_name(name: str) -> str:
    """C++ (Itanium ABI) names to their source form; anything else unchanged."""
    base, sep, version = name.partition("@")
    if not base.startswith("_Z"):
        return name
    try:
        import cxxfilt

        out = str(cxxfilt.demangle(base))
    except Exception:  # cxxfilt raises its own InvalidName, or fails to load libstdc++
        return name
    return out + (sep + version if sep else "")
