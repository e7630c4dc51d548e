"""The `cyclescope` command: subcommands from the registry; errors as one line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from cyclescope import __version__, import_numpy_single_threaded
from cyclescope.cli import base
from cyclescope.errors import CycleScopeError

# Subcommands: name -> (module, one-line help). Only the module of the command
# being run is imported: each pulls in numpy, pyarrow or DuckDB as it needs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "build and profile the bundled demo workload, then show where its cycles went"),
    "record": ("record", "sample a command, running processes, or the whole system into the database"),
    "daemon": ("daemon", "profile the whole system continuously into the database"),
    "flush": ("daemon", "make the running daemon merge its samples into the database now"),
    "epoch": ("daemon", "start a new epoch (the daemon flushes into the old one first)"),
    "status": ("daemon", "show what the running daemon is doing"),
    "prof": ("prof", "samples per procedure (or per image): where have all the cycles gone?"),
    "list": ("listing", "a procedure's instructions with samples and source lines (or a source file's lines)"),
    "calc": ("calc", "instruction frequency, CPI and stall culprits of a procedure, from samples alone (dcpicalc)"),
    "timeline": ("timeline", "samples over time per process or thread: CPUs busy, step by step"),
    "stats": ("compare", "statistics per procedure across sample sets (epochs, hosts or databases): DCPI's dcpistats"),
    "diff": ("compare", "procedures (or instructions) whose share of samples changed significantly between two sets"),
    "values": ("values", "hotlists of the values instructions saw, per instruction (value sampling)"),
    "invariants": ("values", "hot instructions whose values are (nearly) always the same: specialization candidates"),
    "specialize": ("specialize", "where knowing a value pays for testing it: goal-directed value profiling"),
    "export": ("export", "call stacks or the flat profile as collapsed, speedscope, pprof; llvm-sample for clang"),
    "optimize": ("optimize", "profile a training run, rebuild with its sample profile (clang), measure the speedup"),
    "db": ("db", "inspect or compact the profile database"),
    "serve": ("serve", "a web UI over the database: flame graphs, listings with CPI and culprits, values, stats"),
    "ship": ("ship", "send this host's profiles to a shared database (a path, or `serve --ingest`)"),
}
# Commands that only talk to the daemon: they need no numpy.
CONTROL_COMMANDS = frozenset({"flush", "epoch", "status"})

INTERNAL_ERROR = 70  # EX_SOFTWARE: the fuzz tests fail on it


class Parser(argparse.ArgumentParser):
    """Usage errors as one line that says where to look, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's options are built (and its module imported)."""
    import importlib

    p = Parser(
        prog="cyclescope",
        description="Continuous, system-wide sampling profiler: where have all the cycles gone?",
        epilog="Run 'cyclescope COMMAND --help' for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"cyclescope {__version__}")
    sub = p.add_subparsers(dest="_command", metavar="COMMAND", parser_class=Parser)
    for name, (module, help_) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_)
            continue
        importlib.import_module(f"cyclescope.cli.{module}")
        cls = base.REGISTRY[name]
        sp = sub.add_parser(name, help=help_, description=cls.description or help_, epilog=cls.epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd = cls()
        cmd.add_arguments(sp)
        sp.set_defaults(_cmd=cmd, _parser=sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    if wanted in COMMANDS and wanted not in CONTROL_COMMANDS:
        # Before the arguments are parsed: some options' types import numpy (--call-graph's imports
        # the recording session), and numpy imported then started a BLAS thread per CPU that spun
        # through the recording (0.1-0.4 s of CPU in `record -g`, bench/overhead.py). A command
        # runs only when its own parser was built (build_parser(wanted)), so this covers them all.
        import_numpy_single_threaded()
    parser = build_parser(wanted if wanted in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    cmd = getattr(args, "_cmd", None)
    if cmd is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help(sys.stderr)
        return 2
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    name = args._command
    try:
        return int(cmd.run(args))
    except CycleScopeError as e:
        print(f"cyclescope {name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"cyclescope {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error; keep Python quiet on exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as e:  # a file the command could not read or write: say which and why
        where = f"{e.filename}: " if e.filename else ""
        print(f"cyclescope {name}: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:
        # A bug, not the input's fault: one line, and the traceback on request.
        if os.environ.get("CYCLESCOPE_DEBUG"):
            raise
        print(f"cyclescope {name}: internal error: {type(e).__name__}: {e} (CYCLESCOPE_DEBUG=1 shows where; "
              "please report it)", file=sys.stderr)
        return INTERNAL_ERROR
    finally:
        base.close_engines()  # a local Dask cluster's workers end with the command


def entry() -> None:
    sys.exit(main())
