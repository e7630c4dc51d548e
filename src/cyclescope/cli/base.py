"""What every subcommand shares: the registry, database and selection options."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, ClassVar

from cyclescope.errors import DataError, UsageError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Engine, ProfileSet, Selection
    from cyclescope.fleet.engine import DaskEngine

DEFAULT_DB = "cyclescope.db"


class Command:
    """A subcommand: a name, its options, and run() returning an exit code. Its one-line help is
    cli/main.py's COMMANDS (listed without importing the command's module)."""

    name: ClassVar[str]
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
    add_engine_options(g)  # type: ignore[arg-type]


def add_engine_options(g: argparse.ArgumentParser) -> None:
    g.add_argument("--engine", choices=["duckdb", "dask"], default="duckdb",
                   help="where the counts and stacks are summed: the embedded DuckDB (default) or Dask (a local "
                        "cluster of worker processes, or the one at --engine-address): for a fleet's database")
    g.add_argument("--engine-address", metavar="ADDR",
                   help="--engine dask: the scheduler of a running cluster (tcp://HOST:8786), whose workers see "
                        "the database at the same path")


def selection(args: argparse.Namespace) -> Selection:
    from cyclescope.db.query import Selection

    return Selection(
        epochs=args.epoch, hosts=tuple(args.host), processes=tuple(args.process), images=tuple(args.image),
        events=tuple(getattr(args, "event", []) or ()),
    )


def open_selection(args: argparse.Namespace, db: Database | None = None, sel: Selection | None = None,
                   what: str | None = None) -> ProfileSet:
    """The selection's profile, its warnings said on stderr (one line each: corrupt segments left
    out, epochs a range named that do not exist); DataError when every segment it covers is
    unreadable. ``what`` names the set in the warnings (stats and diff open several)."""
    from cyclescope.db.query import open_profile

    db = db or open_db(args)
    profile_set = open_profile(db, sel or selection(args), engine(args))
    name = getattr(args, "_command", None) or "cyclescope"
    for w in profile_set.warnings:
        eprint(f"cyclescope {name}: {what + ': ' if what else ''}{w}")
    if not profile_set.segments and any(w.startswith("skipping") for w in profile_set.warnings):
        raise DataError(f"{what + ': ' if what else ''}no readable segment in the selection "
                        f"({sum(w.startswith('skipping') for w in profile_set.warnings)} unreadable)")
    return profile_set


_ENGINES: dict[tuple[str, str | None], DaskEngine] = {}


def engine(args: argparse.Namespace) -> Engine | None:
    """The engine --engine names (None: the embedded DuckDB); one per process, closed at exit."""
    name = getattr(args, "engine", "duckdb")
    if name == "duckdb":
        if getattr(args, "engine_address", None):
            raise UsageError("--engine-address goes with --engine dask")
        return None
    key = (name, getattr(args, "engine_address", None))
    if key not in _ENGINES:
        from cyclescope.fleet.engine import DaskEngine

        _ENGINES[key] = DaskEngine(key[1])
    return _ENGINES[key]


def close_engines() -> None:
    while _ENGINES:
        _, eng = _ENGINES.popitem()
        eng.close()


def open_profile(args: argparse.Namespace, db: Database | None = None, sel: Selection | None = None,
                 what: str | None = None) -> Profile:
    """The selection opened for analysis (app.profile.Profile), its warnings said on stderr as
    open_selection's, and those of later loads too (loop counts, values)."""
    from cyclescope.app.profile import Profile
    from cyclescope.binaries.symbolize import Symbolizer

    db = db or open_db(args)
    profile_set = open_selection(args, db, sel, what)
    name = getattr(args, "_command", None) or "cyclescope"
    return Profile(profile_set, Symbolizer(db),
                   lambda w: eprint(f"cyclescope {name}: {what + ': ' if what else ''}{w}"))


def add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="write JSON instead of a table")


def finite_float(text: str) -> float:
    """argparse type: a float that is a number (not nan, not inf)."""
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return v


def eprint(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def stderr_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def read_token(path: str | None, option: str, env: str = "CYCLESCOPE_INGEST_TOKEN") -> str | None:
    """A token from the first line of ``path`` (given as ``option``), else from $``env``, else None."""
    if path:
        try:
            with open(path) as f:
                token = f.readline().strip()
        except OSError as e:
            raise UsageError(f"{option} {path}: {e.strerror}") from None
        if len(token) < 16:
            raise UsageError(f"{option} {path}: the token must be at least 16 characters")
        return token
    return os.environ.get(env) or None
