"""Call stacks on disk: ``epoch=N/host=H/stacks/stk-A-B.parquet``, one file per flush.

Rows: (event, process, count, images, offsets): one per distinct stack, event and command, frames
leaf first as two list columns (image keys repeat across frames and rows and compress to a dictionary). The footer
holds the images the frames refer to (their paths and kinds), since a caller's image may have no
flat samples. Writes follow the segments' rules: a temporary file, fsync, then a link to a name
no other file has.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cyclescope.collect.stacks import StackCounts
from cyclescope.db.layout import Database, fsync_file
from cyclescope.errors import DataError

META_KEY = b"cyclescope-stacks"
_STK_RE = re.compile(r"^stk-(\d{8,})-(\d{8,})\.parquet$")
SCHEMA = pa.schema([
    ("event", pa.dictionary(pa.int32(), pa.string())),
    ("process", pa.dictionary(pa.int32(), pa.string())),  # the command when sampled (absent in early files)
    ("count", pa.uint64()),
    ("images", pa.list_(pa.dictionary(pa.int32(), pa.string()))),
    ("offsets", pa.list_(pa.uint64())),
])


def stacks_dir(db: Database, epoch: int, host: str) -> Path:
    return db.host_dir(epoch, host) / "stacks"


def write_stacks(db: Database, epoch: int, host: str, sc: StackCounts, image_keys: list[str],
                 events: list[str], images: dict[str, Any], comm_names: list[str] | None = None) -> Path:
    stacks, ev, counts, comms = sc.rows()
    names = comm_names or []
    key_of = [k if i > 0 else "[unknown]" for i, k in enumerate(image_keys)]
    img_col = [[key_of[i] if 0 <= i < len(key_of) else "[unknown]" for i, _ in st] for st in stacks]
    off_col = [[o for _, o in st] for st in stacks]
    table = pa.table({
        "event": pa.array([events[e] if 0 <= e < len(events) else str(e) for e in ev]).dictionary_encode(),
        "process": pa.array([names[c] if 0 <= c < len(names) else "[unknown]" for c in comms],
                            pa.string()).dictionary_encode(),
        "count": pa.array(counts, pa.uint64()),
        "images": pa.array(img_col, pa.list_(pa.string())).cast(SCHEMA.field("images").type),
        "offsets": pa.array(off_col, pa.list_(pa.uint64())),
    })
    with db.host_lock(epoch, host):
        d = stacks_dir(db, epoch, host)
        d.mkdir(parents=True, exist_ok=True)
        seqs = [int(m.group(2)) for f in d.iterdir() if (m := _STK_RE.match(f.name))]
        seq = max(seqs, default=0) + 1
        tmp = db.temp_path(d)
        try:
            meta = {"epoch": epoch, "host": host, "images": images}
            t = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
            pq.write_table(t, tmp, compression="zstd")
            fsync_file(tmp)
            return db.link_new(tmp, d, seq, seq, prefix="stk")
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


@dataclass
class StackSelection:
    counts: Counter[tuple[str, tuple[tuple[str, int], ...]]] = field(default_factory=Counter)  # (event, stack)
    images: dict[str, Any] = field(default_factory=dict)  # image key -> ImageInfo JSON
    files: int = 0
    corrupt: list[str] = field(default_factory=list)


def load_stacks(db: Database, epochs: list[int], hosts: list[str] | None = None,
                images: set[str] | None = None, processes: set[str] | None = None) -> StackSelection:
    """Every stack of the selection, summed. ``images``: keep the stacks whose leaf is in one of
    these images; ``processes``: those of these commands (files written before stacks recorded
    the command have none to match). Corrupt files are reported and skipped."""
    out = StackSelection()
    for epoch in epochs:
        for host in db.hosts(epoch):
            if hosts is not None and host not in hosts:
                continue
            d = stacks_dir(db, epoch, host)
            if not d.is_dir():
                continue
            for f in sorted(d.iterdir()):
                if not _STK_RE.match(f.name):
                    continue
                try:
                    pf = pq.ParquetFile(f)
                    meta = json.loads((pf.schema_arrow.metadata or {}).get(META_KEY, b"{}"))
                    t = pf.read()
                except (OSError, pa.ArrowException, ValueError) as err:
                    out.corrupt.append(f"{f}: {err}")
                    continue
                out.files += 1
                out.images.update(meta.get("images", {}))
                ev = t.column("event").to_pylist()
                cnt = t.column("count").to_pylist()
                imgs = t.column("images").to_pylist()
                offs = t.column("offsets").to_pylist()
                procs = (t.column("process").to_pylist() if "process" in t.column_names
                         else [None] * len(ev))
                for name, c, im, of, pr in zip(ev, cnt, imgs, offs, procs, strict=True):
                    if images is not None and (not im or im[0] not in images):
                        continue
                    if processes is not None and pr not in processes:
                        continue
                    out.counts[(name, tuple(zip(im, of, strict=True)))] += int(c)
    if not out.files and out.corrupt:
        raise DataError(f"every stack file is corrupt: {out.corrupt[0]}")
    return out
