"""In-memory aggregation of mapped samples into counts per (image, offset, event, process).

The daemon's analog of DCPI's per-image hash tables, vectorized: batches are
appended as arrays and reduced by sorting when enough rows are pending, so
memory depends on the number of distinct keys, not on the number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cyclescope.arrays import group

_IMAGE_SHIFT = 32
_COMM_SHIFT = 8
_COMM_MASK = (1 << 24) - 1
_EVENT_MASK = 0xFF
_OFFSET_BITS = 48
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_MAX_IDS = 1 << (64 - _OFFSET_BITS)


@dataclass
class Counts:
    """Reduced counts; every (image, offset, event, comm) appears once."""

    image: np.ndarray  # int32
    offset: np.ndarray  # uint64
    event: np.ndarray  # int16
    comm: np.ndarray  # int32
    count: np.ndarray  # uint64
    # uint64: the sum of the samples' periods (event units), so that reports weigh each sample by
    # the period it stood for (periods are randomized; see Session.account)
    weight: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.count)

    @property
    def total(self) -> int:
        return int(self.count.sum())

    @staticmethod
    def empty() -> Counts:
        z = np.zeros(0, np.int32)
        return Counts(z, np.zeros(0, np.uint64), np.zeros(0, np.int16), z, np.zeros(0, np.uint64),
                      np.zeros(0, np.uint64))


def pack_key(image: np.ndarray, event: np.ndarray, comm: np.ndarray) -> np.ndarray:
    if len(image) and (image.max() >= 1 << 31 or comm.max() > _COMM_MASK or event.max() > _EVENT_MASK):
        raise OverflowError("too many distinct images, processes or events to pack")
    return (
        (image.astype(np.uint64) << np.uint64(_IMAGE_SHIFT))
        | (comm.astype(np.uint64) << np.uint64(_COMM_SHIFT))
        | event.astype(np.uint64)
    )


def reduce_keys(k1: np.ndarray, k2: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum ``counts`` (one column or several) over equal (k1, k2) pairs; output sorted by (k1, k2)."""
    if not len(k1):
        return k1, k2, counts
    order = np.lexsort((k2, k1))
    a, b, c = k1[order], k2[order], counts[order]
    change = np.empty(len(a), dtype=bool)
    change[0] = True
    change[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    starts = np.flatnonzero(change)
    return a[starts], b[starts], np.add.reduceat(c, starts).astype(np.uint64)


class Aggregator:
    """Counts per (image, offset, event, process), kept as one sorted array of 64-bit keys and two
    count columns (24 bytes a distinct key), merged into at each reduction.

    A key is a dense number for (image, event, process, the offset's top 16 bits), given out as
    they first come, above the offset's low 48 bits: one integer column, so that a reduction sorts
    only the rows that came since the last one and merges them into the held keys by binary
    search. Sorting everything held at every reduction (the design before) briefly needed about
    three times the memory of all rows held, the daemon's peak between flushes. Rows are reduced
    once ``step`` have come (768 KiB); past 65,536 dense numbers the keys so far are set aside,
    decoded, and merged at ``take`` (a batch is taken 65,536 rows at a time, so that no batch
    alone brings more groups than there are numbers)."""

    def __init__(self, step: int = 1 << 15) -> None:
        self.step = step
        self.samples = 0
        self._start()
        self._spilled: list[Counts] = []

    def _start(self) -> None:
        # per dense number: its packed (image, process, event) and offset >> 48
        self._group_k1 = np.zeros(0, np.uint64)
        self._group_hi = np.zeros(0, np.uint64)
        self._low_k1 = np.zeros(0, np.uint64)  # the groups of offsets under 2**48, sorted, and their numbers
        self._low_id = np.zeros(0, np.uint64)
        self._high: dict[tuple[int, int], int] = {}  # the others
        self._keys = np.zeros(0, np.uint64)  # sorted, distinct
        self._cnt = np.zeros(0, np.uint64)  # per key: samples
        self._wsum = np.zeros(0, np.uint64)  # and the sum of their periods
        self._pk: list[np.ndarray] = []
        self._pc: list[np.ndarray] = []
        self._pending = 0

    def add(self, image: np.ndarray, offset: np.ndarray, event: np.ndarray, comm: np.ndarray,
            count: np.ndarray | None = None, weight: np.ndarray | None = None) -> None:
        """``weight``: each row's period (sum of periods where ``count`` is given); 0 if unknown."""
        n = len(image)
        if not n:
            return
        if n > _MAX_IDS:
            for lo in range(0, n, _MAX_IDS):
                part = slice(lo, lo + _MAX_IDS)
                self.add(image[part], offset[part], event[part], comm[part], None if count is None else count[part],
                         None if weight is None else weight[part])
            return
        c = np.empty((n, 2), np.uint64)
        c[:, 0] = 1 if count is None else count.astype(np.uint64, copy=False)
        c[:, 1] = 0 if weight is None else np.rint(weight).astype(np.uint64)
        self.samples += int(c[:, 0].sum())
        k1 = pack_key(image, event, comm)
        off = offset.astype(np.uint64, copy=False)
        gid = self._group_ids(k1, off >> np.uint64(_OFFSET_BITS))
        self._pk.append((gid << np.uint64(_OFFSET_BITS)) | (off & np.uint64(_OFFSET_MASK)))
        self._pc.append(c)
        self._pending += n
        if self._pending >= self.step:
            self._reduce()

    def _group_ids(self, k1: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Each row's dense number, given out to the groups not seen yet."""
        if hi.any():  # offsets past 2**48: not seen in practice, but kept whole
            groups, inverse = np.unique(np.stack([k1, hi]), axis=1, return_inverse=True)
            if len(self._group_k1) + groups.shape[1] > _MAX_IDS:
                self._spill()
            ids: list[int] = []
            for a, b in groups.T.tolist():
                if (a, b) not in self._high:
                    self._high[(a, b)] = int(self._new_groups(np.array([a], np.uint64), np.array([b], np.uint64))[0])
                ids.append(self._high[(a, b)])
            return np.array(ids, np.uint64)[inverse.reshape(-1)]
        u, inverse = group(k1)
        if len(self._group_k1) + len(u) > _MAX_IDS:
            self._spill()
        pos = np.searchsorted(self._low_k1, u)
        seen = pos < len(self._low_k1)
        seen[seen] = self._low_k1[pos[seen]] == u[seen]
        found = np.empty(len(u), np.uint64)
        found[seen] = self._low_id[pos[seen]]
        fresh = ~seen
        if fresh.any():
            found[fresh] = new = self._new_groups(u[fresh], np.zeros(int(fresh.sum()), np.uint64))
            self._low_k1 = np.insert(self._low_k1, pos[fresh], u[fresh])
            self._low_id = np.insert(self._low_id, pos[fresh], new)
        return found[inverse.reshape(-1)]

    def _new_groups(self, k1: np.ndarray, hi: np.ndarray) -> np.ndarray:
        first = len(self._group_k1)
        self._group_k1 = np.concatenate([self._group_k1, k1])
        self._group_hi = np.concatenate([self._group_hi, hi])
        return np.arange(first, len(self._group_k1), dtype=np.uint64)

    def _reduce(self) -> None:
        if not self._pk:
            return
        keys, counts = np.concatenate(self._pk), np.concatenate(self._pc)
        self._pk, self._pc, self._pending = [], [], 0
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        keys, counts = keys[starts], np.add.reduceat(counts, starts).astype(np.uint64)
        pos = np.searchsorted(self._keys, keys)
        held = pos < len(self._keys)
        held[held] = self._keys[pos[held]] == keys[held]
        at = pos[held]  # distinct positions: no np.add.at needed
        self._cnt[at] += counts[held, 0]
        self._wsum[at] += counts[held, 1]
        new = ~held
        if new.any():
            at = pos[new]
            self._keys = np.insert(self._keys, at, keys[new])
            self._cnt = np.insert(self._cnt, at, counts[new, 0])
            self._wsum = np.insert(self._wsum, at, counts[new, 1])

    def _decoded(self) -> Counts:
        """The reduced counts so far, sorted by (image, process, event, offset); the aggregator
        starts empty, and its arrays are let go of as they are used: a flush's peak memory is
        this, about 64 bytes a distinct key at its height (95 when every step kept its inputs)."""
        self._reduce()
        keys, cnt, wsum, group_k1, group_hi = self._keys, self._cnt, self._wsum, self._group_k1, self._group_hi
        self._start()
        if not len(keys):
            return Counts.empty()
        rank = np.empty(len(group_k1), np.uint64)
        rank[np.lexsort((group_hi, group_k1))] = np.arange(len(group_k1), dtype=np.uint64)
        sort_key = rank[keys >> np.uint64(_OFFSET_BITS)]
        sort_key <<= np.uint64(_OFFSET_BITS)
        sort_key |= keys & np.uint64(_OFFSET_MASK)
        order = np.argsort(sort_key)
        del sort_key
        keys, cnt, wsum = keys[order], cnt[order], wsum[order]
        del order
        gid = keys >> np.uint64(_OFFSET_BITS)
        offset = keys
        offset &= np.uint64(_OFFSET_MASK)
        if group_hi.any():
            offset |= group_hi[gid] << np.uint64(_OFFSET_BITS)
        k1 = group_k1[gid]
        del gid
        return _unpacked(k1, offset, cnt, wsum)

    def _spill(self) -> None:
        self._spilled.append(self._decoded())

    def __len__(self) -> int:
        """Rows held (distinct keys after the last reduction plus pending rows)."""
        return len(self._keys) + self._pending + sum(len(c) for c in self._spilled)

    def take(self) -> Counts:
        """The reduced counts so far; the aggregator starts empty again."""
        out = self._decoded()
        if self._spilled:
            parts = [*self._spilled, out]
            k1, offset, c = reduce_keys(
                np.concatenate([pack_key(p.image, p.event, p.comm) for p in parts]),
                np.concatenate([p.offset for p in parts]),
                np.concatenate([np.stack([p.count, p.weight if p.weight is not None else 0 * p.count], axis=1)
                                for p in parts]))
            out = _unpacked(k1, offset, np.ascontiguousarray(c[:, 0]), np.ascontiguousarray(c[:, 1]))
        self._spilled = []
        self.samples = 0
        return out


def _unpacked(k1: np.ndarray, offset: np.ndarray, count: np.ndarray, weight: np.ndarray) -> Counts:
    """Counts from packed (image, process, event) keys (consumed), offsets and counts. The fields
    are held as narrow as they are packed (image and process under 2**31, event under 2**8): 34
    bytes a row instead of 48, what the rest of a flush (the segment's parts, the processors'
    tallies) builds on top of (3 MiB at the soak's 200k rows a flush)."""
    comm = k1 >> np.uint64(_COMM_SHIFT)
    comm &= np.uint64(_COMM_MASK)
    narrow_comm = comm.astype(np.int32)
    del comm
    image = (k1 >> np.uint64(_IMAGE_SHIFT)).astype(np.int32)
    k1 &= np.uint64(_EVENT_MASK)
    return Counts(image, offset, k1.astype(np.int16), narrow_comm, count, weight)
