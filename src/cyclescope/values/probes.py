"""Exact capture for goal-directed profiling: every execution of a kept candidate's point, with its
register, where that is cheap enough (Watterson and Debray's instrumentation, without rewriting
the binary).

A uprobe perf event with a sample period of 1 (collect/kernel.open_uprobe_sampler) writes a sample
with the user registers at each execution of one instruction, before it runs. `specialize --plan`
gives each candidate a probe site (values/goal.ProbeSpec): the instruction just after its
definition (for an argument, the procedure's entry), its file offset, and how many times a second
of the profiled programs' CPU the plain profile says it ran. Each hit traps (HIT_COST_S), so a
candidate is probed only where its rate times that cost fits the budget (``--goal-budget``, a share
of one CPU the programs may lose, as ``--anchor-budget``): the cheapest first, the others left to
the samples, as before. Where calc had no count of the point (no samples on it and no anchor), the
rate is unknown and the site is probed only with a budget of a whole CPU (ground truth runs). A
rate from a count calc gave with low confidence is the model's guess and is taken as it is: a
procedure entry ahead of a long loop may be guessed at hundreds of times its calls
(tests/programs/difference.c's mix: 3,000 calls guessed at 1.4 million once in 25 plain recordings
of a second), and left to the samples; the site's state says the rate was a guess. Probing such
guesses anyway at a whole CPU's budget probed the hot ones too: their hits overflowed the rings
(tests/programs/specialize.c, 3,000 calls of 65,536 elements: 8.4 million hits lost, and the
recording took 62 s against 1.5 s). The paper's goal is the same: the selection favours points
outside hot loops, and those are the ones cheap to count.

While recording, the hits are counted: a probe whose traps exceed the budget of the time since it
opened (the plan came from another run; rates move) is closed and its candidate goes back to the
samples. Rule (3) switching a candidate off closes its probe too. Closing a uprobe takes the kernel
about 85 ms, serialized, and the probe traps until then: closes happen on a thread of their own.

The values land in ``exact:REG`` hotlists at the probe's instruction, counted without thinning
(each is one execution, not one sample), beside the ``goal:REG`` ones the samples give.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cyclescope.errors import CycleScopeError
from cyclescope.values.goal import Plan, operands

# A sampled uprobe hit's cost to the probed task: 7.25 us on Zen 3 machines of this kind (5.8 us
# counting only; bench/probecost.py), 9.5 us counting on the Zen 4 ones: the slower kind plus the sample.
HIT_COST_S = 11e-6
SAMPLE_EXTRA_S = 1.5e-6  # a sampled hit's cost beyond a counted one's (7.25 - 5.81 us on Zen 3)
DEFAULT_BUDGET = 0.01  # a share of one CPU the probed programs may lose to the probes' traps
ALLOWANCE_S = 0.02  # trap seconds a probe may spend ahead of its budget before it is closed
RING_PAGES = 256  # per CPU: 1 MiB, about 18,000 hits of one register between two polls


@dataclass
class Site:
    """One candidate's probe: where, what it costs, and its fds while open."""

    point: int  # index in the plan
    path: str
    file_offset: int
    reg: str
    at: int  # the instruction's offset in its image, as samples key it
    image: str  # image key
    rate: float  # executions per CPU-second in the plan's profile (0: unknown)
    guess: bool = False  # the rate rests on a low-confidence count (the model's)
    fds: list[int] = field(default_factory=list)
    hits: int = 0
    lost: float = 0.0  # the ring's lost hits put down to it (in proportion to its hits in the poll)
    opened: float = 0.0  # clock seconds
    state: str = "planned"  # planned, open, closed (why), or why it was not opened
    emulated: bool = False  # the kernel emulates the probed instruction: a hit costs a fraction

    def cost(self, hit_cost_s: float = HIT_COST_S) -> float:
        """Planned share of one CPU its traps take, a hit costing ``hit_cost_s``."""
        return self.rate * hit_cost_s


def hit_cost(emulated: bool = False) -> float:
    """A sampled hit's cost on this machine, as the probes' budget charges it: at an instruction the
    kernel single-steps, collect/clock.charged_hit_s (the trap as measured and SAMPLE_EXTRA_S); at
    one it emulates (``emulated``), a sampled hit as measured once per boot (the task's whole CPU,
    sample and disturbance included: 0.67 us here on getenv's push, 0.58 us in bench/probecost.py's
    loop), else as charged_hit_s charges an emulated trap with SAMPLE_EXTRA_S."""
    from cyclescope.collect.clock import charged_hit_s, sampled_hit_cost
    from cyclescope.images.cache import Cache

    if emulated:
        measured = sampled_hit_cost(Cache().root)
        if measured:
            return measured
    return charged_hit_s(HIT_COST_S, SAMPLE_EXTRA_S, emulated)


class Kernel:
    """collect/kernel's calls the probes make, replaceable by a fake in tests."""

    def __init__(self) -> None:
        from cyclescope.collect import kernel

        self.k = kernel
        self.pmu = kernel.uprobe_pmu_type()

    def sampler(self, path: str, file_offset: int, pid: int, cpu: int, regs_mask: int, inherit: bool,
                on_exec: bool) -> int:
        if self.pmu is None:
            raise CycleScopeError("this kernel has no uprobe PMU")
        return self.k.open_uprobe_sampler(self.pmu, path, file_offset, pid, cpu, regs_mask, inherit, on_exec,
                                          RING_PAGES * self.k.PAGE_SIZE)

    def ring(self, pid: int, cpu: int, inherit: bool) -> tuple[int, Any]:
        fd = self.k.open_ring_owner(pid, cpu, inherit, RING_PAGES * self.k.PAGE_SIZE)
        try:
            return fd, self.k.RingBuffer(fd, RING_PAGES)
        except BaseException:
            self.k.close_fd(fd)
            raise

    def redirect(self, fd: int, owner: int) -> None:
        self.k.ioctl_set_output(fd, owner)

    def ident(self, fd: int) -> int:
        return self.k.ioctl_id(fd)

    def enable(self, fd: int) -> None:
        self.k.ioctl_enable(fd)

    def close(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            self.k.ioctl_disable(fd)
        self.k.close_fd(fd)


@dataclass
class ExactValues:
    """One poll's hits: per hit, the process, the plan's point and the register's value."""

    pid: np.ndarray  # int64
    site: np.ndarray  # int64: index into GoalProbes.sites
    value: np.ndarray  # uint64

    def __len__(self) -> int:
        return len(self.pid)


def _sites(plan: Plan) -> list[Site]:
    return [Site(i, p.probe.path, p.probe.file_offset, p.probe.reg, p.probe.at, p.image, p.probe.rate,
                 p.probe.rate_confidence == "low", emulated=p.probe.emulated)
            for i, p in enumerate(plan.points) if p.probe is not None]


class GoalProbes:
    """The probes of one recording: chosen within the budget, opened for the recorded tasks (or
    every CPU), polled at each drain, policed, closed."""

    def __init__(self, plan: Plan, budget: float = DEFAULT_BUDGET, kernel: Any = None,
                 clock: Callable[[], float] = time.monotonic, hit_cost_s: float = HIT_COST_S,
                 emulated_hit_cost_s: float | None = None) -> None:
        from cyclescope.perf.abi import X86_REGS_USER_MASK, Sample, regs_in_mask
        from cyclescope.perf.records import RecordDecoder, SampleLayout
        from cyclescope.values.insn import PERF_COLUMNS

        self.plan = plan
        self.budget = budget
        self.hit_cost_s = hit_cost_s
        self.emulated_hit_cost_s = emulated_hit_cost_s  # at a site the kernel emulates (None: as any)
        self.kernel = kernel
        self.clock = clock
        self.sites = _sites(plan)
        # Only the registers the sites read: a sample is 48 bytes plus 8 a register, so that a ring
        # holds thousands of hits between two drains.
        full = regs_in_mask(X86_REGS_USER_MASK)
        self.regs_mask = 0
        views = [operands(s.reg) or () for s in self.sites]
        for vs in views:
            for v in vs:
                self.regs_mask |= 1 << int(full[PERF_COLUMNS[v.full]])
        order = [int(r) for r in regs_in_mask(self.regs_mask)]
        col = {name: order.index(int(full[c])) for name, c in PERF_COLUMNS.items() if int(full[c]) in order}
        # Per site: the column of its register (of the first operand of a difference), the second
        # operand's column (-1: none) and the width's mask.
        self._a = np.array([col[vs[0].full] if vs else 0 for vs in views], np.int64)
        self._b = np.array([col[vs[1].full] if len(vs) == 2 else -1 for vs in views], np.int64)
        self._mask = np.array([vs[0].mask if len(vs) == 2 else (1 << 64) - 1 for vs in views], np.uint64)
        self.decoder = RecordDecoder(SampleLayout(int(Sample.IDENTIFIER | Sample.IP | Sample.TID | Sample.TIME
                                                      | Sample.REGS_USER), self.regs_mask))
        self.rings: list[tuple[int, Any]] = []  # (owner fd, RingBuffer) per CPU
        self._by_id: dict[int, int] = {}  # event id -> site index
        self._id_keys: np.ndarray | None = None  # _by_id's ids, sorted (uint64), and their sites
        self._id_sites = np.zeros(0, np.int64)
        self.lost = 0
        self.hits = 0
        self._closing: deque[int] = deque()
        self._wake = threading.Event()
        self._closer: threading.Thread | None = None
        self._lock = threading.Lock()

    def _hit_s(self, s: Site) -> float:
        """What a hit at ``s`` costs: less where the kernel emulates the probed instruction."""
        return self.emulated_hit_cost_s if s.emulated and self.emulated_hit_cost_s else self.hit_cost_s

    def trap_s(self) -> float:
        """The probes' traps so far, in seconds of the programs' time."""
        return sum(s.hits * self._hit_s(s) for s in self.sites)

    # --- choosing -------------------------------------------------------------------------------
    def choose(self) -> list[Site]:
        """The sites to open: cheapest first while their planned traps fit the budget."""
        chosen: list[Site] = []
        spent = 0.0
        for s in sorted(self.sites, key=lambda s: s.rate):
            if not self.plan.points[s.point].on:
                s.state = "switched off"
            elif s.rate <= 0 and self.budget < 1:
                s.state = "rate unknown (calc had no count of the point)"
            elif spent + s.cost(self._hit_s(s)) > self.budget:
                s.state = f"too costly ({s.rate:,.0f} executions/s{', calc guessed' if s.guess else ''})"
            else:
                spent += s.cost(self._hit_s(s))
                chosen.append(s)
        return chosen

    # --- opening --------------------------------------------------------------------------------
    def open(self, tasks: tuple[int, ...], cpus: tuple[int, ...], on_exec: bool) -> list[Site]:
        """Opens the chosen sites for ``tasks`` (and what they start) on every CPU, or, without tasks,
        for every task on each CPU. A site the kernel refuses is left to the samples with the reason.
        Returns the sites open."""
        chosen = self.choose()
        if not chosen:
            return []
        if self.kernel is None:
            self.kernel = Kernel()
        k = self.kernel
        per_task = bool(tasks)
        targets = [(t, c) for t in tasks for c in cpus] if per_task else [(-1, c) for c in cpus]
        owners: dict[int, int] = {}
        try:
            for t, c in targets:
                if c not in owners:
                    fd, ring = k.ring(t, c, per_task)
                    owners[c] = fd
                    self.rings.append((fd, ring))
        except (OSError, CycleScopeError) as e:
            for s in chosen:
                s.state = f"no ring buffer: {e}"
            self.close()
            return []
        opened: list[Site] = []
        for s in chosen:
            if not self._verify(s):
                continue
            try:
                for t, c in targets:
                    fd = k.sampler(s.path, s.file_offset, t, c, self.regs_mask, per_task, on_exec and per_task)
                    s.fds.append(fd)
                    k.redirect(fd, owners[c])
                    self._by_id[k.ident(fd)] = self.sites.index(s)
                    self._id_keys = None
                    if not (on_exec and per_task):
                        k.enable(fd)
            except (OSError, CycleScopeError) as e:
                s.state = f"refused: {e}"
                self._close_now(s)
                continue
            s.state, s.opened = "open", self.clock()
            self.plan.points[s.point].exact = True
            opened.append(s)
        return opened

    def _verify(self, s: Site) -> bool:
        """The file on disk is the one the plan was made from (same build-id)."""
        from cyclescope.images.elf import read_load_info

        want = self.plan.points[s.point].probe
        if want is None or not want.build_id:
            return True
        try:
            got = read_load_info(s.path).build_id
        except (OSError, CycleScopeError) as e:
            s.state = f"unreadable: {e}"
            return False
        if got != want.build_id:
            s.state = "the file changed since the plan was made"
            return False
        return True

    # --- running ----------------------------------------------------------------------------------
    def _sites_of(self, ids: np.ndarray) -> np.ndarray:
        """The site index of each hit's event id (-1: an id no open site has), as one search of the
        sorted ids (a dictionary look-up per hit: 3.4 ms for 40,000 hits, against 0.8 ms)."""
        from cyclescope.arrays import lookup

        if self._id_keys is None:
            keys = np.array(sorted(self._by_id), np.uint64)
            self._id_keys, self._id_sites = keys, np.array([self._by_id[int(k)] for k in keys], np.int64)
        return lookup(self._id_keys, self._id_sites, ids.astype(np.uint64, copy=False))

    def poll(self) -> ExactValues:
        """The hits since the last poll, from every CPU's ring."""
        from cyclescope.perf.records import LostRecord

        pids, sites, values = [], [], []
        lost = 0
        for _, ring in self.rings:
            data = ring.read()
            if not data:
                continue
            b = self.decoder.decode(data)
            lost += sum(r.lost for r in b.side if isinstance(r, LostRecord))
            s = b.samples
            if not len(s):
                continue
            rows = s["regs"]
            ok = rows >= 0
            if not ok.any():
                continue
            s, rows = s[ok], rows[ok]
            idx = self._sites_of(s["id"])
            known = idx >= 0
            s, rows, idx = s[known], rows[known], idx[known]
            if not len(s):
                continue
            regs = b.regs[rows].astype(np.uint64)
            v = regs[np.arange(len(idx)), self._a[idx]]
            two = self._b[idx] >= 0
            if two.any():  # a difference, in the compared registers' width
                with np.errstate(over="ignore"):
                    v[two] = (v[two] - regs[np.flatnonzero(two), self._b[idx][two]]) & self._mask[idx][two]
            pids.append(s["pid"].astype(np.int64))
            sites.append(idx)
            values.append(v)
        out = ExactValues(*(np.concatenate(c) if c else np.zeros(0, t)
                            for c, t in ((pids, np.int64), (sites, np.int64), (values, np.uint64))))
        counts = np.bincount(out.site, minlength=len(self.sites))
        for i in np.flatnonzero(counts).tolist():
            self.sites[i].hits += int(counts[i])
        self.hits += len(out)
        if lost:
            # Lost hits trapped too: the police counts them, put down to the sites that filled the
            # ring (by their hits in this poll; the open ones alike if the ring held none).
            self.lost += lost
            weights = counts.astype(np.float64) if counts.any() else \
                np.array([s.state == "open" for s in self.sites], np.float64)
            if weights.any():
                parts = lost * weights / weights.sum()
                for i in np.flatnonzero(parts).tolist():
                    self.sites[i].lost += float(parts[i])
        return out

    def police(self) -> list[int]:
        """Closes the open sites whose traps so far exceed their share of the budget for the time
        they have been open (plus ALLOWANCE_S); returns their plan points."""
        now = self.clock()
        out = []
        open_sites = [s for s in self.sites if s.state == "open"]
        share = self.budget / max(1, len(open_sites))
        for s in open_sites:
            if (s.hits + s.lost) * self._hit_s(s) > share * (now - s.opened) + ALLOWANCE_S:
                out.append(s.point)
                rate = (s.hits + s.lost) / max(now - s.opened, 1e-9)
                self.drop_site(s, f"closed: over budget ({rate:,.0f} hits/s)")
        return out

    def drop(self, points: list[int], why: str) -> None:
        """Closes the probes of these plan points (rule (3) switched them off)."""
        for s in self.sites:
            if s.point in points and s.state == "open":
                self.drop_site(s, why)

    def drop_site(self, s: Site, why: str) -> None:
        s.state = why
        self.plan.points[s.point].exact = False
        with self._lock:
            self._closing.extend(s.fds)
        s.fds = []
        if self._closer is None:
            self._closer = threading.Thread(target=self._close_loop, name="goal-probes-closer", daemon=True)
            self._closer.start()
        self._wake.set()

    def _close_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    fd = self._closing.popleft() if self._closing else None
                if fd is None:
                    break
                if fd < 0:
                    return
                self.kernel.close(fd)

    def _close_now(self, s: Site) -> None:
        for fd in s.fds:
            self.kernel.close(fd)
        s.fds = []

    def close(self) -> None:
        """Closes every probe (the caller polled them last), then the rings."""
        if self._closer is not None:
            with self._lock:
                self._closing.append(-1)
            self._wake.set()
            self._closer.join()
            self._closer = None
        for s in self.sites:
            if s.fds:
                self._close_now(s)
                if s.state == "open":
                    s.state = "closed at the end"
        for fd, ring in self.rings:
            ring.close()
            self.kernel.close(fd)
        self.rings = []

    # --- reporting --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {"probes": {f"{self.plan.points[s.point].procedure}:{s.reg}@{s.at:#x}": {"state": s.state,
                                                                                        "hits": s.hits}
                           for s in self.sites},
                "hits": self.hits, "lost": self.lost, "trap_s": round(self.trap_s(), 3)}

    def summary(self) -> str | None:
        if not self.sites:
            return None
        probed = [s for s in self.sites if s.hits or s.state == "open" or s.state.startswith("closed")]
        line = (f"exact: {len(probed)} of {len(self.sites)} candidate(s) probed at every execution, "
                f"{self.hits:,} hits (about {self.trap_s():.2f} s of the programs' time in traps)")
        if self.lost:
            line += f", {self.lost:,} lost"
        others = {s.state for s in self.sites if s not in probed}
        if others:
            line += "; not probed: " + ", ".join(sorted(others))
        return line
