"""What the CLI tests share: running a command in-process, and golden files (the `utc` fixture is in
tests/conftest.py)."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stdout
from pathlib import Path

from cyclescope.cli.main import main

DATA = Path(__file__).parents[1] / "data"


def run(*args: str) -> str:
    """Standard output of ``cyclescope ARGS`` run in this process (which must succeed)."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(list(args)) == 0
    return buf.getvalue()


def golden(name: str, got: str) -> None:
    """``got`` must equal tests/data/NAME; CYCLESCOPE_REGOLD=1 rewrites the file instead."""
    p = DATA / name
    if os.environ.get("CYCLESCOPE_REGOLD"):
        p.write_text(got)
    assert got == p.read_text()
