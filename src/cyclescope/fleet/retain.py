"""Retention: old epochs merged into coarser ones (a day, a week), and a size budget.

Merging adds: the flat counts, stacks and tallies of the epochs of one day (or week) are summed
per host into one epoch, and their value hotlists merged per owner by thinning, exactly as a
host's compaction merges its flushes (the same functions do it). The merged epoch keeps the
number and creation time of the group's first epoch; its ``merged.json`` lists the epochs it
replaces, and readers hide those while they still exist (``Database.epochs``), so a reader sees
either the old epochs or the merged one, never both, whatever moment it looks or a crash stops
the work:

1. The merged epoch is built apart, in a temporary database under the root: every live file of
   the group is hard-linked there under a new flush number (nothing is copied; the originals are
   untouched), then compacted there.
2. It trades places with the group's first epoch in one atomic ``renameat2(RENAME_EXCHANGE)``:
   from then on it hides the others.
3. The replaced epochs are deleted. A crash before 2 leaves a temporary directory, deleted by the
   next run; after 2, epochs already hidden, deleted by the next run.

A shipped source (fleet/place.py) merged this way keeps its marker, with the flush ranges merged:
a file of it that arrives later is dropped if merged already and refused if it overlaps, since
it could not be added without counting some flushes twice.

The budget: while the database is larger than its budget, the oldest epoch goes (never the one
daemons write).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cyclescope.db.layout import MERGED, Database, files_named, fsync_dir, live_segments, write_atomic
from cyclescope.errors import DataError, UsageError
from cyclescope.fleet.place import SOURCES, file_kinds

GRAINS = {"day": 86400, "week": 7 * 86400}
_MARKER_RE = re.compile(r"^block-(\d{6,})\.json$")
RENAME_EXCHANGE = 2
AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """Swap two directories atomically (Linux renameat2; Python has no binding for it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2 {a} <-> {b}: {os.strerror(err)}")


def bucket_of(created: float, grain: str) -> int:
    """The day (UTC) or week (from Monday, UTC) an epoch begun at ``created`` belongs to."""
    day = int(created // 86400)
    return day if grain == "day" else (day + 3) // 7  # 1970-01-01 was a Thursday


def plan(db: Database, older_than_s: float, grain: str, now: float | None = None) -> list[list[int]]:
    """Groups of two or more epochs begun before ``now - older_than_s`` in the same day or week;
    never the epoch daemons write (the newest shared one)."""
    if grain not in GRAINS:
        raise UsageError(f"--by {grain}: day or week")
    now = time.time() if now is None else now
    live = db.newest_shared_epoch()
    groups: dict[int, list[int]] = {}
    for ep in db.epochs():
        created = db.epoch_info(ep).get("created")
        if ep == live or not isinstance(created, (int, float)) or created > now - older_than_s:
            continue
        groups.setdefault(bucket_of(float(created), grain), []).append(ep)
    return [g for _, g in sorted(groups.items()) if len(g) > 1]


@dataclass
class Merged:
    epochs: list[int]
    bytes_before: int
    bytes_after: int


@dataclass
class RetainReport:
    merged: list[Merged] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    cleaned: int = 0  # leftovers of an interrupted run removed
    size_before: int = 0
    size_after: int = 0


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _link_group(db: Database, tdb: Database, epochs: list[int], into: int) -> None:
    """Every live file of ``epochs`` hard-linked into ``tdb``'s epoch ``into``, each kind of each
    host numbered afresh; the sources' markers carried over with the ranges they had shipped."""
    from cyclescope.db.values import uids, value_files, values_dir

    seq: dict[tuple[str, str], int] = {}
    blocks: dict[str, int] = {}
    for ep in epochs:
        for host in db.hosts(ep):
            hd, td = db.host_dir(ep, host), tdb.host_dir(into, host)
            for kind in file_kinds():
                d = hd / kind.subdir if kind.subdir else hd
                refs = files_named(d, kind.prefix)
                if not refs:
                    continue
                dest = tdb.ensure(td / kind.subdir if kind.subdir else td)
                for ref in live_segments(refs):
                    n = seq[(host, kind.prefix)] = seq.get((host, kind.prefix), 0) + 1
                    os.link(ref.path, dest / f"{kind.prefix}-{n:08d}-{n:08d}.parquet", follow_symlinks=False)
            for uid in uids(db, ep, host):
                dest = tdb.ensure(values_dir(tdb, into, host, uid))
                for ref in value_files(db, ep, host, uid):
                    n = seq[(host, f"vals{uid}")] = seq.get((host, f"vals{uid}"), 0) + 1
                    os.link(ref.path, dest / f"vals-{n:08d}-{n:08d}.parquet", follow_symlinks=False)
            _carry_markers(hd, td, tdb, host, blocks)


def _carry_markers(hd: Path, td: Path, tdb: Database, host: str, blocks: dict[str, int]) -> None:
    from cyclescope.db.layout import SOURCE_BLOCK

    src_dir = hd / SOURCES
    if not src_dir.is_dir():
        return
    for f in sorted(src_dir.iterdir()):
        m = _MARKER_RE.match(f.name)
        if not m:
            continue
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        block = int(m.group(1))
        covered: dict[str, list[list[int]]] = {k: list(v) for k, v in d.get("covered", {}).items()}
        for kind in file_kinds():
            kd = hd / kind.subdir if kind.subdir else hd
            for ref in live_segments(files_named(kd, kind.prefix)):
                if ref.first // SOURCE_BLOCK == block:
                    covered.setdefault(kind.prefix, []).append([ref.first % SOURCE_BLOCK, ref.last % SOURCE_BLOCK])
        n = blocks[host] = blocks.get(host, 0) + 1
        out = tdb.ensure(td / SOURCES)
        write_atomic(out / f"block-{n:06d}.json", json.dumps({**d, "covered": covered}).encode())


def _compact_all(tdb: Database, epoch: int) -> None:
    """The linked files merged, with the functions the daemon's compaction uses."""
    from cyclescope.db.compact import compact
    from cyclescope.db.stacks import compact_stacks
    from cyclescope.db.tallies import KINDS, compact_tallies
    from cyclescope.db.values import compact_values, uids

    for host in tdb.hosts(epoch):
        compact(tdb, epoch, host)
        compact_stacks(tdb, epoch, host)
        for k in KINDS.values():
            compact_tallies(tdb, epoch, host, k)
        for uid in uids(tdb, epoch, host):
            compact_values(tdb, epoch, host, uid)


def merge_group(db: Database, epochs: list[int], grain: str) -> Merged:
    """Merge ``epochs`` (of one day or week) into one; see the module's doc for the steps."""
    first = epochs[0]
    before = sum(dir_size(db.epoch_dir(e)) for e in epochs)
    tmp = db.root / f".tmp-retain-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp, 0o755)
    try:
        tdb = Database(tmp)
        into = tdb.epoch_dir(first)
        os.mkdir(into, 0o755)
        _link_group(db, tdb, epochs, first)
        _compact_all(tdb, first)
        info = dict(db.epoch_info(first))
        names = [db.epoch_info(e).get("name") for e in epochs]
        info.update({"id": first, "shared": True, "grain": grain,
                     "name": f"{grain} of epochs {epochs[0]}-{epochs[-1]}" + (f" ({names[0]})" if names[0] else "")})
        write_atomic(into / "epoch.json", json.dumps(info).encode())
        # What the group's merged epochs replaced too, in case a crash left some of them behind.
        hides = sorted({*epochs, *(h for e in epochs for h in db.merged_from(e))})
        write_atomic(into / MERGED, json.dumps({"epochs": hides, "grain": grain, "at": time.time()}).encode())
        fsync_dir(into)
        exchange(into, db.epoch_dir(first))  # the commit: the merged epoch now hides the others
        fsync_dir(db.root)
        for e in epochs[1:]:
            _remove(db, db.epoch_dir(e))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Merged(epochs, before, dir_size(db.epoch_dir(first)))


def _remove(db: Database, d: Path) -> None:
    """An epoch's directory out of readers' sight first (one rename), then deleted."""
    trash = db.root / f".tmp-trash-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(d, trash)
    except FileNotFoundError:
        return
    fsync_dir(db.root)
    shutil.rmtree(trash, ignore_errors=True)


def clean(db: Database, older_than_s: float = 600) -> int:
    """What an interrupted run left: epochs a merged one hides, and temporary directories older
    than ``older_than_s`` (a run under way has young ones)."""
    n = 0
    for e in sorted(set(db.epochs(hidden=True)) - set(db.epochs())):
        _remove(db, db.epoch_dir(e))
        n += 1
    now = time.time()
    for d in db.root.iterdir():
        if d.name.startswith((".tmp-retain-", ".tmp-trash-")) and d.is_dir():
            with contextlib.suppress(OSError):
                if now - d.stat().st_mtime > older_than_s:
                    shutil.rmtree(d, ignore_errors=True)
                    n += 1
    return n


def retain(db: Database, older_than_s: float, grain: str, max_bytes: int | None = None,
           progress: Callable[[str], None] | None = None, now: float | None = None) -> RetainReport:
    report = RetainReport()
    report.cleaned = clean(db)
    report.size_before = dir_size(db.root)
    for group in plan(db, older_than_s, grain, now):
        if progress is not None:
            progress(f"merging epochs {group[0]}-{group[-1]} ({len(group)}) into one {grain}")
        try:
            report.merged.append(merge_group(db, group, grain))
        except OSError as e:
            raise DataError(f"merging epochs {group}: {e}") from None
    if max_bytes is not None:
        size = dir_size(db.root)
        live = db.newest_shared_epoch()
        for ep in db.epochs():
            if size <= max_bytes or ep == live or ep == db.epochs()[-1]:
                break
            size -= dir_size(db.epoch_dir(ep))
            if progress is not None:
                progress(f"dropping epoch {ep} (over the size budget)")
            _remove(db, db.epoch_dir(ep))
            report.dropped.append(ep)
    report.size_after = dir_size(db.root)
    return report


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '90s' or seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m:
        raise UsageError(f"cannot read the duration {text!r} (try 7d, 12h, 30m)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def parse_size(text: str) -> int:
    """'50G', '500M', '1T' or bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise UsageError(f"cannot read the size {text!r} (try 50G, 500M)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))
