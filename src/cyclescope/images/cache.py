"""A per-user cache of data derived from binaries, keyed by image (build-id).

Decoding DWARF or a large .symtab takes seconds (all line tables of
libpython3.11: 7.5 s here); a binary named by its build-id never changes, so
what was decoded once is kept as Parquet under
``$CYCLESCOPE_CACHE`` (default ``$XDG_CACHE_HOME/cyclescope`` or
``~/.cache/cyclescope``). Writes are atomic; a cache that cannot be written
is simply not used. Safe to delete at any time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from cyclescope import parquet, sha1_hex

CACHE_VERSION = 1


def default_root() -> Path:
    env = os.environ.get("CYCLESCOPE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cyclescope"


def _dir_name(key: str) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in key)[:64]
    return f"{safe}-{sha1_hex(key.encode())[:8]}"


class Cache:
    def __init__(self, root: Path | None = None, enabled: bool = True) -> None:
        self.root = (root or default_root()) / f"v{CACHE_VERSION}"
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def path(self, key: str, name: str) -> Path:
        return self.root / _dir_name(key) / f"{name}.parquet"

    def load(self, key: str, name: str, columns: list[str] | None = None) -> pa.Table | None:
        """The table save wrote (only ``columns`` where given), or None."""
        if not self.enabled:
            return None
        p = self.path(key, name)
        try:
            t = parquet.read_table(p, columns)
        except (OSError, pa.ArrowException, ValueError):
            self.misses += 1
            return None
        self.hits += 1
        return t

    def save(self, key: str, name: str, table: pa.Table) -> None:
        if not self.enabled:
            return
        p = self.path(key, name)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".tmp-{os.getpid()}-{p.name}")
            parquet.write_table(table, tmp, compression="zstd")
            os.replace(tmp, p)
        except OSError:
            pass  # a read-only or full disk: work without the cache

    def load_arrays(self, key: str, name: str) -> dict[str, Any] | None:
        """Arrays saved by save_arrays (an .npz without pickled objects), or None."""
        if not self.enabled:
            return None
        import numpy as np

        p = self.root / _dir_name(key) / f"{name}.npz"
        try:
            with np.load(p, allow_pickle=False) as z:
                out = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError):
            self.misses += 1
            return None
        self.hits += 1
        return out

    def save_arrays(self, key: str, name: str, arrays: dict[str, Any]) -> None:
        if not self.enabled:
            return
        import numpy as np

        p = self.root / _dir_name(key) / f"{name}.npz"
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".tmp-{os.getpid()}-{p.name}")
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, p)
        except OSError:
            pass  # a read-only or full disk: work without the cache
