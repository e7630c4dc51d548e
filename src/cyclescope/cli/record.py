"""`cyclescope record`: sample a command, running processes, or the whole system."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cyclescope.cli.base import Command, add_db_option, db_path, eprint, finite_float, register, stderr_tty
from cyclescope.cli.sampling import (
    PYTHON_FRAMES_NOTE,
    add_count_options,
    add_sampling_options,
    add_value_options,
    bpf_collector,
    drain_interval,
    exit_code,
    host_of,
    list_value_modules,
    make_events,
    open_session,
    processors,
    progress_printer,
    python_flat_hint,
    python_frames_args,
    summary_line,
    value_options,
)
from cyclescope.errors import CycleScopeError, UsageError

if TYPE_CHECKING:
    from cyclescope.collect.daemon import Collector, RunTotals
    from cyclescope.collect.session import Command as CommandTarget
    from cyclescope.collect.session import Processes, SystemWide

DEFAULT_RECORD_HZ = 5000.0


@register
class Record(Command):
    name = "record"
    description = (
        "Sample a command and its children, running processes (-p), or every CPU (-a), and store the\n"
        "samples as counts per (image, offset, event) in a new epoch of the database."
    )
    epilog = (
        "examples:\n"
        "  cyclescope record -- ./myprog --input big.txt\n"
        "  cyclescope record -F 1000 -p 1234 -d 30\n"
        "  cyclescope record -a -d 10            # everything, kernel included, for 10 s\n"
        "  cyclescope prof                       # then: where did the cycles go?"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)
        t = p.add_argument_group("what to sample")
        t.add_argument("-a", "--all-cpus", action="store_true",
                       help="system-wide: every CPU and process, the kernel included (with a command: while it runs)")
        t.add_argument("-p", "--pid", metavar="PID[,PID]", help="running process(es) and their future children")
        t.add_argument("-d", "--duration", type=finite_float, metavar="SECONDS", help="stop after this long")
        add_sampling_options(p, DEFAULT_RECORD_HZ)
        add_value_options(p, exact=True)
        o = p.add_argument_group("storing")
        o.add_argument("--append", action="store_true", help="add to the latest epoch instead of starting a new one")
        o.add_argument("--epoch-name", metavar="NAME", help="a name for the new epoch")
        o.add_argument("--flush-interval", type=finite_float, default=60.0, metavar="S",
                       help="write to the database every S seconds during long runs (default: 60)")
        o.add_argument("--no-archive", action="store_true",
                       help="do not copy profiled binaries into the database (they are needed if the files change)")
        add_count_options(p)
        p.add_argument("-q", "--quiet", action="store_true", help="no progress or summary on stderr")
        p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS]",
                       help="the command to run and sample")

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.collect.daemon import Collector, CollectorConfig, child_done
        from cyclescope.collect.session import Command as CommandTarget
        from cyclescope.collect.session import Processes, SystemWide, online_cpus

        cmd = list(args.command)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if args.values == "list":
            return list_value_modules()
        value_opts = value_options(args)
        target, until = _target(args, cmd)
        events, rate = make_events(args)
        rate = rate if rate is not None or args.period is not None else DEFAULT_RECORD_HZ
        if args.exact:
            from cyclescope.cli.exact import run_exact

            if args.call_graph:
                raise UsageError("--exact does not record call stacks; leave out --call-graph")
            assert value_opts is not None
            return int(run_exact(args, cmd, events, rate, value_opts))
        ncpus = len(target.cpus) if isinstance(target, SystemWide) else len(online_cpus())
        bpf, note = None, None
        lean = python_frames_args(args, cmd, target.pids if isinstance(target, Processes) else ())
        if lean is not None:  # a CPython program's stacks: the eBPF path, which alone names its frames
            procs = processors(lean, value_opts)
            bpf = bpf_collector(lean, procs, rate, ncpus, "record")
            note = PYTHON_FRAMES_NOTE.format(what=cmd[0] if cmd else target.describe()) if bpf is not None else None
        if bpf is None:
            note = python_flat_hint(args, cmd)
            procs = processors(args, value_opts, system_wide=bool(args.all_cpus))
            bpf = bpf_collector(args, procs, rate, ncpus, "record", system_wide=bool(args.all_cpus))
        session, db = open_session(args, events, target, rate, value_opts, procs, bpf)
        cfg = CollectorConfig(host=host_of(args), flush_interval_s=args.flush_interval, new_epoch=not args.append,
                              epoch_name=args.epoch_name, archive="none" if args.no_archive else "binaries",
                              rerandomize_s=args.redraw / 1000, drain_s=drain_interval(value_opts), processors=procs,
                              bpf=bpf)
        show = not args.quiet and stderr_tty()
        start = time.monotonic()
        collector = Collector(session, db, cfg, progress=progress_printer(start) if show else None)
        child_session = None
        if cmd and args.all_cpus:
            # System-wide while a command runs: start it ourselves, unsampled-specific.
            child_session = _spawn(cmd)
            until = lambda: child_session.poll() is not None  # noqa: E731
        try:
            collector.start()
        except BaseException:
            if child_session is not None:
                child_session.kill()
            collector.close()
            raise
        for w in session.warnings:
            eprint(f"cyclescope record: {w}")
        if note is not None and not args.quiet:
            eprint(f"cyclescope record: {note}")
        if isinstance(target, CommandTarget):
            until = child_done(session)
        if child_session is not None:
            running: Callable[[], int | None] = lambda: child_session.pid if child_session.status is None else None  # noqa: E731
        else:
            running = lambda: session.child_pid if session.exit_status is None else None  # noqa: E731
        collector.install_signals(running if cmd else None)
        if child_session is not None:
            child_session.release()
        totals = collector.run(duration_s=args.duration, until=until)
        _report(args, collector, totals, time.monotonic() - start, rate, show)
        status = session.exit_status
        if child_session is not None:
            status = child_session.status
        return exit_code(status)


def _target(args: argparse.Namespace, cmd: list[str]
            ) -> tuple[SystemWide | Processes | CommandTarget, Callable[[], bool] | None]:
    """What to sample (every CPU, processes, or the command), checked against the other options,
    and when sampling ends for it (None: when the command exits or on a signal)."""
    from cyclescope.collect.daemon import processes_gone
    from cyclescope.collect.session import Command as CommandTarget
    from cyclescope.collect.session import Processes, SystemWide, online_cpus

    if args.exact and (not cmd or args.pid or args.all_cpus):
        raise UsageError("--exact needs a command (and neither -p nor -a)")
    if args.pid and cmd:
        raise UsageError("give either -p PID or a command, not both")
    if not cmd and not args.pid and not args.all_cpus:
        raise UsageError("nothing to record: give a command after --, -p PID, or -a")
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be positive")
    if cmd:
        import shutil

        if shutil.which(cmd[0]) is None:
            raise CycleScopeError(f"{cmd[0]}: command not found")
    if args.all_cpus:
        return SystemWide(online_cpus()), None
    if args.pid:
        try:
            pids = tuple(int(x) for x in str(args.pid).split(",") if x.strip())
        except ValueError:
            raise UsageError(f"-p: not a process id list: {args.pid}") from None
        return Processes(pids), processes_gone(pids)
    return CommandTarget(tuple(cmd)), None


def _report(args: argparse.Namespace, collector: Collector, totals: RunTotals, elapsed: float,
            rate: float | None, show: bool) -> None:
    """The end of a recording on stderr: nothing sampled, the summary, the processors' lines, losses."""
    if not totals.samples:
        every = f"; at {rate:g} Hz a sample comes every {1 / rate:.3g} s per CPU" if rate else ""
        eprint(f"cyclescope record: no samples were taken in {elapsed:.1f} s{every} (raise -F, run longer, "
               "or check that the command did any work)")
    if show:
        sys.stderr.write("\r\x1b[K")
    if not args.quiet:
        eprint(f"cyclescope record: {summary_line(totals, elapsed, collector.epoch, db_path(args))}")
        for line in collector.summaries():
            eprint(f"cyclescope record: {line}")
        if totals.lost_records or totals.lost_samples:
            eprint("cyclescope record: some samples were lost (the ring buffer filled); "
                   "lower the rate or add CPUs to the drain")


class _Spawned:
    """A command started blocked, released once sampling is on (for -a -- CMD)."""

    def __init__(self, argv: list[str]) -> None:
        import shutil

        if shutil.which(argv[0]) is None:
            raise CycleScopeError(f"{argv[0]}: command not found")
        r, w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                from cyclescope.collect.session import die_with

                die_with(parent)
                os.close(w)
                os.read(r, 1)
                os.execvp(argv[0], argv)
            finally:
                os._exit(127)
        os.close(r)
        self.pid = pid
        self._go: int | None = w
        self.status: int | None = None

    def release(self) -> None:
        if self._go is not None:
            os.write(self._go, b"x")
            os.close(self._go)
            self._go = None

    def kill(self) -> None:
        import signal

        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)

    def poll(self) -> int | None:
        if self.status is None:
            done, st = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = st
        return self.status


def _spawn(argv: list[str]) -> _Spawned:
    return _Spawned(argv)
