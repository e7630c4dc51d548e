"""Distinct values and groups of small arrays, for the recorder's per-drain work.

numpy's np.unique does more than the collector needs (numpy 2.4, here): over rows (axis=0) it
compares them as a structured dtype (about 220 us for 200 rows of two columns, against 20 us for
one sort of packed keys), with return_inverse or return_counts it adds passes and checks, and its
first call imports numpy.ma (about 20 ms; parquet.from_numpy keeps pyarrow's conversions from
importing it too), as does np.median's first call (its check for a masked array: 10 ms of a
recording's first drain with moving arguments). These do the one sort (or a bincount, or a
partition) and nothing else;
the recording path (collect/, images/, db/, and calc's evidence collected while recording) uses
them instead of np.unique.
"""

from __future__ import annotations

import numpy as np


def _starts(s: np.ndarray) -> np.ndarray:
    """Where each run of equal values of the sorted ``s`` starts (a mask)."""
    new = np.empty(len(s), bool)
    new[:1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    return new


def distinct(x: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D array, ascending: np.unique(x)."""
    x = np.asarray(x)
    if not len(x):
        return x[:0]
    s = np.sort(x)
    out: np.ndarray = s[_starts(s)]
    return out


def group(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D array, ascending, and each element's index among them:
    np.unique(x, return_inverse=True)."""
    x = np.asarray(x)
    first, inverse = group_rows(x)
    return x[first], inverse


def group_rows(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by one or more 1-D keys of one length, the first the most significant: the
    index of each group's first row, groups in ascending order of their keys, and each row's
    group (what np.unique over the rows gives with return_index and return_inverse)."""
    n = len(keys[0])
    if not n:
        return np.zeros(0, np.intp), np.zeros(0, np.intp)
    # Stable, so that a group's first row in the order is its first row in the input.
    order = np.argsort(keys[0], kind="stable") if len(keys) == 1 else np.lexsort(keys[::-1])
    new = _starts(keys[0][order])
    for k in keys[1:]:
        new |= _starts(k[order])
    inverse = np.empty(n, np.intp)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse


def counts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D integer array, ascending, and how many times each occurs:
    np.unique(x, return_counts=True); by a bincount where they are small non-negative integers
    (indices into a table)."""
    x = np.asarray(x)
    if not len(x):
        return x[:0], np.zeros(0, np.int64)
    if int(x.min()) >= 0 and int(x.max()) < 1 << 16:
        c = np.bincount(x)
        values = np.flatnonzero(c)
        return values.astype(x.dtype, copy=False), c[values]
    s = np.sort(x)
    first = np.flatnonzero(_starts(s))
    return s[first], np.diff(np.append(first, len(s)))


def lookup(keys: np.ndarray, values: np.ndarray, x: np.ndarray, missing: int = -1) -> np.ndarray:
    """``values`` at each of ``x`` among the ascending ``keys`` (``missing`` where it is none of
    them): one search of the sorted keys, where a dictionary look-up per element costs a Python
    call each (a sample's event by its id, a probe's site by its hit's id)."""
    if not len(keys):
        return np.full(len(x), missing, values.dtype)
    pos = np.minimum(np.searchsorted(keys, x), len(keys) - 1)
    return np.where(keys[pos] == x, values[pos], missing)


def median(x: np.ndarray) -> float:
    """np.median of a non-empty 1-D array (the mean of the two middle values of an even count)."""
    x = np.asarray(x, np.float64)
    n = len(x)
    lo, hi = (n - 1) // 2, n // 2
    p = np.partition(x, (lo, hi))
    return 0.5 * (float(p[lo]) + float(p[hi]))
