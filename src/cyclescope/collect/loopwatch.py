"""The eBPF path's samples for the loop counter (analysis/loopcount.py).

On the eBPF path the program (collect/bpf/profile.bpf.c, "Loop counts") counts every sample in the
kernel, so no sample's registers reach user space; the loop counter needs those of a thread's
consecutive samples in one loop. So the program also sends, through a BPF output event per CPU,
each sample of the time event that falls in a range this module watches for its process (the
procedures the loop counter found a counter register in, at the addresses the process maps them),
with its general registers, and the next sample of that event on the same CPU whatever it is
(a pair is a thread's two consecutive samples on one CPU; the counter also tallies how many of a
loop's samples were followed by one of the same thread in the loop). Before, loop counts
system-wide meant reading every sample from perf's rings (``--collector perf``), giving up the
program's stacks, Python frames and cost; the daemon's profiles then had none, and calc's counts
there were its model's (the demo's pointer chase at a CPI of 7.4 where it takes about 90).

This module opens those events and their rings, tells the program each process's ranges, and
reads the records back (:func:`decode`, pure) as rows the collection loop maps and hands to the
processors that take them. What comes back is registers, used and dropped by the loop counter as
on the rings' path: no value is stored.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cyclescope.collect.ebpf import LC_FOLLOWER, LC_KERNEL, LC_RANGES, LC_REC_DTYPE, LC_WATCHED
from cyclescope.perf.abi import RecordType

if TYPE_CHECKING:
    from cyclescope.collect.ebpf import BpfAggregator
    from cyclescope.images.maps import ProcessState

PAGE = 4096
# A record: perf's header, the raw data's size (u32), the program's lc_rec padded so that the
# record stays 8-byte aligned (perf rounds the u32 and the data up to 8 bytes).
RAW_SIZE = (4 + LC_REC_DTYPE.itemsize + 7) // 8 * 8 - 4
RECORD_SIZE = 8 + 4 + RAW_SIZE
RECORD_DTYPE = np.dtype([("type", "<u4"), ("misc", "<u2"), ("size", "<u2"), ("raw_size", "<u4"),
                         ("rec", LC_REC_DTYPE), ("pad", "V", RAW_SIZE - LC_REC_DTYPE.itemsize)])
MIN_PAGES, MAX_PAGES = 16, 512  # per CPU's ring (64 KiB to 2 MiB)
RING_SECONDS = 2.0  # a ring holds this long's samples at the rate sent, all watched
# The most samples a second per CPU the program sends: above it, one 100 ms window in every
# ceil(rate / this), evenly spread (loop tallies are ratios, which such windows leave alone unless
# a program's phases keep time with them). Measured: all of
# 16 kHz's on two CPUs (31,000 a second) cost the daemon 200-290 ms a second of CPU and, with -g
# dwarf, fell behind its rings (bench/collectorcpu.py); 2,000 a second costs it about 10 ms.
MAX_SENT_HZ = 2000.0


def window_share(rate_hz: float) -> int:
    """One window in how many the program watches at ``rate_hz`` per CPU (1: every window)."""
    return max(1, int(np.ceil(rate_hz / MAX_SENT_HZ - 1e-9)))


def ring_pages(rate_hz: float) -> int:
    """Data pages of one CPU's ring: RING_SECONDS of samples at ``rate_hz`` if every one were
    watched, as a power of two within [MIN_PAGES, MAX_PAGES]. The reader is woken when it is half
    full, so that a drain a second apart never finds it full."""
    want = max(1.0, rate_hz * RECORD_SIZE * RING_SECONDS / PAGE)
    pages = 1 << int(np.ceil(np.log2(want)))
    return int(min(MAX_PAGES, max(MIN_PAGES, pages)))


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """The program's records (LC_REC_DTYPE) in a ring's bytes, and how many the kernel dropped
    for want of room (its PERF_RECORD_LOST records). Bytes that end mid-record are left out."""
    n = len(data) // RECORD_SIZE
    if n and len(data) == n * RECORD_SIZE:
        rows = np.frombuffer(data, RECORD_DTYPE, n)
        if ((rows["type"] == RecordType.SAMPLE) & (rows["size"] == RECORD_SIZE)
                & (rows["raw_size"] == RAW_SIZE)).all():
            return rows["rec"].copy(), 0
    recs: list[bytes] = []
    lost = 0
    off = 0
    while off + 8 <= len(data):
        rtype, _misc, size = struct.unpack_from("<IHH", data, off)
        if size < 8 or off + size > len(data):
            break
        if rtype == RecordType.SAMPLE and size == RECORD_SIZE:
            (raw,) = struct.unpack_from("<I", data, off + 8)
            if raw == RAW_SIZE:
                recs.append(data[off + 12 : off + 12 + LC_REC_DTYPE.itemsize])
        elif rtype == RecordType.LOST and size >= 24:
            lost += struct.unpack_from("<Q", data, off + 16)[0]
        off += size
    out = np.frombuffer(b"".join(recs), LC_REC_DTYPE).copy() if recs else np.zeros(0, LC_REC_DTYPE)
    return out, int(lost)


def process_ranges(state: ProcessState, procedures: dict[int, list[tuple[int, int, float]]],
                   limit: int = LC_RANGES) -> list[tuple[int, int]]:
    """The address ranges of the process ``state`` describes that hold the ``procedures`` (image
    -> (start, end, weight) in the image's ELF addresses), at most ``limit``, the heaviest first,
    then sorted by address: each procedure where a mapping of its image covers it (address =
    ELF address + the mapping's bias)."""
    found: list[tuple[float, int, int]] = []
    for s, e, bias, img in zip(state.starts, state.ends, state.biases, state.images, strict=True):
        for ps, pe, w in procedures.get(img, ()):
            lo, hi = max(s, ps + bias), min(e, pe + bias)
            if lo < hi:
                found.append((w, lo, hi))
    found.sort(key=lambda x: (-x[0], x[1]))
    return sorted((lo, hi) for _, lo, hi in found[:limit])


@dataclass
class WatchStats:
    sent: int = 0  # records read
    watched: int = 0  # of them in a watched range
    lost: int = 0  # records the rings had no room for
    processes: int = 0  # processes watched now
    procedures: int = 0  # procedures watched (analyzed, with a counter register)
    errors: list[str] = field(default_factory=list)


class LoopWatch:
    """The BPF output events and rings of ``cpus``, the program told to send the samples of event
    ``event`` in the ranges :meth:`update` gives it. Raises OSError (kernel.PerfOpenError) where
    an event cannot be opened; nothing is left open then."""

    def __init__(self, bpf: BpfAggregator, cpus: list[int], rate_hz: float, event: int) -> None:
        from cyclescope.collect import kernel

        self.bpf = bpf
        self.every = window_share(rate_hz)
        self.pages = ring_pages(rate_hz / self.every)
        self.rings: list[tuple[int, kernel.RingBuffer]] = []
        self.installed: dict[int, list[tuple[int, int]]] = {}  # pid -> its ranges in the program
        # pid -> what its ranges were computed from (the watched set's generation, its mappings'
        # images and starts): unchanged, a process is not looked at again
        self._seen: dict[int, tuple[int, int]] = {}
        self._watched: dict[tuple[int, int], tuple[int, float]] = {}
        self._generation = 0
        self.stats = WatchStats()
        outputs: dict[int, int] = {}
        try:
            for cpu in cpus:
                fd = kernel.open_bpf_output(cpu, self.pages * PAGE // 2)
                outputs[cpu] = fd
                self.rings.append((fd, kernel.RingBuffer(fd, self.pages)))
                kernel.ioctl_enable(fd)
            bpf.send_loop_samples(event, outputs, self.every)
        except BaseException:
            self._close_rings(outputs)
            raise

    def fds(self) -> tuple[int, ...]:
        """The rings' descriptors: readable when one is half full (a drain is due)."""
        return tuple(fd for fd, _ in self.rings)

    def read(self) -> np.ndarray:
        """Every record the program sent since the last read (LC_REC_DTYPE), by CPU then time."""
        parts = []
        for _, ring in self.rings:
            if not ring.pending():
                continue
            recs, lost = decode(ring.read())
            self.stats.lost += lost
            if len(recs):
                parts.append(recs)
        out = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0, LC_REC_DTYPE))
        self.stats.sent += len(out)
        self.stats.watched += int(((out["flags"] & LC_WATCHED) != 0).sum())
        return out

    def update(self, states: dict[int, ProcessState], pids: list[int],
               watched: dict[tuple[int, int], tuple[int, float]]) -> None:
        """Give the program the ranges of each of ``pids`` (processes with samples lately, their
        mappings in ``states``) that hold the ``watched`` procedures ((image, start) -> (end,
        weight)); a process whose ranges did not change is left alone."""
        # New procedures, or a process whose ranges are all taken (its heaviest may have changed):
        # every process is looked at again.
        if set(watched) != set(self._watched) or any(len(self.installed.get(p, ())) >= LC_RANGES for p in pids):
            self._generation += 1
        self._watched = dict(watched)
        if len(self._seen) > 2 * len(states) + 1024:  # processes gone without an exit record read
            self._seen = {p: v for p, v in self._seen.items() if p in states}
        # Exited processes (their last samples come in the drain of their exit, so they are among
        # ``pids`` once more) or gone: watched again, they would hold their entries of the
        # program's map (LC_WATCH_ENTRIES) for good, and new processes would find it full.
        for pid in [p for p in self.installed if p not in states or states[p].exited_ns is not None]:
            self.forget(pid)
        by_image: dict[int, list[tuple[int, int, float]]] = {}
        for (img, start), (end, w) in watched.items():
            by_image.setdefault(img, []).append((start, end, w))
        self.stats.procedures = len(watched)
        for pid in pids:
            st = states.get(pid)
            if st is None or st.exited_ns is not None:
                continue
            sig = (self._generation, hash((tuple(st.images), tuple(st.starts))))
            if self._seen.get(pid) == sig:
                continue
            self._seen[pid] = sig
            ranges = process_ranges(st, by_image)
            if ranges == self.installed.get(pid, []):
                continue
            try:
                self.bpf.watch_loops(pid, ranges)
            except OSError as e:  # the map is full: this process's loops are not counted
                if len(self.stats.errors) < 4:
                    self.stats.errors.append(f"pid {pid}: {e.strerror or e}")
                continue
            if ranges:
                self.installed[pid] = ranges
            else:
                self.installed.pop(pid, None)
        self.stats.processes = len(self.installed)

    def forget(self, pid: int) -> None:
        """``pid`` exited or exec'd: its ranges no longer hold."""
        self._seen.pop(pid, None)
        if self.installed.pop(pid, None) is not None:
            self.bpf.unwatch_loops(pid)
            self.stats.processes = len(self.installed)

    def close(self) -> None:
        """Close the output events and their rings (again: nothing more)."""
        self._close_rings({fd: fd for fd, _ in self.rings})
        self.rings = []

    def _close_rings(self, fds: dict[int, int]) -> None:
        from cyclescope.collect import kernel

        for _, ring in self.rings:
            ring.close()
        for fd in fds.values():
            kernel.close_fd(fd)


def as_samples(recs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The records as the collection loop's samples (records.SAMPLE_DTYPE: each its own row of
    registers), their events, their periods and their registers in perf/abi.py's GPRS order."""
    from cyclescope.perf.abi import MISC_KERNEL, MISC_USER
    from cyclescope.perf.records import SAMPLE_DTYPE

    n = len(recs)
    s = np.zeros(n, SAMPLE_DTYPE)
    s["ip"] = recs["ip"]
    s["pid"] = recs["pid"].astype(np.int32)
    s["tid"] = recs["tid"].astype(np.int32)
    s["time"] = recs["time"]
    s["cpu"] = recs["cpu"]
    s["cpumode"] = np.where((recs["flags"] & LC_KERNEL) != 0, MISC_KERNEL, MISC_USER)
    s["extra"] = -1
    s["regs"] = np.arange(n, dtype=np.int32)
    return s, recs["event"].astype(np.int64), recs["period"].astype(np.float64), recs["regs"]


__all__ = ["LC_FOLLOWER", "LoopWatch", "as_samples", "decode", "process_ranges", "ring_pages"]
