"""Whether a command or a process is a CPython interpreter, without importing collect/pyframes.py
(40 ms): `record` asks it of every command it runs, to choose its collection path and its hints."""

from __future__ import annotations

import os
import re
import shutil

PY_COMMAND = re.compile(r"^python3?(?:\.\d+)?$")  # an interpreter by its file name (a pyenv shim is a script)
# An interpreter image by its path: libpython3.X or python3.X (its version: group 1; collect/pyframes.py)
PY_IMAGE = re.compile(r"(?:^|/)(?:libpython|python)3\.(\d+)[^/]*$")


def runs_cpython(argv0: str, depth: int = 0) -> bool:
    """Whether a command is a CPython interpreter: an executable named python, python3 or python3.X
    (a virtualenv's python, symlinks followed; pyenv's shims, which are scripts, by their name), or
    a script whose #! line names one (through /usr/bin/env too: console scripts, `./app.py`)."""
    path = shutil.which(argv0)
    if path is None:
        return False
    real = os.path.realpath(path)
    if PY_COMMAND.match(os.path.basename(path)) or PY_COMMAND.match(os.path.basename(real)):
        return True
    if depth >= 2:
        return False
    try:
        with open(real, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    if not head.startswith(b"#!"):
        return False
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]  # `env -S python3 -u`
    return bool(words) and runs_cpython(words[0], depth + 1)


def is_cpython_process(pid: int) -> bool:
    """Whether a running process is a CPython interpreter: its executable (python3.X) or a
    libpython3.X it maps."""
    try:
        if PY_COMMAND.match(os.path.basename(os.readlink(f"/proc/{pid}/exe"))):
            return True
        with open(f"/proc/{pid}/maps") as f:
            return any(PY_IMAGE.search(line.rstrip("\n")) for line in f)
    except OSError:
        return False
