"""`cyclescope record --values --exact -- CMD`: value capture by single-stepping (values/exact.py).

The command is sampled as usual for the flat profile (per-task events through the
ring buffer); a second, sigtrap event stops it for exact capture. The collector's
own loop runs it, waking for SIGCHLD (through a wakeup pipe) as well as for the
ring buffers; the tracer's stops are collected in its tick hook.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from cyclescope.cli.base import db_path, eprint, stderr_tty
from cyclescope.collect.daemon import RunHooks
from cyclescope.collect.events import EventSpec
from cyclescope.errors import CycleScopeError
from cyclescope.values.capture import ValueOptions

if TYPE_CHECKING:
    from cyclescope.collect.daemon import Collector
    from cyclescope.values.capture import ValueCapture
    from cyclescope.values.exact import ExactTracer
    from cyclescope.values.processor import ValueProcessor

DEFAULT_EXACT_HZ = 1000.0  # each stop costs about (L + 2) x 95 us: 1 kHz slows L=4 by about half
HAND_OVER_S = 0.5  # drain the rings and hand the stops over to value capture at least this often


def run_exact(args: argparse.Namespace, cmd: list[str], events: list[EventSpec], rate: float | None,
              value_opts: ValueOptions) -> int:
    from cyclescope.cli.sampling import exit_code, host_of, progress_printer, summary_line
    from cyclescope.collect.daemon import Collector, CollectorConfig
    from cyclescope.collect.session import Command as CommandTarget
    from cyclescope.collect.session import Session
    from cyclescope.db.layout import Database
    from cyclescope.values.exact import WALL, ExactTracer
    from cyclescope.values.processor import ValueProcessor

    if os.geteuid() != 0 and not os.access("/proc/self/status", os.R_OK):
        raise CycleScopeError("exact mode needs to trace the command (ptrace)")
    hz = args.freq if args.freq is not None else DEFAULT_EXACT_HZ
    if value_opts.length < 1:
        raise CycleScopeError("exact mode steps at least one instruction: --interpret L with L >= 1")
    value_opts = replace(value_opts, exact=True)
    values = ValueProcessor(value_opts)  # fed by the tracer's stops (the session samples no registers)
    session = Session(events, CommandTarget(tuple(cmd)), rate_hz=hz if args.period is None else None,
                      band=args.band, force=args.force, traceme=True)
    db = Database.create_or_open(db_path(args))
    cfg = CollectorConfig(host=host_of(args), flush_interval_s=args.flush_interval, new_epoch=not args.append,
                          epoch_name=args.epoch_name, archive="none" if args.no_archive else "binaries",
                          rerandomize_s=args.redraw / 1000, drain_s=HAND_OVER_S, processors=[values])
    show = not args.quiet and stderr_tty()
    start = time.monotonic()
    c = Collector(session, db, cfg, progress=progress_printer(start) if show else None)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_wakeup = signal.set_wakeup_fd(wake_w)
    old_chld = signal.signal(signal.SIGCHLD, lambda *_: None)
    tracer: ExactTracer | None = None
    try:
        c.start()
        pid = session.child_pid
        if pid is None:
            raise CycleScopeError("the command did not start")
        period_ns = int(1e9 / hz)
        tracer = ExactTracer(pid, value_opts.length, value_opts.stack, period_ns, band=args.band, how=args.exact)
        assert values.capture is not None
        values.capture.pin_owner(pid)
        c.install_signals()
        for w in session.warnings:
            eprint(f"cyclescope record: {w}")
        tr = tracer
        c.run(duration_s=args.duration, until=lambda: tr.exited is not None,
              hooks=_hooks(c, values, tracer, value_opts, wake_r, WALL))
    finally:
        if tracer is not None and tracer.exited is None:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(tracer.pid, signal.SIGKILL)
                os.waitpid(tracer.pid, WALL)
        if tracer is not None:
            tracer.close()
        signal.set_wakeup_fd(old_wakeup)
        signal.signal(signal.SIGCHLD, old_chld)
        os.close(wake_r)
        os.close(wake_w)
        c.close()
    assert tracer is not None
    elapsed = time.monotonic() - start
    if show:
        sys.stderr.write("\r\x1b[K")
    if not args.quiet:
        eprint(f"cyclescope record: {summary_line(c.totals, elapsed, c.epoch, db_path(args))}")
        eprint(f"cyclescope record: exact mode: {tracer.perf_stops:,} stops, {value_opts.length} steps each; "
               f"{values.summary()}")
        it = tracer.interp
        if tracer.how == "interpret" and it is not None and it.runs:
            stops = ", ".join(f"{k} {100 * v / it.runs:.0f}%" for k, v in it.stops.most_common())
            eprint(f"cyclescope record: interpreted while stopped: {it.steps / it.runs:.1f} steps a run "
                   f"(stops: {stops})")
        s = tracer.stats
        if s.compared:
            eprint(f"cyclescope record: the interpreter agreed with single-stepping on {s.agree:,} of "
                   f"{s.compared:,} steps ({100 * s.agree / s.compared:.1f}%)")
    return exit_code(tracer.exited)


def _hooks(c: Collector, values: ValueProcessor, tracer: ExactTracer, value_opts: ValueOptions, wake_r: int,
           wall: int) -> RunHooks:
    """The tracer's part of Collector.run's loop: collect the command's stops when SIGCHLD wakes
    it (through the wakeup pipe), hand them over in batches, and the rest at the end."""
    capture = values.capture
    assert capture is not None
    next_hand = [time.monotonic() + HAND_OVER_S]

    def tick(now: float) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_r, 512):
                pass
        while tracer.exited is None:
            try:
                got, status = os.waitpid(tracer.pid, os.WNOHANG | wall)
            except ChildProcessError:
                tracer.exited = 0
                break
            if not got:
                break
            tracer.on_stop(status)
        if tracer.stops and (len(tracer.stops) >= 256 or now >= next_hand[0] or tracer.exited is not None):
            _hand_over(c, capture, tracer, value_opts)
            next_hand[0] = now + HAND_OVER_S

    def finish() -> None:
        if tracer.stops:
            _hand_over(c, capture, tracer, value_opts)
        c.session.exit_status = tracer.exited
        capture.check.update(tracer.stats.as_dict())

    return RunHooks((wake_r,), tick, finish)


def _hand_over(c: Collector, capture: ValueCapture, tracer: ExactTracer, value_opts: ValueOptions) -> None:
    c.step()  # the ring's mmap records first: they map the stops' addresses
    samples, regs, stack, stack_len, stops = tracer.take_batch(value_opts.stack)
    mapped = c.mapper.map_batch(samples, [])
    capture.process(samples, mapped.image, mapped.offset, regs, stack, stack_len, mapped.comm)
    capture.add_sequences(tracer.pid, [(s.steps, s.reason) for s in stops])
