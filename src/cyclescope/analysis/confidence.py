"""The confidence levels of calc's estimates, in order.

A module of its own so that the collector's tallies (analysis/progress.py, imported by the daemon
at every flush) rank estimates without importing the model: analysis/frequency.py brings the
schedule (llvm-mca) and, through hashlib, OpenSSL (3-4 MiB of the daemon's memory).
"""

import math

SURETY = {"high": 2, "medium": 1, "low": 0}


def ratio_error(n: int, num: float, den: float, num_sq: float, den_sq: float, cross: float) -> float | None:
    """The relative standard error of the ratio estimator R = sum(num_k) / sum(den_k) over ``n``
    windows, from the sums of their values, squares and products: sqrt(sum((num_k - R den_k)^2) /
    (n (n - 1))) / mean(den_k) / R. None from fewer than two windows, without a ratio, or where no
    squares were kept (zero in tallies written before them)."""
    if n < 2 or num <= 0 or den <= 0 or den_sq <= 0:
        return None
    r = num / den
    resid = max(0.0, num_sq - 2.0 * r * cross + r * r * den_sq)
    return math.sqrt(resid / (n * (n - 1))) / (den / n) / r
