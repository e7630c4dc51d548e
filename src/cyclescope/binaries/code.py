"""Procedures and their code per image, from the binaries: what analyses of code need
(bounds, bytes, call-target names, jump tables as the loaded program sees them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cyclescope.binaries.symbolize import Symbolizer
from cyclescope.images.disasm import read_code
from cyclescope.images.elf import ElfInfo, SymbolTable, apply_relative, read_load_info
from cyclescope.images.registry import ImageInfo


@dataclass(frozen=True)
class Procedure:
    start: int
    end: int
    name: str


@dataclass
class Binary:
    """One image's file, its load segments and symbols."""

    path: str
    elf: ElfInfo
    table: SymbolTable

    def procedure_starts(self, offsets: np.ndarray) -> np.ndarray:
        """The start of the procedure holding each offset (-1 where none does)."""
        i = self.table.lookup(offsets.astype(np.uint64))
        out = np.full(len(offsets), -1, np.int64)
        ok = i >= 0
        out[ok] = self.table.starts[i[ok]].astype(np.int64)
        return out

    def procedure(self, start: int) -> Procedure | None:
        i = int(self.table.lookup(np.array([start], np.uint64))[0])
        if i < 0 or int(self.table.starts[i]) != start:
            return None
        return Procedure(start, int(self.table.ends[i]), self.table.names[i])

    def code(self, start: int, end: int) -> bytes:
        return read_code(self.path, start, end, self.elf)

    def read(self, addr: int, n: int) -> bytes | None:
        """Bytes as the loaded program sees them (a PIE's relative relocations applied); None
        outside the file."""
        try:
            data = read_code(self.path, addr, addr + n, self.elf)
            return apply_relative(self.path, addr, data) if self.elf.elf_type == "ET_DYN" else data
        except Exception:  # an address outside the file, or unreadable relocations
            return None

    def name_at(self, addr: int) -> str | None:
        i = int(self.table.lookup(np.array([addr], np.uint64))[0])
        return self.table.names[i] if i >= 0 else None


def open_binary(info: ImageInfo, sym: Symbolizer) -> Binary | None:
    """The binary of an ELF image with virtual-address offsets, or None (not ELF, gone, changed,
    unreadable, no symbols)."""
    if info.kind != "elf" or info.offsets != "vaddr":
        return None
    path = sym.binary(info).path
    if path is None:
        return None
    try:
        elf = read_load_info(path)
    except Exception:  # unreadable or not ELF after all: nothing to analyze
        return None
    table = sym.table(info)
    if not len(table):
        return None
    return Binary(path, elf, table)


class BinaryCache:
    """``open_binary`` per image index of an image table, remembered (None included)."""

    def __init__(self, info_of: Callable[[int], ImageInfo], sym: Symbolizer | None = None) -> None:
        self.info_of = info_of
        self.sym = sym or Symbolizer(None)
        self._open: dict[int, Binary | None] = {}

    def get(self, img: int) -> Binary | None:
        if img not in self._open:
            self._open[img] = open_binary(self.info_of(img), self.sym)
        return self._open[img]
