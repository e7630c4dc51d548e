"""The confidence levels of calc's estimates, in order.

A module of its own so that the collector's tallies (analysis/progress.py, imported by the daemon
at every flush) rank estimates without importing the model: analysis/frequency.py brings the
schedule (llvm-mca) and, through hashlib, OpenSSL (3-4 MiB of the daemon's memory).
"""

SURETY = {"high": 2, "medium": 1, "low": 0}
