"""Aggregation of mapped samples into counts per (image, offset, event, process)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cyclescope.collect import aggregate
from cyclescope.collect.aggregate import Aggregator, pack_key, reduce_keys


def test_counts_equal_a_plain_counter_over_many_batches() -> None:
    rng = np.random.default_rng(1)
    agg = Aggregator(step=5000)
    truth: Counter[tuple[int, int, int, int]] = Counter()
    for _ in range(30):
        n = 2000
        image = rng.integers(0, 5, n)
        offset = rng.integers(0, 300, n).astype(np.uint64)
        event = rng.integers(0, 3, n)
        comm = rng.integers(0, 4, n)
        agg.add(image, offset, event, comm)
        truth.update(zip(image.tolist(), offset.tolist(), event.tolist(), comm.tolist(), strict=True))
    # Reduced along the way: at most the distinct keys and one step's rows, not all 60000.
    distinct = 5 * 300 * 3 * 4
    assert len(agg) <= distinct + 5000 + 2000 < 60000
    c = agg.take()
    got = Counter({k: v for k, v in zip(zip(c.image.tolist(), c.offset.tolist(), c.event.tolist(), c.comm.tolist(),
                                                strict=True), c.count.tolist(), strict=True)})
    assert got == truth
    assert c.total == 60000
    assert len(agg) == 0 and agg.take().total == 0


Rows = list[tuple[np.ndarray, ...]]


def _truth_and_rows(rng: np.random.Generator, batches: int, n: int,
                    high: bool) -> tuple[Counter[tuple[int, ...]], Rows]:
    truth: Counter[tuple[int, ...]] = Counter()
    rows: Rows = []
    for _ in range(batches):
        image = rng.integers(0, 40, n)
        offset = rng.integers(0, 200, n).astype(np.uint64)
        if high:  # offsets past 2**48 share their low bits with small ones
            offset |= rng.integers(0, 3, n).astype(np.uint64) << np.uint64(50)
        event, comm = rng.integers(0, 2, n), rng.integers(0, 30, n)
        count, weight = rng.integers(1, 4, n), rng.integers(0, 1000, n)
        rows.append((image, offset, event, comm, count, weight))
        for i, o, e, c, k, w in zip(image.tolist(), offset.tolist(), event.tolist(), comm.tolist(), count.tolist(),
                                    weight.tolist(), strict=True):
            truth[(i, o, e, c, 0)] += k
            truth[(i, o, e, c, 1)] += w
    return truth, rows


@pytest.mark.parametrize("high", [False, True])
@pytest.mark.parametrize("max_ids", [1 << 16, 64])
def test_counts_and_weights_equal_a_plain_counter(monkeypatch: pytest.MonkeyPatch, high: bool, max_ids: int) -> None:
    """Sums of counts and periods, offsets past 2**48 kept whole, and more (image, event,
    process) groups than dense numbers (set aside and merged at take), in sorted order."""
    monkeypatch.setattr(aggregate, "_MAX_IDS", max_ids)
    truth, rows = _truth_and_rows(np.random.default_rng(7), 12, 3000, high)
    agg = Aggregator(step=4000)
    for image, offset, event, comm, count, weight in rows:
        agg.add(image, offset, event, comm, count, weight.astype(np.float64))
    c = agg.take()
    got: Counter[tuple[int, ...]] = Counter()
    for i, o, e, m, k, w in zip(c.image.tolist(), c.offset.tolist(), c.event.tolist(), c.comm.tolist(),
                                c.count.tolist(), c.weight.tolist() if c.weight is not None else [], strict=True):
        got[(i, o, e, m, 0)] += k
        got[(i, o, e, m, 1)] += w
    assert +got == +truth
    keys = list(zip(c.image.tolist(), c.comm.tolist(), c.event.tolist(), c.offset.tolist(), strict=True))
    assert keys == sorted(set(keys))  # distinct, sorted
    assert agg.take().total == 0 and len(agg) == 0


def test_explicit_counts_are_added() -> None:
    agg = Aggregator()
    one = np.array([1])
    agg.add(one, np.array([5], np.uint64), one * 0, one * 0, np.array([7]))
    agg.add(one, np.array([5], np.uint64), one * 0, one * 0, np.array([3]))
    c = agg.take()
    assert c.count.tolist() == [10] and c.offset.tolist() == [5]


def test_reduce_keys_sorts_and_sums() -> None:
    k1, k2, c = reduce_keys(np.array([2, 1, 2, 1], np.uint64), np.array([1, 9, 1, 3], np.uint64),
                            np.array([1, 2, 3, 4], np.uint64))
    assert list(zip(k1.tolist(), k2.tolist(), c.tolist(), strict=True)) == [(1, 3, 4), (1, 9, 2), (2, 1, 4)]


def test_keys_that_do_not_fit_are_refused() -> None:
    with pytest.raises(OverflowError):
        pack_key(np.array([1]), np.array([300]), np.array([0]))


def test_more_groups_in_one_batch_than_dense_numbers() -> None:
    """A batch with 70,000 distinct (image, process) pairs: the dense numbers (16 bits) would
    wrap; the batch is taken in parts and the keys set aside between them."""
    n = 70_000
    image = np.arange(1, n + 1)
    offset = (np.arange(n) % 7).astype(np.uint64)
    zero = np.zeros(n, np.int64)
    agg = Aggregator()
    agg.add(image, offset, zero, zero)
    agg.add(image[::-1].copy(), offset[::-1].copy(), zero, zero)
    c = agg.take()
    assert len(c) == n and c.total == 2 * n
    assert c.image.tolist() == image.tolist() and c.offset.tolist() == offset.tolist()
    assert set(c.count.tolist()) == {2}


def test_taken_counts_hold_their_fields_as_narrow_as_they_are_packed() -> None:
    """What a flush builds on: image and process numbers in 32 bits, events in 16, the largest
    values the keys can hold kept whole (34 bytes a row instead of 48)."""
    agg = Aggregator()
    image = np.array([(1 << 31) - 1, 0, 7])
    comm = np.array([(1 << 24) - 1, 3, 0])
    event = np.array([255, 0, 1])
    agg.add(image, np.array([1 << 40, 5, 6], np.uint64), event, comm)
    c = agg.take()
    assert (c.image.dtype, c.comm.dtype, c.event.dtype) == (np.int32, np.int32, np.int16)
    assert sorted(zip(c.image.tolist(), c.comm.tolist(), c.event.tolist(), c.offset.tolist(), strict=True)) == sorted(
        [((1 << 31) - 1, (1 << 24) - 1, 255, 1 << 40), (0, 3, 0, 5), (7, 0, 1, 6)])
    e = Aggregator().take()
    assert (e.image.dtype, e.comm.dtype, e.event.dtype, len(e)) == (np.int32, np.int32, np.int16, 0)
