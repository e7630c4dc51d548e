"""What `record`, `daemon` and exact mode share: the sampling, value and count options, the
processors they ask for, the run's progress and summary lines, and the exit status."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from cyclescope.cli.base import eprint, finite_float
from cyclescope.collect.events import DEFAULT_BAND, KNOWN_EVENTS, SAFE_MAX_RATE_HZ, EventSpec, parse_events
from cyclescope.errors import UsageError
from cyclescope.perf.abi import STACK_BYTES
from cyclescope.report.render import fmt_count

if TYPE_CHECKING:
    from cyclescope.collect.daemon import Collector, RunTotals
    from cyclescope.collect.ebpf import BpfAggregator
    from cyclescope.collect.processor import Processor
    from cyclescope.collect.session import CallGraph, Command, Processes, Session, SystemWide
    from cyclescope.db.layout import Database
    from cyclescope.values.capture import ValueOptions

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
    g.add_argument("--host", type=host_name_arg, default=None, metavar="NAME",
                   help="file the samples under host NAME (default: $CYCLESCOPE_HOST, else this machine's host "
                        "name): for containers, cloned machines and fleets, where the host name does not say "
                        "which machine it is")
    g.add_argument("-g", "--call-graph", type=call_graph_arg, default=None, metavar="fp|dwarf[,SIZE]",
                   help="record call stacks, counted in the database for `export`: 'fp' has the kernel walk "
                        "frame pointers (code built with -fno-omit-frame-pointer); 'dwarf' walks them with the "
                        "binaries' .eh_frame (any code with unwind tables: most distribution binaries), in the "
                        "kernel on the eBPF path, else by copying SIZE bytes of user stack per sample "
                        "(default: 8192) and unwinding the copies here")
    g.add_argument("--collector", choices=("auto", "bpf", "perf"), default="auto",
                   help="how samples reach the database: 'bpf' counts them in the kernel with an eBPF program "
                        "(user space reads one row per distinct process, address and stack: the cheapest); "
                        "'perf' reads every sample from perf's ring buffers (needed by loop counts, "
                        "anchors and values); 'auto' (default) takes bpf where the options and the kernel allow it")


HOST_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def host_name_arg(text: str) -> str:
    """A host name as the database files it (a directory name: letters, digits, '.', '_', '-')."""
    if not HOST_NAME_RE.match(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a host name: letters, digits, '.', '_' and '-', "
                                         "at most 63, starting with a letter or digit")
    return text


def host_of(args: argparse.Namespace) -> str:
    """The host the samples are filed under: --host, else $CYCLESCOPE_HOST, else this machine's name."""
    from cyclescope.images.procfs import hostname

    if getattr(args, "host", None):
        return str(args.host)
    env = os.environ.get("CYCLESCOPE_HOST")
    if env:
        try:
            return host_name_arg(env)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"$CYCLESCOPE_HOST: {e}") from None
    return hostname()


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
    g.add_argument("--value-stack", type=int, default=None, metavar="BYTES",
                   help="bytes of user stack copied at each interrupt (default: 512; 0 with --goal alone, "
                        "whose candidates are registers)")
    g.add_argument("--goal", metavar="PLAN",
                   help="goal-directed value profiling: capture only the candidates of PLAN (written by "
                        "`cyclescope specialize --plan PLAN`), wherever a sample finds their value live, and "
                        "switch off those whose top value can no longer pay (implies --values goal "
                        "--interpret 0 unless --values is given)")
    g.add_argument("--goal-budget", type=finite_float, default=0.01, metavar="SHARE",
                   help="with --goal: most of one CPU the programs may lose to probes that capture the "
                        "plan's cheapest candidates at every execution (uprobes with registers; default: "
                        "0.01); the others are captured at samples; 0: samples only")
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
    """The ValueOptions the value flags ask for (None without --values or --goal)."""
    goal = getattr(args, "goal", None)
    if goal is not None:
        from cyclescope.values.goal import read_plan

        read_plan(goal)  # a missing or malformed plan fails here, in one line
        if args.values is None:
            args.values = "goal"
            args.interpret = 0
            if args.value_stack is None:
                args.value_stack = 0
    if args.values is None:
        for flag in ("values_users", "values_commands"):
            if getattr(args, flag, None):
                raise UsageError(f"--{flag.replace('_', '-')} needs --values")
        if getattr(args, "exact", False):
            raise UsageError("--exact needs --values")
        return None
    if args.value_stack is None:
        args.value_stack = 512
    goal_budget = getattr(args, "goal_budget", 0.0)
    if not 0 <= goal_budget <= 1:
        raise UsageError("--goal-budget must be a share of one CPU between 0 and 1")
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
                        users=users, commands=commands, budget=args.interpret_budget, goal=goal,
                        goal_budget=goal_budget if goal is not None else 0.0)


def add_count_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution counts (what calc rests on; loop counts on by default, anchors and trip "
                             "windows per task only unless asked)")
    loops = g.add_mutually_exclusive_group()
    loops.add_argument("--no-loop-counts", action="store_true",
                       help="do not count loop iterations between samples (per task the user registers are then "
                            "not sampled, and samples can be counted in the kernel: --collector; calc falls back "
                            "to its model where loops had counts)")
    loops.add_argument("--loop-counts", action="store_true",
                       help="count loop iterations (the default; system-wide the eBPF program sends the samples "
                            "of procedures whose loops have a counter register, with their registers, and counts "
                            "the rest in the kernel)")
    g.add_argument("--no-anchors", action="store_true",
                   help="do not count hot procedures' entries exactly with uprobes (calc then scales "
                        "straight-line code by its model)")
    g.add_argument("--anchors", action="store_true",
                   help="count hot procedures' entries with uprobes also when sampling system-wide (-a, "
                        "daemon), where they are off by default: there they count almost nothing (see "
                        "the README's limitations); implies --loop-counts")
    g.add_argument("--no-trip-windows", action="store_true",
                   help="do not count anchored procedures' loop headers and hot blocks beside their entries "
                        "(calc's exact ratios between their counts; they take --anchor-budget again)")
    g.add_argument("--anchor-budget", type=finite_float, default=None, metavar="SHARE",
                   help="most of one CPU the profiled programs may lose to the anchors' traps (default: "
                        "0.01); anchors whose entries run often are counted in random windows to stay "
                        "within it")
    g.add_argument("--loop-stack", type=int, default=STACK_BYTES, metavar="BYTES",
                   help=f"bytes of the user stack above rsp each sample carries for the loop counts (default: "
                        f"{STACK_BYTES}, at most that; 0: the registers alone): the words where procedures spill "
                        "the positions calc counts entries from; read, never stored")


def processors(args: argparse.Namespace, value_opts: ValueOptions | None, system_wide: bool = False) -> list[Processor]:
    """What the collector computes from each drain besides the flat counts (collect/processor.py),
    as the options ask: the timeline (always), loop counts and anchors (calc's evidence; loop
    counts on unless --no-loop-counts; anchors per task unless --no-anchors, when ``system_wide``
    only with --anchors: anchors need the loop counter's procedure bounds), call stacks
    (--call-graph), values (--values).

    System-wide, loop counts count the loops whose executions outlast a sampling period on one CPU
    (a pair of samples must fall in one execution within 1.25 periods: at the daemon's 1 kHz,
    loops that run over a millisecond at a time), and on the eBPF path the program sends only the
    samples in procedures whose loops have a counter register (collect/loopwatch.py): the rest
    are counted in the kernel as without them.

    Anchors are off system-wide because there they count almost nothing at a cost: with gcc
    compiling in a loop under `record -a -F 5000`, 0-2 entries counted in 30 s for 1-2% of the
    compiles (hot libc and cc1 entries, run 50,000-500,000 times a second by processes that live a
    fraction of a second, reach the budget's cap at once). An earlier session also saw cc1 and the
    recorder die with SIGSEGV under system-wide anchors; ten runs since crashed nothing."""
    from cyclescope.collect.timeline import TimelineProcessor

    out: list[Processor] = [TimelineProcessor()]  # samples over time, per thread (cheap: always)
    anchors = getattr(args, "anchors", False)
    loops_on = not getattr(args, "no_loop_counts", False) or anchors
    if loops_on:
        from cyclescope.analysis.loopcount import LoopCountProcessor

        loops = LoopCountProcessor()
        out.append(loops)
        if not getattr(args, "no_anchors", False) and (anchors or not system_wide):
            from cyclescope.analysis.anchors import DEFAULT_BUDGET, AnchorProcessor

            budget = getattr(args, "anchor_budget", None)
            if budget is not None and not 0 < budget <= 1:
                raise UsageError("--anchor-budget must be a share of one CPU above 0 and at most 1")
            anchors_proc = AnchorProcessor(loops, DEFAULT_BUDGET if budget is None else budget)
            out.append(anchors_proc)
            if not getattr(args, "no_trip_windows", False):
                from cyclescope.analysis.trips import TripWindows

                out.append(TripWindows(anchors_proc, loops, anchors_proc.budget))
    if getattr(args, "call_graph", None) is not None:
        from cyclescope.collect.stacks import StackProcessor

        out.append(StackProcessor(args.call_graph))
    if value_opts is not None:
        from cyclescope.values.processor import ValueProcessor

        out.append(ValueProcessor(value_opts))
    return out


def bpf_without(needs: list[str], args: argparse.Namespace) -> str:
    """The options that leave out the processors ``needs`` names, for --collector bpf's error:
    anchors and trip windows run only with loop counts, so --no-loop-counts takes all three (and
    --anchors, which turns loop counts on system-wide, must go too)."""
    hints = []
    if {"loops", "anchors", "trips"} & set(needs):
        hints.append("add --no-loop-counts" + (" and drop --anchors" if getattr(args, "anchors", False) else ""))
    if "values" in needs:
        hints.append("drop --values (or --goal)")
    return " and ".join(hints) if hints else "leave them out"


PYTHON_FRAMES_NOTE = ("{what} runs CPython: its Python frames are read by the eBPF path, which counts samples "
                      "without their registers, so loop counts, anchors and trip windows are off (--collector perf "
                      "keeps them; Python frames then come only from perf maps: python3 -X perf)")


PYTHON_FLAT_HINT = ("{what} runs CPython: a flat profile names the interpreter's C functions; its Python functions "
                    "are named in call stacks (record -g fp, then prof --stacks)")


def python_flat_hint(args: argparse.Namespace, cmd: list[str]) -> str | None:
    """The line for a recording of a CPython command without call stacks, whose profile shows
    only the interpreter's C code (None: not such a recording)."""
    if getattr(args, "call_graph", None) is not None or not cmd or getattr(args, "quiet", False):
        return None
    from cyclescope.collect.pycommand import runs_cpython

    return PYTHON_FLAT_HINT.format(what=cmd[0]) if runs_cpython(cmd[0]) else None


def python_frames_args(args: argparse.Namespace, cmd: list[str], pids: tuple[int, ...]) -> argparse.Namespace | None:
    """The options with loop counts off where call stacks of a CPython program are asked per task
    with --collector auto and nothing that needs each sample's registers was asked for explicitly
    (--loop-counts, --anchors, --anchor-budget, values): its Python frames are read from the
    interpreter's memory by the eBPF program only, and the loop counter (on by default per task)
    needs the rings. Left as they were, `record -g fp -- python3 app.py` named no Python function
    (71% of a CPython 3.11 program's samples under unknown frames, the rest in libpython). None
    where the options stay as they are."""
    if (getattr(args, "collector", "auto") != "auto" or getattr(args, "call_graph", None) is None
            or getattr(args, "all_cpus", False) or getattr(args, "no_loop_counts", False)
            or getattr(args, "loop_counts", False) or getattr(args, "anchors", False)
            or getattr(args, "anchor_budget", None) is not None or getattr(args, "values", None)
            or getattr(args, "goal", None)):
        return None
    from cyclescope.collect.pycommand import is_cpython_process, runs_cpython

    if not (runs_cpython(cmd[0]) if cmd else any(is_cpython_process(p) for p in pids)):
        return None
    return argparse.Namespace(**{**vars(args), "no_loop_counts": True})


def bpf_collector(args: argparse.Namespace, procs: list[Processor], rate_hz: float | None, ncpus: int,
                  who: str, system_wide: bool = False) -> BpfAggregator | None:
    """The eBPF program loaded for this run, or None for the perf ring path, as --collector asks:
    'auto' takes bpf when every processor asked for can work on counted rows (call stacks, walked
    by the program with frame pointers or, with -g dwarf, with unwind rows from .eh_frame:
    collect/bpfunwind.py; loop counts when ``system_wide``, from the samples the program sends
    them: collect/loopwatch.py; not per task, nor anchors or values, which need each sample's
    registers) and the kernel loads the program; otherwise perf, with a line on stderr when the
    kernel is why. 'bpf' fails in one line where 'auto' would fall back."""
    choice = getattr(args, "collector", "auto")
    if choice == "perf":
        return None
    # By name: importing the stacks' processor to test for it cost every recording 7 ms.
    needs = [p.name for p in procs if p.name not in ("stacks", "timeline")
             and not (system_wide and p.name == "loops")]
    if needs:
        if choice == "bpf":
            what = {"loops": "loop counts", "trips": "trip windows", "values": "value capture"}
            need = "needs" if len(needs) == 1 else "need"
            raise UsageError(f"--collector bpf counts samples in the kernel, without the registers that "
                             f"{', '.join(what.get(n, n) for n in needs)} {need}: {bpf_without(needs, args)}, "
                             "or use --collector perf")
        return None
    from cyclescope.collect.ebpf import BpfUnavailable, load

    # A generation holds a drain's distinct keys (the loop drains every second): room for every
    # sample of two seconds, within bounds.
    per_s = (rate_hz or 1000.0) * ncpus
    entries = int(min(max(2 * per_s, 1 << 16), 1 << 20))
    graph = getattr(args, "call_graph", None)
    stacks = int(min(max(2 * per_s, 1 << 14), 1 << 16)) if graph else 0
    dwarf = graph is not None and graph.mode == "dwarf"
    try:
        if not dwarf:
            return load(entries, stacks)
        from cyclescope.collect.bpfunwind import DEFAULT_PROCS, DEFAULT_ROWS

        bpf = load(entries, stacks, DEFAULT_ROWS, DEFAULT_PROCS)
        from cyclescope.collect.stacks import StackProcessor

        for p in procs:
            if isinstance(p, StackProcessor):
                p.in_kernel = True  # the program walks the stacks: no snapshots to unwind here
        return bpf
    except BpfUnavailable as e:
        if choice == "bpf":
            raise
        eprint(f"cyclescope {who}: reading every sample from perf's rings: {e}")
        return None


def open_session(args: argparse.Namespace, events: list[EventSpec], target: SystemWide | Processes | Command,
                 rate: float | None, value_opts: ValueOptions | None, procs: list[Processor],
                 bpf: BpfAggregator | None) -> tuple[Session, Database]:
    """The session the options ask for (its stacks left to the eBPF program when ``bpf`` counts
    the samples) and the database; ``bpf`` is closed if either fails."""
    from cyclescope.cli.base import db_path
    from cyclescope.collect.session import Session
    from cyclescope.db.layout import Database

    try:
        session = Session(events, target, rate_hz=rate, band=args.band, force=args.force,
                          user_stack=value_opts.stack if value_opts is not None else None,
                          call_graph=None if bpf is not None else args.call_graph,
                          user_regs=bpf is None and any(p.needs_regs for p in procs),
                          loop_stack=getattr(args, "loop_stack", STACK_BYTES))
        return session, Database.create_or_open(db_path(args))
    except BaseException:
        if bpf is not None:
            bpf.close()
        raise


def drain_interval(value_opts: ValueOptions | None) -> float:
    """Seconds between drains on the timer: short with interpretation (VALUE_DRAIN_S), else 1. On
    the eBPF path with stacks, a process that maps a CPython interpreter brings the next drain
    forward (Collector._peek_side): it is described to the program (collect/pyframes.py) before
    most of its samples go by without Python frames; a quarter-second timer did that at four
    times the drains, each several ms with stacks."""
    if value_opts is not None and value_opts.length > 0:
        return VALUE_DRAIN_S
    return 1.0


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


def exit_code(status: int | None) -> int:
    if status is None:
        return 0
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 0


