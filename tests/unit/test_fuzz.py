"""No traceback for any input: random options for every command, and damaged databases.

Each example runs the real command line in this process. A command may refuse the input (exit 1-4,
one line on stderr); it may not crash: an internal error (exit 70, cli/main.py) or an exception
escaping main() fails the test with the input that caused it. bench/reliability.py runs the same
generators for many more examples and reports how many were tried.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cyclescope.cli.main import INTERNAL_ERROR, main
from cyclescope.db.layout import Database
from cyclescope.db.segment import EventMeta, SegmentMeta, build_table, write_segment
from cyclescope.db.tallies import LOOPS, build, write_tally
from cyclescope.images.elf import read_load_info
from cyclescope.images.registry import ImageInfo

DATA = Path(__file__).parents[1] / "data"

# Report commands (the options each takes come from its own parser: options_of).
REPORTS = ["prof", "list", "calc", "stats", "diff", "export", "values", "invariants", "db"]
POSITIONAL: dict[str, list[str]] = {
    "list": ["work", "main", "0x1190-0x11c6", "nosuch", "0xzz", "inl.c"],
    "calc": ["work", "main", "0x1190-0x11c6", "0x11c6-0x1190", "nosuch", ""],
    "diff": ["1", "2", "-1", "0", "99", "1-2", "x:1", "db:1"],
    "export": ["collapsed", "speedscope", "pprof", "llvm-sample", "bolt-fdata", "nope"],
    "db": ["inspect", "compact"],
}
VALUES = ["0", "1", "-1", "2", "99", "1-2", "2-1", "1,2", "all", "latest", "-5", "nan", "inf", "-inf", "1e400",
          "0.5", "x", "", " ", "cpu-clock", "cycles", "work", "inl", "../etc/passwd", "é", "9" * 40,
          "epoch", "host", "db", "dcpi", "geomean", "znver3", "samples", "calc"]
RECORD_OPTS = ["-F", "-c", "--band", "--redraw", "-e", "-d", "-p", "-g", "--values", "--interpret",
               "--interpret-every", "--interpret-budget", "--value-stack", "--flush-interval", "--epoch-name"]
RECORD_VALUES = [*VALUES, "fp", "dwarf", "dwarf,8", "dwarf,-8", "dwarf,999999", "operands", "list", "1000",
                 "cycles,instructions", "cpu-clock:u", "cpu-clock/period=0/", "cpu-clock/period=x/", "nosuch"]


def options_of(cmd: str) -> list[tuple[str, list[str] | None]]:
    """The options of ``cmd`` from its parser: (option, its choices, or None for a flag; [] for a
    value of any kind)."""
    import argparse

    from cyclescope.cli.main import build_parser

    parser = build_parser(cmd)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out: list[tuple[str, list[str] | None]] = []
    for a in sub.choices[cmd]._actions:
        if not a.option_strings or "--help" in a.option_strings or "--db" in a.option_strings:
            continue
        if a.option_strings[-1].startswith("--engine"):
            continue  # a Dask cluster started per example (2 s) or an unreachable scheduler (20 s): test_fleet
        flag = a.nargs == 0
        out.append((a.option_strings[-1], None if flag else [str(c) for c in (a.choices or [])]))
    return out


_SCRATCH: list[str] = []


def run_cli(args: list[str]) -> tuple[int, str]:
    """``cyclescope ARGS`` in this process, in a scratch directory (a drawn `-o 0.5` writes there,
    not into the repository): exit code and standard error."""
    import atexit
    import tempfile

    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="cs-fuzz-cwd-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(_SCRATCH[0]), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:  # argparse: usage errors and --help
            code = e.code if isinstance(e.code, int) else 2
    return code, err.getvalue()


def check(args: list[str]) -> None:
    code, err = run_cli(args)
    assert code != INTERNAL_ERROR and "Traceback" not in err, f"cyclescope {args!r} crashed:\n{err}"


def make_db(root: Path) -> Database:
    """Two epochs of samples in tests/data/inl (a real binary, with DWARF), a loop tally."""
    db = Database.create_or_open(root)
    exe = DATA / "inl"
    bid = read_load_info(str(exe)).build_id
    assert bid
    for e in (1, 2):
        ep = db.new_epoch()
        offs = np.array([0x1190, 0x1198, 0x11A0, 0x11B0, 0x1060, 0x1070], np.uint64)
        cnt = np.array([50, 80, 300 * e, 40, 20, 5], np.uint64)
        n = len(offs)
        t = build_table(["[unknown]", bid], np.ones(n, np.int64), offs, ["cpu-clock"], np.zeros(n, np.int64),
                        ["[unknown]", "inl"], np.ones(n, np.int64), cnt, cnt * np.uint64(200_000))
        m = SegmentMeta("h", ep, start_time=1.7e9 + e, end_time=1.7e9 + e + 1, targets=["./inl"], clock_ghz=2.5)
        m.events["cpu-clock"] = EventMeta("cpu-clock", samples=int(cnt.sum()), period_sum=int(cnt.sum()) * 200_000,
                                          nominal_period=200_000)
        m.images = {bid: ImageInfo(bid, str(exe), "elf", bid).to_json()}
        write_segment(db, ep, "h", t, m)
        cols = {n_: [0] for n_ in LOOPS.schema.names}
        cols.update(image=[bid], header=[0x11A0], own=[400], own_period=[8e7], followed=[400], next_own=[399],
                    pairs=[399], iterations=[399 * 1000], pair_period=[399 * 2e5])
        write_tally(db, ep, "h", LOOPS, build(LOOPS, cols))
    return db


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_db(tmp_path_factory.mktemp("fuzz") / "db").root


def report_args(db: Path) -> st.SearchStrategy[list[str]]:
    opts = {c: options_of(c) for c in REPORTS}

    @st.composite
    def gen(draw: Callable[..., object]) -> list[str]:
        cmd = str(draw(st.sampled_from(REPORTS)))
        args = [cmd]
        pos = POSITIONAL.get(cmd)
        if pos:
            args.append(str(draw(st.sampled_from(pos))))
        for opt, choices in draw(st.lists(st.sampled_from(opts[cmd]), max_size=4)):  # type: ignore[attr-defined]
            args.append(opt)
            if choices is not None:  # a value: mostly a fitting one, sometimes anything
                pool = choices if choices and draw(st.integers(0, 3)) else VALUES
                args.append(str(draw(st.sampled_from(pool))))
        if draw(st.integers(0, 19)) == 0:
            args.append(str(draw(st.sampled_from(["--bogus", "-Z", "extra"]))))
        return [*args, "--db", str(db)]

    return gen()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_options_of_every_report(pristine: Path, data: st.DataObject) -> None:
    check(data.draw(report_args(pristine)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opts=st.lists(st.tuples(st.sampled_from(RECORD_OPTS), st.sampled_from(RECORD_VALUES)), max_size=4))
def test_random_options_of_record_and_daemon(opts: list[tuple[str, str]], tmp_path_factory: pytest.TempPathFactory
                                             ) -> None:
    flat = [x for o, v in opts for x in (o, v)]
    db = str(tmp_path_factory.mktemp("rec") / "db")
    # A command that does not exist: everything up to starting it is checked, nothing is sampled.
    check(["record", "--db", db, *flat, "--", "/nonexistent/cyclescope-fuzz"])
    check(["daemon", "--db", db, *[x for x in flat if x not in ("-p", "-d")], "--cpus", "999"])


DAMAGE = ("truncate", "garbage", "flip", "delete", "wrong-schema", "empty")


def damage(root: Path, which: int, how: str, at: float) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    f = files[which % len(files)]
    data = f.read_bytes()
    if how == "truncate":
        f.write_bytes(data[: int(len(data) * at)])
    elif how == "garbage":
        f.write_bytes(bytes((i * 131 + 7) % 256 for i in range(max(16, int(len(data) * at)))))
    elif how == "flip" and data:
        i = int(len(data) * at) % len(data)
        f.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "delete":
        f.unlink()
    elif how == "wrong-schema":
        if f.suffix == ".parquet":
            pq.write_table(pa.table({"x": [1, 2, 3]}), f)
        else:
            f.write_text('{"id": "two", "format": 7}')
    elif how == "empty":
        f.write_bytes(b"")
    return f"{how} {f.relative_to(root)}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(which=st.integers(0, 1000), how=st.sampled_from(DAMAGE), at=st.floats(0, 1), data=st.data())
def test_damaged_databases(pristine: Path, tmp_path_factory: pytest.TempPathFactory, which: int, how: str,
                           at: float, data: st.DataObject) -> None:
    root = tmp_path_factory.mktemp("dmg") / "db"
    shutil.copytree(pristine, root)
    what = damage(root, which, how, at)
    cmd = data.draw(st.sampled_from([["prof"], ["prof", "--images"], ["list", "work"], ["calc", "work"],
                                     ["stats", "--epoch", "all"], ["diff", "1", "2"], ["export", "collapsed"],
                                     ["export", "pprof"], ["db", "inspect"], ["db", "compact"], ["values"],
                                     ["calc", "--image", "inl"]]))
    out = root.parent / "out.bin"
    args = [*cmd, "--db", str(root)] + (["-o", str(out)] if cmd[0] == "export" else [])
    code, err = run_cli(args)
    assert code != INTERNAL_ERROR and "Traceback" not in err, f"{what}: cyclescope {args!r} crashed:\n{err}"
