"""In-memory aggregation of mapped samples into counts per (image, offset, event, process).

The daemon's analog of DCPI's per-image hash tables, vectorized: batches are
appended as arrays and reduced by sorting when enough rows are pending, so
memory depends on the number of distinct keys, not on the number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_IMAGE_SHIFT = 32
_COMM_SHIFT = 8
_COMM_MASK = (1 << 24) - 1
_EVENT_MASK = 0xFF


@dataclass
class Counts:
    """Reduced counts; every (image, offset, event, comm) appears once."""

    image: np.ndarray  # int64
    offset: np.ndarray  # uint64
    event: np.ndarray  # int64
    comm: np.ndarray  # int64
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
        z = np.zeros(0, np.int64)
        return Counts(z, np.zeros(0, np.uint64), z, z, np.zeros(0, np.uint64), np.zeros(0, np.uint64))


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
    def __init__(self, reduce_at: int = 1 << 18) -> None:  # 8 MiB of pending rows
        self._k1: list[np.ndarray] = []
        self._k2: list[np.ndarray] = []
        self._c: list[np.ndarray] = []
        self._pending = 0
        self._reduced = 0
        self.reduce_at = reduce_at
        self.samples = 0

    def add(self, image: np.ndarray, offset: np.ndarray, event: np.ndarray, comm: np.ndarray,
            count: np.ndarray | None = None, weight: np.ndarray | None = None) -> None:
        """``weight``: each row's period (sum of periods where ``count`` is given); 0 if unknown."""
        n = len(image)
        if not n:
            return
        self._k1.append(pack_key(image, event, comm))
        self._k2.append(offset.astype(np.uint64, copy=False))
        c = np.empty((n, 2), np.uint64)
        c[:, 0] = 1 if count is None else count.astype(np.uint64, copy=False)
        c[:, 1] = 0 if weight is None else np.rint(weight).astype(np.uint64)
        self._c.append(c)
        self._pending += n
        self.samples += int(c[:, 0].sum())
        if self._pending >= self.reduce_at:
            self._reduce()

    def _reduce(self) -> None:
        if len(self._k1) <= 1 and self._pending == self._reduced:
            return
        k1, k2, c = reduce_keys(np.concatenate(self._k1), np.concatenate(self._k2), np.concatenate(self._c))
        self._k1, self._k2, self._c = [k1], [k2], [c]
        self._pending = self._reduced = len(k1)
        # If the distinct keys alone fill the budget, raise it rather than re-sort on every batch.
        if self._reduced * 2 > self.reduce_at:
            self.reduce_at = self._reduced * 2

    def __len__(self) -> int:
        """Rows held (distinct keys after the last reduction plus pending rows)."""
        return self._pending

    def take(self) -> Counts:
        """The reduced counts so far; the aggregator starts empty again."""
        if not self._k1:
            return Counts.empty()
        self._reduce()
        k1, k2, c = self._k1[0], self._k2[0], self._c[0]
        self._k1, self._k2, self._c = [], [], []
        self._pending = self._reduced = 0
        self.samples = 0
        return Counts(
            (k1 >> np.uint64(_IMAGE_SHIFT)).astype(np.int64),
            k2,
            (k1 & np.uint64(_EVENT_MASK)).astype(np.int64),
            ((k1 >> np.uint64(_COMM_SHIFT)) & np.uint64(_COMM_MASK)).astype(np.int64),
            np.ascontiguousarray(c[:, 0]),
            np.ascontiguousarray(c[:, 1]),
        )
