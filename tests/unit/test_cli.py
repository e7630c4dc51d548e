"""The command line: help, one-line errors, exit codes."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from cyclescope.cli.main import build_parser, main


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def test_every_command_has_help() -> None:
    p = build_parser()
    for name in ("demo", "record", "daemon", "flush", "epoch", "status", "prof", "db"):
        rc, out, _ = run(name, "--help")
        assert rc == 0 and out.startswith("usage: cyclescope " + name)
    assert "where have all the cycles gone" in p.format_help()


@pytest.mark.parametrize("args, message", [
    (["record", "--nosuch"], "cyclescope record: unrecognized arguments: --nosuch (see 'cyclescope record --help')"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["prof", "--limit", "x"], "invalid int value: 'x'"),
    (["record"], "cyclescope record: nothing to record: give a command after --, -p PID, or -a"),
    (["record", "-p", "1", "--", "true"], "cyclescope record: give either -p PID or a command, not both"),
    (["record", "-e", "bogus", "--", "true"], "cyclescope record: unknown event 'bogus'"),
    (["record", "-p", "x1"], "cyclescope record: -p: not a process id list: x1"),
    (["prof", "--lines"], "cyclescope prof: --lines goes with --stacks"),
    (["prof", "--stacks", "--images"], "cyclescope prof: --stacks and --images do not go together"),
    (["prof", "--sort", "self"], "cyclescope prof: --sort goes with --stacks"),
    (["optimize", "--build", "cc -o {out} p.c", "--cpu", "4096", "--", "{out}"],
     "cyclescope optimize: --cpu 4096: not a CPU this process may run on"),
])
def test_bad_usage_is_one_line_with_exit_code_2(args: list[str], message: str) -> None:
    rc, out, err = run(*args)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_missing_database_and_epoch(tmp_path: Path) -> None:
    rc, _, err = run("prof", "--db", str(tmp_path / "none"))
    expected = f"cyclescope prof: {tmp_path / 'none'}: no such database (record something first, or pass --db)"
    assert rc == 4 and err.strip() == expected
    (tmp_path / "junk").mkdir()
    rc, _, err = run("prof", "--db", str(tmp_path / "junk"))
    assert rc == 3 and "not a cyclescope database" in err
    rc, _, err = run("epoch", "--db", str(tmp_path / "new"))
    assert rc == 0
    rc, _, err = run("prof", "--db", str(tmp_path / "new"), "--epoch", "7")
    assert rc == 4 and err.strip() == "cyclescope prof: no epoch 7 (epochs: 1)"


def test_a_corrupt_database_marker_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "cyclescope.json").write_text("{nope")
    rc, _, err = run("db", "inspect", "--db", str(tmp_path / "db"))
    assert rc == 3 and len(err.strip().splitlines()) == 1 and "unreadable" in err


def test_the_command_table_matches_the_commands() -> None:
    import importlib

    from cyclescope.cli.base import REGISTRY
    from cyclescope.cli.main import COMMANDS

    for name, (module, _help) in COMMANDS.items():
        importlib.import_module(f"cyclescope.cli.{module}")
        assert REGISTRY[name].__module__ == f"cyclescope.cli.{module}", name
    assert set(REGISTRY) == set(COMMANDS)


def test_optimize_measures_on_the_cpu_asked_for() -> None:
    import os
    import sys

    from cyclescope.cli.optimize import run_cpu

    cpu = max(os.sched_getaffinity(0))
    _, out = run_cpu([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], None, cpu)
    assert out.decode().strip() == f"[{cpu}]"
    _, out = run_cpu([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], None)
    assert out.decode().strip() == str(sorted(os.sched_getaffinity(0)))


def test_the_host_samples_are_filed_under(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from cyclescope.cli.sampling import host_name_arg, host_of
    from cyclescope.errors import UsageError
    from cyclescope.images.procfs import hostname

    monkeypatch.delenv("CYCLESCOPE_HOST", raising=False)
    assert host_of(argparse.Namespace(host=None)) == hostname()
    monkeypatch.setenv("CYCLESCOPE_HOST", "web-7.dc1")
    assert host_of(argparse.Namespace(host=None)) == "web-7.dc1"
    assert host_of(argparse.Namespace(host="db_2")) == "db_2"  # the option wins
    monkeypatch.setenv("CYCLESCOPE_HOST", "../etc")
    with pytest.raises(UsageError, match="CYCLESCOPE_HOST"):
        host_of(argparse.Namespace(host=None))
    for bad in ("", "a b", "../x", "-x", "x" * 64, "a/b"):
        with pytest.raises(argparse.ArgumentTypeError):
            host_name_arg(bad)
    args = build_parser().parse_args(["record", "--host", "container-3", "--", "true"])
    assert args.host == "container-3"
    args = build_parser().parse_args(["daemon", "--host", "clone-1"])
    assert args.host == "clone-1"


def test_numpy_is_imported_with_one_blas_thread_even_when_an_option_imports_it() -> None:
    """--call-graph's type imports the recording session, and with it numpy: imported then, before
    main() asked numpy for one BLAS thread, OpenBLAS started one per CPU, and they spun through the
    recording (record -g fp cost 0.1-0.4 s of CPU more than flat sampling on 2 CPUs)."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: OpenBLAS starts no thread of its own to tell apart")
    code = ("import os, sys\n"
            "from cyclescope.cli.main import main\n"
            "try:\n"
            "    main(['record', '-g', 'fp', '--nosuch'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "assert 'numpy' in sys.modules, 'the option did not import numpy: the test tests nothing'\n"
            "print(len(os.listdir('/proc/self/task')))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                            "MKL_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"  # the main thread alone
