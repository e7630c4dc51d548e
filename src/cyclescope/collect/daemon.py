"""The collection loop: drain → decode → map → aggregate → flush.

Shared by `cyclescope record` (a command, processes, or a fixed time) and
`cyclescope daemon` (system-wide, until stopped). Flushes on an interval, on
demand (`cyclescope flush`), when the in-memory table grows large, and when
the loop ends; starts a new epoch on command; reaps exited processes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cyclescope.collect.aggregate import Aggregator, Counts
from cyclescope.collect.clock import measure_ghz, sample_overhead
from cyclescope.collect.control import ControlServer
from cyclescope.collect.processor import Context, Drain, Processor
from cyclescope.collect.session import CallGraph, Command, Processes, Session, SystemWide
from cyclescope.collect.stacks import StackAggregator
from cyclescope.db import symbols as symstore
from cyclescope.db.layout import Database, safe_host
from cyclescope.db.segment import EventMeta, SegmentMeta, build_table, merge_clock, write_segment
from cyclescope.images.cache import Cache
from cyclescope.images.elf import SymbolTable, symbols_from_bytes
from cyclescope.images.kernel import (
    KernelMap,
    KernelRange,
    boot_stamp,
    kernel_symbols,
    load_kernel_ranges,
    read_kallsyms,
)
from cyclescope.images.maps import Mapper
from cyclescope.images.procfs import list_pids, own_vdso, parse_perf_map, read_perf_map
from cyclescope.images.registry import ImageInfo, ImageResolver, ImageTable, Unknown
from cyclescope.perf.abi import X86_REGS_USER_MASK, RecordType, regs_in_mask
from cyclescope.perf.records import (
    CommRecord,
    LostRecord,
    RecordDecoder,
    SideRecord,
    TaskRecord,
    ThrottleRecord,
)

if TYPE_CHECKING:  # value capture (capstone, unicorn, the modules) is imported only when asked for
    from cyclescope.collect.unwind import DwarfStacks
    from cyclescope.values.capture import ValueCapture, ValueOptions


# A ring's wake-up is acted on only when the fullest ring holds at least this share of its size
# (a quarter: half a watermark). Skipping a wake-up below it leaves the ring at most three
# quarters full by the next one.
WAKE_MIN_FILL = 0.25


@dataclass
class CollectorConfig:
    host: str
    flush_interval_s: float = 60.0
    # PERF_EVENT_IOC_PERIOD is a synchronous cross-CPU call (an IPI) when the
    # event's task or CPU is busy elsewhere: about 0.5 ms each on these VMs.
    # Every 200 ms keeps that near 0.5% of a CPU.
    rerandomize_s: float = 0.2
    drain_s: float = 1.0
    compact_after: int = 8
    max_pending_rows: int = 2_000_000
    reap_interval_s: float = 5.0
    new_epoch: bool = False
    # A daemon follows the epochs `cyclescope epoch` makes (here or on another host sharing the
    # database); a `record` run writes into the epoch it made (or, --append, the latest) and no other.
    follow_epochs: bool = False
    epoch_name: str | None = None
    # What of each profiled binary to keep in the database, by build-id, so that reports
    # survive upgrades and deletions: "binaries" (needed by list and calc), "symbols"
    # (enough for prof, a few KB each) or "none".
    archive: str = "binaries"
    # Value capture (opt-in): registers and stack at each interrupt, hotlists per owner.
    values: ValueOptions | None = None
    # Call stacks (PERF_SAMPLE_CALLCHAIN, frame pointers or .eh_frame unwinding of user stack
    # snapshots): counted per stack, written beside the flat counts.
    stacks: CallGraph | None = None
    # What else is computed from each drain's samples (loop-iteration counts), each writing its
    # own tally at every flush.
    processors: list[Processor] = field(default_factory=list)


@dataclass(frozen=True)
class RunHooks:
    """What a caller adds to Collector.run's loop (exact value mode: its tracer's stops)."""

    fds: tuple[int, ...] = ()  # more file descriptors to wake on
    tick: Callable[[float], None] | None = None  # after each wake-up, with the monotonic time
    finish: Callable[[], None] | None = None  # before the last drain and flush


@dataclass
class FlushResult:
    epoch: int
    path: str | None
    samples: int
    rows: int
    seconds: float


@dataclass
class RunTotals:
    samples: int = 0
    lost_records: int = 0
    lost_samples: int = 0
    unknown: int = 0
    throttles: int = 0
    malformed: int = 0
    flushes: int = 0
    per_event: dict[str, int] = field(default_factory=dict)
    unknown_reasons: dict[str, int] = field(default_factory=dict)


class Collector:
    def __init__(self, session: Session, db: Database, config: CollectorConfig,
                 progress: Callable[[Collector], None] | None = None) -> None:
        self.session = session
        self.db = db
        self.cfg = config
        self.progress = progress
        self.table = ImageTable()
        self.resolver = ImageResolver(self.table)
        ranges = load_kernel_ranges(db.cache_dir)
        self.kernel_ranges = ranges
        kimgs = [self.table.intern(ImageInfo(r.key, r.name, "kernel" if r.name == "[kernel.kallsyms]" else "module",
                                             r.key if not r.key.startswith(("kernel:", "module:")) else None,
                                             None, None, "kernel")) for r in ranges]
        self.mapper = Mapper(self.resolver, KernelMap(ranges), kimgs)
        vdso = own_vdso()
        self.vdso_bytes = vdso
        if vdso:
            self.resolver.set_vdso(vdso)
        self.decoder = RecordDecoder(session.layout)
        self.values: ValueCapture | None = None
        if config.values is not None:
            from cyclescope.values.capture import ValueCapture

            self.values = ValueCapture(config.values, self.mapper, self.table)
        self.value_files: list[str] = []
        self._values_since = time.time()
        self.stacks: StackAggregator | None = StackAggregator() if config.stacks else None
        self.dwarf: DwarfStacks | None = None
        if config.stacks is not None and config.stacks.mode == "dwarf":
            from cyclescope.collect.unwind import DwarfStacks, TableLoader

            self.dwarf = DwarfStacks(TableLoader(self.table, Cache(), vdso))
        self.agg = Aggregator()
        self.totals = RunTotals()
        self.epoch = 0
        self._flush_meta = self._fresh_meta()
        self._stop = False
        self._flush_requested = False
        self._epoch_requested: str | None = None
        self._last_counters: dict[int, tuple[int, int, int]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compact")
        self._compacting: concurrent.futures.Future[Any] | None = None
        self.control: ControlServer | None = None
        self.started = time.time()
        self._symbols_written: set[str] = set()
        self._archived: set[str] = set()
        self._clock = 0.0
        self._overhead: dict[int, float] = {}
        # Rings whose event hung up (its task exited with no children left): drained once more by
        # the wake-up that reported it, never polled again (poll would report it at once forever).
        self._hung_up: set[int] = set()
        self.processors = list(config.processors)
        self.tally_files: list[str] = []

    # --- life cycle ---------------------------------------------------------------------
    def _fresh_meta(self) -> SegmentMeta:
        return SegmentMeta(self.cfg.host, 0, start_time=time.time(), targets=[self.session.target.describe()])

    def start(self) -> None:
        self.session.open()  # first: a failure here must not leave an empty epoch behind
        owner = f"{'daemon' if self.cfg.follow_epochs else 'record'} {self.cfg.host} pid {os.getpid()}"
        latest = self.db.current_epoch()
        if self.cfg.new_epoch or latest is None:
            self.epoch = self.db.new_epoch(self.cfg.epoch_name, shared=self.cfg.follow_epochs, owner=owner)
        elif self.cfg.follow_epochs:
            self.epoch = self.db.ensure_epoch()
        else:
            self.epoch = latest
        self._clock = measure_ghz() or 0.0
        for i, spec in enumerate(self.session.events):
            if spec.time_based:  # before the target runs: a quiet machine
                ns = sample_overhead(int(self.session.randomizers[i].mean), Cache().root)
                self._overhead[i] = ns or 0.0
        time_event = next((i for i, e in enumerate(self.session.events)
                           if e.time_based or e.label.startswith("cycles")), -1)
        cols = {r.name.lower(): k for k, r in enumerate(regs_in_mask(self.session.layout.regs_user_mask
                                                                      or X86_REGS_USER_MASK))}
        cols = {("r" + n if len(n) == 2 and not n[1].isdigit() else n): k for n, k in cols.items()}
        ctx = Context(self.table, not isinstance(self.session.target, SystemWide), time_event, cols)
        for p in self.processors:
            p.bind(ctx)
        self.session.start()
        if isinstance(self.session.target, SystemWide):
            # DCPI's third source: processes that were running before we started.
            self.mapper.scan_proc(list_pids())
        elif isinstance(self.session.target, Processes):
            self.mapper.scan_proc(list(self.session.target.pids))
        self.started = time.time()

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def install_signals(self, child: Callable[[], int | None] | None = None) -> None:
        """SIGTERM and SIGINT stop the loop (it flushes first), SIGHUP flushes. With ``child`` (the
        pid of the command being recorded, while it runs): the first SIGTERM or SIGINT goes on to
        the command, and recording goes on until it exits (its last samples are wanted too); a
        second one stops at once."""
        asked = {"n": 0}

        def stop(signum: int, _frame: object) -> None:
            pid = child() if child is not None else None
            asked["n"] += 1
            if pid is not None and asked["n"] == 1:
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)
                return
            self._stop = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "_flush_requested", True))

    def run(self, duration_s: float | None = None, until: Callable[[], bool] | None = None,
            hooks: RunHooks | None = None) -> RunTotals:
        """Loop until stopped, ``duration_s`` elapses, or ``until()`` says so; flush at the end.

        The loop wakes every ``rerandomize_s`` to draw new periods (an ioctl per
        event), but drains the rings only when one is half full or every
        ``drain_s``: large batches keep the per-sample cost of decoding and
        mapping low.
        """
        start = time.monotonic()
        deadline = start + duration_s if duration_s else None
        next_flush = start + self.cfg.flush_interval_s
        next_rand = start + self.cfg.rerandomize_s
        next_drain = start + self.cfg.drain_s
        next_reap = start + self.cfg.reap_interval_s
        next_progress = start + 1.0 if self.progress else float("inf")
        try:
            while not self._stop:
                now = time.monotonic()
                wake = min(next_rand, next_drain, next_flush, next_progress, deadline or next_flush)
                ready = self._wait(max(0.0, wake - now), hooks.fds if hooks is not None else ())
                now = time.monotonic()
                if hooks is not None and hooks.tick is not None:
                    hooks.tick(now)
                if ready or now >= next_drain:
                    self.step()
                    next_drain = now + self.cfg.drain_s
                if now >= next_rand:
                    self.session.rerandomize()
                    next_rand = now + self.cfg.rerandomize_s
                if now >= next_flush or self._flush_requested or len(self.agg) > self.cfg.max_pending_rows:
                    self.step()
                    self.flush()
                    self._flush_requested = False
                    next_flush = now + self.cfg.flush_interval_s
                if now >= next_reap:
                    self.mapper.reap()
                    next_reap = now + self.cfg.reap_interval_s
                if self.progress is not None and now >= next_progress:
                    self.progress(self)
                    next_progress = now + 1.0
                if deadline is not None and now >= deadline:
                    break
                if until is not None and until():
                    break
            if hooks is not None and hooks.finish is not None:
                hooks.finish()
            self.step()
            for p in self.processors:
                p.finish()
            if self.dwarf is not None:
                # Unwind tables still loading: wait for them (a walk may meet a new image on its
                # way, so repeat while that brings progress), then unwind what is left regardless.
                give_up = time.monotonic() + 120.0
                while self.dwarf.waiting and self.dwarf.loader.pending() and time.monotonic() < give_up:
                    self.dwarf.loader.wait(timeout=give_up - time.monotonic())
                    self._unwind(None, None, [])
                self._unwind(None, None, [], force=True)
            self.flush()
        finally:
            self.close()
        return self.totals

    def _wait(self, timeout: float, extra: tuple[int, ...] = ()) -> bool:
        """Sleep until a ring is worth draining (True), a control request was served, an
        ``extra`` descriptor is readable, or timeout."""
        p = select.poll()
        for fd in self.session.fds:
            if fd not in self._hung_up:
                p.register(fd, select.POLLIN)
        for fd in extra:
            p.register(fd, select.POLLIN)
        if self.control is not None:
            p.register(self.control.fileno(), select.POLLIN)
        try:
            events = p.poll(math.ceil(timeout * 1000))  # round up: a 0 ms timeout would spin
        except InterruptedError:
            return False
        ring = hup = False
        for fd, ev in events:
            if self.control is not None and fd == self.control.fileno():
                self._serve()
            elif fd not in extra:
                ring = True
                if ev & (select.POLLHUP | select.POLLERR):
                    hup = True
                    self._hung_up.add(fd)
        # The kernel wakes us each time a ring's head crosses the next multiple of the watermark,
        # counted from the ring's start, not from where we last read: after a drain on the timer
        # (drain_s shorter than the time to fill half a ring, as with interpretation) the next
        # wake-up comes with only a fraction of a watermark in the ring. Draining then would double
        # the drains and their fixed cost; the timer or the next crossing (at most half a ring
        # later) takes those samples instead. A hang-up or error is drained at once, and only
        # once: the event has nothing left to sample, and poll would report it again at once on
        # every call, a busy loop of empty drains until the command's exit is reaped.
        return ring and (hup or self.session.fullest() >= WAKE_MIN_FILL)

    def close(self) -> None:
        if self._compacting is not None:
            with contextlib.suppress(Exception):
                self._compacting.result()
        self._pool.shutdown(wait=True)
        for p in self.processors:
            p.close()
        if self.dwarf is not None:
            self.dwarf.loader.close()
        self.session.close()
        if self.control is not None:
            self.control.close()
            self.control = None

    # --- one drain ---------------------------------------------------------------------
    def step(self) -> int:
        chunks = self.session.drain()
        samples_list = []
        side: list[SideRecord] = []
        regs_parts: list[np.ndarray] = []
        stack_parts: list[np.ndarray] = []
        len_parts: list[np.ndarray] = []
        nregs = 0
        chains: list[tuple[int, ...] | None] = []
        for raw in chunks:
            if not raw:
                continue
            batch = self.decoder.decode(raw)
            if self.stacks is not None:
                ex = batch.samples["extra"].tolist()
                chains.extend(batch.extras[e].callchain if e >= 0 else None for e in ex)
            if len(batch.regs):
                # Row indices into this batch's register arrays → into the concatenated ones.
                has = batch.samples["regs"] >= 0
                batch.samples["regs"][has] += nregs
                nregs += len(batch.regs)
                regs_parts.append(batch.regs)
                stack_parts.append(batch.stack)
                len_parts.append(batch.stack_len)
            samples_list.append(batch.samples)
            side.extend(batch.side)
            if batch.malformed:
                self.totals.malformed += batch.malformed
                self._flush_meta.malformed += batch.malformed
        for rec in side:
            if isinstance(rec, LostRecord):
                self._note_lost(rec)
            elif isinstance(rec, ThrottleRecord) and rec.throttled:
                self.totals.throttles += 1
                idx = int(self.session.event_index(np.array([rec.id], np.uint64))[0])
                if idx >= 0:
                    self.session.stats[idx].throttles += 1
            elif isinstance(rec, TaskRecord) and rec.kind == RecordType.FORK and rec.pid != rec.ppid:
                self.session.note_fork(rec.pid, rec.ppid, rec.time)
            elif isinstance(rec, TaskRecord) and rec.kind == RecordType.EXIT:
                for p in self.processors:
                    p.forget(rec.pid, rec.tid)
                if rec.pid == rec.tid:
                    self.session.forget_pid(rec.pid)
                    if self.values is not None:
                        self.values.forget(rec.pid)
            elif isinstance(rec, CommRecord) and rec.exec and self.values is not None:
                self.values.forget(rec.pid)
        if not samples_list:
            if side:
                self.mapper.map_batch(np.zeros(0, dtype=self._sample_dtype()), side)
            return 0
        samples = np.concatenate(samples_list) if len(samples_list) > 1 else samples_list[0]
        ev = self.session.event_index(samples["id"])
        keep = ev >= 0
        if not keep.all():
            samples, ev = samples[keep], ev[keep]
        periods = self.session.account(ev, samples)
        mapped = self.mapper.map_batch(samples, side)
        self.agg.add(mapped.image, mapped.offset, ev, mapped.comm, weight=periods)
        regs = stack = slen = None
        if regs_parts:
            regs = np.concatenate(regs_parts) if len(regs_parts) > 1 else regs_parts[0]
            stack = np.concatenate(stack_parts) if len(stack_parts) > 1 else stack_parts[0]
            slen = np.concatenate(len_parts) if len(len_parts) > 1 else len_parts[0]
        if self.processors:
            drain = Drain(samples, ev, periods, mapped.image, mapped.offset, regs)
            for p in self.processors:
                p.process(drain)
        if self.stacks is not None and chains:
            kept = chains if keep.all() else [c for c, k in zip(chains, keep.tolist(), strict=True) if k]
            if self.dwarf is not None:
                self._unwind(samples, ev, kept, mapped.comm, regs, stack, slen)
            else:
                self.stacks.add(self.mapper, samples["pid"].astype(np.int64), samples["ip"], ev, kept,
                                mapped.comm.tolist())
        if self.values is not None and regs is not None and stack is not None and slen is not None:
            self.values.process(samples, mapped.image, mapped.offset, regs, stack, slen, mapped.comm)
        n = len(samples)
        self.totals.samples += n
        unk = mapped.image == 0
        if unk.any():
            self.totals.unknown += int(unk.sum())
        return n

    def _unwind(self, samples: np.ndarray | None, ev: np.ndarray | None, chains: list[tuple[int, ...] | None],
                comm: np.ndarray | None = None, regs: np.ndarray | None = None, stack: np.ndarray | None = None,
                slen: np.ndarray | None = None, force: bool = False) -> None:
        """Unwind user stack snapshots into callchains and count them (--call-graph dwarf)."""
        assert self.dwarf is not None and self.stacks is not None
        if samples is None or ev is None or comm is None:
            out = self.dwarf.chains(self.mapper, [], [], [], [], [], [], None, None, None, force=force)
        else:
            rows = samples["regs"].tolist() if regs is not None else [-1] * len(samples)
            out = self.dwarf.chains(self.mapper, samples["pid"].tolist(), samples["ip"].tolist(), ev.tolist(),
                                    comm.tolist(), chains, rows, regs, stack, slen, force=force)
        if out.pids:
            self.stacks.add(self.mapper, np.array(out.pids, np.int64), np.array(out.ips, np.uint64),
                            np.array(out.events, np.int64), out.chains, out.comms)

    @staticmethod
    def _sample_dtype() -> np.dtype:
        from cyclescope.perf.records import SAMPLE_DTYPE

        return SAMPLE_DTYPE

    def _note_lost(self, rec: LostRecord) -> None:
        idx = int(self.session.event_index(np.array([rec.id], np.uint64))[0])
        if rec.kind == RecordType.LOST:
            self.totals.lost_records += rec.lost
            self._flush_meta.lost_records += rec.lost
        else:
            self.totals.lost_samples += rec.lost
            self._flush_meta.lost_samples += rec.lost
        if idx >= 0:
            self.session.stats[idx].lost += rec.lost

    # --- flushing ---------------------------------------------------------------------
    def flush(self) -> FlushResult:
        t0 = time.monotonic()
        if self.dwarf is not None and self.dwarf.waiting:
            self._unwind(None, None, [])  # stacks whose tables arrived since the last drain
        counts = self.agg.take()
        meta = self._flush_meta
        self._flush_meta = self._fresh_meta()
        meta.end_time = time.time()
        now_clock = measure_ghz() or 0.0
        meta.clock_ghz = merge_clock(self._clock, 1, now_clock, 1)
        self._clock = now_clock or self._clock
        self.session.read_counters()
        for i, spec in enumerate(self.session.events):
            st = self.session.stats[i]
            pv, pe, pr = self._last_counters.get(i, (0, 0, 0))
            em = EventMeta(
                name=spec.label, type=spec.type, config=spec.config, time_based=spec.time_based,
                nominal_period=self.session.randomizers[i].nominal, band=self.session.band,
                samples=st.samples, period_sum=st.period_sum, lost=st.lost, throttles=st.throttles,
                value=max(0, st.value - pv), enabled_ns=max(0, st.enabled_ns - pe),
                running_ns=max(0, st.running_ns - pr), overhead_ns=self._overhead.get(i, 0.0),
            )
            self._last_counters[i] = (st.value, st.enabled_ns, st.running_ns)
            st.samples = st.period_sum = st.lost = st.throttles = 0
            meta.events[spec.label] = em
        path = None
        epoch = self.epoch
        if len(counts) or any(e.lost for e in meta.events.values()) or meta.lost_records:
            self._describe(counts, meta)
            table = build_table(
                self.table.keys(), counts.image, counts.offset, [s.label for s in self.session.events],
                counts.event, self.mapper.comms.names, counts.comm, counts.count, counts.weight,
            )
            path = str(write_segment(self.db, epoch, self.cfg.host, table, meta))
            self.totals.flushes += 1
            self._store_symbols(counts)
            if self.cfg.archive != "none":
                self._archive(counts)
        if self.values is not None:
            self._flush_values(epoch)
        if self.stacks is not None:
            self._flush_stacks(epoch)
        for p in self.processors:
            self.tally_files += [str(x) for x in p.flush(self.db, epoch, self.cfg.host)]
        for e in meta.events.values():
            self.totals.per_event[e.name] = self.totals.per_event.get(e.name, 0) + e.samples
        for k, v in meta.unknown.items():
            self.totals.unknown_reasons[k] = self.totals.unknown_reasons.get(k, 0) + v
        # A new epoch made by `cyclescope epoch` (here or on another host): switch now.
        newest = self.db.newest_shared_epoch() if self.cfg.follow_epochs else None
        if self._epoch_requested is not None:
            newest = self.db.new_epoch(self._epoch_requested or None, shared=True,
                                       owner=f"daemon {self.cfg.host} pid {os.getpid()}")
            self._epoch_requested = None
        if newest is not None and newest > self.epoch:
            old = self.epoch
            self.epoch = newest
            self._compact_async(old, min_segments=2)
        else:
            live = len(self.db.segments(self.epoch, self.cfg.host))
            if live >= self.cfg.compact_after:
                self._compact_async(self.epoch, min_segments=2)
        return FlushResult(epoch, path, counts.total, len(counts), time.monotonic() - t0)

    def _describe(self, counts: Counts, meta: SegmentMeta) -> None:
        used = np.unique(counts.image).tolist()
        for i in used:
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

    def _flush_stacks(self, epoch: int) -> None:
        from cyclescope.db.stacks import write_stacks

        assert self.stacks is not None
        sc = self.stacks.take()
        if not len(sc):
            return
        used = {i for st in sc.stacks for i, _ in st}
        images = {self.table[i].key: self.table[i].to_json() for i in used if i > 0}
        write_stacks(self.db, epoch, self.cfg.host, sc, self.table.keys(),
                     [s.label for s in self.session.events], images, self.mapper.comms.names)

    def _flush_values(self, epoch: int) -> None:
        from cyclescope.db.values import write_values

        assert self.values is not None
        now = time.time()
        for _uid, (hotlists, vmeta) in self.values.take(self._values_since, now).items():
            if not len(hotlists.hl) and not vmeta.samples:
                continue
            path = write_values(self.db, epoch, self.cfg.host, hotlists, vmeta)
            self.value_files.append(str(path))  # compacted with the segments (`db compact`, in a child)
        self._values_since = now

    def _store_symbols(self, counts: Counts) -> None:
        """Kernel, module, vdso and JIT symbols go into the database (their sources are transient)."""
        for i in np.unique(counts.image).tolist():
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
            elif info.kind == "vdso" and self.vdso_bytes and info.key not in self._symbols_written:
                symstore.write_binary(self.db, info.key, self.vdso_bytes)
                if not symstore.has_symbols(self.db, info.key):
                    with contextlib.suppress(Exception):
                        symstore.write_symbols(self.db, info.key, symbols_from_bytes(self.vdso_bytes, "[vdso]"))
                self._symbols_written.add(info.key)
            elif info.kind == "jit":
                parts = info.key.split(":")  # jit:PID:MTIME:OWNER
                owner = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
                text = read_perf_map(info.path, owner)
                if text is None:
                    continue
                entries = parse_perf_map(text)
                symstore.write_symbols(self.db, info.key, SymbolTable.build(entries))

    def _archive(self, counts: Counts) -> None:
        todo = []
        for i in np.unique(counts.image).tolist():
            info = self.table[i]
            if info.kind == "elf" and info.build_id and info.key == info.build_id and info.key not in self._archived:
                self._archived.add(info.key)
                todo.append((info.key, info.path, info.build_id))
        if not todo:
            return
        if self.cfg.archive == "binaries":
            self._pool.submit(lambda: [symstore.archive_binary(self.db, *t) for t in todo])
        else:
            self._pool.submit(lambda: [symstore.archive_symbols(self.db, *t) for t in todo])

    def _compact_async(self, epoch: int, min_segments: int) -> None:
        """Compact in a child process: merging segments briefly needs hundreds of MiB, which a
        long-running daemon would otherwise keep (allocators rarely give memory back)."""
        if self._compacting is not None and not self._compacting.done():
            return
        cmd = [sys.executable, "-m", "cyclescope", "db", "compact", "--db", str(self.db.root), "--epoch", str(epoch),
               "--host", safe_host(self.cfg.host)]
        self._compacting = self._pool.submit(_run_quietly, cmd)

    # --- control socket ------------------------------------------------------------------
    def listen(self) -> None:
        self.control = ControlServer(self.db.root)

    def _serve(self) -> None:
        """Answer the requests the control server checked and queued (in this thread: flushes and
        epochs change the collector's state)."""
        assert self.control is not None
        for p in self.control.pending():
            cmd = p.request["cmd"]
            try:
                if cmd == "flush":
                    self.step()
                    r = self.flush()
                    p.reply({"ok": True, "epoch": r.epoch, "samples": r.samples, "rows": r.rows,
                             "path": r.path, "seconds": round(r.seconds, 3)})
                elif cmd == "epoch":
                    self.step()
                    self._epoch_requested = str(p.request.get("name") or "")
                    old = self.epoch
                    r = self.flush()
                    p.reply({"ok": True, "flushed_into": old, "samples": r.samples, "epoch": self.epoch})
                elif cmd == "status":
                    p.reply({"ok": True, **self.status()})
                elif cmd == "stop":
                    self._stop = True
                    p.reply({"ok": True})
                else:
                    p.reply({"ok": False, "error": f"unknown command {cmd!r}"})
            except Exception as e:  # a failing request must not kill the daemon
                p.reply({"ok": False, "error": f"{type(e).__name__}: {e}"})

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(), "epoch": self.epoch, "host": self.cfg.host,
            "uptime_s": round(time.time() - self.started, 1), "samples": self.totals.samples,
            "lost_records": self.totals.lost_records, "lost_samples": self.totals.lost_samples,
            "unknown": self.totals.unknown, "pending_rows": len(self.agg), "processes": len(self.mapper.procs),
            "images": len(self.table), "flushes": self.totals.flushes, "rss_kib": rss_kib(),
            "events": [s.label for s in self.session.events],
            "values": self._value_status(),
            **{p.name: p.status() for p in self.processors},
        }

    def _value_status(self) -> dict[str, Any] | None:
        v = self.values
        if v is None:
            return None
        interp = v.interp
        return {"hotlist_rows_pending": v._pending_rows, "skipped": dict(v.skipped),
                "interpreted": interp.runs if interp else 0, "stops": dict(interp.stops) if interp else {}}


def _run_quietly(cmd: list[str]) -> int:
    import subprocess

    try:
        return subprocess.run(cmd, capture_output=True, timeout=3600).returncode
    except (OSError, subprocess.TimeoutExpired):
        return -1


def rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def child_done(session: Session) -> Callable[[], bool]:
    """For record -- CMD: true once the command has exited (its status is kept)."""
    state: dict[str, int | None] = {"status": None}

    def check() -> bool:
        pid = session.child_pid
        if pid is None:
            return True
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            state["status"] = status
            session.exit_status = status
            return True
        return False

    return check


def processes_gone(pids: tuple[int, ...]) -> Callable[[], bool]:
    return lambda: not any(os.path.exists(f"/proc/{p}") for p in pids)


def describe_target(target: SystemWide | Processes | Command) -> str:
    return target.describe()


def eprint(*a: object) -> None:
    print(*a, file=sys.stderr)
