"""The perf_event ABI and its records: the bottom layer that collect, images and values all use.

abi.py: perf_event_attr, record layouts and constants (no system calls); records.py: ring-buffer
bytes decoded into typed records (pure, tested with bytes the tests build).
"""
