"""Fixtures the system tests share."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def spinner(compile_c: Callable[..., Path]) -> Iterator[int]:
    """A C program spinning until killed (tests/programs/spinner.c); its pid."""
    proc = subprocess.Popen([str(compile_c("spinner"))], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    yield pid
    proc.kill()
    proc.wait()
