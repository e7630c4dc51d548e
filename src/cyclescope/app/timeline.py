"""A profile over time: samples per process or thread in steps of time, from the timeline the
collector keeps (100 ms windows per thread: collect/timeline.py, db/tallies.py TIMELINE)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cyclescope.errors import NotFoundError, UsageError
from cyclescope.report.timeline import CLOCK_EVENTS, WINDOW_MS, Series, Timeline, pick_step

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile

def timeline(p: Profile, by: str = "process", step_ms: int | None = None, top: int = 6,
             buckets: int = 60) -> Timeline:
    """The selection's samples over time, one series per process (or thread) for the ``top``
    busiest and one for the rest. ``step_ms``: the step (a multiple of 100 ms); None picks one that
    fits ``buckets`` steps. Selection: its epochs, hosts, processes (by name) and event (else the
    time event, else the busiest)."""
    from cyclescope.db.tallies import TIMELINE, load_tally

    if by not in ("process", "thread"):
        raise UsageError(f"timeline by {by!r}: 'process' or 'thread'")
    if step_ms is not None and (step_ms < WINDOW_MS or step_ms % WINDOW_MS):
        raise UsageError(f"the step must be a multiple of {WINDOW_MS} ms (the timeline's grain)")
    if top < 1:
        raise UsageError("--top must be at least 1")
    profile_set = p.profile_set
    sel = load_tally(profile_set.db, TIMELINE, profile_set.epochs, profile_set.hosts or None,
                     set(profile_set.selection.processes) or None)
    notes = [f"skipping {c}" for c in sel.corrupt]
    t = sel.table
    if not t.num_rows:
        raise NotFoundError("no timeline in this selection (it was recorded before cyclescope kept one, "
                            "or no process of it was sampled)")
    events = t.column("event").to_pylist()
    wanted = list(profile_set.selection.events)
    have = sorted(set(events))
    if wanted:
        event = wanted[0]
        if event not in have:
            raise NotFoundError(f"no timeline of event {event} in this selection (it has {', '.join(have)})")
    else:
        clock = [e for e in have if e.split(":")[0] in CLOCK_EVENTS]
        event = clock[0] if clock else max(have, key=events.count)
    keep = np.array([e == event for e in events], bool)
    window = np.asarray(t.column("window_ms").to_numpy())[keep]
    samples = np.asarray(t.column("samples").to_numpy()).astype(np.int64)[keep]
    period = np.asarray(t.column("period").to_numpy())[keep]
    procs = np.array(t.column("process").cast("string").to_pylist(), object)[keep]
    if by == "thread":
        pid = t.column("pid").to_numpy()[keep].tolist()
        tid = t.column("tid").to_numpy()[keep].tolist()
        names = np.array([f"{n} {a}/{b}" for n, a, b in zip(procs.tolist(), pid, tid, strict=True)], object)
    else:
        names = procs
    start = int(window.min())
    span = int(window.max()) + WINDOW_MS - start
    step = step_ms or pick_step(span, buckets)
    start -= start % step
    nb = (int(window.max()) - start) // step + 1
    b = (window - start) // step
    uniq, inv = np.unique(names, return_inverse=True)
    per_name = np.bincount(inv, weights=samples, minlength=len(uniq))
    order = np.argsort(-per_name, kind="stable")
    shown = order[:top]
    series = []
    for i in shown.tolist():
        m = inv == i
        series.append(Series(str(uniq[i]), np.bincount(b[m], weights=samples[m], minlength=nb).astype(int).tolist(),
                             np.bincount(b[m], weights=period[m], minlength=nb).tolist(), int(per_name[i])))
    if len(order) > top:
        m = ~np.isin(inv, shown)
        series.append(Series(f"other ({len(order) - top})",
                             np.bincount(b[m], weights=samples[m], minlength=nb).astype(int).tolist(),
                             np.bincount(b[m], weights=period[m], minlength=nb).tolist(), int(samples[m].sum())))
    return Timeline(event, by, step, start, series, np.bincount(b, weights=samples, minlength=nb).astype(int).tolist(),
                    np.bincount(b, weights=period, minlength=nb).tolist(), notes)
