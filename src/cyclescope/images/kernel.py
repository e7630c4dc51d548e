"""The kernel and its modules as images: /proc/kallsyms, /proc/modules, notes.

The running kernel has no file to read symbols from, so its symbol table is
snapshotted from /proc/kallsyms and stored in the database. Kernel offsets are
relative to ``_text`` and module offsets relative to the module's base, so that
profiles do not depend on where KASLR put the kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cyclescope import sha1_hex
from cyclescope.images.elf import SymbolTable, build_id_from_notes

KERNEL_IMAGE_PATH = "[kernel.kallsyms]"


@dataclass(frozen=True)
class KernelRange:
    name: str  # "[kernel.kallsyms]" or "[module_name]"
    key: str
    start: int
    end: int
    base: int  # offset = ip - base


_KALLSYMS_RE = re.compile(r"^([0-9a-fA-F]+) [tTwW] (\S+)(?:\t\[(\S+)\])?", re.M)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def kernel_build_id(notes_path: str = "/sys/kernel/notes") -> str | None:
    data = _read(notes_path)
    return build_id_from_notes(data) if data else None


def parse_kallsyms(text: str) -> tuple[np.ndarray, list[str], list[str]]:
    """Text symbols: (addresses, names, owners) with owner "" for the kernel proper."""
    found = _KALLSYMS_RE.findall(text)
    addrs = np.array([int(a, 16) for a, _, _ in found], dtype=np.uint64)
    names = [n for _, n, _ in found]
    owners = [o for _, _, o in found]
    keep = addrs != 0
    if not keep.all():
        idx = np.flatnonzero(keep).tolist()
        addrs = addrs[keep]
        names = [names[i] for i in idx]
        owners = [owners[i] for i in idx]
    return addrs, names, owners


def parse_modules(text: str) -> list[tuple[str, int, int]]:
    """(name, base, size) from /proc/modules."""
    mods = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6:
            try:
                mods.append((parts[0], int(parts[5], 16), int(parts[1])))
            except ValueError:
                continue
    return mods


def _find_symbol(text: str, name: str) -> int:
    """Address of a kernel (not module) symbol: a plain substring search, fast on 100k+ lines."""
    pos = 0
    needle = f" {name}\n"
    while True:
        i = text.find(needle, pos)
        if i < 0:
            return 0
        line = text[text.rfind("\n", 0, i) + 1 : i]
        parts = line.split()
        if len(parts) == 2 and len(parts[1]) == 1:
            try:
                return int(parts[0], 16)
            except ValueError:
                return 0
        pos = i + 1


def kernel_ranges(kallsyms: str, modules: str, kernel_key: str) -> list[KernelRange]:
    """Address ranges of the kernel image and of each module (symbol tables: see kernel_symbols).

    Only a few anchor symbols are looked up, so this stays cheap at start-up:
    the kernel spans ``_text`` (offsets are relative to it) to ``_einittext``.
    """
    ranges: list[KernelRange] = []
    text = _find_symbol(kallsyms, "_text")
    stext = _find_symbol(kallsyms, "_stext")
    etext = _find_symbol(kallsyms, "_etext")
    kend = _find_symbol(kallsyms, "_einittext")  # init text lies after _etext
    base = text or stext
    if base:
        end = max(kend, etext, base + 1)
        ranges.append(KernelRange(KERNEL_IMAGE_PATH, kernel_key, min(base, stext or base), end, base))
    for name, mbase, size in parse_modules(modules):
        notes = _read(f"/sys/module/{name}/notes/.note.gnu.build-id")
        bid = build_id_from_notes(notes) if notes else None
        key = bid or f"module:{name}:{kernel_key}"
        ranges.append(KernelRange(f"[{name}]", key, mbase, mbase + size, mbase))
    return ranges


def kernel_symbols(kallsyms: str, rng: KernelRange) -> SymbolTable:
    """The symbols of one range, relative to its base (the kernel's ``_text`` or the module's base)."""
    addrs, names, owners = parse_kallsyms(kallsyms)
    owner = "" if rng.name == KERNEL_IMAGE_PATH else rng.name.strip("[]")
    sel = np.array([o == owner for o in owners], dtype=bool) & (addrs >= rng.base) & (addrs < rng.end)
    idx = np.flatnonzero(sel)
    rel = addrs[idx] - np.uint64(rng.base)
    return SymbolTable.from_arrays(rel, np.zeros(len(idx), np.uint64), [names[i] for i in idx.tolist()],
                                   text_end=rng.end - rng.base)


_KALLSYMS: tuple[float, str | None] | None = None
KALLSYMS_TTL_S = 30.0  # modules come and go: a long-running daemon reads it afresh


def read_kallsyms() -> str | None:
    """/proc/kallsyms (about 0.15 s to read), kept for a few seconds: start-up reads it twice."""
    global _KALLSYMS
    now = time.monotonic()
    if _KALLSYMS is not None and now - _KALLSYMS[0] < KALLSYMS_TTL_S:
        return _KALLSYMS[1]
    ks = _read("/proc/kallsyms")
    text: str | None = ks.decode("utf-8", "replace") if ks else None
    if text is not None and all(line.startswith("0000000000000000") for line in text.splitlines()[:50]):
        text = None  # kptr_restrict hides the addresses
    _KALLSYMS = (now, text)
    return text


def forget_kallsyms() -> None:
    """Drop the text kept by read_kallsyms (5 MiB here): a daemon's flush, once done with it."""
    global _KALLSYMS
    _KALLSYMS = None


def boot_stamp(modules: str | None = None) -> str | None:
    """This boot and its set of loaded modules, as a short hash (None if the boot id is unknown):
    what kallsyms shows changes only with them."""
    mods = modules if modules is not None else (_read("/proc/modules") or b"").decode("utf-8", "replace")
    boot = (_read("/proc/sys/kernel/random/boot_id") or b"").decode().strip()
    return sha1_hex((boot + "\0" + mods).encode())[:16] if boot else None


def load_kernel_ranges(cache_dir: Path | None = None) -> list[KernelRange]:
    """The running kernel's text and modules, or [] when kallsyms is unreadable.

    Reading /proc/kallsyms costs about 0.1 s, so the ranges are kept in
    ``cache_dir`` for the current boot (KASLR changes only at boot), and
    re-read if /proc/modules changed.
    """
    mods = (_read("/proc/modules") or b"").decode("utf-8", "replace")
    stamp = boot_stamp(mods)
    cached = cache_dir / f"kernel-{stamp}.json" if cache_dir is not None and stamp else None
    if cached is not None:
        try:
            return [KernelRange(**r) for r in json.loads(cached.read_text())]
        except (OSError, ValueError, TypeError):
            pass
    text = read_kallsyms()
    if text is None:
        return []
    release = os.uname().release
    key = kernel_build_id() or f"kernel:{release}"
    ranges = kernel_ranges(text, mods, key)
    if cached is not None:
        with contextlib.suppress(OSError):
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".tmp-{os.getpid()}-{cached.name}")
            tmp.write_text(json.dumps([vars(r) for r in ranges]))
            os.replace(tmp, cached)
    return ranges


class KernelMap:
    """Vectorized lookup of kernel addresses in the kernel and module ranges."""

    def __init__(self, ranges: list[KernelRange]) -> None:
        self.ranges = sorted(ranges, key=lambda r: r.start)
        self._starts = np.array([r.start for r in self.ranges], dtype=np.uint64)
        self._ends = np.array([r.end for r in self.ranges], dtype=np.uint64)
        self._bases = np.array([r.base for r in self.ranges], dtype=np.uint64)

    def lookup(self, ips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(range index or -1, offset) per address."""
        if not self.ranges:
            return np.full(len(ips), -1, dtype=np.int64), np.zeros(len(ips), dtype=np.uint64)
        idx = np.searchsorted(self._starts, ips, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        ok &= ips < self._ends[safe]
        off = ips - self._bases[safe]
        return np.where(ok, idx, -1), np.where(ok, off, 0).astype(np.uint64)
