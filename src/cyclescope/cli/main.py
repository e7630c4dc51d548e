"""The `cyclescope` command: subcommands from the registry; errors as one line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from cyclescope import __version__
from cyclescope.cli import base
from cyclescope.errors import CycleScopeError

# Importing the modules registers their commands.
from cyclescope.cli import calc as _calc  # noqa: F401  isort: skip
from cyclescope.cli import compare as _compare  # noqa: F401  isort: skip
from cyclescope.cli import daemon as _daemon  # noqa: F401  isort: skip
from cyclescope.cli import db as _db  # noqa: F401  isort: skip
from cyclescope.cli import demo as _demo  # noqa: F401  isort: skip
from cyclescope.cli import listing as _listing  # noqa: F401  isort: skip
from cyclescope.cli import prof as _prof  # noqa: F401  isort: skip
from cyclescope.cli import record as _record  # noqa: F401  isort: skip

ORDER = ["demo", "record", "daemon", "flush", "epoch", "status", "prof", "list", "calc", "stats", "diff", "db"]


class Parser(argparse.ArgumentParser):
    """Usage errors as one line that says where to look, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="cyclescope",
        description="Continuous, system-wide sampling profiler: where have all the cycles gone?",
        epilog="Run 'cyclescope COMMAND --help' for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"cyclescope {__version__}")
    sub = p.add_subparsers(dest="_command", metavar="COMMAND", parser_class=Parser)
    names = [n for n in ORDER if n in base.REGISTRY] + sorted(set(base.REGISTRY) - set(ORDER))
    for name in names:
        cls = base.REGISTRY[name]
        sp = sub.add_parser(name, help=cls.help, description=cls.description or cls.help, epilog=cls.epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd = cls()
        cmd.add_arguments(sp)
        sp.set_defaults(_cmd=cmd, _parser=sp)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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


def entry() -> None:
    sys.exit(main())
