"""Value capture as one of the collector's processors (collect/processor.py): the drains' user
registers and stack snapshots go in, per-owner hotlist files come out at every flush."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cyclescope.values.capture import ValueCapture, ValueOptions
from cyclescope.values.goal import EXACT_KIND, GoalModule, kind_of
from cyclescope.values.probes import ExactValues

HELD_MAX = 1 << 20  # probe hits kept while their image is not in the table yet

if TYPE_CHECKING:
    from pathlib import Path

    from cyclescope.collect.processor import Context, Drain
    from cyclescope.db.layout import Database
    from cyclescope.values.probes import GoalProbes


class ValueProcessor:
    name = "values"
    needs_regs = True

    def __init__(self, opts: ValueOptions) -> None:
        self.opts = opts
        self.capture: ValueCapture | None = None
        self.written = 0  # files written so far (compacted with the segments later)
        self._since = time.time()
        self.probes: GoalProbes | None = None
        self._held: ExactValues | None = None  # probe hits of images not in the table yet
        self._table: Any = None

    def bind(self, ctx: Context) -> None:
        self.capture = ValueCapture(self.opts, ctx.mapper, ctx.table)
        self._since = time.time()
        self._table = ctx.table
        goal = self._goal()
        if goal is not None and self.opts.goal_budget > 0 and any(p.probe for p in goal.goal_plan.points):
            from cyclescope.collect.session import online_cpus
            from cyclescope.values.probes import GoalProbes, hit_cost

            self.probes = GoalProbes(goal.goal_plan, self.opts.goal_budget, hit_cost_s=hit_cost(),
                                     emulated_hit_cost_s=hit_cost(emulated=True))
            if self.probes.open(ctx.tasks, online_cpus(), ctx.on_exec):
                self.capture.replan()

    def _goal(self) -> GoalModule | None:
        if self.capture is None:
            return None
        return next((m for m in self.capture.modules if isinstance(m, GoalModule)), None)

    def process(self, d: Drain) -> None:
        if self.capture is None or d.regs is None:
            return
        if d.stack is None or d.stack_len is None or len(d.stack_len) != len(d.regs):
            # registers only (--value-stack 0, goal recordings)
            stack, stack_len = np.zeros((len(d.regs), 0), np.uint8), np.zeros(len(d.regs), np.uint32)
        else:
            stack, stack_len = d.stack, d.stack_len
        self.capture.process(d.samples, d.image, d.offset, d.regs, stack, stack_len, d.comm)
        self._poll()

    def _poll(self) -> None:
        """The probes' hits into the hotlists; probes over budget closed (their candidates go back
        to the samples). Hits of an image the table does not have yet (a drain's side records are
        handled before its samples are mapped) wait for the next poll."""
        if self.probes is None or self.capture is None:
            return
        got = self.probes.poll()
        if self._held is not None:
            got = ExactValues(*(np.concatenate([a, b]) for a, b in zip(
                (self._held.pid, self._held.site, self._held.value), (got.pid, got.site, got.value), strict=True)))
            self._held = None
        if len(got):
            sites = self.probes.sites
            img = np.array([self._table.index_of(s.image) for s in sites], np.int64)[got.site]
            off = np.array([s.at for s in sites], np.uint64)[got.site]
            kinds = [EXACT_KIND + kind_of(s.reg) for s in sites]
            self.capture.add_exact(got.pid, img, off, kinds, got.site, got.value)
            wait = img == 0
            if wait.any() and wait.sum() <= HELD_MAX:
                self._held = ExactValues(got.pid[wait], got.site[wait], got.value[wait])
        if self.probes.police():
            self.capture.replan()

    def wake_fds(self) -> tuple[int, ...]:
        """The probes' rings, per CPU: a drain when one is half full. Their hits come at every
        execution of the probed instructions, faster than drains once a second empty a 1 MiB
        ring (about 18,000 hits): tests/system/test_specialize.py's daemon counted 8,040-8,140 of
        9,000 calls made in 1.2 s with three sites probed, and the kernel reported only part of
        the loss (a ring's lost count is written with its next record, and the rings went quiet)."""
        return tuple(fd for fd, _ in self.probes.rings) if self.probes is not None else ()

    def forget(self, pid: int, tid: int) -> None:
        if self.capture is not None and pid == tid:  # a process's owner, name and memory go with it
            self._poll()  # its probes' hits first, while its owner is known
            self.capture.forget(pid)

    def finish(self) -> None:
        if self.probes is not None:
            self._poll()
            self.probes.close()

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]:
        from cyclescope.db.values import write_values

        if self.capture is None:
            return []
        now = time.time()
        out = []
        if self.probes is not None and self.probes.rings:
            self._poll()
        goal = self._goal()
        for _uid, (hotlists, vmeta) in self.capture.take(self._since, now).items():
            off = goal.observe(hotlists) if goal is not None else []
            if off:
                self.capture.replan()  # candidates switched off: their captures stop
                if self.probes is not None:
                    self.probes.drop(off, "closed: switched off by rule (3)")
            if len(hotlists.lists) or vmeta.samples:
                out.append(write_values(db, epoch, host, hotlists, vmeta))
        self._since = now
        self.written += len(out)
        return out

    def close(self) -> None:
        if self.probes is not None:
            self.probes.close()

    def status(self) -> dict[str, Any]:
        v = self.capture
        if v is None:
            return {}
        it = v.interp
        out = {"hotlist_rows_pending": v._pending_rows, "skipped": dict(v.skipped),
               "interpreted": it.runs if it else 0, "stops": dict(it.stops) if it else {}}
        if self.probes is not None:
            out["exact"] = self.probes.status()
        return out

    def summary(self) -> str | None:
        v = self.capture
        if v is None:
            return None
        it = v.interp
        parts = [f"values in {self.written} file(s) readable by their owners only"]
        goal = next((m for m in v.modules if isinstance(m, GoalModule)), None)
        if goal is not None:
            parts.append(f"goal: {len(goal.goal_plan.points)} candidate(s) profiled, {goal.switched_off} switched off "
                         "by rule (3)")
        if self.probes is not None and (line := self.probes.summary()):
            parts.append(line)
        if it is not None and it.runs:
            from cyclescope.values.interp import describe_stops

            parts.append(f"{it.runs:,} interpreted runs, {it.steps / it.runs:.1f} steps each "
                         f"(stops: {describe_stops(it.stops)})")
        skipped = {k: n for k, n in v.skipped.items() if n}
        if skipped:
            parts.append("skipped: " + ", ".join(f"{k} {n:,}" for k, n in skipped.items()))
        return "; ".join(parts)
