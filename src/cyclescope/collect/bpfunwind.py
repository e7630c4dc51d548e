"""Unwinding user stacks in the kernel (the eBPF path with -g dwarf): the images' .eh_frame as rows
the BPF program walks with (collect/bpf/profile.bpf.c's uw_rows, uw_procs, uw_slots).

Most distribution binaries are built without frame pointers, where the kernel's frame-pointer walk
stops after a frame or wanders off. The ring path copies a stack snapshot per sample and walks it
in Python (collect/unwind.py: 67 us a sample); here the program walks the live stack at the
sample, as the OpenTelemetry eBPF profiler and Parca's agent do, so that user space gets one row
per distinct stack a drain, as with frame pointers.

User space's part: each image's CFI table (images/cfi.py, read on a worker thread through the
per-user cache by collect/unwind.py's TableLoader) encoded into fixed rows and written once into
the program's row array; each process seen in a drain described by its executable mappings (start,
end, bias, and where its image's rows are), again when its mappings change or a table it waits
for arrives; its description deleted at its exit or exec. Samples of a process before its first
description get the frame-pointer walk, as Python frames do before theirs.

What the rows follow: a CFA of rsp or rbp plus an offset, the PLT's expression, the return address
at CFA - 8, rbp saved at an offset from the CFA; other rules (a CFA in another register, a return
address elsewhere: signal frames, some hand-written assembly) end the walk there, as does code
with no row. Images linked above 4 GiB are not described (rows keep 32-bit addresses).
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cyclescope.collect.ebpf import UW_LOADING, UW_MAPS, UW_PROC_DTYPE, UW_ROW_DTYPE
from cyclescope.collect.helpers import is_helper
from cyclescope.collect.unwind import PENDING, TableLoader
from cyclescope.images import cfi

if TYPE_CHECKING:
    from cyclescope.collect.ebpf import BpfAggregator
    from cyclescope.images.cache import Cache
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageTable

ROWS_CACHE = "uwrows-v1"

# profile.bpf.c's enums
UW_CFA_NONE, UW_CFA_RSP, UW_CFA_RBP, UW_CFA_PLT, UW_CFA_END = range(5)
UW_BP_SAME, UW_BP_SAVED, UW_BP_LOST = range(3)

# Default room in the program: rows for about 40 images of libc's size (16 bytes each in the
# kernel: 32 MiB), processes described at once.
DEFAULT_ROWS = 1 << 21
DEFAULT_PROCS = 1024
SHORT_WAIT_S = 0.02
FINISH_WAIT_S = 1.0  # bounds the delay at exit


def plt_rule(ops: list[tuple[str, list[int]]]) -> tuple[int, int] | None:
    """(offset, threshold) of the PLT's CFA expression, rsp + offset + 8 * ((rip & 15) >=
    threshold) (GCC and binutils emit it for .plt: the stub's second half pushed one word more),
    or None for any other expression."""
    names = [n for n, _ in ops]
    if names != ["DW_OP_breg7", "DW_OP_breg16", "DW_OP_lit15", "DW_OP_and", names[4] if len(names) > 4 else "",
                 "DW_OP_ge", "DW_OP_lit3", "DW_OP_shl", "DW_OP_plus"]:
        return None
    if not names[4].startswith("DW_OP_lit") or ops[1][1] != [0]:
        return None
    return ops[0][1][0], int(names[4][9:])


def encode(table: cfi.CfiTable) -> np.ndarray | None:
    """The table as the program's rows (UW_ROW_DTYPE), or None when its addresses pass 4 GiB."""
    n = len(table)
    out = np.zeros(n, UW_ROW_DTYPE)
    if not n:
        return out
    if table.pcs[-1] >= 1 << 32:
        return None
    out["pc"] = np.array(table.pcs, np.uint64)
    i32, i16 = (-(1 << 31), (1 << 31) - 1), (-(1 << 15), (1 << 15) - 1)
    plts = {k: plt_rule(e) for k, e in enumerate(table.exprs)}
    cfa = np.zeros(n, np.uint8)
    cfa_off = np.zeros(n, np.int64)
    bp = np.zeros(n, np.uint8)
    bp_off = np.zeros(n, np.int64)
    for k, r in enumerate(table.rows):
        kind = UW_CFA_NONE
        off = r.cfa_off
        if r.ra_kind == cfi.SAVED_NONE and r.cfa_kind != cfi.CFA_NONE:
            kind = UW_CFA_END  # the outermost frame (_start, a thread's start)
        elif r.ra_kind != cfi.SAVED_AT or r.ra_off != -8:
            kind = UW_CFA_NONE
        elif r.cfa_kind == cfi.CFA_REG and r.cfa_reg in (cfi.DW_RSP, cfi.DW_RBP):
            kind = UW_CFA_RSP if r.cfa_reg == cfi.DW_RSP else UW_CFA_RBP
        elif r.cfa_kind == cfi.CFA_EXPR and (rule := plts.get(r.expr)) is not None:
            kind, off = UW_CFA_PLT, rule[0]
            bp_off[k] = rule[1]  # the PLT's threshold rides in bp_off (rbp is untouched there)
        if not i32[0] <= off <= i32[1]:
            kind = UW_CFA_NONE
        cfa[k] = kind
        cfa_off[k] = off if kind != UW_CFA_NONE else 0
        if kind == UW_CFA_PLT:
            continue
        if r.bp_kind == cfi.SAVED_AT and i16[0] <= r.bp_off <= i16[1]:
            bp[k], bp_off[k] = UW_BP_SAVED, r.bp_off
        elif r.bp_kind != cfi.SAVED_NONE:
            bp[k] = UW_BP_LOST
    out["cfa"], out["cfa_off"], out["bp"], out["bp_off"] = cfa, cfa_off, bp, bp_off
    return out


class RowLoader(TableLoader):
    """Each image's rows (``encode``d), loaded on a worker thread: from the per-user cache by
    build-id (a millisecond), else from the image's CFI (images/cfi.py: readelf, a quarter of a
    second for libc, seconds for the largest libraries), then saved there; the CFI table itself is
    not cached (the ring path's unwinder caches its own). Until an image's rows are in, walks stop
    there, so the images asked for wait in order of need (``need``: the samples of the processes
    mapping them), not of asking: system-wide, a process mapping sixty libraries (a Python with
    numpy and Arrow: the recorder itself) would otherwise hold up everyone else's libc."""

    def __init__(self, images: ImageTable, cache: Cache | None = None, vdso: bytes | None = None) -> None:
        super().__init__(images, cache, vdso)
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, int]] = []  # (-need, order, image)
        self._need: dict[int, float] = {}  # image -> need, while it waits
        self._results: dict[int, object] = {}
        self._order = 0
        self._stop = False
        self._busy = False
        self._worker = threading.Thread(target=self._run, name="cyclescope-uwrows", daemon=True)
        self._worker.start()

    def need(self, image: int, pid: int, weight: float) -> None:
        """Add ``weight`` to the need of an image waiting to load (asked for by ``pid``)."""
        with self._cv:
            if image in self._need:
                self._need[image] += weight
                self._order += 1
                heapq.heappush(self._heap, (-self._need[image], self._order, image))

    def __call__(self, image: int, pid: int = 0) -> object:
        t = self.tables.get(image, PENDING)
        if t is not PENDING:
            return t
        with self._cv:
            if image in self._results:
                self.tables[image] = self._results.pop(image)
                return self.tables[image]
            if image not in self._need:
                if pid:
                    self.pids[image] = pid
                self._need[image] = 0.0
                self._order += 1
                heapq.heappush(self._heap, (0.0, self._order, image))
                self._cv.notify()
        return PENDING

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._heap:
                    self._cv.wait()
                if self._stop:
                    return
                need, _, image = heapq.heappop(self._heap)
                if self._need.get(image) != -need:
                    continue  # an older entry of an image since needed more (or loaded)
                del self._need[image]
                self._busy = True
            try:
                got = self._load(image)
            except Exception as e:  # a file we cannot read: no rows, said in the summary
                got = None
                self.failed[image] = f"{type(e).__name__}: {e}"
            with self._cv:
                self._results[image] = got
                self._busy = False
                self._cv.notify_all()

    def reload(self, image: int) -> object:
        """An image's rows again, now (rows written to the program are not kept here: from the
        cache in milliseconds, else built again)."""
        try:
            return self._load(image)
        except Exception:  # a file gone since: its processes' walks stop there
            return None

    def pending(self) -> bool:
        with self._cv:
            return bool(self._need) or self._busy

    def wait(self, timeout: float) -> None:
        """Until nothing waits or loads, or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self._need or self._busy) and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        super().close()

    def _load(self, image: int) -> object:
        info = self.images[image]
        key = info.build_id or None
        if key and self.cache is not None:
            got = self.cache.load_arrays(key, ROWS_CACHE)
            if got is not None and "rows" in got:
                try:
                    return np.asarray(got["rows"]).view(UW_ROW_DTYPE).reshape(-1)
                except ValueError:
                    pass  # an entry of another layout: rebuild it
        t = self._table(image, cached=False)
        rows = encode(t) if t is not None else None
        if rows is not None and key and self.cache is not None:
            self.cache.save_arrays(key, ROWS_CACHE, {"rows": rows.view(np.uint8)})
        return rows


@dataclass
class _Described:
    slot: int
    signature: tuple[tuple[int, int, int], ...]  # (start, end, image) of the mappings described
    waiting: bool  # some image's table was still loading
    images: frozenset[int] = frozenset()


class KernelUnwind:
    """Keeps the program's unwind rows and process descriptions in step with the mapper's view of
    the processes sampled."""

    def __init__(self, table: ImageTable, mapper: Mapper, bpf: BpfAggregator, loader: RowLoader) -> None:
        self.table = table
        self.mapper = mapper
        self.bpf = bpf
        self.loader = loader
        self.rows: dict[int, tuple[int, int]] = {}  # image -> (first, count) in the program's rows
        self.next_row = 0
        self.no_room: set[int] = set()  # images whose rows did not fit
        self.procs: dict[int, _Described] = {}
        self.free = list(range(bpf.unwind_procs - 1, -1, -1))
        self.own = os.getpid()
        self.described = 0
        self.too_many_maps = 0
        self.no_slot = 0
        self.compactions = 0

    def watch(self, pids: list[int], samples: list[float] | None = None) -> None:
        """Describe the processes among ``pids`` (with their ``samples`` in this drain) whose
        mappings changed since, or that were never described; describe again those waiting for
        rows that have arrived. Rows still to load wait in order of their processes' samples."""
        weight = dict(zip(pids, samples if samples is not None else [1.0] * len(pids), strict=True))
        # Not this process (system-wide it samples itself): its sixty libraries' rows would be
        # most of the rows and of the first minutes' loading; its stacks are walked by frame pointer.
        # Nor its helpers, the flusher's symbol archivers and compactions (collect/helpers.py): the
        # same libraries, in a new process after every flush (a daemon at 16 kHz with -g dwarf
        # once spent half a CPU).
        todo = set(p for p in pids if p > 0 and p != self.own and not is_helper(p))
        todo |= {p for p, d in self.procs.items() if d.waiting}
        if self._compact_due():
            self._compact()
            todo |= set(self.procs)  # every description names rows that moved
        self._watch(sorted(todo))
        for pid in todo:
            d = self.procs.get(pid)
            st = self.mapper.procs.get(pid)
            if d is not None and d.waiting and st is not None and weight.get(pid):
                for img in set(st.images):
                    if img > 0:
                        self.loader.need(img, pid, weight[pid])
        if (self.starting or self.waiting) and self.loader.pending():
            # Rows come from the cache in milliseconds: a short wait here describes the processes
            # whole now rather than a drain later (the rings carry only side records here).
            self.loader.wait(SHORT_WAIT_S)
            self._watch(sorted(p for p, d in self.procs.items() if d.waiting))

    def _watch(self, pids: list[int]) -> None:
        for pid in pids:
            st = self.mapper.procs.get(pid)
            if st is None:
                continue
            maps = [(s, e, b, img) for s, e, b, img in zip(st.starts, st.ends, st.biases, st.images, strict=True)
                    if img >= 0 and self._unwindable(img)]
            sig = tuple((s, e, img) for s, e, _, img in maps)
            old = self.procs.get(pid)
            if old is None and not maps:
                continue  # a kernel thread, or a process whose images we cannot walk: no slot
            if old is not None and old.signature == sig and not old.waiting:
                continue
            self._describe(pid, maps, sig, old)

    def _unwindable(self, image: int) -> bool:
        info = self.table[image]
        return info.kind == "vdso" or (info.kind == "elf" and info.offsets == "vaddr")

    @property
    def waiting(self) -> bool:
        """Some process described waits for an image's rows."""
        return any(d.waiting for d in self.procs.values())

    @property
    def starting(self) -> bool:
        """No process described yet: a command still starting, described at the next drain."""
        return not self.procs

    def _describe(self, pid: int, maps: list[tuple[int, int, int, int]], sig: tuple[tuple[int, int, int], ...],
                  old: _Described | None) -> None:
        if old is None and not self.free:
            self.no_slot += 1
            return
        rows: dict[int, tuple[int, int]] = {}
        waiting = False
        for _, _, _, img in maps:
            if img in rows:
                continue
            got = self._rows_of(img, pid)
            if got is PENDING:
                waiting = True
                rows[img] = (UW_LOADING, 0)
            else:
                assert isinstance(got, tuple)
                rows[img] = got
        if len(maps) > UW_MAPS:
            # Keep the mappings with rows, then by address; the others are walked by frame pointer.
            self.too_many_maps += 1
            maps = sorted(sorted(maps, key=lambda m: rows[m[3]][1] == 0)[:UW_MAPS])
        proc = np.zeros(1, UW_PROC_DTYPE)
        proc["n"] = len(maps)
        m = proc["m"][0]
        for k, (s, e, b, img) in enumerate(maps):
            first, count = rows[img]
            m[k] = (s & 0xFFFFFFFFFFFFFFFF, e & 0xFFFFFFFFFFFFFFFF, b & 0xFFFFFFFFFFFFFFFF, first, count)
        slot = old.slot if old is not None else self.free.pop()
        try:
            self.bpf.describe_unwind(pid, slot, proc)
        except OSError:  # the program's table of processes is full
            if old is None:
                self.free.append(slot)
            self.no_slot += 1
            return
        if old is None:
            self.described += 1
        self.procs[pid] = _Described(slot, sig, waiting, frozenset(rows))

    def _rows_of(self, image: int, pid: int) -> object:
        """(first, count) of the image's rows in the program (written now if they were not),
        (0, 0) for an image without rows, or PENDING while they load."""
        got = self.rows.get(image)
        if got is not None:
            return got
        enc = self.loader(image, pid)
        if enc is PENDING:
            return PENDING
        if not isinstance(enc, np.ndarray) or not len(enc):
            self.rows[image] = (0, 0)
        elif self.next_row + len(enc) > self.bpf.unwind_rows:
            self.no_room.add(image)
            self.rows[image] = (0, 0)
        else:
            self.bpf.write_rows(self.next_row, enc)
            self.rows[image] = (self.next_row, len(enc))
            self.next_row += len(enc)
            self.loader.tables.pop(image, None)  # in the program now (and in the cache)
        return self.rows[image]

    def _compact_due(self) -> bool:
        """Rows ran out (or are three quarters used) and images no process described maps hold a
        quarter of them: a daemon sees images come and go (builds, upgrades)."""
        cap = self.bpf.unwind_rows
        if not self.no_room and self.next_row <= 0.75 * cap:
            return False
        live = {img for d in self.procs.values() for img in d.images}
        dead = sum(c for img, (_, c) in self.rows.items() if img not in live)
        return dead >= 0.25 * cap  # each compaction frees a quarter at least: no rewrite every drain

    def _compact(self) -> None:
        """Write the rows of the images processes described map from the array's start again (the
        others' are dropped; an image that had no room is tried again). Walks running meanwhile may
        read a moved row: a few stacks cut or wrong during the rewrite (milliseconds)."""
        live = {img for d in self.procs.values() for img in d.images}
        old = sorted(self.rows.items(), key=lambda kv: kv[1][0])
        self.rows, self.next_row, self.no_room = {}, 0, set()
        for img, (_, count) in old:
            if img not in live or count == 0:
                continue  # an image without rows is looked at again when a process maps it
            enc = self.loader.reload(img)
            if not isinstance(enc, np.ndarray) or len(enc) != count:
                continue
            self.bpf.write_rows(self.next_row, enc)
            self.rows[img] = (self.next_row, count)
            self.next_row += count
        for d in self.procs.values():
            d.signature = ()  # described again by the caller
        self.compactions += 1

    def forget(self, pid: int) -> None:
        """The process exited or exec'd: its description no longer holds."""
        d = self.procs.pop(pid, None)
        if d is not None:
            self.bpf.forget_unwind(pid)
            self.free.append(d.slot)

    def close(self) -> None:
        # Rows still loading are finished for the cache (a short command's next run finds them),
        # within a bound.
        self.loader.wait(FINISH_WAIT_S)
        self.loader.close()

    def summary(self, stats: dict[str, int]) -> str | None:
        """One line for the end of a run, from the program's counters (BpfAggregator.stats)."""
        walks = stats.get("uw_walks", 0)
        if not walks:
            return "unwound no user stacks in the kernel" if self.described else None
        line = (f"unwound {walks:,} user stacks in the kernel with .eh_frame, "
                f"{stats.get('uw_frames', 0) / walks:.1f} frames on average, "
                f"{100 * stats.get('uw_complete', 0) / walks:.1f}% to the outermost frame")
        if stats.get("uw_fp"):
            line += f"; {stats['uw_fp']:,} frames of code in no image (JIT) by frame pointer"
        extra = []
        if stats.get("uw_loading"):
            extra.append(f"{stats['uw_loading']:,} cut short while unwind tables loaded")
        if self.loader.failed:
            extra.append(f"no unwind tables for {len(self.loader.failed)} images")
        if self.no_room:
            extra.append(f"no room for the rows of {len(self.no_room)} images")
        if self.compactions:
            extra.append(f"rows compacted {self.compactions} times")
        if self.no_slot:
            extra.append(f"{self.no_slot:,} processes not described (the program's table was full)")
        return line + ("; " + "; ".join(extra) if extra else "")
