"""arrays.py against np.unique, whose results it must give, on random and edge-case inputs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from cyclescope.arrays import counts, distinct, group, group_rows, lookup, median


@pytest.mark.parametrize("n", [0, 1, 2, 7, 300])
@pytest.mark.parametrize("kind", ["small", "small_u64", "wide", "negative", "uint64", "object"])
def test_the_helpers_give_what_np_unique_gives(n: int, kind: str) -> None:
    rng = np.random.default_rng(n)
    x = {"small": rng.integers(0, 5, n), "small_u64": rng.integers(0, 5, n).astype(np.uint64),
         "wide": rng.integers(0, 1 << 40, n) // (1 << 38) << 38,
         "negative": rng.integers(-3, 3, n), "uint64": rng.integers(0, 4, n).astype(np.uint64) << np.uint64(63),
         "object": np.array([f"p{k}" for k in rng.integers(0, 4, n)], dtype=object)}[kind]
    u = np.unique(x)
    assert distinct(x).tolist() == u.tolist() and distinct(x).dtype == u.dtype
    v, inv = group(x)
    uu, uinv = np.unique(x, return_inverse=True)
    assert v.tolist() == uu.tolist() and inv.tolist() == uinv.reshape(-1).tolist()
    if kind != "object":
        v, c = counts(x)
        uu, uc = np.unique(x, return_counts=True)
        assert v.tolist() == uu.tolist() and c.tolist() == uc.tolist() and v.dtype == uu.dtype


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_group_rows_gives_what_np_unique_over_rows_gives(n: int) -> None:
    rng = np.random.default_rng(n)
    a, b = rng.integers(0, 3, n).astype(np.uint64), rng.integers(-2, 2, n)
    rows = np.zeros(n, [("a", "<u8"), ("b", "<i8")])
    rows["a"], rows["b"] = a, b
    _, first, inv = np.unique(rows, return_index=True, return_inverse=True)
    got_first, got_inv = group_rows(a, b)
    assert got_first.tolist() == first.tolist() and got_inv.tolist() == inv.reshape(-1).tolist()


def test_lookup_finds_each_value_among_sorted_keys_and_says_where_none() -> None:
    keys, values = np.array([3, 7, 20], np.uint64), np.array([0, 1, 2], np.int64)
    x = np.array([7, 1, 20, 21, 3], np.uint64)  # found, below every key, the last, above every key
    assert lookup(keys, values, x).tolist() == [1, -1, 2, -1, 0]
    assert lookup(keys[:0], values[:0], x).tolist() == [-1] * 5


@pytest.mark.parametrize("n", [1, 2, 3, 4, 11, 300])
def test_median_gives_what_np_median_gives_without_importing_numpy_ma(n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.random(n) * 10 - 3
    assert median(x) == pytest.approx(float(np.median(x)), rel=0, abs=1e-12)
    assert median(np.repeat([5.0], n)) == 5.0
    code = ("import sys, numpy as np; from cyclescope.arrays import median; median(np.arange(7.0));"
            "sys.exit('numpy.ma' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
