"""`cyclescope record`: sample a command, running processes, or the whole system."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from cyclescope.cli.base import Command, add_db_option, db_path, eprint, finite_float, register, stderr_tty
from cyclescope.collect.events import DEFAULT_BAND, KNOWN_EVENTS, SAFE_MAX_RATE_HZ, EventSpec, parse_events
from cyclescope.errors import CycleScopeError, UsageError
from cyclescope.report.render import fmt_count

if TYPE_CHECKING:
    from cyclescope.collect.daemon import Collector, RunTotals
    from cyclescope.collect.processor import Processor
    from cyclescope.collect.session import CallGraph
    from cyclescope.values.capture import ValueOptions

DEFAULT_RECORD_HZ = 5000.0
# With interpretation, drain often: the interpreter reads the process's memory when it runs, and
# the closer that is to the interrupt, the fewer values have changed since. Capture at the interrupt
# alone needs nothing but the sample, and drains like plain sampling (fewer, larger batches).
# 0.15 s: at 5 kHz half a ring of value samples (about 800 bytes each) fills in about 0.13 s, so
# the rings' watermark sets the pace and the timer bounds how stale memory gets at lower rates;
# each drain has a fixed cost of a few ms (grouping by PC, hotlist building), and 0.1 s cost a
# third more drains for 0.02-0.05 s less staleness.
VALUE_DRAIN_S = 0.15


def add_sampling_options(p: argparse.ArgumentParser, default_hz: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-e", "--event", action="append", default=[], metavar="EVENTS",
                   help="events to sample, comma-separated (default: cpu-clock). NAME:u / NAME:k for user or "
                        "kernel only, NAME/period=N/ for a fixed period. Known: " + ", ".join(KNOWN_EVENTS))
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("-F", "--freq", type=finite_float, default=None, metavar="HZ",
                      help=f"samples per second per CPU (default: {default_hz:g}; refused above "
                           f"{SAFE_MAX_RATE_HZ:,} without --force)")
    rate.add_argument("-c", "--period", type=int, default=None, metavar="N",
                      help="events (nanoseconds for clock events) between samples, for every event")
    g.add_argument("--band", type=finite_float, default=DEFAULT_BAND, metavar="F",
                   help="randomize each period uniformly in [P*(1-F), P] (default: 1/16, as DCPI); 0: fixed")
    g.add_argument("--redraw", type=finite_float, default=200.0, metavar="MS",
                   help="draw a new random period every MS milliseconds (default: 200)")
    g.add_argument("--force", action="store_true", help="allow sampling rates above the safe ceiling")
    g.add_argument("-g", "--call-graph", type=call_graph_arg, default=None, metavar="fp|dwarf[,SIZE]",
                   help="record call stacks, counted in the database for `export`: 'fp' has the kernel walk "
                        "frame pointers (code built with -fno-omit-frame-pointer); 'dwarf' copies SIZE bytes "
                        "of user stack per sample (default: 8192) and unwinds them with the binaries' "
                        ".eh_frame (any code with unwind tables: most distribution binaries)")


def call_graph_arg(text: str) -> CallGraph:
    """argparse type of --call-graph: fp, dwarf or dwarf,SIZE (as perf record's)."""
    from cyclescope.collect.session import MAX_USER_STACK, CallGraph

    mode, _, size = text.partition(",")
    if mode == "fp" and not size:
        return CallGraph("fp")
    if mode == "dwarf":
        if not size:
            return CallGraph("dwarf")
        try:
            n = int(size, 0)
        except ValueError:
            n = -1
        if n <= 0 or n % 8 or n > MAX_USER_STACK:
            raise argparse.ArgumentTypeError(
                f"dwarf stack size must be a positive multiple of 8 up to {MAX_USER_STACK}: {size}")
        return CallGraph("dwarf", n)
    raise argparse.ArgumentTypeError(f"expected fp, dwarf or dwarf,SIZE: {text}")


def add_value_options(p: argparse.ArgumentParser, exact: bool) -> None:
    from cyclescope.values import DEFAULT_MODULES

    g = p.add_argument_group("value sampling (opt-in: values are the sampled programs' data)")
    g.add_argument("--values", nargs="?", const=",".join(DEFAULT_MODULES), default=None, metavar="MODULES",
                   help="capture values at each interrupt into per-instruction hotlists; MODULES is a "
                        f"comma-separated list (default: {','.join(DEFAULT_MODULES)}; entry points of the "
                        "'cyclescope.values' group or package.module:Class; 'list' shows them)")
    g.add_argument("--interpret", type=int, default=4, metavar="L",
                   help="interpret the next L instructions after a sample (default: 4; 0: only the "
                        "interrupt's registers)")
    g.add_argument("--interpret-every", type=int, default=2, metavar="K",
                   help="interpret one value sample in K (default: 2)")
    g.add_argument("--interpret-budget", type=finite_float, default=0.5, metavar="SHARE",
                   help="most of one CPU interpretation may use (default: 0.5); samples past it are "
                        "captured but not interpreted, and counted, so that PC samples are never lost to "
                        "it; 0: no limit")
    g.add_argument("--value-stack", type=int, default=512, metavar="BYTES",
                   help="bytes of user stack copied at each interrupt (default: 512)")
    g.add_argument("--values-users", metavar="USER[,USER]",
                   help="capture values only from processes of these users (names or uids)")
    g.add_argument("--values-commands", metavar="COMM[,COMM]",
                   help="capture values only from processes with these command names")
    if exact:
        g.add_argument("--exact", nargs="?", const="step", choices=("step", "interpret"), metavar="HOW",
                       help="exact mode (with a command only): stop the thread at each sample and run the next "
                            "L instructions from its exact state: 'step' (the default) single-steps them with "
                            "ptrace (about 95 us a step: for targeted capture and ground truth), 'interpret' "
                            "interprets them while the thread is stopped (memory as the thread sees it; much "
                            "cheaper, stops at what the interpreter cannot run)")


def value_options(args: argparse.Namespace) -> ValueOptions | None:
    """The ValueOptions the value flags ask for (None without --values)."""
    if args.values is None:
        for flag in ("values_users", "values_commands"):
            if getattr(args, flag, None):
                raise UsageError(f"--{flag.replace('_', '-')} needs --values")
        if getattr(args, "exact", False):
            raise UsageError("--exact needs --values")
        return None
    if args.interpret < 0 or args.interpret > 1024:
        raise UsageError("--interpret must be between 0 and 1024")
    if args.interpret_every < 1:
        raise UsageError("--interpret-every must be at least 1")
    if not 0 <= args.interpret_budget <= 1:
        raise UsageError("--interpret-budget must be a share of one CPU between 0 (no limit) and 1")
    if args.value_stack < 0 or args.value_stack % 8 or args.value_stack > 16384:
        raise UsageError("--value-stack must be a multiple of 8 between 0 and 16384")
    from cyclescope.values.capture import ValueOptions
    from cyclescope.values.modules import load_modules

    names = tuple(x.strip() for x in args.values.split(",") if x.strip())
    load_modules(names)  # unknown names fail here, with the list of known ones
    users = None
    if args.values_users:
        import pwd

        uids = set()
        for u in args.values_users.split(","):
            u = u.strip()
            if u.isdigit():
                uids.add(int(u))
            else:
                try:
                    uids.add(pwd.getpwnam(u).pw_uid)
                except KeyError:
                    raise UsageError(f"--values-users: no user '{u}'") from None
        users = frozenset(uids)
    commands = frozenset(c.strip() for c in args.values_commands.split(",")) if args.values_commands else None
    return ValueOptions(modules=names, length=args.interpret, every=args.interpret_every, stack=args.value_stack,
                        users=users, commands=commands, budget=args.interpret_budget)


def add_count_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution counts (what calc rests on; on by default)")
    g.add_argument("--no-loop-counts", action="store_true",
                   help="do not count loop iterations between samples (the user registers are then not "
                        "sampled; calc falls back to its model where loops had counts)")


def count_processors(args: argparse.Namespace) -> list[Processor]:
    """The processors that gather calc's evidence while sampling (collect/processor.py)."""
    out: list[Processor] = []
    if not getattr(args, "no_loop_counts", False):
        from cyclescope.analysis.loopcount import LoopCountProcessor

        out.append(LoopCountProcessor())
    return out


def list_value_modules() -> int:
    from cyclescope.values.modules import available, load_module

    for name, where in sorted(available().items()):
        try:
            desc = load_module(name).description
        except UsageError as e:
            desc = f"(does not load: {e})"
        print(f"{name:<10} {desc}  [{where}]")
    return 0


def make_events(args: argparse.Namespace) -> tuple[list[EventSpec], float | None]:
    events = parse_events(args.event or ["cpu-clock"])
    if args.period is not None:
        if args.period <= 0:
            raise UsageError("--period must be positive")
        events = [replace(e, period=args.period) for e in events]
    if args.freq is not None and args.freq <= 0:
        raise UsageError("--freq must be positive")
    if args.freq is not None and args.freq > 1e6 and not args.force:
        raise UsageError(f"--freq {args.freq:g}: above the safe ceiling of {SAFE_MAX_RATE_HZ:,} samples/s per CPU "
                         "(pass --force to try anyway)")
    if not 0 <= args.band < 1:
        raise UsageError("--band must be at least 0 and below 1 (periods are drawn from [P*(1-F), P])")
    if args.redraw <= 0:
        raise UsageError("--redraw must be positive")
    return events, args.freq


def summary_line(totals: RunTotals, elapsed: float, epoch: int, db: str) -> str:
    lost = totals.lost_records + totals.lost_samples
    share = 100.0 * totals.unknown / totals.samples if totals.samples else 0.0
    evs = ", ".join(f"{k} {fmt_count(v)}" for k, v in totals.per_event.items()) or "no samples"
    return (f"{fmt_count(totals.samples)} samples ({evs}) in {elapsed:.1f} s; lost {fmt_count(lost)}; "
            f"unknown {share:.2f}%; written to epoch {epoch} of {db}")


def progress_printer(start: float) -> Callable[[Collector], None]:
    def show(c: Collector) -> None:
        t = c.totals
        lost = t.lost_records + t.lost_samples
        sys.stderr.write(f"\rrecording: {time.monotonic() - start:6.1f} s, {fmt_count(t.samples)} samples, "
                         f"{fmt_count(lost)} lost ")
        sys.stderr.flush()

    return show


@register
class Record(Command):
    name = "record"
    help = "sample a command, running processes, or the whole system into the database"
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
        from cyclescope.collect.daemon import Collector, CollectorConfig, child_done, processes_gone
        from cyclescope.collect.session import Command as CommandTarget
        from cyclescope.collect.session import Processes, Session, SystemWide, online_cpus
        from cyclescope.db.layout import Database
        from cyclescope.images.procfs import hostname

        cmd = list(args.command)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if args.values == "list":
            return list_value_modules()
        vopts = value_options(args)
        if args.exact and (not cmd or args.pid or args.all_cpus):
            raise UsageError("--exact needs a command (and neither -p nor -a)")
        if args.pid and cmd:
            raise UsageError("give either -p PID or a command, not both")
        if not cmd and not args.pid and not args.all_cpus:
            raise UsageError("nothing to record: give a command after --, -p PID, or -a")
        if args.duration is not None and args.duration <= 0:
            raise UsageError("--duration must be positive")
        events, rate = make_events(args)
        rate = rate if rate is not None or args.period is not None else DEFAULT_RECORD_HZ
        until = None
        target: SystemWide | Processes | CommandTarget
        if args.all_cpus:
            target = SystemWide(online_cpus())
        elif args.pid:
            try:
                pids = tuple(int(x) for x in str(args.pid).split(",") if x.strip())
            except ValueError:
                raise UsageError(f"-p: not a process id list: {args.pid}") from None
            target = Processes(pids)
            until = processes_gone(pids)
        else:
            target = CommandTarget(tuple(cmd))
        if cmd:
            import shutil

            if shutil.which(cmd[0]) is None:
                raise CycleScopeError(f"{cmd[0]}: command not found")
        if args.exact:
            from cyclescope.cli.exact import run_exact

            if args.call_graph:
                raise UsageError("--exact does not record call stacks; leave out --call-graph")
            assert vopts is not None
            return int(run_exact(args, cmd, events, rate, vopts))
        processors = count_processors(args)
        session = Session(events, target, rate_hz=rate, band=args.band, force=args.force,
                          user_stack=vopts.stack if vopts is not None else None,
                          call_graph=args.call_graph, user_regs=any(p.needs_regs for p in processors))
        db = Database.create_or_open(db_path(args))
        cfg = CollectorConfig(host=hostname(), flush_interval_s=args.flush_interval, new_epoch=not args.append,
                              epoch_name=args.epoch_name, archive="none" if args.no_archive else "binaries",
                              rerandomize_s=args.redraw / 1000, values=vopts, stacks=args.call_graph,
                              drain_s=VALUE_DRAIN_S if vopts is not None and vopts.length > 0 else 1.0,
                              processors=processors)
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
        elapsed = time.monotonic() - start
        if not totals.samples:
            every = f"; at {rate:g} Hz a sample comes every {1 / rate:.3g} s per CPU" if rate else ""
            eprint(f"cyclescope record: no samples were taken in {elapsed:.1f} s{every} (raise -F, run longer, "
                   "or check that the command did any work)")
        if show:
            sys.stderr.write("\r\x1b[K")
        if not args.quiet:
            eprint(f"cyclescope record: {summary_line(totals, elapsed, collector.epoch, db_path(args))}")
            if collector.values is not None:
                eprint(f"cyclescope record: {value_summary(collector)}")
            if collector.dwarf is not None:
                eprint(f"cyclescope record: {unwind_summary(collector)}")
            if totals.lost_records or totals.lost_samples:
                eprint("cyclescope record: some samples were lost (the ring buffer filled); "
                       "lower the rate or add CPUs to the drain")
        status = session.exit_status
        if child_session is not None:
            status = child_session.status
        return _exit_code(status)


def unwind_summary(c: Collector) -> str:
    """One line on --call-graph dwarf: stacks unwound, mean depth, why walks stopped."""
    assert c.dwarf is not None
    st = c.dwarf.stats
    if not st.samples:
        return "unwound no user stacks"
    stops = ", ".join(f"{k} {100 * v / st.samples:.1f}%" for k, v in st.stops.most_common())
    line = f"unwound {st.samples:,} user stacks, {st.frames / st.samples:.1f} frames on average; stopped at: {stops}"
    if st.truncated_loading:
        line += f"; {st.truncated_loading:,} cut short while unwind tables loaded"
    if c.dwarf.loader.failed:
        line += f"; no unwind tables for {len(c.dwarf.loader.failed)} images"
    return line


def value_summary(c: Collector) -> str:
    v = c.values
    assert v is not None
    it = v.interp
    parts = [f"values in {len(c.value_files)} file(s) readable by their owners only"]
    if it is not None and it.runs:
        from cyclescope.values.interp import describe_stops

        parts.append(f"{fmt_count(it.runs)} interpreted runs, {it.steps / it.runs:.1f} steps each "
                     f"(stops: {describe_stops(it.stops)})")
    skipped = {k: n for k, n in v.skipped.items() if n}
    if skipped:
        parts.append("skipped: " + ", ".join(f"{k} {fmt_count(n)}" for k, n in skipped.items()))
    return "; ".join(parts)


def _exit_code(status: int | None) -> int:
    if status is None:
        return 0
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 0


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
