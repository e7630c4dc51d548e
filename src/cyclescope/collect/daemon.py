"""The collection loop: drain → decode → map → aggregate → flush.

Shared by `cyclescope record` (a command, processes, or a fixed time) and
`cyclescope daemon` (system-wide, until stopped). Flushes on an interval, on
demand (`cyclescope flush`), when the in-memory table grows large, and when
the loop ends; starts a new epoch on command; reaps exited processes.
"""

from __future__ import annotations

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

from cyclescope.arrays import distinct, group
from cyclescope.collect.aggregate import Aggregator
from cyclescope.collect.clock import FLUSH_CLOCK_S, boot_clock, measure_ghz, sample_overhead
from cyclescope.collect.control import ControlServer
from cyclescope.collect.flusher import Flusher
from cyclescope.collect.helpers import is_helper
from cyclescope.collect.processor import Context, Drain, Processor
from cyclescope.collect.session import Processes, Session, SystemWide
from cyclescope.db.layout import Database
from cyclescope.db.segment import EventMeta, SegmentMeta, merge_clock
from cyclescope.images.cache import Cache
from cyclescope.images.kernel import KernelMap, forget_kallsyms, load_kernel_ranges
from cyclescope.images.maps import Mapper
from cyclescope.images.procfs import list_pids, own_vdso
from cyclescope.images.registry import ImageInfo, ImageResolver, ImageTable
from cyclescope.perf.abi import GPRS, MISC_KERNEL, MISC_USER, X86_REGS_USER_MASK, RecordType, Sample, regs_in_mask
from cyclescope.perf.records import (
    SAMPLE_DTYPE,
    CommRecord,
    LostRecord,
    MmapRecord,
    RecordDecoder,
    SideRecord,
    TaskRecord,
    ThrottleRecord,
)

if TYPE_CHECKING:
    from cyclescope.collect.bpfunwind import KernelUnwind
    from cyclescope.collect.ebpf import BpfAggregator, Drained
    from cyclescope.collect.loopwatch import LoopWatch
    from cyclescope.collect.pyframes import PythonFrames

# A ring's wake-up is acted on only when the fullest ring holds at least this share of its size
# (a quarter: half a watermark). Skipping a wake-up below it leaves the ring at most three
# quarters full by the next one.
WAKE_MIN_FILL = 0.25
FIRST_DRAIN_S = 0.05
PYTHON_DRAIN_S = 0.25  # drains while Python processes show code objects not read yet
# The same while a command waits to be described to the eBPF program for unwinding (-g dwarf):
# its samples until then have frame-pointer stacks, and a drain with nothing much to read costs
# a millisecond or two.
UNWIND_DRAIN_S = 0.01
# How often an interpreter whose runtime has not started is looked at again (a pointer read): a
# Python program is described to the eBPF program within this of its runtime's start, where a
# drain every FIRST_DRAIN_S left its first 50 ms without Python frames.
PY_WAIT_POLL_S = 0.005
# Programs starting a CPython interpreter wake the collector (pyframes' start probes) at most this
# often: with python3.11 -c pass started about 100 times a second under `record -a`, a drain per
# start took the recorder's CPU from 0.6-0.7 s to 1.3 s over 6 s.
PY_START_WAKE_S = 0.1


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
    # Where to ship the database's sealed files after each flush (fleet/ship.py): a path or an
    # http(s) URL, and the ingest token for the latter.
    ship_to: str | None = None
    ship_token: str | None = None
    # A long-running process (the daemon): each flush gives freed memory back to the system.
    lean_memory: bool = False
    # What else is computed from each drain's samples (loop-iteration counts, call stacks, values
    # at the interrupt), each writing its own files at every flush.
    processors: list[Processor] = field(default_factory=list)
    # Samples counted in the kernel by the eBPF program (collect/ebpf.py), loaded by the caller;
    # None: every sample is read from the rings. The processors then see one row per distinct
    # (process, ip, event, stack) with its count, so only those that need nothing else (call
    # stacks walked with frame pointers) may be given.
    bpf: BpfAggregator | None = None


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
    lost_stacks: int = 0  # eBPF path: samples whose stack did not fit in the program's map
    lost_timeline: int = 0  # eBPF path: samples left out of the timeline (its map was full)


class Collector:
    def __init__(self, session: Session, db: Database, config: CollectorConfig,
                 progress: Callable[[Collector], None] | None = None) -> None:
        self.session = session
        self.db = db
        self.cfg = config
        self.progress = progress
        self.table = ImageTable()
        self.resolver = ImageResolver(self.table)
        ranges = load_kernel_ranges(Cache().root)  # per user and boot, as the clock calibrations
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
        self._chains = bool(session.layout.sample_type & Sample.CALLCHAIN)
        self.flusher = Flusher(db, config.host, self.table, self.mapper, ranges, vdso, config.archive)
        self.flusher.lean = config.lean_memory
        self.agg = Aggregator()
        self.totals = RunTotals()
        self.epoch = 0
        self._flush_meta = self._fresh_meta()
        self._stop = False
        self._flush_requested = False
        self._epoch_requested: str | None = None
        self._last_counters: dict[int, tuple[int, int, int]] = {}
        self.control: ControlServer | None = None
        self.started = time.time()
        self._clock = 0.0
        self._overhead: dict[int, float] = {}
        # Rings whose event hung up (its task exited with no children left): drained once more by
        # the wake-up that reported it, never polled again (poll would report it at once forever).
        self._hung_up: set[int] = set()
        self.processors = list(config.processors)
        self.bpf = config.bpf
        self._bpf_attached = 0
        self._bpf_stacks: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        self._bpf_stats: dict[str, int] = {}
        self._side_pending: list[SideRecord] = []  # side records read between drains (peek_side)
        self._start_quiet_until = 0.0  # the start probes' rings are not polled until then
        # (pid, tid) of the exits read in the drain under way: forgotten once its samples are handled
        self._exited: list[tuple[int, int]] = []
        self._python_seen = (0, 0)  # PythonFrames' code objects read and processes described at the last drain
        self.python: PythonFrames | None = None  # the eBPF path with stacks: CPython frames
        self.unwind: KernelUnwind | None = None  # the eBPF path with -g dwarf: unwind rows
        # The eBPF path system-wide with a processor that takes watched samples (the loop counter):
        # the program's samples in the procedures it watches, with their registers
        self.loops: LoopWatch | None = None
        self.loops_error: str | None = None  # why there is none where one was wanted
        self._regs_cols: dict[str, int] = {}

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
        self._clock = boot_clock(Cache().root) or 0.0
        for i, spec in enumerate(self.session.events):
            if spec.time_based:  # before the target runs: a quiet machine
                ns = sample_overhead(int(self.session.randomizers[i].mean), Cache().root)
                self._overhead[i] = ns or 0.0
        time_event = next((i for i, e in enumerate(self.session.events)
                           if e.time_based or e.label.startswith("cycles")), -1)
        cols = {r.name.lower(): k for k, r in enumerate(regs_in_mask(self.session.layout.regs_user_mask
                                                                      or X86_REGS_USER_MASK))}
        cols = {("r" + n if len(n) == 2 and not n[1].isdigit() else n): k for n, k in cols.items()}
        if self.bpf is not None and self.bpf.stack_entries:
            from cyclescope.collect.pyframes import PythonFrames

            target = self.session.target
            self.python = PythonFrames(self.table, self.mapper, self.bpf,
                                       start_cpus=target.cpus if isinstance(target, SystemWide) else ())
            self.flusher.symbol_sources["python"] = self.python.symbols
        if self.bpf is not None and self.bpf.unwind_rows:
            from cyclescope.collect.bpfunwind import KernelUnwind, RowLoader

            self.unwind = KernelUnwind(self.table, self.mapper, self.bpf,
                                       RowLoader(self.table, Cache(), self.vdso_bytes))
        python_stack = None
        if self.python is not None:
            py = self.python
            python_stack = py.stacks
        tasks = tuple(sorted({ev.tid for ev in self.session.open_events if ev.tid >= 0}))
        ctx = Context(self.table, self.mapper, tuple(s.label for s in self.session.events),
                      not isinstance(self.session.target, SystemWide), time_event, cols, self.vdso_bytes,
                      self.flusher.store_symbols, python_stack, tasks, self.session.child_pid is not None)
        for p in self.processors:
            p.bind(ctx)
        self._regs_cols = cols
        self._attach_bpf()
        self._watch_loops_start(time_event)
        self.session.start()
        if isinstance(self.session.target, SystemWide):
            # DCPI's third source: processes that were running before we started.
            self.mapper.scan_proc(list_pids())
            if self.python is not None:
                self.python.probe_known()  # the interpreters they run, ours too: their next starts
                self.python.watch_execs()  # and any python executed: its first program too
        elif isinstance(self.session.target, Processes):
            self.mapper.scan_proc(list(self.session.target.pids))
        if self.cfg.lean_memory:  # the start-up's reads of kallsyms are done; the first flush is far off
            forget_kallsyms()
        self.started = time.time()

    def _watch_loops_start(self, time_event: int) -> None:
        """On the eBPF path system-wide, where a processor takes the program's watched samples
        (collect/loopwatch.py), their output events; where they cannot be opened, loop counts are
        off and loops_error says why."""
        target = self.session.target
        takers = [p for p in self.processors if hasattr(p, "process_watched")]
        if self.bpf is None or not takers or not isinstance(target, SystemWide) or time_event < 0:
            return
        from cyclescope.collect.kernel import PerfOpenError
        from cyclescope.collect.loopwatch import LoopWatch

        rate = float(self.session.rate_hz or 1000.0)
        try:
            self.loops = LoopWatch(self.bpf, list(target.cpus), rate, time_event)
        except (OSError, PerfOpenError) as e:
            self.loops_error = f"loop counts are off: the eBPF program's output events could not be opened ({e})"

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
        # With Python frames to read or stacks to unwind in the kernel (the eBPF path with
        # stacks), the first drain comes early: a command is described to the program before its
        # samples go by without Python frames or with frame-pointer stacks. Not otherwise: the
        # loop counter, given a first batch of a few samples, counted fewer loops on a loaded
        # machine (tests/system/test_calc.py's branchy lost its trip counts).
        early = self.python is not None or self.unwind is not None
        first = min(self.cfg.drain_s, FIRST_DRAIN_S) if early else self.cfg.drain_s
        # A processor may want its first samples sooner (anchors: their windows start once a
        # procedure has samples, and a run under a second had none).
        first = min([first] + [float(s) for p in self.processors if (s := getattr(p, "first_drain_s", None))])
        if self.unwind is not None or self.python is not None:
            # A Python program's runtime starts 10-20 ms after its exec, and its script soon
            # after: seen at 10 ms, it waits (polled every PY_WAIT_POLL_S) and is described as its
            # runtime starts. At 50 ms the first 50 ms of a short script had no Python frames.
            first = min(first, UNWIND_DRAIN_S)
        next_drain = start + first
        next_reap = start + self.cfg.reap_interval_s
        next_progress = start + 1.0 if self.progress else float("inf")
        try:
            while not self._stop:
                now = time.monotonic()
                wake = min(next_rand, next_drain, next_flush, next_progress, deadline or next_flush)
                if self.python is not None and (self.python.waiting or self.python.watching_exec()):
                    wake = min(wake, now + PY_WAIT_POLL_S)
                drain_fds = tuple(fd for p in self.processors for fd in getattr(p, "wake_fds", tuple)())
                if self.loops is not None:
                    drain_fds += self.loops.fds()  # the watched samples' rings, half full
                exec_fds: tuple[int, ...] = ()
                if self.python is not None and now >= self._start_quiet_until:
                    drain_fds += self.python.start_fds()  # a CPython program starting: describe it now
                    exec_fds = self.python.exec_fds()  # a python executed: look at its mappings now
                ready = self._wait(max(0.0, wake - now), (hooks.fds if hooks is not None else ()) + exec_fds,
                                   drain_fds)
                now = time.monotonic()
                if exec_fds and self.python is not None and self.python.take_execs():
                    # Not a drain: the side records (_peek_side, below) bring one when they show
                    # the process's interpreter, at once or within a few polls.
                    self._start_quiet_until = now + PY_START_WAKE_S
                if hooks is not None and hooks.tick is not None:
                    hooks.tick(now)
                if self.python is not None and self.python.poll_waiting():
                    next_drain = min(next_drain, now + FIRST_DRAIN_S)  # its first Python frames named soon
                if ready or now >= next_drain or self._peek_side():
                    self.step()
                    # Soon again while a process is not described to the eBPF program yet, or
                    # waits for unwind rows: its stacks are walked whole from the drain that
                    # describes it with them; and while Python processes need it (_python_drain_s).
                    soon = self.unwind is not None and (self.unwind.starting or self.unwind.waiting)
                    next_drain = now + min(self.cfg.drain_s, self._python_drain_s() or self.cfg.drain_s,
                                           UNWIND_DRAIN_S if soon else self.cfg.drain_s,
                                           self._settling_drain_s() or self.cfg.drain_s)
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
            if self.python is not None:
                self.python.stop_starts()  # closed while the last drain and flush run
            self.step()
            for p in self.processors:
                p.finish()
            self.flush()
        finally:
            self.close()
        return self.totals

    def _settling_drain_s(self) -> float | None:
        """On the eBPF path with watched samples: how soon the processors want the next drain
        (``next_drain_s``: the loop counter's while its procedures are analyzed; once analyzed
        they are watched, and their samples bring registers from the drain after); None: no hurry."""
        if self.loops is None:
            return None
        want = [s for p in self.processors if (s := getattr(p, "next_drain_s", lambda: None)()) is not None]
        return min(want) if want else None

    def _python_drain_s(self) -> float | None:
        """How soon the next drain should come for Python frames: every 50 ms while an interpreter
        has not started its runtime (it is looked at every PY_WAIT_POLL_S meanwhile), and once
        more 50 ms after a process was described (the program's first samples with its Python
        frames: their code objects are read from its memory at that drain; a process that exits
        before it is named from the memory the program copied at its exit, where the kernel runs
        the exit tracepoint before the memory goes, as 6.18 does); every quarter second while drains find
        code objects not read yet (with drains a second apart, a process of a second or two lost
        them all, one time in three, before the copies at exit); None when they find none (a
        steady state)."""
        if self.python is None:
            return None
        seen = (self.python.codes_read, self.python.procs_described)
        described = seen[1] != self._python_seen[1]
        new, self._python_seen = seen != self._python_seen, seen
        if self.python.waiting or described:
            return FIRST_DRAIN_S
        return PYTHON_DRAIN_S if new else None

    def _peek_side(self) -> bool:
        """On the eBPF path with stacks, between drains: read the rings (side records only: the
        program counts the samples), keep the records for the next drain, which maps with them,
        and say whether a process mapped a CPython interpreter (or, with unwinding, any code), so
        that the drain comes now and describes it to the program before most of its samples go
        by (drains can then be a second apart: a drain with stacks costs several ms, the side
        records almost nothing)."""
        if self.python is None or self.bpf is None:
            return False
        _, side, *_ = self._decode(self.session.drain())
        self._side_pending.extend(side)
        if self.unwind is not None and any(isinstance(r, MmapRecord) and r.executable for r in side):
            return True
        return bool(self.python.mapped_interpreters(side))

    def _wait(self, timeout: float, extra: tuple[int, ...] = (), drain_fds: tuple[int, ...] = ()) -> bool:
        """Sleep until a ring is worth draining (True), a control request was served, an
        ``extra`` descriptor is readable, or timeout. ``drain_fds``: processors' own rings (the
        goal probes'), each worth a drain when the kernel wakes us for it (half full)."""
        p = select.poll()
        for fd in self.session.fds:
            if fd not in self._hung_up:
                p.register(fd, select.POLLIN)
        for fd in extra:
            p.register(fd, select.POLLIN)
        for fd in drain_fds:
            if fd not in self._hung_up:
                p.register(fd, select.POLLIN)
        if self.control is not None:
            p.register(self.control.fileno(), select.POLLIN)
        try:
            events = p.poll(math.ceil(timeout * 1000))  # round up: a 0 ms timeout would spin
        except InterruptedError:
            return False
        ring = hup = own = False
        for fd, ev in events:
            if self.control is not None and fd == self.control.fileno():
                self._serve()
            elif fd in drain_fds:
                own = True
                if ev & (select.POLLHUP | select.POLLERR):
                    self._hung_up.add(fd)  # its task is gone: drained once, not polled again
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
        return own or (ring and (hup or self.session.fullest() >= WAKE_MIN_FILL))

    def close(self) -> None:
        if self.python is not None:
            self.python.close()
        if self.loops is not None:
            self.loops.close()  # kept: its counts go in the run's summary
        if self.bpf is not None:
            self.bpf.close()
        if self.unwind is not None:
            self.unwind.close()
        self.flusher.close()
        for p in self.processors:
            p.close()
        self.session.close()
        if self.control is not None:
            self.control.close()
            self.control = None

    # --- one drain ---------------------------------------------------------------------
    def step(self) -> int:
        """One drain: decode the rings, act on the side records, map and count the samples, hand
        them to the processors. Returns how many samples it took."""
        samples, side, regs, stack, stack_len, chains = self._decode(self.session.drain())
        if self._side_pending:  # read between drains (peek_side), in order before these
            side = self._side_pending + side
            self._side_pending = []
        self._side_records(side)
        try:
            return self._step_samples(samples, side, regs, stack, stack_len, chains)
        finally:
            self._forget_exited()

    def _step_samples(self, samples: np.ndarray | None, side: list[SideRecord], regs: np.ndarray | None,
                      stack: np.ndarray | None, stack_len: np.ndarray | None,
                      chains: list[tuple[int, ...] | None]) -> int:
        """The drain's samples (on the eBPF path, the kernel's rows) mapped, counted and handed to
        the processors."""
        if self.bpf is not None:
            return self._step_bpf(side)
        if samples is None:
            if side:
                self.mapper.map_batch(np.zeros(0, dtype=SAMPLE_DTYPE), side)
            return 0
        ev = self.session.event_index(samples["id"])
        keep = ev >= 0
        if not keep.all():
            samples, ev = samples[keep], ev[keep]
            if chains:
                chains = [c for c, k in zip(chains, keep.tolist(), strict=True) if k]
        periods = self.session.account(ev, samples)
        mapped = self.mapper.map_batch(samples, side)
        return self._count(Drain(samples, ev, periods, mapped.image, mapped.offset, mapped.comm, regs, stack, stack_len,
                                 chains if self._chains else None))

    def _count(self, d: Drain) -> int:
        """Count a drain's mapped samples (on the eBPF path, rows of ``d.count`` samples each) and
        hand them to the processors; how many samples they were."""
        self.agg.add(d.image, d.offset, d.event, d.comm, count=d.count, weight=d.period)
        for p in self.processors:
            p.process(d)
        n = len(d) if d.count is None else int(d.count.sum())
        self.totals.samples += n
        unk = d.image == 0
        if unk.any():
            self.totals.unknown += int(unk.sum()) if d.count is None else int(d.count[unk].sum())
        return n

    def _attach_bpf(self) -> None:
        """Attach the eBPF program to the events opened since the last call (all, at start)."""
        if self.bpf is None:
            return
        for ev in self.session.open_events[self._bpf_attached:]:
            self.bpf.attach(ev.fd, ev.index)
        self._bpf_attached = len(self.session.open_events)

    def _step_bpf(self, side: list[SideRecord]) -> int:
        """One drain of the eBPF path: the program's counts of the generation it filled until
        now, one row per distinct (process, ip, event, stack), mapped after the side records
        that came before each row's last sample."""
        assert self.bpf is not None
        self._attach_bpf()
        d = self.bpf.drain()
        if self.python is not None:
            if self.python.take_starts():  # the rings that woke us for a program's start, emptied
                self._start_quiet_until = time.monotonic() + PY_START_WAKE_S
            self.python.take_codes()  # copied as their processes exited: after the stacks
        try:
            return self._count_bpf(d, side)
        finally:
            self.bpf.release_stacks()  # their frames named (ebpf.py's drain says why they stayed)

    def _count_bpf(self, d: Drained, side: list[SideRecord]) -> int:
        """A drain of the eBPF path's rows mapped, counted and handed to the processors."""
        from cyclescope.collect.ebpf import to_rows

        assert self.bpf is not None
        rows = to_rows(d, self._chains_bpf, self._bpf_stacks)
        self._bpf_stacks = d.stacks
        self._note_bpf_stats()
        samples = rows.samples
        if not len(samples):
            if side:
                self.mapper.map_batch(samples, side)
            if self.python is not None:
                self.python.watch(self.python.mapped_interpreters(side))
            return 0
        self.session.account_counted(rows.event, rows.count, rows.period)
        mapped = self.mapper.map_batch(samples, side)
        if self.python is not None:
            # Processes seen for the first time, and those that mapped an interpreter: CPython ones
            # are described to the program, whose next samples of them carry Python frames.
            user = distinct(samples["pid"][samples["cpumode"] != MISC_KERNEL]).tolist()
            self.python.watch(user + self.python.mapped_interpreters(side))
        if self.unwind is not None:
            # Processes seen for the first time or whose mappings changed: their next user stacks
            # are walked with unwind rows (in system calls too: the kernel keeps their registers).
            # Processes that mapped code since the last drain too (an exec): described before
            # their first samples come, a drain sooner.
            pids, where = group(samples["pid"])
            weights = dict(zip(pids.tolist(), np.bincount(where, weights=rows.count).tolist(), strict=True))
            for r in side:
                if isinstance(r, MmapRecord) and r.executable:
                    weights.setdefault(r.pid, 0.0)
            self.unwind.watch(list(weights), list(weights.values()))
        n = self._count(Drain(samples, rows.event, rows.period, mapped.image, mapped.offset, mapped.comm,
                              chains=rows.chains, count=rows.count, timeline=rows.timeline, python=rows.python))
        if self.loops is not None:
            self._step_watched(samples["pid"][samples["cpumode"] == MISC_USER])
        return n

    def _step_watched(self, pids: np.ndarray) -> None:
        """The program's watched samples since the last drain, mapped and handed to the processors
        that take them; then the ranges watched per process, for the processes sampled in user
        mode in this drain (``pids``), from what the processors want watched now."""
        from cyclescope.collect.loopwatch import as_samples

        assert self.loops is not None
        recs = self.loops.read()
        if len(recs):
            samples, event, period, gprs = as_samples(recs)
            mapped = self.mapper.map_batch(samples, [])
            width = max(self._regs_cols.values()) + 1 if self._regs_cols else len(GPRS)
            regs = np.zeros((len(recs), width), np.uint64)
            regs[:, [self._regs_cols.get(r, k) for k, r in enumerate(GPRS)]] = gprs
            d = Drain(samples, event, period, mapped.image, mapped.offset, mapped.comm, regs=regs)
            for p in self.processors:
                if hasattr(p, "process_watched"):
                    p.process_watched(d)
        watched: dict[tuple[int, int], tuple[int, float]] = {}
        for p in self.processors:
            if hasattr(p, "watched"):
                watched.update(p.watched())
        own = os.getpid()
        todo = [p for p in distinct(pids).tolist() if p > 0 and p != own and not is_helper(p)]
        if watched or self.loops.installed:
            self.loops.update(self.mapper.procs, todo, watched)

    @property
    def _chains_bpf(self) -> bool:
        return self.bpf is not None and self.bpf.stack_entries > 0

    def _note_bpf_stats(self) -> None:
        """The program's losses since the last look: samples its full map could not count (as
        lost samples, charged to the first event: the program does not tell events apart there)
        and stacks and timeline windows it could not keep."""
        assert self.bpf is not None
        now = self.bpf.stats()
        new = {k: v - self._bpf_stats.get(k, 0) for k, v in now.items()}  # the counters run since load
        self._bpf_stats = now
        if new["lost"]:
            self.totals.lost_samples += new["lost"]
            self._flush_meta.lost_samples += new["lost"]
            if self.session.stats:
                self.session.stats[0].lost += new["lost"]
        self.totals.lost_stacks += new["lost_stacks"]
        self.totals.lost_timeline += new["lost_timeline"]

    def _decode(self, chunks: list[bytes]) -> tuple[np.ndarray | None, list[SideRecord], np.ndarray | None,
                                                    np.ndarray | None, np.ndarray | None,
                                                    list[tuple[int, ...] | None]]:
        """The rings' bytes as one array of samples (None: no sample), the side records, the user
        registers, stack snapshots and their lengths (rows as the samples' "regs" column says; None
        when no sample has them), and each sample's callchain (if the session samples them)."""
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
            if self._chains:
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

        def joined(parts: list[np.ndarray]) -> np.ndarray | None:
            return (np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else None

        return joined(samples_list), side, joined(regs_parts), joined(stack_parts), joined(len_parts), chains

    def _side_records(self, side: list[SideRecord]) -> None:
        """Losses, throttling, forks, exits and execs (mmaps and comms go to the mapper with the
        samples they precede)."""
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
                self._exited.append((rec.pid, rec.tid))  # after this drain's samples are handled
                if self.unwind is not None and rec.pid == rec.tid:
                    self.unwind.forget(rec.pid)
                if self.loops is not None and rec.pid == rec.tid:
                    self.loops.forget(rec.pid)
                if rec.pid == rec.tid:
                    self.session.forget_pid(rec.pid)
            elif isinstance(rec, CommRecord) and rec.exec:
                for p in self.processors:
                    p.forget(rec.pid, rec.pid)
                if self.python is not None:
                    self.python.forget(rec.pid)
                if self.unwind is not None:
                    self.unwind.forget(rec.pid)
                if self.loops is not None:
                    self.loops.forget(rec.pid)

    def _forget_exited(self) -> None:
        """The threads and processes that exited in this drain, forgotten once its samples are
        handled: their last samples come in the same drain as their exit, and a processor told to
        forget first would lose them (a process's values, the Python names of its frames) or keep
        state for a thread that is gone (the loop counter's last sample of it)."""
        for pid, tid in self._exited:
            for p in self.processors:
                p.forget(pid, tid)
            if self.python is not None and pid == tid:
                self.python.forget(pid)
        self._exited = []

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
        counts = self.agg.take()
        meta = self._flush_meta
        self._flush_meta = self._fresh_meta()
        meta.end_time = time.time()
        now_clock = measure_ghz(FLUSH_CLOCK_S, 2) or 0.0
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
            path = self.flusher.write(epoch, counts, meta, [s.label for s in self.session.events])
            self.totals.flushes += 1
        samples, rows = counts.total, len(counts)
        del counts  # before the processors write theirs
        for p in self.processors:
            p.flush(self.db, epoch, self.cfg.host)
        if self.python is not None:
            self.python.flushed()
        if self.cfg.lean_memory:
            self.flusher.give_back_memory()
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
            self.flusher.compact(old)
        else:
            live = len(self.db.segments(self.epoch, self.cfg.host))
            if live >= self.cfg.compact_after:
                self.flusher.compact(self.epoch)
        if self.cfg.ship_to is not None:
            self.flusher.ship(self.cfg.ship_to, self.cfg.ship_token)
        return FlushResult(epoch, path, samples, rows, time.monotonic() - t0)

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
            "collector": "bpf" if self.bpf is not None else "perf",
            **({"watched": {"records": self.loops.stats.sent, "watched": self.loops.stats.watched,
                            "lost": self.loops.stats.lost, "processes": self.loops.stats.processes,
                            "procedures": self.loops.stats.procedures}} if self.loops is not None else {}),
            **({"ship": {"to": self.cfg.ship_to, "stored": self.flusher.shipped, "offline": self.flusher.offline}}
               if self.cfg.ship_to else {}),
            **{p.name: p.status() for p in self.processors},
        }

    def summaries(self) -> list[str]:
        """The processors' lines for the end of a run, and the eBPF path's stack losses."""
        out = [line for p in self.processors if (line := p.summary()) is not None]
        if self.totals.lost_stacks:
            out.append(f"{self.totals.lost_stacks:,} samples were counted without their stacks (the eBPF "
                       "program's stack map was full; fewer distinct stacks a second, or a lower rate)")
        if self.unwind is not None:
            line = self.unwind.summary(self._bpf_stats)
            if line is not None:
                out.append(line)
        if self.python is not None and self.python.procs_described:
            py = self.python
            copied = self._bpf_stats.get("py_codes", 0)
            out.append(f"Python frames: {py.procs_described:,} CPython processes read, {py.frames_named:,} frames named"
                       + (f"; {copied:,} code objects copied (module bodies as they ran, others as their "
                          f"processes exited), {py.codes_at_exit:,} of them named from the copies" if copied else "")
                       + (f"; {py.unreadable:,} reads failed" if py.unreadable else "")
                       + (f" (processes that exit before a drain lose their names: {self.bpf.exit_error})"
                          if self.bpf is not None and self.bpf.exit_error else "")
                       + (f" (a python executed is seen up to 0.2 s late: {py.exec_error})" if py.exec_error
                          else f" (a console script or a python run under another name is seen up to 0.2 s late:"
                               f" {py.exec_bpf_error})" if py.exec_bpf_error else ""))
        if self.totals.lost_timeline:
            out.append(f"{self.totals.lost_timeline:,} samples were left out of the timeline (the eBPF program's "
                       "timeline map was full)")
        if self.loops is not None and (st := self.loops.stats).sent:
            out.append(f"loop counts: {st.watched:,} samples with their registers from {st.procedures:,} procedure(s) "
                       "whose loops have a counter register (sent by the eBPF program"
                       + (f"; {st.lost:,} lost: its rings were full" if st.lost else "") + ")")
        if self.loops_error:
            out.append(self.loops_error)
        return out


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
    """For record -- CMD: true once the command has exited. It is not reaped here: until the
    session closes (Session.close reaps it and keeps its status), its /proc entry stays, and the
    last drain, which reads its exit, still finds its owner (values and probe hits of a process
    whose owner is unknown are not kept)."""

    def check() -> bool:
        pid = session.child_pid
        if pid is None or session.exit_status is not None:
            return True
        try:
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    return check


def processes_gone(pids: tuple[int, ...]) -> Callable[[], bool]:
    return lambda: not any(os.path.exists(f"/proc/{p}") for p in pids)


def eprint(*a: object) -> None:
    print(*a, file=sys.stderr)
