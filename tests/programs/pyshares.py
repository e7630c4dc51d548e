"""Three Python functions doing the same work per iteration, 70, 20 and 10 iterations in every 100:
their shares of the run are about 70%, 20% and 10% (tests/system/test_ebpf.py, bench/pyframes.py).
With --time, each function's own wall time is printed at the end (the truth a profile is checked
against): "seventy S twenty S ten S"."""

import sys
import time


def seventy(n: int) -> int:
    s = 0
    for i in range(n):
        s += i & 7
    return s


def twenty(n: int) -> int:
    s = 0
    for i in range(n):
        s += i & 7
    return s


def ten(n: int) -> int:
    s = 0
    for i in range(n):
        s += i & 7
    return s


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    timed = "--time" in sys.argv
    spent = dict.fromkeys(("seventy", "twenty", "ten"), 0)
    for _ in range(rounds):
        for f, n in ((seventy, 70_000), (twenty, 20_000), (ten, 10_000)):
            t0 = time.perf_counter_ns() if timed else 0
            f(n)
            if timed:
                spent[f.__name__] += time.perf_counter_ns() - t0
    if timed:
        print(" ".join(f"{k} {v / 1e9:.6f}" for k, v in spent.items()))


main()
