"""What a flush writes besides the processors' files: the flat counts as a segment with its
metadata, the symbols of images whose sources do not last (kernel, modules, vDSO, JIT maps), the
profiled binaries archived by build-id; and compaction of an epoch's segments, in a child process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from cyclescope import trim_heap
from cyclescope.arrays import distinct
from cyclescope.collect.aggregate import Counts
from cyclescope.collect.helpers import run_helper
from cyclescope.db import symbols as symstore
from cyclescope.db.layout import Database, safe_host
from cyclescope.db.segment import Chunks, SegmentMeta, build_table, write_segment
from cyclescope.errors import CycleScopeError
from cyclescope.images.cache import Cache
from cyclescope.images.elf import SymbolTable
from cyclescope.images.kernel import KernelRange, boot_stamp, forget_kallsyms, kernel_symbols, read_kallsyms
from cyclescope.images.maps import Mapper
from cyclescope.images.procfs import parse_perf_map, read_perf_map
from cyclescope.images.registry import ImageTable, Unknown

if TYPE_CHECKING:
    from cyclescope.fleet.ship import Destination

# Rows of a segment built and written at a time (a row group each): 512 KiB of Arrow columns. A
# flush of 342k rows peaked 20 MiB above its start at 256k rows a part, 13 MiB at 64k; writing
# 200k rows as the daemon does (Arrow's system pool, glibc's mmap threshold at 256 KiB) peaked
# 4 MiB above its start at 64k rows a part, 2 MiB at 16k, the file 0.9% larger.
CHUNK_ROWS = 1 << 14


class Flusher:
    def __init__(self, db: Database, host: str, table: ImageTable, mapper: Mapper,
                 kernel_ranges: list[KernelRange], vdso: bytes | None, archive: str) -> None:
        self.db = db
        self.host = host
        self.table = table
        self.mapper = mapper
        self.kernel_ranges = kernel_ranges
        self.vdso = vdso
        self.archive = archive  # "binaries", "symbols" or "none"
        self.lean = False  # a daemon's: parse the vdso's symbols in a child, as the binaries' are
        self._symbols_written: set[str] = set()
        self._archived: set[str] = set()
        # One worker: archiving and compaction run beside the drain loop, one job at a time.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compact")
        self._compacting: concurrent.futures.Future[Any] | None = None
        self._shipping: concurrent.futures.Future[Any] | None = None
        self._dest: Destination | None = None
        self.offline: str | None = None  # why the last shipping pass stopped short
        self.shipped = 0  # files stored at the destination
        # Symbol tables of image kinds the collector itself names (kind -> image key -> table).
        self.symbol_sources: dict[str, Callable[[str], SymbolTable | None]] = {}

    def write(self, epoch: int, counts: Counts, meta: SegmentMeta, events: list[str]) -> str:
        """One segment of ``counts`` (described in ``meta``) into ``epoch``; the symbols and binaries
        its images need follow."""
        self._describe(counts, meta)
        keys, comms = self.table.keys(), self.mapper.comms.names

        def part(lo: int, hi: int) -> pa.Table:
            w = counts.weight[lo:hi] if counts.weight is not None else None
            return build_table(keys, counts.image[lo:hi], counts.offset[lo:hi], events, counts.event[lo:hi], comms,
                               counts.comm[lo:hi], counts.count[lo:hi], w)

        n = len(counts)
        parts = Chunks(n, (part(lo, lo + CHUNK_ROWS) for lo in range(0, max(n, 1), CHUNK_ROWS)))
        path = str(write_segment(self.db, epoch, self.host, parts, meta))
        self.store_symbols(distinct(counts.image).tolist())
        if self.archive != "none":
            self._archive(counts)
        return path

    def _describe(self, counts: Counts, meta: SegmentMeta) -> None:
        for i in distinct(counts.image).tolist():
            info = self.table[i]
            meta.images[info.key] = info.to_json()
        unk = counts.image == 0
        if unk.any():
            for reason in Unknown:
                n = int(counts.count[unk & (counts.offset == reason.value)].sum())
                if n:
                    meta.unknown[reason.name.lower()] = n
        by_comm = np.bincount(counts.comm, weights=counts.count.astype(np.float64))
        top = np.argsort(by_comm)[::-1][:200]
        meta.processes = {self.mapper.comms.names[i]: int(by_comm[i]) for i in top.tolist() if by_comm[i] > 0}

    def store_symbols(self, images: Iterable[int]) -> None:
        """The symbols of these images that have no file to read them from later (kernel, module,
        vdso, JIT) go into the database: the images of the flat counts, and those that only the
        frames of call stacks name (a JIT's trampolines, say)."""
        for i in images:
            info = self.table[i]
            if info.kind in ("kernel", "module"):
                if info.key in self._symbols_written or symstore.has_symbols(self.db, info.key):
                    self._symbols_written.add(info.key)
                    continue
                for r in self.kernel_ranges:
                    if r.key == info.key:
                        def make(r: KernelRange = r) -> SymbolTable | None:
                            text = read_kallsyms()
                            return kernel_symbols(text, r) if text else None

                        shared = symstore.shared_kernel_symbols(Cache().root, boot_stamp(), info.key)
                        symstore.store_kernel_symbols(self.db, info.key, make, shared)
                self._symbols_written.add(info.key)
            elif info.kind == "vdso" and self.vdso and info.key not in self._symbols_written:
                symstore.write_binary(self.db, info.key, self.vdso)
                if self.lean:  # pyelftools stays out of the daemon (2.7 MiB of imports)
                    if not symstore.has_symbols(self.db, info.key):
                        self._pool.submit(run_helper, [sys.executable, "-m", "cyclescope.db.symbols",
                                                       str(self.db.root), "--stored", info.key, "[vdso]"])
                else:
                    with contextlib.suppress(Exception):
                        symstore.symbols_of_stored_binary(self.db, info.key, "[vdso]")
                self._symbols_written.add(info.key)
            elif info.kind in self.symbol_sources:
                table = self.symbol_sources[info.kind](info.key)
                if table is not None:
                    symstore.write_symbols(self.db, info.key, table)
            elif info.kind == "jit":
                parts = info.key.split(":")  # jit:PID:MTIME:OWNER
                owner = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
                text = read_perf_map(info.path, owner)
                if text is None:
                    continue
                symstore.write_symbols(self.db, info.key, SymbolTable.build(parse_perf_map(text)))

    def _archive(self, counts: Counts) -> None:
        todo = []
        for i in distinct(counts.image).tolist():
            info = self.table[i]
            if info.kind == "elf" and info.build_id and info.key == info.build_id and info.key not in self._archived:
                self._archived.add(info.key)
                todo.append((info.key, info.path, info.build_id))
        if not todo:
            return
        if self.archive == "binaries":  # a copy of each file: nothing parsed but its ELF header
            self._pool.submit(lambda: [symstore.archive_binary(self.db, *t) for t in todo])
        else:  # symbol tables: parsed in a child, whose memory goes back to the system when it exits
            todo = [t for t in todo if not symstore.has_symbols(self.db, t[0])]  # a child costs 0.3 s of imports
            for lo in range(0, len(todo), 100):
                cmd = [sys.executable, "-m", "cyclescope.db.symbols", str(self.db.root)]
                for key, path, build_id in todo[lo : lo + 100]:
                    cmd += [key, path, build_id or ""]
                self._pool.submit(run_helper, cmd)

    def compact(self, epoch: int) -> None:
        """Compact ``epoch``'s segments of this host in a child process (unless one is at work):
        merging segments briefly needs hundreds of MiB, which a long-running daemon would
        otherwise keep (allocators rarely give memory back)."""
        if self._compacting is not None and not self._compacting.done():
            return
        cmd = [sys.executable, "-m", "cyclescope", "db", "compact", "--db", str(self.db.root), "--epoch", str(epoch),
               "--host", safe_host(self.host)]
        self._compacting = self._pool.submit(run_helper, cmd)

    def ship(self, dest: str, token: str | None) -> None:
        """Ship the database's sealed files to ``dest`` (fleet/ship.py, following the destination's
        epochs) on the worker thread, after the compaction under way; skipped while the last pass
        runs. In this process: a pass is file copies and a listing, and a child's start-up alone
        cost 0.6 CPU-s (bench/fleet.py). What goes wrong is said on stderr, one line each."""
        if self._shipping is not None and not self._shipping.done():
            return
        self._shipping = self._pool.submit(self._ship_pass, dest, token)

    def _ship_pass(self, dest: str, token: str | None) -> None:
        from cyclescope.fleet.ship import Offline, destination, ship

        try:
            if self._dest is None:
                self._dest = destination(dest, token)
            report = ship(self.db, self._dest, follow=True)
        except (Offline, CycleScopeError, OSError) as e:
            print(f"cyclescope daemon: shipping to {dest}: {e}", file=sys.stderr, flush=True)
            return
        for r in report.rejected:
            print(f"cyclescope daemon: rejected by {dest}: {r}", file=sys.stderr, flush=True)
        if report.offline and report.offline != self.offline:
            print(f"cyclescope daemon: shipping stopped: {report.offline} (retried at the next flush)", file=sys.stderr,
                  flush=True)
        self.offline = report.offline
        self.shipped += report.stored

    @staticmethod
    def return_large_frees() -> None:
        """Large blocks from their own mappings, returned to the system when freed: by default glibc
        raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which
        a reduction's temporary arrays come from the heap and stay there until the next flush's
        trim (a 20 MiB step in the soak's RSS half-way between flushes). A fixed threshold turns
        that off; the cost is a page fault per page of each large array."""
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            m_mmap_threshold = -3
            ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 256 << 10)

    @staticmethod
    def give_back_memory() -> None:
        """Return what a flush freed to the system: Arrow's pool (mimalloc) keeps freed memory for
        reuse, and glibc keeps freed heap once large numpy arrays have raised its mmap threshold;
        a daemon would otherwise hold its largest flush's memory for good. The text of
        /proc/kallsyms, kept a few seconds for the start-up's two reads, goes first."""
        forget_kallsyms()
        with contextlib.suppress(Exception):
            pa.default_memory_pool().release_unused()
        trim_heap()

    def close(self) -> None:
        """Wait for the archiving and compaction under way."""
        if self._compacting is not None:
            with contextlib.suppress(Exception):
                self._compacting.result()
        self._pool.shutdown(wait=True)
