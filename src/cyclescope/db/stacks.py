"""Call stacks on disk: ``epoch=N/host=H/stacks/stk-A-B.parquet``, one file per flush.

Rows: (event, process, count, images, offsets): one per distinct stack, event and command, frames
leaf first as two list columns (image keys repeat across frames and rows and compress to a dictionary). The footer
holds the images the frames refer to (their paths and kinds), since a caller's image may have no
flat samples. Writes follow the segments' rules: a temporary file, fsync, then a link to a name
no other file has. Compaction (`compact_stacks`, with the segments' in `db compact` and the
daemon's) merges a run of files into one covering their flush range, summing equal stacks, and
then deletes them; readers take only the files no other strictly covers, so a crash between the
two counts nothing twice.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cyclescope import parquet
from cyclescope.arrays import group
from cyclescope.db.compact import CompactResult, contiguous_run, delete_covered
from cyclescope.db.layout import Database, SegmentRef, files_named, fsync_dir, fsync_file, live_segments, own_segments
from cyclescope.errors import DataError

META_KEY = b"cyclescope-stacks"
SCHEMA = pa.schema([
    ("event", pa.dictionary(pa.int32(), pa.string())),
    ("process", pa.dictionary(pa.int32(), pa.string())),  # the command when sampled (absent in early files)
    ("count", pa.uint64()),
    ("images", pa.list_(pa.dictionary(pa.int32(), pa.string()))),
    ("offsets", pa.list_(pa.uint64())),
])


@dataclass
class StackCounts:
    """Stacks seen since the last flush: frames as (image index, offset) tuples, leaf first."""

    stacks: dict[tuple[tuple[int, int], ...], int] = field(default_factory=dict)  # stack -> id
    # (stack id, event, command as a CommTable index or -1) -> samples
    counts: Counter[tuple[int, int, int]] = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.counts)

    def intern(self, stack: tuple[tuple[int, int], ...]) -> int:
        sid = self.stacks.get(stack)
        if sid is None:
            sid = len(self.stacks)
            self.stacks[stack] = sid
        return sid

    def rows(self) -> tuple[list[tuple[tuple[int, int], ...]], list[int], list[int], list[int]]:
        """(stack, event, count, command) columns."""
        by_id = list(self.stacks)
        st, ev, n, cm = [], [], [], []
        for (sid, e, comm), c in self.counts.items():
            st.append(by_id[sid])
            ev.append(e)
            n.append(c)
            cm.append(comm)
        return st, ev, n, cm



def stacks_dir(db: Database, epoch: int, host: str) -> Path:
    return db.host_dir(epoch, host) / "stacks"


def stack_files(db: Database, epoch: int, host: str, live_only: bool = True) -> list[SegmentRef]:
    """The stack files of ``epoch``/``host`` in flush order; ``live_only``: without those a
    compacted file covers (left behind by a crash before their deletion)."""
    out = files_named(stacks_dir(db, epoch, host), "stk")
    return live_segments(out) if live_only else out


def _encoded(labels: list[str | None]) -> pa.DictionaryArray:
    """``labels`` as a dictionary array in order of first appearance, as Array.dictionary_encode()
    builds it, but without pyarrow.compute: that module's import (a quarter of a second) was the
    largest cost of a recording's first flush with stacks."""
    index: dict[str | None, int] = {}
    codes = np.fromiter((index.setdefault(x, len(index)) for x in labels), np.int32, len(labels))
    return pa.DictionaryArray.from_arrays(parquet.from_numpy(codes, pa.int32()), pa.array(list(index), pa.string()))


def _table(events: list[str], processes: list[str | None], counts: list[int],
           images: list[list[str]], offsets: list[list[int]]) -> pa.Table:
    bounds = parquet.from_numpy(np.cumsum([0, *map(len, images)], dtype=np.int32), pa.int32())
    return pa.Table.from_arrays([
        _encoded(list(events)), _encoded(processes), pa.array(counts, pa.uint64()),
        pa.ListArray.from_arrays(bounds, _encoded([k for st in images for k in st])),
        pa.ListArray.from_arrays(bounds, pa.array([o for st in offsets for o in st], pa.uint64())),
    ], schema=SCHEMA)


def _link(db: Database, d: Path, table: pa.Table, meta: dict[str, Any], first: int, last: int) -> Path:
    tmp = db.temp_path(d)
    try:
        t = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
        parquet.write_table(t, tmp, compression="zstd")
        fsync_file(tmp)
        return db.link_new(tmp, d, first, last, prefix="stk")
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_stacks(db: Database, epoch: int, host: str, sc: StackCounts, image_keys: list[str],
                 events: list[str], images: dict[str, Any], comm_names: list[str] | None = None) -> Path:
    stacks, ev, counts, comms = sc.rows()
    names = comm_names or []
    key_of = [k if i > 0 else "[unknown]" for i, k in enumerate(image_keys)]
    table = _table([events[e] if 0 <= e < len(events) else str(e) for e in ev],
                   [names[c] if 0 <= c < len(names) else "[unknown]" for c in comms], counts,
                   [[key_of[i] if 0 <= i < len(key_of) else "[unknown]" for i, _ in st] for st in stacks],
                   [[o for _, o in st] for st in stacks])
    with db.host_lock(epoch, host):
        d = db.ensure(stacks_dir(db, epoch, host))
        seq = max((s.last for s in own_segments(stack_files(db, epoch, host, live_only=False))), default=0) + 1
        return _link(db, d, table, {"epoch": epoch, "host": host, "images": images}, seq, seq)


def read_stack_file(path: Path) -> tuple[dict[str, Any], pa.Table]:
    """One stack file: its footer and its rows (DataError when it cannot be read)."""
    try:
        with parquet.File(path) as pf:
            meta = json.loads((pf.schema.metadata or {}).get(META_KEY, b"{}"))
            t = pf.read()
        t.validate(full=True)  # damaged strings (invalid UTF-8) fail here, not later
    except (OSError, pa.ArrowException, ValueError) as err:
        raise DataError(f"{path}: {err}") from None
    missing = [n for n in ("event", "count", "images", "offsets") if n not in t.column_names]
    if missing:
        raise DataError(f"{path}: not a cyclescope stack file (no {', '.join(missing)} column)")
    return meta, t


def _merge_files(files: list[tuple[Path, pa.Table]]) -> pa.Table:
    """The rows of stack files summed over equal (event, command, frames), the most samples first,
    as one table: in columns (StackArrays.summed, its event being the pair), no Python object per
    row or frame."""
    ev_index: dict[str | None, int] = {}
    ev_names: list[str | None] = []
    pr_index: dict[str | None, int] = {}
    pr_names: list[str | None] = []
    key_index: dict[str | None, int] = {}
    key_names: list[str | None] = []
    parts = []
    for path, t in files:
        lengths, im, of = _frames(path, t)
        ev = _codes(t.column("event").combine_chunks(), ev_index, ev_names).astype(np.int64)
        if "process" in t.column_names:  # files from before it have no command
            pr = _codes(t.column("process").combine_chunks(), pr_index, pr_names)
        else:
            pr = np.full(t.num_rows, pr_index.setdefault(None, len(pr_index)), np.int32)
            pr_names += [None] * (len(pr_index) - len(pr_names))
        parts.append(((ev << 32) | pr.astype(np.int64), t.column("count").to_numpy().astype(np.float64), lengths,
                      _codes(im, key_index, key_names), of.to_numpy(zero_copy_only=False).astype(np.uint64)))
    pair, count, lengths, image, offset = (np.concatenate([p[i] for p in parts]) for i in range(5))
    pairs, code = group(pair)
    arr = StackArrays.build([str(i) for i in range(len(pairs))], code, count, lengths, [], image, offset).summed()
    rows = np.argsort(-arr.count, kind="stable")
    splits, frames = select_rows(arr.splits, rows)
    pair = pairs[arr.event[rows]]
    ev, pr = (pair >> 32).astype(np.int32), (pair & 0xFFFFFFFF).astype(np.int32)

    def names(codes: np.ndarray, table: list[str | None]) -> pa.DictionaryArray:
        none = [i for i, n in enumerate(table) if n is None]
        return pa.DictionaryArray.from_arrays(pa.array(codes, mask=np.isin(codes, none) if none else None),
                                              pa.array([n or "" for n in table], pa.string()))

    bounds = parquet.from_numpy(splits, pa.int32())
    return pa.Table.from_arrays([
        names(ev, ev_names), names(pr, pr_names), parquet.from_numpy(np.rint(arr.count[rows]), pa.uint64()),
        pa.ListArray.from_arrays(bounds, names(arr.image[frames], key_names)),
        pa.ListArray.from_arrays(bounds, parquet.from_numpy(arr.offset[frames], pa.uint64())),
    ], schema=SCHEMA)


def compact_stacks(db: Database, epoch: int, host: str, min_files: int = 2) -> CompactResult | None:
    """Merge the live stack files of ``epoch``/``host`` into one covering their flush range (equal
    stack, event and command summed); None when there is nothing to do. A corrupt file is left
    alone and the merged range never covers it."""
    with db.host_lock(epoch, host):
        d = stacks_dir(db, epoch, host)
        if not d.is_dir():
            return None
        db.clean_temp(d)
        live = stack_files(db, epoch, host)
        delete_covered(stack_files(db, epoch, host, live_only=False), live)
        readable: dict[str, tuple[dict[str, Any], pa.Table]] = {}
        corrupt: list[SegmentRef] = []
        for s in live:
            try:
                readable[s.name] = read_stack_file(s.path)
            except DataError:
                corrupt.append(s)
        run = contiguous_run([s for s in live if s.name in readable], corrupt)
        if len(run) < min_files:
            return None
        images: dict[str, Any] = {}
        for s in run:
            images.update(readable[s.name][0].get("images", {}))
        table = _merge_files([(s.path, readable[s.name][1]) for s in run])
        first, last = run[0].first, run[-1].last
        out = _link(db, d, table, {"epoch": epoch, "host": host, "images": images}, first, last)
        before = sum(s.path.stat().st_size for s in run)
        for s in run:
            with contextlib.suppress(FileNotFoundError):
                s.path.unlink()
        fsync_dir(d)
        return CompactResult(epoch, host, len(run), before, out.stat().st_size,
                             sum(readable[s.name][1].num_rows for s in run), table.num_rows, [c.name for c in corrupt])


@dataclass
class StackSelection:
    counts: Counter[tuple[str, tuple[tuple[str, int], ...]]] = field(default_factory=Counter)  # (event, stack)
    images: dict[str, Any] = field(default_factory=dict)  # image key -> ImageInfo JSON
    files: int = 0
    corrupt: list[str] = field(default_factory=list)


def stack_paths(db: Database, epochs: list[int], hosts: list[str] | None = None) -> list[Path]:
    """The live stack files of the selection's epochs and hosts."""
    return [ref.path for epoch in epochs for host in db.hosts(epoch) if hosts is None or host in hosts
            for ref in stack_files(db, epoch, host)]


def load_stacks(db: Database, epochs: list[int], hosts: list[str] | None = None,
                images: set[str] | None = None, processes: set[str] | None = None) -> StackSelection:
    """Every stack of the selection, summed. ``images``: keep the stacks whose leaf is in one of
    these images; ``processes``: those of these commands (files written before stacks recorded
    the command have none to match). Corrupt files are reported and skipped."""
    out = sum_stack_files(stack_paths(db, epochs, hosts), images, processes)
    if not out.files and out.corrupt:
        raise DataError(f"every stack file is corrupt: {out.corrupt[0]}")
    return out


def sum_stack_files(paths: list[Path], images: set[str] | None = None,
                    processes: set[str] | None = None) -> StackSelection:
    """load_stacks over these files; a file that cannot be read goes to ``corrupt``."""
    return sum_in_groups(paths, images, processes).selection()


@dataclass
class StackArrays:
    """The stacks of a selection as columns, one row per stored stack (rows are not summed): what a
    flame graph folds without a Python object per frame. Row r's frames, leaf first, are
    ``image[splits[r]:splits[r+1]]`` (indices into ``keys``) and the same slice of ``offset``."""

    events: list[str]
    event: np.ndarray  # int32 per row, into events
    count: np.ndarray  # float64 per row
    splits: np.ndarray  # int64, rows + 1
    keys: list[str]  # image keys
    image: np.ndarray  # int32 per frame, into keys
    offset: np.ndarray  # uint64 per frame
    images: dict[str, Any] = field(default_factory=dict)  # image key -> ImageInfo JSON (the files' footers)
    files: int = 0
    corrupt: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.count)

    def rows_of(self, event: str) -> np.ndarray:
        """The rows of ``event``'s stacks."""
        return np.nonzero(self.event == (self.events.index(event) if event in self.events else -1))[0]

    @staticmethod
    def build(events: list[str], event: np.ndarray, count: np.ndarray, lengths: np.ndarray, keys: list[str],
              image: np.ndarray, offset: np.ndarray) -> StackArrays:
        splits = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=splits[1:])
        return StackArrays(events, event.astype(np.int32), count.astype(np.float64), splits, keys,
                           image.astype(np.int32), offset.astype(np.uint64))

    def summed(self) -> StackArrays:
        """Equal stacks (the same event and frames) in one row, their counts added, rows in the
        order of their first occurrence: a fleet's files repeat the same stacks thousands of times.
        Rows are told apart by their event, length and a 64-bit polynomial hash of their frames
        (two distinct stacks of one event and length collide with probability 2**-64 a pair)."""
        n = len(self)
        if n < 2:
            return self
        lengths = np.diff(self.splits)
        depth = int(lengths.max(initial=0))
        pw = np.ones(max(depth, 1), np.uint64)
        with np.errstate(over="ignore"):
            for i in range(1, depth):
                pw[i] = pw[i - 1] * np.uint64(0x100000001B3)
            f = self.offset.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            f ^= (self.image.astype(np.uint64) + np.uint64(1)) * np.uint64(0xC2B2AE3D27D4EB4F)
            f ^= f >> np.uint64(29)
            pos = np.arange(len(self.image), dtype=np.int64) - np.repeat(self.splits[:-1], lengths)
            contrib = f * pw[pos]
        h = np.zeros(n, np.uint64)
        nz = np.nonzero(lengths > 0)[0]
        if len(nz):
            h[nz] = np.add.reduceat(contrib, self.splits[:-1][nz])
        order = np.lexsort((h, lengths, self.event))
        k_ev, k_len, k_h = self.event[order], lengths[order], h[order]
        new = np.ones(n, bool)
        new[1:] = (k_ev[1:] != k_ev[:-1]) | (k_len[1:] != k_len[:-1]) | (k_h[1:] != k_h[:-1])
        group = np.cumsum(new) - 1
        if group[-1] == n - 1:
            return self  # nothing to sum
        inverse = np.empty(n, np.int64)
        inverse[order] = group
        first = np.full(group[-1] + 1, n, np.int64)
        np.minimum.at(first, inverse, np.arange(n))
        count = np.bincount(inverse, weights=self.count, minlength=len(first))
        rank = np.argsort(first, kind="stable")
        rows = first[rank]
        splits, frames = select_rows(self.splits, rows)
        return StackArrays(self.events, self.event[rows], count[rank], splits, self.keys, self.image[frames],
                           self.offset[frames], self.images, self.files, self.corrupt)

    @staticmethod
    def concat(parts: list[StackArrays]) -> StackArrays:
        """The rows of ``parts`` together, their event and image codes made common."""
        events: list[str] = []
        keys: list[str] = []
        ev_ix: dict[str, int] = {}
        key_ix: dict[str, int] = {}
        cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        out = StackArrays([], np.zeros(0, np.int32), np.zeros(0), np.zeros(1, np.int64), [], np.zeros(0, np.int32),
                          np.zeros(0, np.uint64))
        for p in parts:
            em = np.array([ev_ix.setdefault(e, len(ev_ix)) for e in p.events] or [0], np.int32)
            km = np.array([key_ix.setdefault(k, len(key_ix)) for k in p.keys] or [0], np.int32)
            cols.append((em[p.event], p.count, np.diff(p.splits), km[p.image], p.offset))
            out.images.update(p.images)
            out.files += p.files
            out.corrupt += p.corrupt
        events, keys = list(ev_ix), list(key_ix)
        if not cols:
            out.events, out.keys = events, keys
            return out
        ev, count, lengths, image, offset = (np.concatenate([c[i] for c in cols]) for i in range(5))
        built = StackArrays.build(events, ev, count, lengths, keys, image, offset)
        built.images, built.files, built.corrupt = out.images, out.files, out.corrupt
        return built

    def selection(self) -> StackSelection:
        """The rows as load_stacks's Counter of (event, frames) -> samples."""
        out = StackSelection(images=dict(self.images), files=self.files, corrupt=list(self.corrupt))
        summed = self.summed()
        keys, img, off, sp = summed.keys, summed.image.tolist(), summed.offset.tolist(), summed.splits.tolist()
        for r, (e, c) in enumerate(zip(summed.event.tolist(), summed.count.tolist(), strict=True)):
            stack = tuple((keys[img[j]], off[j]) for j in range(sp[r], sp[r + 1]))
            out.counts[(summed.events[e], stack)] += round(c)
        return out


def _codes(arr: pa.Array, index: dict[str | None, int], names: list[Any]) -> np.ndarray:
    """A (dictionary-encoded) string column as codes into ``names``, which grows with new strings."""
    if not pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_encode()
    local = np.array([index.setdefault(v, len(index)) for v in arr.dictionary.to_pylist()] or [0], np.int32)
    for v, i in index.items():
        if i == len(names):
            names.append(v)
    idx = arr.indices.fill_null(0).to_numpy(zero_copy_only=False)
    return local[idx] if len(local) else np.zeros(len(idx), np.int32)


def _list_parts(col: pa.ChunkedArray, path: Path) -> tuple[np.ndarray, pa.Array]:
    """A list column as (row lengths, the values of every row, concatenated)."""
    arr = col.combine_chunks()
    if arr.null_count:
        raise DataError(f"{path}: a stack with no frame list")
    offs = np.asarray(arr.offsets, np.int64)
    return np.diff(offs), arr.values.slice(int(offs[0]), int(offs[-1] - offs[0]))


def _frames(path: Path, t: pa.Table) -> tuple[np.ndarray, pa.Array, pa.Array]:
    """A stack file's frames: (frames per row, every row's image keys, every row's offsets)."""
    lengths, im = _list_parts(t.column("images"), path)
    olen, of = _list_parts(t.column("offsets"), path)
    if not np.array_equal(lengths, olen):
        raise DataError(f"{path}: frames with an image and no offset")
    return lengths, im, of


def select_rows(splits: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For stacks whose row r holds frames ``splits[r]:splits[r+1]``: the splits of ``rows`` alone,
    and the index of their frames among all."""
    lengths = np.diff(splits)[rows]
    out = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out, np.repeat(splits[rows] - out[:-1], lengths) + np.arange(out[-1])


def load_stack_arrays(db: Database, epochs: list[int], hosts: list[str] | None = None,
                      images: set[str] | None = None, processes: set[str] | None = None,
                      events: set[str] | None = None) -> StackArrays:
    """load_stacks's selection as columns, equal stacks summed (``events``: of these events only).
    Corrupt files are reported and skipped; DataError when every file is."""
    out = sum_in_groups(stack_paths(db, epochs, hosts), images, processes, events)
    if not out.files and out.corrupt:
        raise DataError(f"every stack file is corrupt: {out.corrupt[0]}")
    return out


def sum_in_groups(paths: list[Path], images: set[str] | None = None, processes: set[str] | None = None,
                  events: set[str] | None = None, group: int = 32, max_rows: int = 1 << 21) -> StackArrays:
    """stack_arrays_of summed, ``group`` files at a time, the sums summed again whenever they pass
    ``max_rows`` rows: memory follows the distinct stacks, not the files (a fleet's thousands of
    files repeat the same stacks)."""
    parts: list[StackArrays] = []
    rows = 0
    for lo in range(0, max(len(paths), 1), group):
        part = stack_arrays_of(paths[lo : lo + group], images, processes, events).summed()
        parts.append(part)
        rows += len(part)
        if rows > max_rows and len(parts) > 1:
            parts = [StackArrays.concat(parts).summed()]
            rows = len(parts[0])
    return parts[0] if len(parts) == 1 else StackArrays.concat(parts).summed()


def stack_arrays_of(paths: list[Path], images: set[str] | None = None, processes: set[str] | None = None,
                    events: set[str] | None = None) -> StackArrays:
    """The rows of these stack files as columns (not summed: see StackArrays.summed), filtered as
    load_stack_arrays says; a file that cannot be read goes to ``corrupt``."""
    ev_index: dict[str | None, int] = {}
    ev_names: list[str] = []
    key_index: dict[str | None, int] = {}
    key_names: list[str] = []
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    out = StackArrays([], np.zeros(0, np.int32), np.zeros(0), np.zeros(1, np.int64), [], np.zeros(0, np.int32),
                      np.zeros(0, np.uint64))
    for path in paths:
        try:
            meta, t = read_stack_file(path)
            lengths, im, of = _frames(path, t)
        except DataError as err:
            out.corrupt.append(str(err))
            continue
        out.files += 1
        out.images.update(meta.get("images", {}))
        ev = _codes(t.column("event").combine_chunks(), ev_index, ev_names)
        img = _codes(im, key_index, key_names)
        keep = np.ones(t.num_rows, bool)
        if events is not None:
            keep &= np.isin(ev, [i for n, i in ev_index.items() if n in events])
        if processes is not None:
            if "process" in t.column_names:
                pr = t.column("process").combine_chunks().cast(pa.string()).to_pylist()
                keep &= np.fromiter((p in processes for p in pr), bool, len(pr))
            else:
                keep[:] = False
        splits = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=splits[1:])
        if images is not None:
            leaf = np.full(len(lengths), -1, np.int64)
            leaf[lengths > 0] = img[splits[:-1][lengths > 0]]
            want = np.array([i for k, i in key_index.items() if k in images], np.int32)
            keep &= (lengths > 0) & np.isin(leaf, want)
        rows = np.nonzero(keep)[0]
        _, frames = select_rows(splits, rows)
        parts.append((ev[rows], t.column("count").to_numpy().astype(np.float64)[rows], lengths[rows], img[frames],
                      of.to_numpy(zero_copy_only=False).astype(np.uint64)[frames]))
    if parts:
        cols = [np.concatenate([p[i] for p in parts]) for i in range(5)]
        built = StackArrays.build(ev_names, cols[0], cols[1], cols[2], key_names, cols[3], cols[4])
        built.images, built.files, built.corrupt = out.images, out.files, out.corrupt
        return built
    out.events, out.keys = ev_names, key_names
    return out
