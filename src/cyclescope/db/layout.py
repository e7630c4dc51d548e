"""The profile database on disk: a directory of epochs, hosts and segments.

    DB/
      cyclescope.json                 format marker and version
      epoch=000001/
        epoch.json                    id, creation time, name
        merged.json                   in an epoch retention merged: the epochs it replaces
        host=vm1/
          seg-00000001-00000001.parquet   one flush
          seg-00000001-00000008.parquet   a compaction of flushes 1..8
      symbols/<key>.parquet           symbol tables of images with no file (kernel, vdso, JIT)
      binaries/<build-id>             bytes of images with no file (the vdso)
      cache/                          derived data (decoded line tables), safe to delete
      id                              this database's identity (its files shipped elsewhere name it)

The ``key=value`` directory names are Hive partitioning, so DuckDB (or any
engine reading Parquet) sees ``epoch`` and ``host`` as columns.

Crash safety without a manifest: a segment named ``seg-A-B`` holds flushes A
to B. Files are written under a temporary name, fsynced, then hard-linked to
their final name (which fails rather than overwrite) and the directory
fsynced. A reader uses the segments whose range no other segment strictly
covers, so after a compaction is linked in, the flushes it replaced are
ignored even if a crash left them on disk, and they are deleted afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cyclescope import random_hex
from cyclescope.errors import DataError, NotFoundError, UsageError

FORMAT_NAME = "cyclescope-db"
FORMAT_VERSION = 1
MARKER = "cyclescope.json"
MERGED = "merged.json"  # in an epoch that replaces others (retention): which
_EPOCH_RE = re.compile(r"^epoch=(\d{6,})$")
_HOST_RE = re.compile(r"^host=(.+)$")
_SAFE_HOST_RE = re.compile(r"[^A-Za-z0-9_.-]")
# Flush numbers of files shipped from another database are offset by a multiple of this (fleet/
# place.py): a database's own writers number from 1 and never reach it.
SOURCE_BLOCK = 10**8


@dataclass(frozen=True, order=True)
class SegmentRef:
    first: int
    last: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


def segment_name(first: int, last: int, prefix: str = "seg") -> str:
    """The name of a file covering flushes first..last: segments (seg), value files (vals) and
    stack files (stk) follow the same rule."""
    return f"{prefix}-{first:08d}-{last:08d}.parquet"


def safe_host(host: str) -> str:
    return _SAFE_HOST_RE.sub("_", host) or "localhost"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a mix."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{random_hex(4)}-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits the file should keep, or left ones it should not
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


# Directories cyclescope makes: writable by their owner only, whatever the umask.
DIR_MODE = 0o755


def unsafe_dir(st: os.stat_result, euid: int | None = None) -> str | None:
    """Why a root writer must not write into a directory (another user could swap its entries for
    links to files of root's), or None. A non-root writer risks only its own files: anything goes."""
    import stat

    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != 0:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o002:
        return "writable by every user"
    if st.st_mode & 0o020 and st.st_gid != 0:
        return f"writable by group {st.st_gid}"
    return None


def ensure_dir(root: Path, path: Path, mode: int = DIR_MODE) -> Path:
    """Create ``path`` (under ``root``) and the directories on the way, each with ``mode``, walking
    down from ``root`` on directory descriptors without following links; as root, refuse any
    directory on the way that another user could write (UsageError saying which and why)."""
    rel = path.relative_to(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        where = root
        why = unsafe_dir(os.fstat(fd))
        if why:
            raise UsageError(f"{where}: {why}; as root, cyclescope writes only into directories no other user "
                             "can write (chown the database to root, or write it as its owner)")
        for part in rel.parts:
            where = where / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode, dir_fd=fd)
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise DataError(f"{where}: not a directory cyclescope can use ({e.strerror})") from None
            os.close(fd)
            fd = nfd
            why = unsafe_dir(os.fstat(fd))
            if why:
                raise UsageError(f"{where}: {why}; as root, cyclescope writes only into directories no other "
                                 "user can write")
        return path
    finally:
        os.close(fd)


def files_named(d: Path, prefix: str) -> list[SegmentRef]:
    """The files ``prefix-A-B.parquet`` of directory ``d`` (none if it does not exist), in order."""
    pat = re.compile(rf"^{re.escape(prefix)}-(\d{{8,}})-(\d{{8,}})\.parquet$")
    out = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for f in d.iterdir():
            if m := pat.match(f.name):
                out.append(SegmentRef(int(m.group(1)), int(m.group(2)), f))
    return sorted(out)


def own_segments(segs: list[SegmentRef]) -> list[SegmentRef]:
    """The files this database's own writers made (not shipped from another): the only ones its
    compactions merge, since a host's later shipments must still nest with what it shipped."""
    return [s for s in segs if s.last < SOURCE_BLOCK]


def live_segments(segs: list[SegmentRef]) -> list[SegmentRef]:
    """Drop segments whose flush range another segment strictly covers."""
    out = []
    for s in segs:
        covered = any(
            o.first <= s.first and s.last <= o.last and (o.first, o.last) != (s.first, s.last) for o in segs
        )
        if not covered:
            out.append(s)
    # Two identical ranges cannot exist (names are unique); overlapping
    # non-nested ranges are never produced: compaction covers whole live ranges.
    return sorted(out)


class Database:
    def __init__(self, root: Path) -> None:
        self.root = root

    # --- opening --------------------------------------------------------------------
    @staticmethod
    def create_or_open(path: str | os.PathLike[str]) -> Database:
        """Open the database at ``path`` for writing, creating it if need be. Creation is atomic:
        the directory appears with its marker in it (several writers creating one database at
        once all end up using the one that won)."""
        root = Path(path)
        if root.exists() and not root.is_dir():
            raise UsageError(f"{root}: exists and is not a directory")
        if not root.exists():
            Database._create(root)
        elif not (root / MARKER).exists():
            if any(n != MARKER and not n.startswith(".tmp-") for n in os.listdir(root)):
                raise UsageError(f"{root}: directory is not empty and is not a cyclescope database")
            Database._mark(root)
        db = Database.open(root)
        why = unsafe_dir(os.stat(root))
        if why:
            raise UsageError(f"{root}: {why}; as root, cyclescope writes only into a database no other user "
                             "can write (chown it to root, or write it as its owner)")
        return db

    @staticmethod
    def _marker_bytes() -> bytes:
        return json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "created": time.time()},
                          indent=1).encode()

    @staticmethod
    def _create(root: Path) -> None:
        """A new database: a temporary directory with its marker, renamed into place."""
        parent = root.parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".tmp-{os.getpid()}-{random_hex(4)}-{root.name}"
        os.mkdir(tmp, DIR_MODE)
        try:
            os.chmod(tmp, DIR_MODE)  # the umask may have taken bits
            write_atomic(tmp / MARKER, Database._marker_bytes())
            try:
                os.rename(tmp, root)  # fails if another writer's directory is there first
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                if not root.is_dir():
                    raise UsageError(f"{root}: exists and is not a directory") from None
                if not (root / MARKER).exists():
                    Database._mark(root)
            fsync_dir(parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                (tmp / MARKER).unlink()
            with contextlib.suppress(FileNotFoundError, OSError):
                tmp.rmdir()

    @staticmethod
    def _mark(root: Path) -> None:
        """The marker in an existing empty directory, linked so that only one writer's lands."""
        tmp = root / f".tmp-{os.getpid()}-{random_hex(4)}-{MARKER}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, Database._marker_bytes())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, root / MARKER)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        fsync_dir(root)

    def ensure(self, path: Path, mode: int = DIR_MODE) -> Path:
        """``path`` (under the database) made safely: see :func:`ensure_dir`."""
        return ensure_dir(self.root, path, mode)

    @staticmethod
    def open(path: str | os.PathLike[str]) -> Database:
        root = Path(path)
        marker = root / MARKER
        if not root.exists():
            raise NotFoundError(f"{root}: no such database (record something first, or pass --db)")
        try:
            meta = json.loads(marker.read_text())
        except FileNotFoundError:
            raise DataError(f"{root}: not a cyclescope database (no {MARKER})") from None
        except (OSError, ValueError) as e:
            raise DataError(f"{root}/{MARKER}: unreadable ({e})") from None
        if meta.get("format") != FORMAT_NAME:
            raise DataError(f"{root}: not a cyclescope database")
        if int(meta.get("version", 0)) > FORMAT_VERSION:
            raise DataError(
                f"{root}: database format version {meta.get('version')} is newer than this cyclescope "
                f"understands ({FORMAT_VERSION})"
            )
        return Database(root)

    def identity(self) -> str:
        """A random name for this database, made once (the first caller's wins): what the files
        it ships are filed under elsewhere, so that a database made again never collides."""
        path = self.root / "id"
        with contextlib.suppress(FileNotFoundError):
            return path.read_text().strip()
        tmp = self.root / f".tmp-{os.getpid()}-{random_hex(4)}-id"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, random_hex(16).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
        fsync_dir(self.root)
        return path.read_text().strip()

    # --- epochs ---------------------------------------------------------------------
    def epochs(self, hidden: bool = False) -> list[int]:
        """The epochs, oldest first; without those a merged epoch replaces (fleet/retain.py),
        unless ``hidden``."""
        out = []
        hide: set[int] = set()
        with contextlib.suppress(FileNotFoundError):
            for d in self.root.iterdir():
                m = _EPOCH_RE.match(d.name)
                if m and d.is_dir():
                    e = int(m.group(1))
                    out.append(e)
                    if not hidden and os.path.exists(d / MERGED):
                        hide |= set(self.merged_from(e)) - {e}
        return sorted(e for e in out if e not in hide)

    def merged_from(self, epoch: int) -> list[int]:
        """The epochs a merged epoch replaces (itself among them); [] for one never merged."""
        try:
            got = json.loads((self.epoch_dir(epoch) / MERGED).read_text()).get("epochs", [])
            return [int(e) for e in got]
        except (OSError, ValueError, TypeError, AttributeError):
            return []

    def epoch_dir(self, epoch: int) -> Path:
        return self.root / f"epoch={epoch:06d}"

    def epoch_info(self, epoch: int) -> dict[str, object]:
        try:
            info = json.loads((self.epoch_dir(epoch) / "epoch.json").read_text())
            return info if isinstance(info, dict) else {"id": epoch}
        except (OSError, ValueError):
            return {"id": epoch}

    def current_epoch(self) -> int | None:
        eps = self.epochs()
        return eps[-1] if eps else None

    def new_epoch(self, name: str | None = None, shared: bool = True, owner: str | None = None) -> int:
        """Create the next epoch and return its number. A ``shared`` epoch (`cyclescope epoch`, a
        daemon's first) is one every daemon writing to the database switches to at its next flush;
        an epoch a `record` run makes for itself is its own, and no other writer follows it."""
        why = unsafe_dir(os.stat(self.root))
        if why:
            raise UsageError(f"{self.root}: {why}; as root, cyclescope writes only into a database no other "
                             "user can write")
        while True:
            eps = self.epochs()
            nxt = (eps[-1] + 1) if eps else 1
            d = self.epoch_dir(nxt)
            try:
                os.mkdir(d, DIR_MODE)
            except FileExistsError:
                continue
            info = {"id": nxt, "created": time.time(), "name": name, "shared": shared, "owner": owner}
            write_atomic(d / "epoch.json", json.dumps(info).encode())
            fsync_dir(self.root)
            return nxt

    def newest_shared_epoch(self) -> int | None:
        """The newest epoch daemons follow (epochs from before the distinction count as shared)."""
        for ep in reversed(self.epochs()):
            if self.epoch_info(ep).get("shared", True):
                return ep
        return None

    def ensure_epoch(self) -> int:
        """The epoch a daemon joins at start: the newest shared one, or a new one."""
        cur = self.newest_shared_epoch()
        return cur if cur is not None else self.new_epoch()

    # --- hosts and segments ---------------------------------------------------------------
    def host_dir(self, epoch: int, host: str) -> Path:
        return self.epoch_dir(epoch) / f"host={safe_host(host)}"

    def hosts(self, epoch: int) -> list[str]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for d in self.epoch_dir(epoch).iterdir():
                m = _HOST_RE.match(d.name)
                if m and d.is_dir():
                    out.append(m.group(1))
        return sorted(out)

    def segments(self, epoch: int, host: str, live_only: bool = True) -> list[SegmentRef]:
        segs = files_named(self.host_dir(epoch, host), "seg")
        return live_segments(segs) if live_only else segs

    def next_seq(self, epoch: int, host: str) -> int:
        return max((s.last for s in own_segments(self.segments(epoch, host, live_only=False))), default=0) + 1

    @contextlib.contextmanager
    def host_lock(self, epoch: int, host: str) -> Iterator[Path]:
        """Exclusive lock on one epoch/host directory: writers and compaction take turns."""
        d = self.ensure(self.host_dir(epoch, host))
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield d
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def link_new(self, tmp: Path, d: Path, first: int, last: int, prefix: str = "seg") -> Path:
        """Give ``tmp`` (written and fsynced) its final name without ever overwriting a file."""
        final = d / segment_name(first, last, prefix)
        os.link(tmp, final)  # FileExistsError rather than clobbering
        os.unlink(tmp)
        fsync_dir(d)
        return final

    def temp_path(self, d: Path) -> Path:
        return d / f".tmp-{os.getpid()}-{random_hex(6)}.parquet"

    def clean_temp(self, d: Path, older_than_s: float = 3600) -> int:
        """Remove temporary files a crashed writer left behind."""
        n = 0
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            for f in d.iterdir():
                if f.name.startswith(".tmp-"):
                    try:
                        if now - f.stat().st_mtime > older_than_s:
                            f.unlink()
                            n += 1
                    except FileNotFoundError:
                        pass
        return n

    # --- side stores ----------------------------------------------------------------------
    @property
    def symbols_dir(self) -> Path:
        return self.root / "symbols"

    @property
    def binaries_dir(self) -> Path:
        return self.root / "binaries"

    def all_segment_files(self) -> Iterator[tuple[int, str, SegmentRef]]:
        for ep in self.epochs():
            for h in self.hosts(ep):
                for s in self.segments(ep, h):
                    yield ep, h, s
