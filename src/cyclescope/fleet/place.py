"""The central side of shipping: a file of one host's database filed into the shared database.

Every host numbers its own epochs and flushes, so a shipped file cannot keep its name. A host's
database has an identity (``Database.identity``); each of its epochs is a *source* that lands
whole in one central epoch, the one in force when the source epoch began (the newest central
epoch created no later than it; the first, if the source is older than every central epoch; a
new one, if the central database has none). Within that central epoch and host, the source gets
a *block*: its flush numbers A..B become ``block * SOURCE_BLOCK + A .. + B``. Names stay unique
without coordination between hosts, ranges from one source nest as they do at the host (so the
readers' rule "take the files no other strictly covers" holds unchanged), and no two sources'
ranges ever meet. The block is claimed by linking a marker, ``sources/block-NNNNNN.json``,
which fails rather than overwrite: two shippers racing for one block both see who won.

Files are immutable and named by (host, source, flush range): a repeated upload finds its name
taken and compares digests (same: nothing to do; different: an error, nothing overwritten). A
file is validated (it must read as what its name says) before it is linked, written under a
temporary name and fsynced first, so an upload cut short leaves nothing behind but a temporary
file the next compaction sweeps. Once a host's compaction covering flushes A..B is linked in,
the files it covers are deleted; a file arriving after something already covers it is dropped.
The central database never compacts shipped files itself (``layout.own_segments``): the hosts
do, and ship the result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from cyclescope.db.layout import (
    SOURCE_BLOCK,
    Database,
    files_named,
    fsync_dir,
    fsync_file,
    safe_host,
)
from cyclescope.errors import DataError, UsageError

SOURCES = "sources"
_BLOCK_RE = re.compile(r"^block-(\d{6,})\.json$")
_SIDE_RE = re.compile(r"^(symbols/[A-Za-z0-9_.-]{1,120}\.parquet|binaries/[A-Za-z0-9_.-]{1,120})$")
MAX_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class FileKind:
    """A kind of file a host ships: where it lives under the host's directory, its name's prefix,
    and how to check that a file is one."""

    subdir: str  # "" for segments
    prefix: str
    check: Callable[[Path], object]

    def pattern(self) -> re.Pattern[str]:
        sub = re.escape(self.subdir + "/") if self.subdir else ""
        return re.compile(rf"^{sub}{re.escape(self.prefix)}-(\d{{8,}})-(\d{{8,}})\.parquet$")


def _check_segment(path: Path) -> object:
    from cyclescope.db.segment import read_meta, read_table

    read_meta(path)
    return read_table(path)


def _check_stacks(path: Path) -> object:
    from cyclescope.db.stacks import read_stack_file

    return read_stack_file(path)


def file_kinds() -> list[FileKind]:
    """What ships: the flat segments, the call stacks and every kind of tally. Value hotlists do
    not: they are the sampled processes' data, kept per owner at the host (db/values.py), and a
    user id means nothing on another machine."""
    from cyclescope.db.tallies import KINDS, read_tally

    kinds = [FileKind("", "seg", _check_segment), FileKind("stacks", "stk", _check_stacks)]
    for k in KINDS.values():
        kinds.append(FileKind(k.name, k.prefix, partial(read_tally, kind=k)))
    return kinds


def match_file(rel: str) -> tuple[FileKind, int, int]:
    """The kind and flush range of a file named ``rel`` (relative to a host's directory)."""
    for kind in file_kinds():
        if m := kind.pattern().match(rel):
            first, last = int(m.group(1)), int(m.group(2))
            if not 0 < first <= last < SOURCE_BLOCK:
                raise DataError(f"{rel}: flush range out of bounds")
            return kind, first, last
    raise DataError(f"{rel}: not a file cyclescope ships (segments, stacks and tallies only)")


@dataclass(frozen=True)
class Source:
    """One epoch of one host's database: what lands whole in one central epoch."""

    host: str
    database: str  # the host database's identity
    epoch: int
    created: float  # when the host's epoch began (its clock)

    def to_json(self) -> dict[str, object]:
        return {"host": self.host, "database": self.database, "epoch": self.epoch, "created": self.created}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Central:
    """The shared database files arrive in. Threads may share one (a server's requests): what it
    keeps is a cache of where sources went, and every claim on disk is a link that fails rather
    than overwrite."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._placed: dict[Source, tuple[int, int, dict[str, list[list[int]]]]] = {}

    # --- where a source goes ----------------------------------------------------------------
    def _markers(self, epoch: int, host: str) -> dict[int, dict[str, object]]:
        out: dict[int, dict[str, object]] = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for f in (self.db.host_dir(epoch, host) / SOURCES).iterdir():
                if m := _BLOCK_RE.match(f.name):
                    with contextlib.suppress(OSError, ValueError):
                        d = json.loads(f.read_text())
                        if isinstance(d, dict):
                            out[int(m.group(1))] = d
        return out

    def _find(self, src: Source) -> tuple[int, int, dict[str, list[list[int]]]] | None:
        for ep in reversed(self.db.epochs()):
            for block, d in self._markers(ep, src.host).items():
                if d.get("database") == src.database and d.get("epoch") == src.epoch:
                    covered = d.get("covered")
                    return ep, block, covered if isinstance(covered, dict) else {}
        return None

    def epoch_for(self, created: float) -> int:
        """The central epoch a source epoch begun at ``created`` belongs to."""
        eps = self.db.epochs()
        if not eps:
            # The first epoch, made once however many hosts arrive together.
            fd = os.open(self.db.root / ".epochs.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                eps = self.db.epochs() or [self.db.new_epoch(name="fleet")]
            finally:
                os.close(fd)
        best = eps[0]
        for ep in eps:
            c = self.db.epoch_info(ep).get("created")
            if isinstance(c, (int, float)) and c <= created:
                best = ep
        return best

    def place_source(self, src: Source) -> tuple[int, int, dict[str, list[list[int]]]]:
        """(central epoch, block, flushes of it retention merged per file prefix) of ``src``,
        claimed on first use."""
        got = self._placed.get(src) or self._find(src)
        if got is None:
            ep = self.epoch_for(src.created)
            d = self.db.ensure(self.db.host_dir(ep, src.host) / SOURCES)
            block = max(self._markers(ep, src.host), default=0) + 1
            data = json.dumps(src.to_json()).encode()
            while got is None:
                tmp = d / f".tmp-{os.getpid()}-{secrets.token_hex(4)}-{block}.json"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, d / f"block-{block:06d}.json")
                    got = (ep, block, {})
                except FileExistsError:  # another shipper took this block: was it for our source?
                    theirs = self._markers(ep, src.host).get(block, {})
                    if theirs.get("database") == src.database and theirs.get("epoch") == src.epoch:
                        got = (ep, block, {})
                    block += 1
                finally:
                    tmp.unlink()
            fsync_dir(d)
        self._placed[src] = got
        return got

    # --- files --------------------------------------------------------------------------------
    def place(self, src: Source, rel: str, path: Path, sha256: str | None = None) -> str:
        """File the host's ``rel`` (its bytes at ``path``) into the central database; returns
        "stored", "duplicate" (already there, same bytes) or "superseded" (a file already there
        covers its flushes). DataError for a malformed file or a name taken by other bytes."""
        kind, first, last = match_file(rel)
        if path.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"{rel}: larger than {MAX_FILE_BYTES >> 20} MiB")
        if safe_host(src.host) != src.host:
            raise DataError(f"host name {src.host!r}: use letters, digits, '_', '.' and '-' only")
        ep, block, merged = self.place_source(src)
        for lo, hi in merged.get(kind.prefix, []):
            if lo <= first and last <= hi:
                return "superseded"
            if first <= hi and lo <= last:
                raise DataError(f"{rel}: its epoch was merged (retention) with flushes {lo}..{hi} of it, which this "
                                "file overlaps; it cannot be added without counting them twice")
        base = block * SOURCE_BLOCK
        a, b = base + first, base + last
        with self.db.host_lock(ep, src.host) as hd:
            d = self.db.ensure(hd / kind.subdir) if kind.subdir else hd
            final = d / f"{kind.prefix}-{a:08d}-{b:08d}.parquet"
            if final.exists():
                if sha256_file(final) == (sha256 or sha256_file(path)):
                    return "duplicate"
                raise DataError(f"{rel}: {final.relative_to(self.db.root)} already holds other bytes; not replaced")
            block_files = [s for s in files_named(d, kind.prefix) if base < s.first and s.last < base + SOURCE_BLOCK]
            if any(s.first <= a and b <= s.last for s in block_files):
                return "superseded"
            tmp = self.db.temp_path(d)
            try:
                shutil.copyfile(path, tmp)
                os.chmod(tmp, 0o644)
                fsync_file(tmp)
                if sha256 is not None and sha256_file(tmp) != sha256:
                    raise DataError(f"{rel}: its bytes do not match the digest sent (upload cut short?)")
                try:
                    kind.check(tmp)
                except DataError as e:
                    raise DataError(f"{rel}: rejected: {str(e).split(': ', 1)[-1]}") from None
                os.link(tmp, final)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            fsync_dir(d)
            covered = [s for s in block_files if a <= s.first and s.last <= b]
            for s in covered:  # what the new file covers is no longer live: delete it
                with contextlib.suppress(FileNotFoundError):
                    s.path.unlink()
            if covered:
                fsync_dir(d)
        return "stored"

    def place_side(self, rel: str, path: Path, private: bool = False) -> str:
        """A symbol table or an archived binary (named by its image key, so the same name holds
        the same bytes wherever it comes from): "stored" or "duplicate"."""
        if not _SIDE_RE.match(rel) or ".." in rel:
            raise DataError(f"{rel}: not a symbol table or binary name")
        final = self.db.root / rel
        if final.exists():
            return "duplicate"
        d = self.db.ensure(final.parent)
        tmp = self.db.temp_path(d)
        try:
            shutil.copyfile(path, tmp)
            os.chmod(tmp, 0o600 if private else 0o644)
            fsync_file(tmp)
            self._check_side(rel, tmp)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return "duplicate"
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        fsync_dir(d)
        return "stored"

    @staticmethod
    def _check_side(rel: str, path: Path) -> None:
        if rel.startswith("symbols/"):
            import pyarrow as pa

            from cyclescope import parquet

            try:
                names = parquet.read_schema(path).names
            except (OSError, pa.ArrowException, ValueError) as e:
                raise DataError(f"{rel}: rejected: not a symbol table ({e})") from None
            if not {"start", "end", "name"} <= set(names):
                raise DataError(f"{rel}: rejected: not a symbol table")
        else:
            with open(path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    raise DataError(f"{rel}: rejected: not an ELF image")


def parse_source(host: str, database: str, epoch: str, created: str) -> Source:
    """A Source from the text of an ingest request (UsageError when a part is malformed)."""
    if not re.fullmatch(r"[0-9a-f]{16,64}", database):
        raise UsageError("database: 16 to 64 hex digits expected")
    try:
        return Source(host, database, int(epoch), float(created))
    except ValueError:
        raise UsageError("epoch and created must be numbers") from None

