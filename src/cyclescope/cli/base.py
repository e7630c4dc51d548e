"""What every subcommand shares: the registry, database and selection options."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection

DEFAULT_DB = "cyclescope.db"


class Command:
    """A subcommand: a name, help, its options, and run() returning an exit code."""

    name: ClassVar[str]
    help: ClassVar[str]
    description: ClassVar[str] = ""
    epilog: ClassVar[str] = ""

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError


REGISTRY: dict[str, type[Command]] = {}


def register(cls: type[Command]) -> type[Command]:
    REGISTRY[cls.name] = cls
    return cls


def default_db() -> str:
    return os.environ.get("CYCLESCOPE_DB", DEFAULT_DB)


def add_db_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db", metavar="PATH", default=None,
        help=f"profile database directory (default: $CYCLESCOPE_DB or ./{DEFAULT_DB})",
    )


def db_path(args: argparse.Namespace) -> str:
    return str(args.db or default_db())


def open_db(args: argparse.Namespace) -> Database:
    from cyclescope.db.layout import Database

    return Database.open(db_path(args))


def add_selection_options(p: argparse.ArgumentParser, events: bool = True) -> None:
    g = p.add_argument_group("selecting samples")
    add_db_option(g)  # type: ignore[arg-type]
    g.add_argument("--epoch", "-E", metavar="SPEC", default="latest",
                   help="epochs to include: N, A-B, A,B, -1 (latest), -2, latest (default) or all")
    g.add_argument("--host", metavar="HOST", action="append", default=[], help="only samples from HOST (repeatable)")
    g.add_argument("--process", "--comm", metavar="NAME", action="append", default=[], dest="process",
                   help="only samples of processes named NAME (repeatable)")
    g.add_argument("--image", metavar="IMAGE", action="append", default=[],
                   help="only samples in IMAGE: a path, file name or build-id (repeatable)")
    if events:
        g.add_argument("--event", "-e", metavar="EVENT", action="append", default=[],
                       help="only these events (repeatable; default: all recorded)")


def selection(args: argparse.Namespace) -> Selection:
    from cyclescope.db.query import Selection

    return Selection(
        epochs=args.epoch, hosts=tuple(args.host), processes=tuple(args.process), images=tuple(args.image),
        events=tuple(getattr(args, "event", []) or ()),
    )


def add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="write JSON instead of a table")


def eprint(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def stderr_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
