"""Value hotlists on disk: other people's data, kept apart per owner.

Layout: ``epoch=N/host=H/values/uid=U/vals-A-B.parquet``. Every file is mode 0600
and owned by U (the owner of the sampled processes), so a user reads their own
values and nobody else's; root reads all. The directories belong to the writer
(root, for the daemon) and only it can write them: a user who could write the
directory where root writes and chowns their files could swap those files for
links to any file of root's and be given it (files made by versions before this
one had the ``uid=U`` directory owned by U: root takes such a directory back
before writing in it, and drops the links in it). Files are made, chowned and
linked on descriptors (openat on the directory, O_EXCL|O_NOFOLLOW, fchown,
fchmod, linkat), never by path after the fact. They follow the segments' rules:
written under a temporary name, fsynced, then linked to a name no other file has;
compaction writes one file covering a range of flushes and deletes those it covers.

Rows: (image, offset, kind, v0, v1, vimage, count, p, total): one per value of
each hotlist; ``p`` and ``total`` (vtot) repeat per hotlist and compress to runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cyclescope import parquet, random_hex
from cyclescope.db.hotlist import VALUE_DTYPE, HotlistSet, hotlist_sizes, merge_sets, unique_struct
from cyclescope.db.layout import Database, SegmentRef, fsync_dir, live_segments
from cyclescope.errors import DataError

META_KEY = b"cyclescope-values"
_VAL_RE = re.compile(r"^vals-(\d{8,})-(\d{8,})\.parquet$")
_UID_RE = re.compile(r"^uid=(\d+)$")
KEY_DTYPE = np.dtype([("image", "<i8"), ("offset", "<u8"), ("kind", "<i4")])

SCHEMA = pa.schema([
    ("image", pa.dictionary(pa.int32(), pa.string())),
    ("offset", pa.uint64()),
    ("kind", pa.dictionary(pa.int32(), pa.string())),
    ("v0", pa.uint64()),
    ("v1", pa.uint64()),
    ("vimage", pa.dictionary(pa.int32(), pa.string())),
    ("count", pa.uint64()),
    ("p", pa.float64()),
    ("total", pa.uint64()),
])


@dataclass
class ValuesMeta:
    uid: int
    epoch: int = 0
    first: int = 0
    last: int = 0
    samples: int = 0  # samples whose values were captured
    interpreted: int = 0  # of which interpreted
    steps: int = 0  # interpreted instructions
    over_budget: int = 0  # samples chosen for interpretation but left out by the CPU budget
    stops: dict[str, int] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    length: int = 0
    every: int = 0
    exact: bool = False
    check: dict[str, int] = field(default_factory=dict)  # exact mode: interpreter against single-stepping
    start_time: float = 0.0
    end_time: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes) -> ValuesMeta:
        d = json.loads(raw)
        m = ValuesMeta(int(d["uid"]))
        for k, v in d.items():
            if hasattr(m, k):
                setattr(m, k, v)
        return m

    def merge(self, o: ValuesMeta) -> None:
        for k in ("samples", "interpreted", "steps", "over_budget"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        for k, v in o.stops.items():
            self.stops[k] = self.stops.get(k, 0) + v
        for k, v in o.check.items():
            self.check[k] = self.check.get(k, 0) + v
        self.modules = sorted(set(self.modules) | set(o.modules))
        self.length = max(self.length, o.length)
        self.every = self.every or o.every
        self.exact = self.exact or o.exact
        self.first = min(self.first, o.first) if self.first else o.first
        self.last = max(self.last, o.last)
        self.start_time = min(self.start_time, o.start_time) if self.start_time else o.start_time
        self.end_time = max(self.end_time, o.end_time)


@dataclass
class NamedHotlists:
    """A HotlistSet whose image and kind columns index the name lists."""

    lists: HotlistSet
    images: list[str]
    kinds: list[str]


def values_dir(db: Database, epoch: int, host: str, uid: int) -> Path:
    return db.host_dir(epoch, host) / "values" / f"uid={uid}"


def _ensure_dir(db: Database, d: Path) -> None:
    """The owner's value directory, the writer's and writable by it only (see the module's doc)."""
    if os.geteuid() == 0:
        _take_back(d)
    db.ensure(d)


def _take_back(d: Path) -> None:
    """A value directory an earlier version gave to its user: root's again, links in it dropped."""
    import stat

    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # not there yet (or not a directory: ensure says so)
    try:
        st = os.fstat(fd)
        if st.st_uid == 0 and not st.st_mode & 0o022:
            return
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o755)
        for name in os.listdir(fd):
            with contextlib.suppress(OSError):
                if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def value_files(db: Database, epoch: int, host: str, uid: int, live_only: bool = True) -> list[SegmentRef]:
    d = values_dir(db, epoch, host, uid)
    out = []
    with contextlib.suppress(FileNotFoundError, PermissionError):
        for f in d.iterdir():
            m = _VAL_RE.match(f.name)
            if m:
                out.append(SegmentRef(int(m.group(1)), int(m.group(2)), f))
    return live_segments(out) if live_only else sorted(out)


def uids(db: Database, epoch: int, host: str) -> list[int]:
    d = db.host_dir(epoch, host) / "values"
    out = []
    with contextlib.suppress(FileNotFoundError, PermissionError):
        for f in d.iterdir():
            m = _UID_RE.match(f.name)
            if m:
                out.append(int(m.group(1)))
    return sorted(out)


def to_table(named: NamedHotlists) -> pa.Table:
    lists = named.lists
    k = lists.keys[lists.hot]
    order = np.lexsort((-lists.counts, k["kind"], k["offset"], k["image"]))
    k = k[order]
    vals = lists.values[order]
    vimg = vals["vimg"]
    # vimage: one dictionary shared with the images (index into nh.images), "" for none.
    vnames = ["", *named.images]

    def dict_array(names: list[str], idx: np.ndarray) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(parquet.from_numpy(idx, pa.int32()), pa.array(names, pa.string()))

    return pa.table({
        "image": dict_array(named.images, k["image"]),
        "offset": parquet.from_numpy(k["offset"], pa.uint64()),
        "kind": dict_array(named.kinds, k["kind"]),
        "v0": parquet.from_numpy(vals["v0"], pa.uint64()),
        "v1": parquet.from_numpy(vals["v1"], pa.uint64()),
        "vimage": dict_array(vnames, np.where(vimg >= 0, vimg + 1, 0)),
        "count": parquet.from_numpy(lists.counts[order], pa.uint64()),
        "p": parquet.from_numpy(lists.p[lists.hot][order], pa.float64()),
        "total": parquet.from_numpy(lists.total[lists.hot][order], pa.uint64()),
    }, schema=SCHEMA)


def _write_at(dirfd: int, name: str, table: pa.Table, meta: ValuesMeta) -> None:
    """A new file ``name`` in the directory ``dirfd``: 0600, its owner's, written and fsynced."""
    table = table.replace_schema_metadata({META_KEY: meta.to_json()})
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dirfd)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        if os.geteuid() == 0:
            os.fchown(fd, meta.uid, -1)
        with parquet.Writer(f, table.schema, compression="zstd", compression_level=6,
                            use_dictionary=["image", "kind", "vimage"]) as w:
            w.write_table(table, row_group_size=1 << 20)
        f.flush()
        os.fsync(fd)


def write_values(db: Database, epoch: int, host: str, named: NamedHotlists, meta: ValuesMeta) -> Path:
    """One flush of one owner's hotlists, atomically."""
    with db.host_lock(epoch, host):
        d = values_dir(db, epoch, host, meta.uid)
        _ensure_dir(db, d)
        existing = value_files(db, epoch, host, meta.uid, live_only=False)
        seq = max((s.last for s in existing), default=0) + 1
        meta.first = meta.last = seq
        meta.epoch = epoch
        return _link(db, d, to_table(named), meta, seq, seq)


def _link(db: Database, d: Path, table: pa.Table, meta: ValuesMeta, first: int, last: int) -> Path:
    """Write and link a value file on descriptors (the directory opened without following links)."""
    from cyclescope.db.layout import segment_name

    dirfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    tmp = f".tmp-{os.getpid()}-{random_hex(6)}.parquet"
    final = segment_name(first, last, "vals")
    try:
        _write_at(dirfd, tmp, table, meta)
        os.link(tmp, final, src_dir_fd=dirfd, dst_dir_fd=dirfd, follow_symlinks=False)  # never clobbers
        os.fsync(dirfd)
        return d / final
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dirfd)
        os.close(dirfd)


def read_meta(path: Path) -> ValuesMeta:
    try:
        md = parquet.read_metadata(path)
    except PermissionError:
        raise
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: corrupt value file ({e})") from None
    raw = (md.metadata or {}).get(META_KEY)
    if raw is None:
        raise DataError(f"{path}: not a cyclescope value file")
    return ValuesMeta.from_json(raw)


def read_file(path: Path, images: dict[str, int], kinds: dict[str, int]) -> HotlistSet:
    """One value file as a HotlistSet, its image and kind names interned into ``images``/``kinds``."""
    try:
        t = parquet.read_table(path)
        t.validate(full=True)  # damaged strings (invalid UTF-8) fail here, not later
    except PermissionError:
        raise
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: corrupt value file ({e})") from None
    missing = [f.name for f in SCHEMA if f.name not in t.column_names]
    if missing:
        raise DataError(f"{path}: not a cyclescope value file (no {', '.join(missing)} column)")
    if not t.num_rows:
        return HotlistSet.empty(KEY_DTYPE)

    def codes(col: str, table: dict[str, int], blank: bool = False) -> np.ndarray:
        arr = t.column(col).combine_chunks()
        names = arr.dictionary.to_pylist()
        remap = np.array([(-1 if (blank and n == "") else table.setdefault(n, len(table))) for n in names],
                         dtype=np.int64)
        out: np.ndarray = remap[arr.indices.to_numpy(zero_copy_only=False)]
        return out

    n = t.num_rows
    keys = np.zeros(n, KEY_DTYPE)
    keys["image"] = codes("image", images)
    keys["offset"] = t.column("offset").to_numpy()
    keys["kind"] = codes("kind", kinds)
    vals = np.zeros(n, VALUE_DTYPE)
    vals["v0"] = t.column("v0").to_numpy()
    vals["v1"] = t.column("v1").to_numpy()
    vals["vimg"] = codes("vimage", images, blank=True)
    uk, hot, _ = unique_struct(keys)
    first = np.zeros(len(uk), np.int64)
    first[hot[::-1]] = np.arange(n - 1, -1, -1)  # the first row of each hotlist
    p = t.column("p").to_numpy()[first]
    total = t.column("total").to_numpy()[first].astype(np.uint64)
    return HotlistSet(uk, p, total, hot.astype(np.int64), vals,
                      t.column("count").to_numpy().astype(np.int64))


@dataclass
class ValueSelection:
    hotlists: NamedHotlists
    meta: ValuesMeta | None
    files: int
    unreadable: int  # value files of other owners this user cannot read
    corrupt: list[str]


def load_values(db: Database, epochs: list[int], hosts: list[str] | None = None,
                uid: int | None = None, rng: np.random.Generator | None = None) -> ValueSelection:
    """Every readable value file of the selection, merged into one set of hotlists."""
    images: dict[str, int] = {}
    kinds: dict[str, int] = {}
    sets = []
    meta: ValuesMeta | None = None
    files = unreadable = 0
    corrupt = []
    for ep in epochs:
        for h in hosts if hosts is not None else db.hosts(ep):
            if h not in db.hosts(ep):
                continue
            for u in uids(db, ep, h):
                if uid is not None and u != uid:
                    continue
                d = values_dir(db, ep, h, u)
                if not os.access(d, os.R_OK | os.X_OK):
                    unreadable += 1
                    continue
                for ref in value_files(db, ep, h, u):
                    try:
                        m = read_meta(ref.path)
                        sets.append(read_file(ref.path, images, kinds))
                    except PermissionError:
                        unreadable += 1
                        continue
                    except DataError as e:
                        corrupt.append(str(e))
                        continue
                    files += 1
                    if meta is None:
                        meta = m
                    else:
                        meta.merge(m)
    merged = merge_sets(sets, hotlist_sizes(kinds), rng=rng) if sets else HotlistSet.empty(KEY_DTYPE)
    return ValueSelection(NamedHotlists(merged, list(images), list(kinds)), meta, files, unreadable, corrupt)


def compact_values(db: Database, epoch: int, host: str, uid: int, min_files: int = 2) -> Path | None:
    """Merge the live value files of one owner into one covering their range (and remove what a
    crash left: files a finished merge covers, stale temporary files)."""
    from cyclescope.db.compact import delete_covered

    with db.host_lock(epoch, host):
        db.clean_temp(values_dir(db, epoch, host, uid))
        live = value_files(db, epoch, host, uid)
        delete_covered(value_files(db, epoch, host, uid, live_only=False), live)
        if len(live) < min_files:
            return None
        images: dict[str, int] = {}
        kinds: dict[str, int] = {}
        sets, meta = [], None
        for ref in live:
            try:
                m = read_meta(ref.path)
                sets.append(read_file(ref.path, images, kinds))
            except DataError:
                return None  # leave a damaged run alone: never lose what is readable
            if meta is None:
                meta = m
            else:
                meta.merge(m)
        assert meta is not None
        merged = merge_sets(sets, hotlist_sizes(kinds))
        first, last = live[0].first, live[-1].last
        meta.first, meta.last = first, last
        d = values_dir(db, epoch, host, uid)
        out = _link(db, d, to_table(NamedHotlists(merged, list(images), list(kinds))), meta, first, last)
        for ref in live:
            with contextlib.suppress(FileNotFoundError):
                ref.path.unlink()
        fsync_dir(d)
        return out


def describe(meta: ValuesMeta | None) -> dict[str, Any]:
    if meta is None:
        return {}
    return {"samples": meta.samples, "interpreted": meta.interpreted, "steps": meta.steps, "stops": meta.stops,
            "modules": meta.modules, "length": meta.length, "every": meta.every, "exact": meta.exact,
            "check": meta.check}
