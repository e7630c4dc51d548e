"""`cyclescope record --values --exact -- CMD`: value capture by single-stepping (values/exact.py).

The command is sampled as usual for the flat profile (per-task events through the
ring buffer); a second, sigtrap event stops it for exact capture. The tracer loop
waits for SIGCHLD (through a wakeup pipe) and the ring buffers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import time
from dataclasses import replace

from cyclescope.cli.base import db_path, eprint, stderr_tty
from cyclescope.collect.events import EventSpec
from cyclescope.errors import CycleScopeError
from cyclescope.values.capture import ValueOptions

DEFAULT_EXACT_HZ = 1000.0  # each stop costs about (L + 2) x 95 us: 1 kHz slows L=4 by about half


def run_exact(args: argparse.Namespace, cmd: list[str], events: list[EventSpec], rate: float | None,
              vopts: ValueOptions) -> int:
    from cyclescope.cli.record import _exit_code, progress_printer, summary_line, value_summary
    from cyclescope.collect.daemon import Collector, CollectorConfig
    from cyclescope.collect.session import Command as CommandTarget
    from cyclescope.collect.session import Session
    from cyclescope.db.layout import Database
    from cyclescope.images.procfs import hostname
    from cyclescope.values.exact import WALL, ExactTracer

    if os.geteuid() != 0 and not os.access("/proc/self/status", os.R_OK):
        raise CycleScopeError("exact mode needs to trace the command (ptrace)")
    hz = args.freq if args.freq is not None else DEFAULT_EXACT_HZ
    if vopts.length < 1:
        raise CycleScopeError("exact mode steps at least one instruction: --interpret L with L >= 1")
    vopts = replace(vopts, exact=True)
    session = Session(events, CommandTarget(tuple(cmd)), rate_hz=hz if args.period is None else None,
                      band=args.band, force=args.force, traceme=True)
    db = Database.create_or_open(db_path(args))
    cfg = CollectorConfig(host=hostname(), flush_interval_s=args.flush_interval, new_epoch=not args.append,
                          epoch_name=args.epoch_name, archive="none" if args.no_archive else "binaries",
                          rerandomize_s=args.redraw / 1000, values=vopts)
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
        tracer = ExactTracer(pid, vopts.length, vopts.stack, period_ns, band=args.band)
        assert c.values is not None
        c.values.pin_owner(pid)
        c.install_signals()
        for w in session.warnings:
            eprint(f"cyclescope record: {w}")
        _loop(c, tracer, vopts, wake_r, WALL, args.duration)
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
        eprint(f"cyclescope record: exact mode: {tracer.perf_stops:,} stops, {vopts.length} steps each; "
               f"{value_summary(c)}")
        s = tracer.stats
        if s.compared:
            eprint(f"cyclescope record: the interpreter agreed with single-stepping on {s.agree:,} of "
                   f"{s.compared:,} steps ({100 * s.agree / s.compared:.1f}%)")
    return _exit_code(tracer.exited)


def _loop(c: object, tracer: object, vopts: ValueOptions, wake_r: int, wall: int, duration: float | None) -> None:
    from cyclescope.collect.daemon import Collector
    from cyclescope.values.exact import ExactTracer

    assert isinstance(c, Collector) and isinstance(tracer, ExactTracer)
    assert c.values is not None
    session = c.session
    next_flush = time.monotonic() + c.cfg.flush_interval_s
    next_rand = time.monotonic() + c.cfg.rerandomize_s
    next_drain = time.monotonic() + 0.5
    next_progress = time.monotonic() + 1.0
    deadline = time.monotonic() + duration if duration else None
    p = select.poll()
    p.register(wake_r, select.POLLIN)
    for fd in session.fds:
        p.register(fd, select.POLLIN)
    while tracer.exited is None and not c._stop:
        p.poll(100)
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
        now = time.monotonic()
        if tracer.stops and (len(tracer.stops) >= 256 or now >= next_drain or tracer.exited is not None):
            _hand_over(c, tracer, vopts)
            next_drain = now + 0.5
        elif now >= next_drain:
            c.step()
            next_drain = now + 0.5
        if now >= next_rand:
            session.rerandomize()
            next_rand = now + c.cfg.rerandomize_s
        if now >= next_flush:
            c.step()
            c.flush()
            next_flush = now + c.cfg.flush_interval_s
        if c.progress is not None and now >= next_progress:
            c.progress(c)
            next_progress = now + 1.0
        if deadline is not None and now >= deadline:
            break
    if tracer.stops:
        _hand_over(c, tracer, vopts)
    session.exit_status = tracer.exited
    c.values.check.update(tracer.stats.as_dict())
    c.step()
    c.flush()


def _hand_over(c: object, tracer: object, vopts: ValueOptions) -> None:
    from cyclescope.collect.daemon import Collector
    from cyclescope.values.exact import ExactTracer

    assert isinstance(c, Collector) and isinstance(tracer, ExactTracer) and c.values is not None
    c.step()  # the ring's mmap records first: they map the stops' addresses
    samples, regs, stack, slen, stops = tracer.take_batch(vopts.stack)
    mapped = c.mapper.map_batch(samples, [])
    c.values.process(samples, mapped.image, mapped.offset, regs, stack, slen, mapped.comm)
    c.values.add_sequences(tracer.pid, [(s.steps, s.reason) for s in stops])
