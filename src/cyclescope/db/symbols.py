"""Symbol tables and image bytes kept in the database for images with no file.

The kernel's symbols come from /proc/kallsyms at recording time, the vdso
exists only in memory, and JIT symbols live in /tmp/perf-PID.map which may be
gone by the time anyone looks: so they are stored beside the profiles.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from cyclescope import parquet, sha1_hex
from cyclescope.db.layout import Database, fsync_dir, fsync_file, write_atomic
from cyclescope.images.elf import SymbolTable


def _file_name(key: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:80]
    return f"{safe}-{sha1_hex(key.encode())[:10]}"


def symbols_path(db: Database, key: str) -> Path:
    return db.symbols_dir / (_file_name(key) + ".parquet")


def has_symbols(db: Database, key: str) -> bool:
    return symbols_path(db, key).exists()


def write_symbols(db: Database, key: str, table: SymbolTable) -> None:
    db.ensure(db.symbols_dir)
    t = pa.table({
        "start": parquet.from_numpy(table.starts, pa.uint64()),
        "end": parquet.from_numpy(table.ends, pa.uint64()),
        "name": pa.array(list(table.names), pa.string()),
    }).replace_schema_metadata({b"image": key.encode()})
    final = symbols_path(db, key)
    tmp = final.with_name(f".tmp-{os.getpid()}-{final.name}")
    parquet.write_table(t, tmp, compression="zstd")
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def store_kernel_symbols(db: Database, key: str, make: Callable[[], SymbolTable | None],
                         shared: Path | None) -> bool:
    """Kernel or module symbols into the database, from ``shared`` (a per-user copy for this boot
    and set of modules, see kernel.boot_stamp) when it holds a sound one, else made by ``make``
    (parsing /proc/kallsyms: about 0.5 s with the write) and copied there for the next database.
    Whether the database has them now."""
    final = symbols_path(db, key)
    if shared is not None:
        try:
            parquet.read_metadata(shared)  # a whole file (written atomically), not a stray one
            db.ensure(db.symbols_dir)
            write_atomic(final, shared.read_bytes())
            return True
        except (OSError, pa.ArrowException, ValueError):
            pass
    table = make()
    if table is None:
        return False
    write_symbols(db, key, table)
    if shared is not None:
        with contextlib.suppress(OSError):
            shared.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(shared, final.read_bytes())
    return True


def shared_kernel_symbols(root: Path, stamp: str | None, key: str) -> Path | None:
    """Where :func:`store_kernel_symbols` keeps its per-user copy (None: no boot id, no copy)."""
    return root / "kernel-symbols" / f"{stamp}-{_file_name(key)}.parquet" if stamp else None


def read_symbols(db: Database, key: str) -> SymbolTable | None:
    p = symbols_path(db, key)
    if not p.exists():
        return None
    try:
        t = parquet.read_table(p)
    except (OSError, pa.ArrowException, ValueError):
        return None
    return SymbolTable(
        t.column("start").to_numpy().astype(np.uint64),
        t.column("end").to_numpy().astype(np.uint64),
        tuple(t.column("name").to_pylist()),
    )


def binary_path(db: Database, key: str) -> Path:
    return db.binaries_dir / _file_name(key)


def write_binary(db: Database, key: str, data: bytes) -> None:
    p = binary_path(db, key)
    if p.exists():
        return
    db.ensure(db.binaries_dir)
    write_atomic(p, data)


ARCHIVE_MAX_BYTES = 512 << 20


def archive_binary(db: Database, key: str, path: str, build_id: str | None) -> bool:
    """Copy an ELF image into the database, so analysis works after it is deleted or upgraded.

    Only images named by build-id are archived (the build-id proves the copy is
    the profiled binary); files above 512 MiB are skipped. The file is opened once,
    without following a link, and its build-id checked and its bytes copied from that
    one descriptor: a root daemon archives the programs of every user, and a user who
    swapped a program for a link between a check and a copy would otherwise have
    root copy any file into the database. The copy is readable by all only where the
    original was.
    """
    import shutil
    import stat

    from cyclescope.images.elf import read_load_info

    if not build_id or key != build_id:
        return False
    dest = binary_path(db, key)
    if dest.exists():
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as src:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > ARCHIVE_MAX_BYTES:
                return False
            if read_load_info(path, src).build_id != build_id:
                return False
            src.seek(0)
            db.ensure(db.binaries_dir)
            mode = 0o644 if st.st_mode & 0o004 else 0o600
            tmp = dest.with_name(f".tmp-{os.getpid()}-{dest.name}")
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(out, "wb") as f:
                os.fchmod(out, mode)
                shutil.copyfileobj(src, f, 1 << 20)
                f.flush()
                os.fsync(out)
            os.replace(tmp, dest)
            return True
        except Exception:  # unreadable or not ELF after all: not archived
            with contextlib.suppress(OSError):
                os.unlink(dest.with_name(f".tmp-{os.getpid()}-{dest.name}"))
            return False


def archive_symbols(db: Database, key: str, path: str, build_id: str | None) -> bool:
    """Keep only the symbol table of a binary (when its build-id still matches)."""
    from cyclescope.errors import DataError
    from cyclescope.images.elf import read_load_info, read_symbols

    if not build_id or key != build_id or has_symbols(db, key):
        return bool(build_id) and has_symbols(db, key)
    try:
        # One descriptor for the check and the read (see archive_binary).
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            if read_load_info(path, f).build_id != build_id:
                return False
            f.seek(0)
            table = read_symbols(path, f)
        write_symbols(db, key, table)
        return True
    except (OSError, DataError):
        return False



def symbols_of_stored_binary(db: Database, key: str, name: str) -> bool:
    """The symbol table of a binary the database keeps under ``key`` (the vdso, copied from the
    collector's memory), written beside it."""
    from cyclescope.errors import DataError
    from cyclescope.images.elf import symbols_from_bytes

    if has_symbols(db, key):
        return True
    try:
        data = binary_path(db, key).read_bytes()
        write_symbols(db, key, symbols_from_bytes(data, name))
        return True
    except (OSError, DataError, ValueError):
        return False


USAGE = "usage: python -m cyclescope.db.symbols DB (KEY PATH BUILD_ID)... | DB --stored KEY NAME"


def main(argv: list[str]) -> int:
    """``python -m cyclescope.db.symbols DB (KEY PATH BUILD_ID)...``: archive_symbols for each
    triple; ``DB --stored KEY NAME``: symbols_of_stored_binary. A daemon runs it as a child:
    reading a large binary's symbol tables with pyelftools leaves tens of MiB behind in the
    process that does it (50 MiB in a 12 s fork-storm probe), and importing pyelftools at all
    costs 2.7 MiB (the vdso's)."""
    if len(argv) == 4 and argv[1] == "--stored":
        return 0 if symbols_of_stored_binary(Database.open(argv[0]), argv[2], argv[3]) else 1
    if len(argv) < 1 or (len(argv) - 1) % 3:
        print(USAGE, file=sys.stderr)
        return 2
    db = Database.open(argv[0])
    for i in range(1, len(argv), 3):
        key, path, build_id = argv[i : i + 3]
        archive_symbols(db, key, path, build_id or None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
