"""A Python program whose last function runs only in its last moments: `pylast.py FIRST LAST`
spins in first() for FIRST seconds, then in last() for LAST seconds, and exits. The collector
reads a code object's name at the drain after its first sample: last()'s is read from the memory
the eBPF program copied as the process exited, if that drain comes after the exit
(tests/system/test_ebpf.py)."""

import sys
import time


def spin(seconds: float) -> int:
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def first(seconds: float) -> int:
    return spin(seconds)


def last(seconds: float) -> int:
    return spin(seconds)


def main() -> None:
    first(float(sys.argv[1]))
    last(float(sys.argv[2]))


main()
