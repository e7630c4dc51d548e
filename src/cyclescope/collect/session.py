"""A sampling session: which events on which CPUs or tasks, ring buffers,
period randomization with the true period timeline, multiplexing and loss
accounting.

Targets:
- system-wide: one event per CPU and event (pid=-1); periods re-randomized
  with PERF_EVENT_IOC_PERIOD as sampling goes.
- a command or existing processes: per-task events on every CPU with inherit,
  so children are followed. PERF_EVENT_IOC_PERIOD reaches only the events we
  opened, not the copies the kernel makes for children at fork (measured here):
  a child keeps the period its parent had when it forked, and the timeline
  records that.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cyclescope.arrays import lookup
from cyclescope.collect import kernel
from cyclescope.collect.events import (
    DEFAULT_BAND,
    SAFE_MAX_RATE_HZ,
    EventSpec,
    PeriodRandomizer,
    cpu_hz,
    max_rate_hz,
    nominal_period,
    parse_event,
)
from cyclescope.errors import CycleScopeError, UsageError
from cyclescope.perf.abi import (
    PERF_ATTR_SIZE,
    STACK_BYTES,
    X86_REGS_USER_MASK,
    AttrFlag,
    PerfEventAttr,
    ReadFormat,
    Sample,
)
from cyclescope.perf.records import SampleLayout

CLOCK = time.CLOCK_MONOTONIC
BASE_SAMPLE_TYPE = Sample.IDENTIFIER | Sample.IP | Sample.TID | Sample.TIME | Sample.CPU


def now_ns() -> int:
    return time.clock_gettime_ns(CLOCK)


class Target(Protocol):
    def describe(self) -> str: ...


MAX_USER_STACK = 32768  # bytes of user stack per sample (a record's size is 16 bits)
DWARF_RING_PAGES = 2048  # 8 MiB per ring: 8 KiB snapshots at 5 kHz fill 1 MiB in 25 ms


@dataclass(frozen=True)
class CallGraph:
    """How call stacks are recorded: 'fp' (the kernel walks frame pointers) or 'dwarf' (the kernel
    gives its own frames; we unwind a stack_size-byte copy of the user stack with .eh_frame)."""

    mode: str
    stack_size: int = 8192
    # dwarf: let the kernel walk the user frame pointers too (for checking the unwinder against them)
    kernel_user: bool = False


@dataclass(frozen=True)
class SystemWide:
    cpus: tuple[int, ...]

    def describe(self) -> str:
        return f"system-wide on {len(self.cpus)} CPU(s)"


@dataclass(frozen=True)
class Processes:
    pids: tuple[int, ...]

    def describe(self) -> str:
        return "process " + ", ".join(map(str, self.pids))


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]

    def describe(self) -> str:
        return " ".join(self.argv)


@dataclass
class OpenEvent:
    index: int  # position in Session.events
    fd: int
    id: int
    cpu: int
    tid: int  # -1 for per-CPU events
    tracking: bool  # carries the side records (mmap, comm, task) for its buffer


TIMELINE_KEEP_NS = 60_000_000_000  # period history kept behind the present


@dataclass
class PeriodTimeline:
    """When each period took effect, per event index (shared by that event's fds)."""

    times: list[int] = field(default_factory=list)
    periods: list[int] = field(default_factory=list)

    def add(self, t: int, period: int) -> None:
        self.times.append(t)
        self.periods.append(period)

    def at(self, ts: np.ndarray) -> np.ndarray:
        t = np.array(self.times, dtype=np.uint64)
        p = np.array(self.periods, dtype=np.uint64)
        i = np.searchsorted(t, ts, side="right").astype(np.int64) - 1
        return p[np.maximum(i, 0)]

    def compact(self, before: int) -> None:
        """Drop history older than ``before`` (keeping the entry in force then)."""
        i = max(0, bisect.bisect_right(self.times, before) - 1)  # five times a second: no array built
        if i > 0:
            del self.times[:i]
            del self.periods[:i]


@dataclass
class EventStats:
    samples: int = 0
    period_sum: int = 0
    lost: int = 0
    throttles: int = 0
    value: int = 0
    enabled_ns: int = 0
    running_ns: int = 0


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A CPU list as sysfs writes it ("0-3,6"); ValueError when it is not one."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part.strip():
            cpus.append(int(part))
    return tuple(cpus)


def online_cpus() -> tuple[int, ...]:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return parse_cpu_list(f.read())
    except OSError:
        return tuple(range(os.cpu_count() or 1))


def _threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def die_with(parent: int) -> None:
    """In a child about to exec the recorded command: be killed when ``parent`` dies, even by
    SIGKILL, rather than run on unrecorded (PR_SET_PDEATHSIG; a set-user-ID program's exec clears
    it). If the parent is already gone, exit now."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def kernel_max_sample_rate() -> int | None:
    try:
        with open("/proc/sys/kernel/perf_event_max_sample_rate") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class Session:
    """Opens the events, owns the fds and ring buffers, and accounts for periods."""

    def __init__(
        self,
        events: list[EventSpec],
        target: SystemWide | Processes | Command,
        rate_hz: float | None = None,
        band: float = DEFAULT_BAND,
        force: bool = False,
        ring_pages: int = 256,
        exclude_idle: bool = True,
        seed: int | None = None,
        user_stack: int | None = None,
        traceme: bool = False,
        call_graph: CallGraph | None = None,
        user_regs: bool = False,
        loop_stack: int = STACK_BYTES,
    ) -> None:
        if not events:
            raise UsageError("no events to sample")
        self.requested = list(events)
        self.target = target
        self.rate_hz = rate_hz
        self.band = band
        self.force = force
        self.ring_pages = ring_pages
        if call_graph is not None and call_graph.mode == "dwarf":
            self.ring_pages = max(ring_pages, DWARF_RING_PAGES)
        self.exclude_idle = exclude_idle
        self.seed = seed
        self.traceme = traceme  # the command asks to be traced before its exec (exact value mode)
        self.cpu_hz = cpu_hz()
        self.events: list[EventSpec] = []
        self.randomizers: list[PeriodRandomizer] = []
        self.timelines: list[PeriodTimeline] = []
        self.open_events: list[OpenEvent] = []
        self.rings: list[kernel.RingBuffer] = []
        self.warnings: list[str] = []
        self.stats: list[EventStats] = []
        self.child_pid: int | None = None
        self.exit_status: int | None = None  # wait status of the command, once it exited
        self._child_go: int | None = None
        self._child_err: int | None = None
        self._id_index: tuple[np.ndarray, np.ndarray] | None = None
        self._fork_time: dict[int, int] = {}  # per-task mode: pid -> when its period was fixed
        self.root_pids: set[int] = set()
        self.call_graph = call_graph
        if call_graph is not None and call_graph.mode == "dwarf":
            # Unwinding needs the user registers and the top of the user stack: share them with
            # value capture, which needs less (its snapshot is the larger of the two).
            user_stack = max(user_stack or 0, call_graph.stack_size)
        if not 0 <= loop_stack <= STACK_BYTES or loop_stack % 8:
            raise UsageError(f"--loop-stack must be a multiple of 8 bytes from 0 to {STACK_BYTES}")
        if user_stack is None and user_regs:
            # The user registers (loop counting: analysis/loopcount.py), 168 bytes a sample, and the
            # top ``loop_stack`` bytes of the user stack (STACK_BYTES by default), where procedures
            # spill the values the loop counter follows (analysis/progress.py): nothing for the
            # sampled code (the interrupt dominates), decoded in bulk, and read for those words
            # alone (never stored).
            st = BASE_SAMPLE_TYPE | Sample.REGS_USER | (Sample.STACK_USER if loop_stack else 0)
            self.layout = SampleLayout(int(st), X86_REGS_USER_MASK, stack_user=loop_stack)
        elif user_stack is None:
            self.layout = SampleLayout(int(BASE_SAMPLE_TYPE))
        else:
            # Value capture: the user registers and the top of the user stack at each interrupt.
            if user_stack < 0 or user_stack % 8 or user_stack > MAX_USER_STACK:
                raise UsageError(f"the user stack snapshot must be a multiple of 8 bytes, at most {MAX_USER_STACK}")
            st = BASE_SAMPLE_TYPE | Sample.REGS_USER | (Sample.STACK_USER if user_stack else 0)
            self.layout = SampleLayout(int(st), X86_REGS_USER_MASK, stack_user=user_stack)
        if call_graph is not None:
            # Call stacks: the kernel walks frame pointers (fp), or gives its own frames only and
            # we unwind the user stack snapshot with .eh_frame (dwarf).
            self.layout = SampleLayout(int(self.layout.sample_type | Sample.CALLCHAIN), self.layout.regs_user_mask,
                                       stack_user=self.layout.stack_user)
        self.started_ns = 0

    # --- set-up --------------------------------------------------------------------
    def check_rates(self) -> None:
        kmax = kernel_max_sample_rate()
        for spec in self.events:
            period = nominal_period(spec, self.rate_hz, self.cpu_hz, self.band)
            rate = max_rate_hz(spec, period, self.band, self.cpu_hz)
            if rate is None:
                continue
            if rate > SAFE_MAX_RATE_HZ and not self.force:
                raise UsageError(
                    f"{spec.label}: up to {rate:,.0f} samples/s per CPU is above the safe ceiling of "
                    f"{SAFE_MAX_RATE_HZ:,} (on these VMs 100 kHz soft-locks a CPU and 20 kHz slows the "
                    "target by about 60%); lower the rate or pass --force"
                )
            if kmax is not None and rate > kmax and spec.time_based:
                self.warnings.append(
                    f"{spec.label}: {rate:,.0f} samples/s exceeds perf_event_max_sample_rate={kmax}; "
                    "the kernel will throttle"
                )

    def _attr(self, spec: EventSpec, period: int, tracking: bool, per_task: bool, on_exec: bool) -> PerfEventAttr:
        a = PerfEventAttr()
        a.type = spec.type
        a.size = PERF_ATTR_SIZE
        a.config = spec.config
        a.sample_period = period
        a.sample_type = int(self.layout.sample_type)
        a.sample_regs_user = self.layout.regs_user_mask
        a.sample_stack_user = self.layout.stack_user
        if self.layout.sample_type & Sample.CALLCHAIN:
            from cyclescope.perf.abi import MAX_DEPTH

            a.sample_max_stack = MAX_DEPTH
        a.read_format = int(ReadFormat.TOTAL_TIME_ENABLED | ReadFormat.TOTAL_TIME_RUNNING)
        flags = AttrFlag.DISABLED | AttrFlag.SAMPLE_ID_ALL | AttrFlag.USE_CLOCKID | AttrFlag.WATERMARK
        if tracking:
            flags |= AttrFlag.MMAP | AttrFlag.MMAP2 | AttrFlag.COMM | AttrFlag.COMM_EXEC | AttrFlag.TASK
            flags |= AttrFlag.BUILD_ID
        if per_task:
            flags |= AttrFlag.INHERIT
            if on_exec:
                flags |= AttrFlag.ENABLE_ON_EXEC
        if spec.exclude_user:
            flags |= AttrFlag.EXCLUDE_USER
        if spec.exclude_kernel:
            flags |= AttrFlag.EXCLUDE_KERNEL
        if self.exclude_idle and not per_task:
            flags |= AttrFlag.EXCLUDE_IDLE
        if self.call_graph is not None and self.call_graph.mode == "dwarf" and not self.call_graph.kernel_user:
            flags |= AttrFlag.EXCLUDE_CALLCHAIN_USER  # the user part comes from our unwinder
        a.flags = int(flags)
        a.clockid = CLOCK
        a.wakeup_events = self.ring_pages * kernel.PAGE_SIZE // 2  # wakeup_watermark (bytes)
        return a

    def _resolve_events(self) -> None:
        """Drop events this machine cannot count (no PMU), falling back to cpu-clock."""
        probe_pid, probe_cpu = (-1, 0) if isinstance(self.target, SystemWide) else (os.getpid(), -1)
        kept: list[EventSpec] = []
        for spec in self.requested:
            if spec.hardware:
                a = self._attr(spec, nominal_period(spec, self.rate_hz, self.cpu_hz, self.band), False, False, False)
                try:
                    fd = kernel.perf_event_open(a, probe_pid, probe_cpu, what=spec.label)
                except kernel.PerfOpenError as e:
                    if e.errno in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV, errno.EINVAL):
                        self.warnings.append(
                            f"{spec.label}: not available here (no hardware PMU: {os.strerror(e.errno)}); "
                            "skipping it"
                        )
                        continue
                    raise
                kernel.close_fd(fd)
            kept.append(spec)
        if not kept:
            fallback = parse_event("cpu-clock")
            self.warnings.append("no requested event can be sampled here; sampling cpu-clock instead")
            kept.append(fallback)
        self.events = kept

    def open(self) -> None:
        self._resolve_events()
        self.check_rates()
        for i, spec in enumerate(self.events):
            nominal = nominal_period(spec, self.rate_hz, self.cpu_hz, self.band)
            seed = None if self.seed is None else self.seed + i
            self.randomizers.append(PeriodRandomizer(nominal, self.band, seed))
            self.timelines.append(PeriodTimeline())
            self.stats.append(EventStats())
        try:
            if isinstance(self.target, SystemWide):
                self._open_system_wide(self.target.cpus)
            elif isinstance(self.target, Processes):
                self._open_processes(self.target.pids)
            else:
                self._open_command(self.target.argv)
        except BaseException:
            self.close()
            raise
        ids = np.array([e.id for e in self.open_events], dtype=np.uint64)
        idx = np.array([e.index for e in self.open_events], dtype=np.int64)
        order = np.argsort(ids)
        self._id_index = (ids[order], idx[order])

    def _open_on(self, pid: int, cpus: tuple[int, ...], per_task: bool, on_exec: bool) -> None:
        """One buffer per CPU: the first fd of a CPU owns it, the others SET_OUTPUT to it."""
        t0 = now_ns()
        periods = [r.draw() for r in self.randomizers]
        for i, p in enumerate(periods):
            self.timelines[i].add(t0, p)
        for cpu in cpus:
            leader: int | None = None
            for i, spec in enumerate(self.events):
                tracking = leader is None
                attr = self._attr(spec, periods[i], tracking, per_task, on_exec)
                fd = kernel.perf_event_open(attr, pid, cpu, what=f"{spec.label} on CPU {cpu}")
                ev = OpenEvent(i, fd, kernel.ioctl_id(fd), cpu, pid if per_task else -1, tracking)
                self.open_events.append(ev)
                if leader is None:
                    self.rings.append(kernel.RingBuffer(fd, self.ring_pages))
                    leader = fd
                else:
                    kernel.ioctl_set_output(fd, leader)

    def _open_system_wide(self, cpus: tuple[int, ...]) -> None:
        self._open_on(-1, cpus, per_task=False, on_exec=False)

    def _open_processes(self, pids: tuple[int, ...]) -> None:
        cpus = online_cpus()
        for pid in pids:
            tids = _threads(pid)
            if not tids:
                raise CycleScopeError(f"no process {pid}")
            self.root_pids.add(pid)
            for tid in tids:
                self._open_per_task(tid, cpus, on_exec=False)

    def _open_per_task(self, tid: int, cpus: tuple[int, ...], on_exec: bool) -> None:
        # Per-task events of one task on several CPUs may share one buffer per CPU.
        existing = {ev.cpu: ev.fd for ev in self.open_events if ev.tracking}
        t0 = now_ns()
        for cpu in cpus:
            for i, spec in enumerate(self.events):
                period = self.randomizers[i].draw() if not self.timelines[i].periods else self.timelines[i].periods[-1]
                tracking = cpu not in existing
                attr = self._attr(spec, period, tracking, True, on_exec)
                fd = kernel.perf_event_open(attr, tid, cpu, what=f"{spec.label} for task {tid} on CPU {cpu}")
                ev = OpenEvent(i, fd, kernel.ioctl_id(fd), cpu, tid, tracking)
                self.open_events.append(ev)
                if tracking:
                    self.rings.append(kernel.RingBuffer(fd, self.ring_pages))
                    existing[cpu] = fd
                else:
                    kernel.ioctl_set_output(fd, existing[cpu])
                if not self.timelines[i].periods:
                    self.timelines[i].add(t0, period)

    def _open_command(self, argv: tuple[str, ...]) -> None:
        if not argv:
            raise UsageError("no command given after --")
        exe = argv[0]
        if shutil.which(exe) is None:
            raise CycleScopeError(f"{exe}: command not found")
        go_r, go_w = os.pipe()
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                die_with(parent)
                os.close(go_w)
                os.close(err_r)
                os.read(go_r, 1)
                os.close(go_r)
                if self.traceme:
                    from cyclescope.collect.ptrace import traceme

                    traceme()
                os.execvp(exe, list(argv))
            except OSError as e:
                os.write(err_w, f"{e.errno}".encode())
            finally:
                os._exit(127)
        os.close(go_r)
        os.close(err_w)
        self.child_pid = pid
        self._child_go = go_w
        self._child_err = err_r
        self.root_pids.add(pid)
        self._open_per_task(pid, online_cpus(), on_exec=True)

    def start(self) -> None:
        """Enable the events (or let the command exec, which enables them)."""
        self.started_ns = now_ns()
        for ev in self.open_events:
            if self.child_pid is None:
                kernel.ioctl_enable(ev.fd)
        if self.child_pid is not None and self._child_go is not None:
            os.write(self._child_go, b"x")
            os.close(self._child_go)
            self._child_go = None
            assert self._child_err is not None
            msg = os.read(self._child_err, 64)
            os.close(self._child_err)
            self._child_err = None
            if msg:
                os.waitpid(self.child_pid, 0)
                err = int(msg.decode() or 0)
                self.child_pid = None
                raise CycleScopeError(f"{self.target.describe()}: cannot execute ({os.strerror(err)})")

    # --- running -------------------------------------------------------------------
    @property
    def fds(self) -> list[int]:
        return [r.fd for r in self.rings]

    def drain(self) -> list[bytes]:
        return [r.read() for r in self.rings]

    def fullest(self) -> float:
        """How full the fullest ring is, from 0 to 1 (two loads from each ring's control page)."""
        return max((r.pending() / r.size for r in self.rings), default=0.0)

    def rerandomize(self) -> None:
        """Draw a new period per event and apply it to the events we opened.

        On cpu-clock the new period takes effect when the current one expires,
        so the timeline entry is stamped one old period later.
        """
        if self.band <= 0:
            return  # a fixed period: nothing to re-draw
        t = now_ns()
        # History older than any sample still to come is dropped, or the timeline would grow by five
        # entries a second for as long as a daemon runs (and each drain's lookup with it): samples
        # are drained within seconds, and a per-task child keeps the period of its fork time.
        keep = max(0, t - TIMELINE_KEEP_NS)
        if self._fork_time:
            keep = min(keep, min(self._fork_time.values()))
        for i in range(len(self.events)):
            self.timelines[i].compact(keep)
            old = self.timelines[i].periods[-1] if self.timelines[i].periods else self.randomizers[i].nominal
            period = self.randomizers[i].draw()
            for ev in self.open_events:
                if ev.index == i:
                    try:
                        kernel.ioctl_period(ev.fd, period)
                    except OSError:
                        continue  # the task exited; its fd is dead
            delay = old if self.events[i].time_based else 0
            self.timelines[i].add(t + delay, period)

    def note_fork(self, pid: int, ppid: int, t: int) -> None:
        """Per-task mode: a child keeps the period in force when it, or the first
        of its ancestors below the traced roots, forked."""
        if isinstance(self.target, SystemWide):
            return
        self._fork_time[pid] = self._fork_time.get(ppid, t)

    def forget_pid(self, pid: int) -> None:
        self._fork_time.pop(pid, None)

    def event_index(self, ids: np.ndarray) -> np.ndarray:
        """Event index per sample id; -1 for ids we did not open."""
        assert self._id_index is not None
        return lookup(*self._id_index, ids)

    def account(self, ev_idx: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """Add samples and the true period of each to the per-event totals; the period of each
        sample (in its event's units), for weighting."""
        per_task = not isinstance(self.target, SystemWide)
        periods = np.zeros(len(samples), np.float64)
        for i in range(len(self.events)):
            mask = ev_idx == i
            n = int(mask.sum())
            if not n:
                continue
            st = self.stats[i]
            st.samples += n
            ts = samples["time"][mask]
            if per_task and self._fork_time:
                pids = samples["pid"][mask]
                fork_t = np.array([self._fork_time.get(p, -1) for p in pids.tolist()], dtype=np.int64)
                eff = np.where(fork_t >= 0, fork_t.astype(np.uint64), ts)
                p = self.timelines[i].at(eff)
            else:
                p = self.timelines[i].at(ts)
            st.period_sum += int(p.sum())
            periods[mask] = p
        return periods

    def account_counted(self, ev_idx: np.ndarray, count: np.ndarray, period: np.ndarray) -> None:
        """Add samples counted elsewhere (the eBPF path: ``count`` samples per row, whose periods
        sum to ``period``, as the kernel reported each sample's) to the per-event totals."""
        for i in range(len(self.events)):
            mask = ev_idx == i
            if mask.any():
                self.stats[i].samples += int(count[mask].sum())
                self.stats[i].period_sum += int(period[mask].sum())

    def read_counters(self) -> None:
        """Counter values and enabled/running times, for the multiplexing share.

        Only hardware events can be multiplexed (software events always run).
        Per-CPU events: running/enabled is the share of time the event was on
        a counter. Per-task events opened on every CPU: each CPU's copy is
        "enabled" whenever the task runs anywhere but "running" only on its
        CPU, so the share is sum(running) / max(enabled) over the copies.
        """
        per_task = not isinstance(self.target, SystemWide)
        for i, spec in enumerate(self.events):
            if not spec.hardware:
                continue
            vals = []
            for ev in self.open_events:
                if ev.index != i:
                    continue
                try:
                    vals.append(kernel.read_counter(ev.fd))
                except OSError:
                    continue
            if not vals:
                continue
            st = self.stats[i]
            st.value = sum(v for v, _, _ in vals)
            st.running_ns = sum(r for _, _, r in vals)
            st.enabled_ns = max(e for _, e, _ in vals) if per_task else sum(e for _, e, _ in vals)

    def close(self) -> None:
        if self.child_pid is not None and self._child_go is None and self.exit_status is None:
            # The command exited (collect.daemon.child_done left it unreaped for the last drain).
            try:
                done, status = os.waitpid(self.child_pid, os.WNOHANG)
                if done:
                    self.exit_status = status
            except ChildProcessError:
                pass
        for r in self.rings:
            r.close()
        self.rings.clear()
        for ev in self.open_events:
            kernel.close_fd(ev.fd)
        self.open_events.clear()
        for fd in (self._child_err,):
            if fd is not None:
                kernel.close_fd(fd)
        self._child_err = None
        if self.child_pid is not None and self._child_go is not None:
            # The command never ran (set-up failed): do not leave it blocked.
            try:
                os.kill(self.child_pid, 9)
                os.waitpid(self.child_pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            kernel.close_fd(self._child_go)
            self._child_go = None
            self.child_pid = None
