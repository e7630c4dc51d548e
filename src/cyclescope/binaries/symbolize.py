"""Finding the binary behind an image and its symbols, at analysis time.

An image is looked for, in order: symbols stored in the database (kernel,
vdso, JIT), the path it was recorded under (if it still has the same
build-id, or size and mtime when it has none), the copy archived in the
database, and /usr/lib/debug/.build-id. A binary that changed since it was
profiled is never used: its symbols would be silently wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from cyclescope.db import symbols as symstore
from cyclescope.db.layout import Database
from cyclescope.errors import DataError
from cyclescope.images.cache import Cache
from cyclescope.images.elf import SymbolTable, read_elf_info, read_load_info, read_symbols
from cyclescope.images.registry import ImageInfo


@dataclass(frozen=True)
class BinaryLookup:
    path: str | None  # a file that is this image, or None
    problem: str | None  # why none was found, for the user


def find_binary(db: Database | None, info: ImageInfo) -> BinaryLookup:
    if info.kind not in ("elf", "vdso"):
        return BinaryLookup(None, None)
    candidates: list[str] = []
    if info.kind == "elf":
        candidates.append(info.path)
    if db is not None:
        archived = symstore.binary_path(db, info.key.split("#")[0])
        candidates.append(str(archived))
    if info.build_id:
        bid = info.build_id
        candidates.append(f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}")
    problem = None
    for cand in candidates:
        if not os.path.exists(cand):
            continue
        if info.build_id:
            try:
                got = read_load_info(cand).build_id
            except (OSError, DataError):
                continue
            if got != info.build_id:
                problem = problem or f"{info.path} has changed since it was profiled (build-id differs)"
                continue
        elif info.size is not None and cand == info.path:
            st = os.stat(cand)
            if st.st_size != info.size or (info.mtime is not None and int(st.st_mtime) != info.mtime):
                problem = problem or f"{info.path} has changed since it was profiled (size or mtime differs)"
                continue
        return BinaryLookup(cand, None)
    if problem is None:
        problem = f"{info.path}: binary not found (deleted or moved since it was profiled)"
    return BinaryLookup(None, problem)


class Symbolizer:
    """Symbol tables per image key: in memory for one report, on disk (per build-id) across reports."""

    def __init__(self, db: Database | None, cache: Cache | None = None) -> None:
        self.db = db
        self.cache = cache or Cache()
        self._tables: dict[str, SymbolTable] = {}
        self._binaries: dict[str, BinaryLookup] = {}
        self.problems: dict[str, str] = {}

    def binary(self, info: ImageInfo) -> BinaryLookup:
        b = self._binaries.get(info.key)
        if b is None:
            b = find_binary(self.db, info)
            self._binaries[info.key] = b
            if b.problem:
                self.problems[info.key] = b.problem
        return b

    def table(self, info: ImageInfo) -> SymbolTable:
        t = self._tables.get(info.key)
        if t is not None:
            return t
        t = self._load(info)
        self._tables[info.key] = t
        return t

    def _load(self, info: ImageInfo) -> SymbolTable:
        if info.kind == "unknown":
            return SymbolTable.empty()
        if self.db is not None and info.kind in ("kernel", "module", "vdso", "jit", "python"):
            stored = symstore.read_symbols(self.db, info.key)
            if stored is not None:
                return stored
            if info.kind != "vdso":
                self.problems.setdefault(info.key, f"{info.path}: no symbols were stored with the profile")
                return SymbolTable.empty()
        b = self.binary(info)
        if b.path is None:
            # The binary is gone, but the daemon may have kept its symbol table.
            if self.db is not None and info.kind == "elf":
                stored = symstore.read_symbols(self.db, info.key.split("#")[0])
                if stored is not None:
                    self.problems.pop(info.key, None)
                    return stored
            return SymbolTable.empty()
        cacheable = bool(info.build_id) and info.key.split("#")[0] == info.build_id
        if cacheable:
            t = self.cache.load(info.key, "symbols")
            if t is not None:
                return SymbolTable(t.column("start").to_numpy().astype(np.uint64),
                                   t.column("end").to_numpy().astype(np.uint64), tuple(t.column("name").to_pylist()))
        try:
            table = read_symbols(b.path)
        except (OSError, DataError) as e:
            self.problems.setdefault(info.key, str(e))
            return SymbolTable.empty()
        if cacheable:
            import pyarrow as pa

            self.cache.save(info.key, "symbols", pa.table({
                "start": pa.array(table.starts, pa.uint64()), "end": pa.array(table.ends, pa.uint64()),
                "name": pa.array(list(table.names), pa.string())}))
        return table

    def offsets_to_vaddr(self, info: ImageInfo, offsets: np.ndarray) -> np.ndarray:
        """Images recorded with raw file offsets (ELF unreadable then) → virtual addresses."""
        if info.offsets != "file":
            return offsets
        b = self.binary(info)
        if b.path is None:
            return offsets
        try:
            elf = read_elf_info(b.path)
        except (OSError, DataError):
            return offsets
        out = offsets.astype(np.uint64).copy()
        for seg in elf.loads:
            m = (offsets >= seg.offset) & (offsets < seg.offset + seg.filesz)
            out[m] = offsets[m] - np.uint64(seg.offset) + np.uint64(seg.vaddr)
        return out
