"""Per-process address maps and the mapping of samples to (image, offset).

DCPI's three sources feed these maps: MMAP2/COMM/FORK/EXIT records from the
kernel, a scan of /proc/*/maps for processes that were already running, and
(our addition) a lazy read of /proc/PID/maps when a sample arrives for a
process nothing has told us about.

Side records and samples are applied in time order per process: before a
record changes the maps of process P at time t, P's samples older than t are
mapped with the maps as they were. Lookups are vectorized per process.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cyclescope.arrays import distinct, group
from cyclescope.images.kernel import KernelMap
from cyclescope.images.procfs import ProcMapping, read_comm, read_maps
from cyclescope.images.registry import Resolved, Unknown
from cyclescope.perf.abi import MISC_KERNEL, MISC_USER, RecordType
from cyclescope.perf.records import CommRecord, MmapRecord, SideRecord, TaskRecord

NS = 1_000_000_000


class Resolver(Protocol):
    """What the mapper needs from images: ImageResolver, or a fake in tests."""

    def resolve(self, pid: int, start: int, end: int, pgoff: int, path: str, build_id: bytes | None) -> Resolved: ...

    def forget_pid(self, pid: int) -> None: ...


@dataclass
class ProcessState:
    pid: int
    comm: int  # index into CommTable
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    biases: list[int] = field(default_factory=list)
    images: list[int] = field(default_factory=list)  # >=0 image index, <0: -(Unknown)-1
    exited_ns: int | None = None
    last_seen_ns: int = 0
    parent: int = 0  # the pid that forked it, where a FORK record said so (0: not known)
    _arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def copy(self, pid: int) -> ProcessState:
        return ProcessState(pid, self.comm, list(self.starts), list(self.ends), list(self.biases), list(self.images))

    def clear(self) -> None:
        self.starts.clear()
        self.ends.clear()
        self.biases.clear()
        self.images.clear()
        self._arrays = None

    def insert(self, start: int, end: int, bias: int, image: int) -> None:
        """Add [start, end), replacing whatever it overlaps (as mmap does)."""
        if end <= start:
            return
        self._arrays = None
        s, e, b, im = self.starts, self.ends, self.biases, self.images
        i = bisect.bisect_right(s, start) - 1
        if i >= 0 and e[i] > start:
            # An existing mapping begins before us and overlaps: keep its head.
            if e[i] > end:
                # We punch a hole in it: its tail survives after us.
                s.insert(i + 1, end)
                e.insert(i + 1, e[i])
                b.insert(i + 1, b[i])
                im.insert(i + 1, im[i])
            e[i] = start
            if e[i] <= s[i]:
                del s[i], e[i], b[i], im[i]
                i -= 1
        j = i + 1
        while j < len(s) and s[j] < end:
            if e[j] <= end:
                del s[j], e[j], b[j], im[j]
            else:
                s[j] = end  # bias is unchanged by trimming the head
                break
        k = bisect.bisect_left(s, start)
        s.insert(k, start)
        e.insert(k, end)
        b.insert(k, bias)
        im.insert(k, image)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = (
                np.array(self.starts, dtype=np.uint64),
                np.array(self.ends, dtype=np.uint64),
                np.array([x & 0xFFFFFFFFFFFFFFFF for x in self.biases], dtype=np.uint64),
                np.array(self.images, dtype=np.int64),
            )
        return self._arrays

    def lookup(self, ips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(image or negative unknown reason, offset) per address."""
        starts, ends, biases, images = self.arrays()
        if not len(starts):
            return np.full(len(ips), -int(Unknown.NO_MAPPING) - 1, dtype=np.int64), np.zeros(len(ips), np.uint64)
        idx = np.searchsorted(starts, ips, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        ok &= ips < ends[safe]
        img = np.where(ok, images[safe], -int(Unknown.NO_MAPPING) - 1)
        off = np.where(ok & (img >= 0), ips - biases[safe], 0).astype(np.uint64)
        return img, off


class CommTable:
    def __init__(self) -> None:
        self.names: list[str] = []
        self._idx: dict[str, int] = {}
        self.intern("[unknown]")

    def intern(self, name: str) -> int:
        i = self._idx.get(name)
        if i is None:
            i = len(self.names)
            self.names.append(name)
            self._idx[name] = i
        return i


@dataclass
class MappedSamples:
    image: np.ndarray  # int64: >=0 image index; unknown samples carry 0
    offset: np.ndarray  # uint64 (the Unknown reason for image 0)
    comm: np.ndarray  # int64 index into CommTable
    order: np.ndarray  # positions in the input sample array, same length


class Mapper:
    """Maintains process maps from side records and maps sample batches."""

    def __init__(self, resolver: Resolver, kernel: KernelMap, kernel_images: list[int],
                 proc_root: str = "/proc", reap_after_s: float = 2.0, lazy_proc: bool = True) -> None:
        self.resolver = resolver
        self.kernel = kernel
        self.kernel_images = np.array(kernel_images, dtype=np.int64)
        self.proc = proc_root
        self.procs: dict[int, ProcessState] = {}
        self.comms = CommTable()
        self.reap_after_ns = int(reap_after_s * NS)
        self.lazy_proc = lazy_proc
        self.stats = {"forks": 0, "execs": 0, "exits": 0, "mmaps": 0, "proc_loads": 0, "reaped": 0}

    # --- state from /proc -------------------------------------------------------
    def load_from_proc(self, pid: int) -> ProcessState | None:
        maps = read_maps(pid, self.proc)
        if maps is None:
            return None
        comm = read_comm(pid, self.proc) or "[unknown]"
        st = ProcessState(pid, self.comms.intern(comm))
        self._apply_proc_maps(st, maps)
        self.procs[pid] = st
        self.stats["proc_loads"] += 1
        return st

    def _apply_proc_maps(self, st: ProcessState, maps: list[ProcMapping]) -> None:
        for m in maps:
            if not m.executable:
                continue
            r = self.resolver.resolve(st.pid, m.start, m.end, m.offset, m.path, None)
            st.insert(m.start, m.end, r.bias, r.image)

    def scan_proc(self, pids: list[int]) -> int:
        n = 0
        for pid in pids:
            if pid not in self.procs and self.load_from_proc(pid) is not None:
                n += 1
        return n

    # --- side records -----------------------------------------------------------
    def _state(self, pid: int, create: bool = True) -> ProcessState | None:
        st = self.procs.get(pid)
        if st is None and create:
            st = self.load_from_proc(pid) if self.lazy_proc else None
            if st is None:
                st = ProcessState(pid, 0)
                if self.lazy_proc:
                    # Gone before we could read its maps: forget it after the usual grace period.
                    st.exited_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                self.procs[pid] = st
        return st

    def apply(self, rec: SideRecord) -> None:
        if isinstance(rec, MmapRecord):
            if not rec.executable or rec.cpumode == MISC_KERNEL:
                return
            st = self._state(rec.pid)
            assert st is not None
            r = self.resolver.resolve(rec.pid, rec.addr, rec.addr + rec.length, rec.pgoff, rec.filename, rec.build_id)
            st.insert(rec.addr, rec.addr + rec.length, r.bias, r.image)
            self.stats["mmaps"] += 1
        elif isinstance(rec, CommRecord):
            if rec.tid != rec.pid and not rec.exec:
                return  # a thread renamed itself; the process keeps its name
            st = self.procs.get(rec.pid)
            if st is None:
                st = ProcessState(rec.pid, 0)
                self.procs[rec.pid] = st
            st.comm = self.comms.intern(rec.comm)
            if rec.exec:
                st.clear()
                st.exited_ns = None
                self.resolver.forget_pid(rec.pid)
                self.stats["execs"] += 1
        elif isinstance(rec, TaskRecord):
            if rec.kind == RecordType.FORK:
                if rec.pid == rec.ppid:
                    return  # a new thread shares its process's maps
                parent = self._state(rec.ppid)
                assert parent is not None
                child = parent.copy(rec.pid)
                child.parent = rec.ppid
                self.procs[rec.pid] = child
                self.stats["forks"] += 1
            elif rec.kind == RecordType.EXIT and rec.pid == rec.tid:
                st = self.procs.get(rec.pid)
                if st is not None:
                    st.exited_ns = rec.time or time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                self.stats["exits"] += 1

    @staticmethod
    def _changes_pid(rec: SideRecord) -> int | None:
        if isinstance(rec, MmapRecord) and rec.executable and rec.cpumode != MISC_KERNEL:
            return rec.pid
        if isinstance(rec, CommRecord):
            return rec.pid
        if isinstance(rec, TaskRecord) and rec.kind == RecordType.FORK and rec.pid != rec.ppid:
            return rec.pid
        return None

    # --- samples ----------------------------------------------------------------
    def map_batch(self, samples: np.ndarray, side: list[SideRecord]) -> MappedSamples:
        """Map samples to images, applying ``side`` records in time order."""
        n = len(samples)
        image = np.zeros(n, dtype=np.int64)
        offset = np.zeros(n, dtype=np.uint64)
        comm = np.zeros(n, dtype=np.int64)
        if n == 0:
            for rec in sorted(side, key=lambda r: r.time):
                self.apply(rec)
            return MappedSamples(image, offset, comm, np.zeros(0, np.int64))
        mode = samples["cpumode"]
        ips = samples["ip"]
        pids = samples["pid"]
        times = samples["time"]

        kern = mode == MISC_KERNEL
        if kern.any():
            image[kern], koff, ok = self._kernel_lookup(ips[kern])
            offset[kern] = np.where(ok, koff, np.uint64(Unknown.KERNEL))
        other = (mode != MISC_KERNEL) & (mode != MISC_USER)
        if other.any():
            offset[other] = np.uint64(Unknown.OTHER_MODE)

        # Group user samples by pid, sorted by time within a pid.
        user_pos = np.flatnonzero(mode == MISC_USER)
        order = user_pos[np.lexsort((times[user_pos], pids[user_pos]))]
        upids = pids[order]
        bounds = np.flatnonzero(np.diff(upids)) + 1
        starts = np.concatenate(([0], bounds)) if len(order) else np.zeros(0, np.int64)
        ends = np.concatenate((bounds, [len(order)])) if len(order) else np.zeros(0, np.int64)
        groups = {int(upids[s]): (int(s), int(e)) for s, e in zip(starts, ends, strict=True)}
        cursor = {p: s for p, (s, _) in groups.items()}
        named = np.zeros(n, dtype=bool)

        def flush(pid: int, until: int | None) -> None:
            g = groups.get(pid)
            if g is None:
                return
            s = cursor[pid]
            e = g[1]
            if until is not None:
                e = s + int(np.searchsorted(times[order[s:e]], until, side="left"))
            if e <= s:
                return
            pos = order[s:e]
            st = self.procs.get(pid)
            if st is None and pid > 0:
                st = self._state(pid)
            if st is not None:
                comm[pos] = st.comm  # the name in force when these samples were taken
                named[pos] = True
            if st is None or (not st.starts and st.comm == 0):
                image[pos] = 0
                offset[pos] = np.uint64(Unknown.NO_PROCESS)
            else:
                img, off = st.lookup(ips[pos])
                unk = img < 0
                image[pos] = np.where(unk, 0, img)
                offset[pos] = np.where(unk, (-img - 1).astype(np.uint64), off)
            cursor[pid] = e

        for rec in sorted(side, key=lambda r: r.time):
            pid = self._changes_pid(rec)
            if pid is not None:
                g = groups.get(pid)
                # Only when some of the pid's samples precede the record: an exec brings dozens of
                # MMAP2 records with no sample in between.
                if g is not None and cursor[pid] < g[1] and int(times[order[cursor[pid]]]) < rec.time:
                    flush(pid, rec.time)
            self.apply(rec)
        for pid in groups:
            flush(pid, None)

        # comm of the other samples (kernel mode): the process's name after this batch.
        all_pids = pids.astype(np.int64)
        uniq, inv = group(all_pids)
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        cidx = np.zeros(len(uniq), dtype=np.int64)
        for i, p in enumerate(uniq.tolist()):
            st = self.procs.get(p)
            if st is not None:
                cidx[i] = st.comm
                st.last_seen_ns = now
            elif p == 0:
                cidx[i] = self.comms.intern("swapper")
        comm = np.where(named, comm, cidx[inv])
        return MappedSamples(image, offset, comm, np.arange(n, dtype=np.int64))

    def _kernel_lookup(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Kernel addresses to (image or 0, offset, found)."""
        kidx, koff = self.kernel.lookup(addrs)
        ok = kidx >= 0
        img = np.where(ok, self.kernel_images[np.where(ok, kidx, 0)] if len(self.kernel_images) else 0, 0)
        return img, koff, ok

    def map_frames(self, pids: np.ndarray, addrs: np.ndarray, kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Callchain frames to (image, offset), with the maps in force now (after the drain's
        records). Unmappable frames get image 0 and offset 0."""
        n = len(addrs)
        image = np.zeros(n, np.int64)
        offset = np.zeros(n, np.uint64)
        if kernel.any():
            img, koff, ok = self._kernel_lookup(addrs[kernel])
            image[kernel] = img
            offset[kernel] = np.where(ok & (img > 0), koff, 0)
        user = ~kernel
        image[user], offset[user] = lookup_user(self.procs, pids[user], addrs[user])
        return image, offset

    # --- memory -----------------------------------------------------------------
    def reap(self, now_ns: int | None = None, idle_s: float = 600.0) -> int:
        """Forget processes that exited (after a grace period for late samples)
        and lazily loaded ones not seen for ``idle_s`` whose /proc entry is gone."""
        now = now_ns if now_ns is not None else time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        dead = []
        for pid, st in self.procs.items():
            exited = st.exited_ns is not None and now - st.exited_ns > self.reap_after_ns
            idle = st.exited_ns is None and now - st.last_seen_ns > idle_s * NS
            if exited or (idle and not _alive(self.proc, pid)):
                dead.append(pid)
        for pid in dead:
            del self.procs[pid]
            self.resolver.forget_pid(pid)
        self.stats["reaped"] += len(dead)
        return len(dead)


def lookup_user(procs: Mapping[int, ProcessState], pids: np.ndarray, addrs: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """User addresses of several processes to (image, offset) with each process's maps in force
    now; image 0 and offset 0 where the process or the mapping is unknown."""
    image = np.zeros(len(addrs), np.int64)
    offset = np.zeros(len(addrs), np.uint64)
    groups: list[tuple[int, slice | np.ndarray]]
    if len(pids) and (pids == pids[0]).all():  # usually one process: all rows at once, no grouping
        groups = [(int(pids[0]), slice(None))]
    else:
        groups = [(p, np.flatnonzero(pids == p)) for p in distinct(pids).tolist()]
    for p, rows in groups:
        st = procs.get(p)
        if st is None:
            continue
        img, off = st.lookup(addrs[rows])
        good = img > 0
        image[rows] = np.where(good, img, 0)
        offset[rows] = np.where(good, off, 0)
    return image, offset


def _alive(proc: str, pid: int) -> bool:
    import os

    return os.path.exists(f"{proc}/{pid}")
