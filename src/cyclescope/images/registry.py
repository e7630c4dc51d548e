"""Images: what a mapping holds, named so that profiles merge across processes and hosts.

An image is named by its ELF build-id; without one, by (path, size, mtime).
Offsets within an image are ELF virtual addresses ("vaddr"), offsets from the
kernel's ``_text`` or a module's base ("kernel"), raw file offsets when the ELF
could not be read ("file"), or absolute addresses for JIT code ("absolute").
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from dataclasses import dataclass

from cyclescope.errors import DataError
from cyclescope.images.elf import ElfInfo, info_from_bytes, read_load_info
from cyclescope.images.procfs import started_at

ImageIndex = int


class Unknown(enum.IntEnum):
    """Why a sample could not be mapped; stored as the offset in the [unknown] image."""

    NO_PROCESS = 0  # no maps known for the process
    NO_MAPPING = 1  # the address is in no known mapping
    ANON = 2  # anonymous executable memory without /tmp/perf-PID.map
    KERNEL = 3  # a kernel address outside the kernel's and modules' text
    OTHER_MODE = 4  # hypervisor or guest mode


UNKNOWN_KEY = "[unknown]"
# A perf map older than its process's start by more than this (the start is known to a clock tick)
# is another process's: jit_image.
STALE_MAP_SLACK_S = 0.05


@dataclass(frozen=True)
class ImageInfo:
    key: str
    path: str
    kind: str  # elf | kernel | module | vdso | jit | unknown
    build_id: str | None = None
    size: int | None = None
    mtime: int | None = None
    offsets: str = "vaddr"

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key, "path": self.path, "kind": self.kind, "build_id": self.build_id,
            "size": self.size, "mtime": self.mtime, "offsets": self.offsets,
        }

    @staticmethod
    def from_json(d: dict[str, object]) -> ImageInfo:
        size = d.get("size")
        mtime = d.get("mtime")
        return ImageInfo(
            str(d["key"]), str(d["path"]), str(d["kind"]),
            str(d["build_id"]) if d.get("build_id") else None,
            int(size) if isinstance(size, int) else None,
            int(mtime) if isinstance(mtime, int) else None,
            str(d.get("offsets", "vaddr")),
        )


class ImageTable:
    """Interns images to small integers; index 0 is the [unknown] pseudo-image."""

    def __init__(self) -> None:
        self.infos: list[ImageInfo] = []
        self._by_key: dict[str, int] = {}
        self.intern(ImageInfo(UNKNOWN_KEY, UNKNOWN_KEY, "unknown", offsets="reason"))

    def intern(self, info: ImageInfo) -> ImageIndex:
        idx = self._by_key.get(info.key)
        if idx is None:
            idx = len(self.infos)
            self.infos.append(info)
            self._by_key[info.key] = idx
        return idx

    def __len__(self) -> int:
        return len(self.infos)

    def __getitem__(self, idx: int) -> ImageInfo:
        return self.infos[idx]

    def keys(self) -> list[str]:
        return [i.key for i in self.infos]

    def index_of(self, key: str) -> ImageIndex:
        """The index of the image with ``key`` (0, the unknown image, if it has not been interned)."""
        return self._by_key.get(key, 0)


ANON_NAMES = ("//anon", "[anon", "/dev/zero", "[heap]", "[stack", "/memfd:", "/SYSV")


def is_anon(path: str) -> bool:
    return not path or path.startswith(ANON_NAMES)


@dataclass(frozen=True)
class Resolved:
    image: ImageIndex
    bias: int  # offset = ip - bias


class ImageResolver:
    """Turns a mapping (pid, start, pgoff, path, build-id) into an image and an address bias.

    ELF headers are read once per build-id (or per path/inode without one) and
    kept in a bounded LRU cache, so process churn re-reads nothing.
    """

    def __init__(self, table: ImageTable, cache_size: int = 4096, proc_root: str = "/proc") -> None:
        self.table = table
        self.proc = proc_root
        self._elf: OrderedDict[tuple[object, ...], tuple[ImageIndex, ElfInfo | None]] = OrderedDict()
        self._cache_size = cache_size
        self.vdso: tuple[ImageIndex, ElfInfo] | None = None
        self.jit_images: dict[int, ImageIndex] = {}
        self.unreadable: set[str] = set()

    def set_vdso(self, data: bytes) -> ImageIndex | None:
        """The vdso is the same in every process of one kernel: learn it from our own."""
        try:
            info = info_from_bytes(data, "[vdso]")
        except DataError:
            return None
        key = info.build_id or f"vdso:{os.uname().release}"
        idx = self.table.intern(ImageInfo(key, "[vdso]", "vdso", info.build_id, len(data), None))
        self.vdso = (idx, info)
        return idx

    def _cache_get(self, k: tuple[object, ...]) -> tuple[ImageIndex, ElfInfo | None] | None:
        v = self._elf.get(k)
        if v is not None:
            self._elf.move_to_end(k)
        return v

    def _cache_put(self, k: tuple[object, ...], v: tuple[ImageIndex, ElfInfo | None]) -> None:
        self._elf[k] = v
        if len(self._elf) > self._cache_size:
            self._elf.popitem(last=False)

    def _candidates(self, pid: int, path: str, start: int, end: int) -> list[str]:
        clean = path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path
        out = []
        if not path.endswith(" (deleted)"):
            out.append(clean)
        out.append(f"{self.proc}/{pid}/map_files/{start:x}-{end:x}")
        out.append(f"{self.proc}/{pid}/root{clean}")
        return out

    def resolve(self, pid: int, start: int, end: int, pgoff: int, path: str, build_id: bytes | None) -> Resolved:
        from cyclescope.images.kernel import KERNEL_IMAGE_PATH

        if path.startswith("[vdso]"):
            if self.vdso is not None:
                idx, vinfo = self.vdso
                b = vinfo.vaddr_bias(pgoff)
                return Resolved(idx, start - pgoff - (b or 0))
            return Resolved(0, 0)  # [unknown]; reason decided by the caller
        if is_anon(path) or path.startswith("[") or path == KERNEL_IMAGE_PATH:
            jit = self.jit_image(pid)
            if jit is not None:
                return Resolved(jit, 0)
            return Resolved(-int(Unknown.ANON) - 1, 0)
        bid = build_id.hex() if build_id else None
        ck: tuple[object, ...]
        if bid:
            ck = ("b", bid)
            hit = self._cache_get(ck)
            if hit is not None:
                return self._with_bias(hit, start, pgoff)
        info: ElfInfo | None = None
        st = None
        for cand in self._candidates(pid, path, start, end):
            try:
                st = os.stat(cand)
                if not bid:
                    ck = ("p", path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                    hit = self._cache_get(ck)
                    if hit is not None:
                        return self._with_bias(hit, start, pgoff)
                info = read_load_info(cand)
                break
            except (OSError, DataError):
                continue
        clean = path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path
        if info is not None:
            key_bid = bid or info.build_id
            size = st.st_size if st else None
            mtime = int(st.st_mtime) if st else None
            key = key_bid or f"{clean}:{size}:{mtime}"
            image = ImageInfo(key, clean, "elf", key_bid, size, mtime, "vaddr")
            entry = (self.table.intern(image), info)
            if not bid:
                ck = ("p", path, st.st_dev if st else 0, st.st_ino if st else 0, size, st.st_mtime_ns if st else 0)
            self._cache_put(ck, entry)
            return self._with_bias(entry, start, pgoff)
        # Not readable as ELF (gone, no permission, or not ELF): keep file offsets.
        self.unreadable.add(clean)
        key = (bid or f"{clean}:?:?") + "#file-offsets"
        idx = self.table.intern(ImageInfo(key, clean, "elf", bid, None, None, "file"))
        return Resolved(idx, start - pgoff)

    def _with_bias(self, entry: tuple[ImageIndex, ElfInfo | None], start: int, pgoff: int) -> Resolved:
        idx, info = entry
        if info is None:
            return Resolved(idx, start - pgoff)
        b = info.vaddr_bias(pgoff)
        if b is None:
            return Resolved(idx, start - pgoff)
        # vaddr = ip - start + pgoff + (p_vaddr - p_offset)
        return Resolved(idx, start - pgoff - b)

    def jit_image(self, pid: int) -> ImageIndex | None:
        idx = self.jit_images.get(pid)
        if idx is not None:
            return idx
        path = f"/tmp/perf-{pid}.map"
        try:
            st = os.stat(path)
            owner = os.stat(f"/proc/{pid}").st_uid  # whose the map must be (procfs.read_perf_map)
        except OSError:
            return None
        started = started_at(pid)
        if started is not None and st.st_mtime < started - STALE_MAP_SLACK_S:
            # Written before the process started: another process's of the same pid (perf maps
            # stay in /tmp after their process; pids come round again, at 32,768 here), whose names
            # would be given to this one's JIT code.
            return None
        key = f"jit:{pid}:{int(st.st_mtime_ns)}:{owner}"
        idx = self.table.intern(ImageInfo(key, path, "jit", None, None, None, "absolute"))
        self.jit_images[pid] = idx
        return idx

    def forget_pid(self, pid: int) -> None:
        self.jit_images.pop(pid, None)
