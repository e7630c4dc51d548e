"""Value capture as one of the collector's processors (collect/processor.py): the drains' user
registers and stack snapshots go in, per-owner hotlist files come out at every flush."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cyclescope.values.capture import ValueCapture, ValueOptions
from cyclescope.values.goal import GoalModule

if TYPE_CHECKING:
    from pathlib import Path

    from cyclescope.collect.processor import Context, Drain
    from cyclescope.db.layout import Database


class ValueProcessor:
    name = "values"
    needs_regs = True

    def __init__(self, opts: ValueOptions) -> None:
        self.opts = opts
        self.capture: ValueCapture | None = None
        self.written = 0  # files written so far (compacted with the segments later)
        self._since = time.time()

    def bind(self, ctx: Context) -> None:
        self.capture = ValueCapture(self.opts, ctx.mapper, ctx.table)
        self._since = time.time()

    def process(self, d: Drain) -> None:
        if self.capture is None or d.regs is None or d.stack is None or d.stack_len is None:
            return
        self.capture.process(d.samples, d.image, d.offset, d.regs, d.stack, d.stack_len, d.comm)

    def forget(self, pid: int, tid: int) -> None:
        if self.capture is not None and pid == tid:  # a process's owner, name and memory go with it
            self.capture.forget(pid)

    def finish(self) -> None:
        pass

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]:
        from cyclescope.db.values import write_values

        if self.capture is None:
            return []
        now = time.time()
        out = []
        goal = next((m for m in self.capture.modules if isinstance(m, GoalModule)), None)
        for _uid, (hotlists, vmeta) in self.capture.take(self._since, now).items():
            if goal is not None and goal.observe(hotlists):
                self.capture.replan()  # candidates switched off: their captures stop
            if len(hotlists.hl) or vmeta.samples:
                out.append(write_values(db, epoch, host, hotlists, vmeta))
        self._since = now
        self.written += len(out)
        return out

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        v = self.capture
        if v is None:
            return {}
        it = v.interp
        return {"hotlist_rows_pending": v._pending_rows, "skipped": dict(v.skipped),
                "interpreted": it.runs if it else 0, "stops": dict(it.stops) if it else {}}

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
        if it is not None and it.runs:
            from cyclescope.values.interp import describe_stops

            parts.append(f"{it.runs:,} interpreted runs, {it.steps / it.runs:.1f} steps each "
                         f"(stops: {describe_stops(it.stops)})")
        skipped = {k: n for k, n in v.skipped.items() if n}
        if skipped:
            parts.append("skipped: " + ", ".join(f"{k} {n:,}" for k, n in skipped.items()))
        return "; ".join(parts)
