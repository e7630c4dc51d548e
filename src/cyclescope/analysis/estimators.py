"""The estimators of a stalled class's execution count (analysis/frequency.py's estimate_class), in
a module of their own so that the command line lists them without importing numpy and capstone."""

ESTIMATORS = ("dcpi", "geomean")
