"""Hotlist accuracy: the paper's Gibbons-Matias hotlist against other summaries at equal memory.

Contenders, each keeping 16 counters:
  gm          the value-sampling paper's hotlist (N = 16, f = 16/15), cyclescope's
  calder      a Calder-style top-N table with an "other" count and periodic cleaning of its lower
              half (interval 1000, then 1000 + the last steady entry's count), as in section 3
              of ../shared/seeds/002_704d1f54f0e04446.txt
  spacesaving Metwally et al.'s Space-Saving (a miss replaces the minimum counter, count = min + 1)
  sketch      Apache DataSketches' frequent-items sketch, lg_max_map_size = 4 (a 16-slot map, at
              most 12 counters at its 0.75 load factor)

Streams: synthetic distributions with a known truth, and real value streams recorded by exact
mode (single-stepping) from programs, whose complete counts are the truth. Reported per
contender: mean absolute error of the estimated probabilities of the true top 3 values, and how
often the estimated top value is the true one.

A second table measures the per-call-site hotlists (kinds ``KIND@ctx``): one hotlist per
instruction holds (value, call site) pairs of every caller, and the report divides by each site's
share. Streams of pairs from 4 call sites (shares 40/30/20/10%), each site with its own top value
(60% of its calls) and a tail over 1,000 values; error of P(top value | site) per site, GM with the
paper's N = 16 against N = 64 (what cyclescope gives these kinds), and one N = 16 hotlist per
site (the same memory for 4 sites, but it grows with the callers: not what cyclescope does).

Usage: python bench/hotlists.py [--trials 20] [--length 100000] [--programs values,gzip]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT, build, machine, save

sys.path.insert(0, str(ROOT / "src"))
from cyclescope.db.hotlist import N_PER_CALL_SITE, Hotlist

N = 16


class Summary:
    name = ""

    def add(self, v: Hashable) -> None:
        raise NotImplementedError

    def estimates(self) -> dict[Hashable, float]:
        """Estimated probability per kept value."""
        raise NotImplementedError


class GM(Summary):
    name = "gm"

    def __init__(self, seed: int) -> None:
        self.h = Hotlist(N, rng=random.Random(seed))

    def add(self, v: Hashable) -> None:
        self.h.add(v)

    def estimates(self) -> dict[Hashable, float]:
        return {v: share for v, _, share in self.h.top()}


class Calder(Summary):
    name = "calder"

    def __init__(self, seed: int) -> None:
        self.table: dict[Hashable, int] = {}
        self.other = 0
        self.total = 0
        self.next_clean = 1000
        self.since = 0

    def add(self, v: Hashable) -> None:
        self.total += 1
        self.since += 1
        if v in self.table:
            self.table[v] += 1
        elif len(self.table) < N:
            self.table[v] = 1
        else:
            self.other += 1
        if self.since >= self.next_clean:
            ranked = sorted(self.table.items(), key=lambda kv: -kv[1])
            steady, evicted = ranked[: N // 2], ranked[N // 2 :]
            self.other += sum(c for _, c in evicted)
            self.table = dict(steady)
            self.since = 0
            self.next_clean = 1000 + (steady[-1][1] if steady else 0)

    def estimates(self) -> dict[Hashable, float]:
        return {v: c / self.total for v, c in self.table.items()} if self.total else {}


class SpaceSaving(Summary):
    name = "spacesaving"

    def __init__(self, seed: int) -> None:
        self.table: dict[Hashable, int] = {}
        self.total = 0

    def add(self, v: Hashable) -> None:
        self.total += 1
        if v in self.table:
            self.table[v] += 1
        elif len(self.table) < N:
            self.table[v] = 1
        else:
            victim = min(self.table, key=self.table.__getitem__)
            c = self.table.pop(victim)
            self.table[v] = c + 1

    def estimates(self) -> dict[Hashable, float]:
        return {v: c / self.total for v, c in self.table.items()} if self.total else {}


class Sketch(Summary):
    name = "sketch"

    def __init__(self, seed: int) -> None:
        import datasketches

        self.ds = datasketches
        self.s = datasketches.frequent_strings_sketch(4)
        self.total = 0

    def add(self, v: Hashable) -> None:
        self.total += 1
        self.s.update(repr(v))

    def estimates(self) -> dict[Hashable, float]:
        items = self.s.get_frequent_items(self.ds.frequent_items_error_type.NO_FALSE_NEGATIVES)
        return {k: est / self.total for k, est, _lo, _hi in items} if self.total else {}


CONTENDERS: list[type[Summary]] = [GM, Calder, SpaceSaving, Sketch]


def score(stream: list[Hashable], summary: Summary) -> tuple[float, bool]:
    truth = Counter(stream)
    n = len(stream)
    for v in stream:
        summary.add(v)
    est = summary.estimates()
    if isinstance(summary, Sketch):
        est = {k: e for k, e in est.items()}
        top3 = [v for v, _ in truth.most_common(3)]
        errs = [abs(est.get(repr(v), 0.0) - truth[v] / n) for v in top3]
        best = max(est, key=est.__getitem__) if est else None
        return float(np.mean(errs)), best == repr(truth.most_common(1)[0][0])
    top3 = [v for v, _ in truth.most_common(3)]
    errs = [abs(est.get(v, 0.0) - truth[v] / n) for v in top3]
    best = max(est, key=est.__getitem__) if est else None
    return float(np.mean(errs)), best == truth.most_common(1)[0][0]


def synthetic(kind: str, n: int, rng: np.random.Generator) -> list[Hashable]:
    if kind == "70/20/10-spread":
        u = rng.random(n)
        return np.where(u < 0.7, 7, np.where(u < 0.9, 42, rng.integers(1000, 6000, n))).tolist()
    if kind == "zipf-1.2":
        return rng.zipf(1.2, n).tolist()
    if kind == "uniform-8":
        return rng.integers(0, 8, n).tolist()
    if kind == "phase-change":
        # One value dominates the first third, another the rest: the rest's value is the true top.
        a = np.where(rng.random(n // 3) < 0.9, 1, rng.integers(100, 10000, n // 3))
        b = np.where(rng.random(n - n // 3) < 0.6, 2, rng.integers(100, 10000, n - n // 3))
        return np.concatenate([a, b]).tolist()
    raise ValueError(kind)


def call_site_stream(n: int, rng: np.random.Generator, sites: int = 4) -> list[tuple[int, int]]:
    """(value, site) pairs: site s has share w[s], its own top value 10 + s in 60% of its calls, and
    a tail over 1,000 values (shared by all sites)."""
    w = np.array([0.4, 0.3, 0.2, 0.1])[:sites]
    site = rng.choice(len(w), n, p=w / w.sum())
    value = np.where(rng.random(n) < 0.6, 10 + site, rng.integers(1000, 2000, n))
    return list(zip(value.tolist(), site.tolist(), strict=True))


def score_call_sites(stream: list[tuple[int, int]], n: int, seed: int,
                     per_site: bool = False) -> tuple[float, float]:
    """Mean over sites of |estimated - true P(top value | site)|, and the share of sites whose
    estimated top value is the true one; P(site) exact (as the ctx hotlist at the procedure's entry
    has it when a procedure has at most 16 callers). ``per_site``: one hotlist of size n per site
    (memory grows with the callers) in place of one hotlist of pairs."""
    truth = Counter(stream)
    site_n = Counter(s for _, s in stream)
    if per_site:
        hs = {s: Hotlist(n, rng=random.Random(seed * 64 + s)) for s in site_n}
        for v, s in stream:
            hs[s].add(v)
        counts = {(v, s): hs[s].estimate(v) for s in hs for v in hs[s].counts}
    else:
        h = Hotlist(n, rng=random.Random(seed))
        h.extend(stream)
        counts = {vs: h.estimate(vs) for vs in h.counts}
    errs, right = [], []
    for s, ns in site_n.items():
        top_v = max((v for v, s2 in truth if s2 == s), key=lambda v: truth[(v, s)])
        est = {v: c / ns for (v, s2), c in counts.items() if s2 == s}
        errs.append(abs(est.get(top_v, 0.0) - truth[(top_v, s)] / ns))
        right.append(bool(est) and max(est, key=est.__getitem__) == top_v)
    return float(np.mean(errs)), float(np.mean(right))


def run_call_sites(length: int, trials: int) -> dict[str, dict[str, float]]:
    stream = call_site_stream(length, np.random.default_rng(7))
    out = {}
    for label, n, per_site in ((f"N={N}", N, False), (f"N={N_PER_CALL_SITE}", N_PER_CALL_SITE, False),
                               (f"N={N}/site", N, True)):
        res = [score_call_sites(stream, n, t, per_site) for t in range(trials)]
        out[label] = {"mae_top": float(np.mean([e for e, _ in res])),
                         "mae_top_max": float(np.max([e for e, _ in res])),
                         "top1_right": float(np.mean([r for _, r in res]))}
    print(f"\nper-call-site hotlists: {length:,} (value, site) pairs from 4 sites (40/30/20/10%), each site's "
          f"top value 60%; {trials} trials")
    print(f"{'hotlist':<14}{'mean abs. error of P(top | site)':>34}{'worst trial':>14}{'top right':>12}")
    for k, r in out.items():
        print(f"{'GM ' + k:<14}{100 * r['mae_top']:>31.2f} pt{100 * r['mae_top_max']:>11.2f} pt"
              f"{100 * r['top1_right']:>11.0f}%")
    return out


def exact_streams(exe: Path, argv: list[str], length: int, rate: float, min_len: int) -> dict[str, list[int]]:
    """Value streams per (pc, kind) from exact-mode single-stepping of ``exe``."""
    from cyclescope.collect.ptrace import traceme
    from cyclescope.values.exact import WALL, ExactTracer
    from cyclescope.values.modules import Addresses, Operands, Results

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            traceme()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # compressors write their output to stdout
            os.execv(str(exe), [str(exe), *argv])
        finally:
            os._exit(127)
    tracer = ExactTracer(pid, length, 512, int(1e9 / rate), check=False)
    mods = [Operands(per_call_site=False), Addresses(), Results()]
    streams: dict[str, list[int]] = defaultdict(list)
    try:
        while tracer.exited is None:
            _, status = os.waitpid(pid, WALL)
            tracer.on_stop(status)
            for st in tracer.stops:
                for m in mods:
                    for e in m.transform(st.steps):
                        streams[f"{e.pc:#x} {e.kind}"].append(e.value.v0)
            tracer.stops.clear()
    finally:
        if tracer.exited is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        tracer.close()
    return {k: v for k, v in streams.items() if len(v) >= min_len and _clear_top(v)}


def _clear_top(stream: list[int]) -> bool:
    """A stream whose top value is defined: at least 5% of it, and 1.2 times the runner-up (streams of
    distinct values, such as loop counters, have no top value to get right)."""
    top = Counter(stream).most_common(2)
    n = len(stream)
    return top[0][1] >= 0.05 * n and (len(top) < 2 or top[0][1] >= 1.2 * top[1][1])


def run_all(streams: Iterable[tuple[str, list[Hashable]]], trials: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for label, stream in streams:
        res: dict[str, Any] = {}
        for cls in CONTENDERS:
            errs, right = [], []
            for t in range(trials if cls is GM else 1):  # the others are deterministic
                e, r = score(stream, cls(t))
                errs.append(e)
                right.append(r)
            res[cls.name] = {"mae_top3": float(np.mean(errs)), "top1_right": float(np.mean(right))}
        out[label] = res
    return out


def print_table(title: str, results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{title}: mean abs. error of the top-3 probabilities (points) / top value right")
    print(f"{'stream':<28}" + "".join(f"{c.name:>20}" for c in CONTENDERS))
    for label, res in results.items():
        cells = "".join(f"{100 * res[c.name]['mae_top3']:>11.2f} / {100 * res[c.name]['top1_right']:>4.0f}%"
                        for c in CONTENDERS)
        print(f"{label:<28}{cells}")
    if len(results) > 1:
        cells = ""
        for c in CONTENDERS:
            mae = np.mean([r[c.name]["mae_top3"] for r in results.values()])
            right = np.mean([r[c.name]["top1_right"] for r in results.values()])
            cells += f"{100 * mae:>11.2f} / {100 * right:>4.0f}%"
        print(f"{'mean':<28}{cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="runs of the (randomized) GM hotlist per stream")
    ap.add_argument("--length", type=int, default=100_000, help="values per synthetic stream")
    ap.add_argument("--programs", default="values,gzip", help="programs to stream real values from (exact mode)")
    ap.add_argument("--exact-rate", type=float, default=2000.0)
    ap.add_argument("--exact-length", type=int, default=8)
    ap.add_argument("--min-stream", type=int, default=300, help="real streams with at least this many values")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    syn = [(k, synthetic(k, args.length, rng)) for k in ("70/20/10-spread", "zipf-1.2", "uniform-8", "phase-change")]
    results = {"synthetic": run_all(syn, args.trials)}
    print_table(f"synthetic streams of {args.length:,} values, {args.trials} GM trials", results["synthetic"])
    results["call_sites"] = run_call_sites(args.length, args.trials)  # type: ignore[assignment]
    real: list[tuple[str, list[Hashable]]] = []
    tmp = Path("/tmp/cs-bench-hotlists")
    for prog in [p for p in args.programs.split(",") if p]:
        if prog == "values":
            exe = build("../tests/programs/values.c", tmp / "values")
            argv = ["3000000"]
        else:
            exe = ROOT / "bench" / "out" / "suite" / "bin" / prog
            inp = ROOT / "bench" / "out" / "suite" / "input.txt"
            if not exe.exists() or not inp.exists():
                print(f"skipping {prog}: build it first with bench/suite.py", file=sys.stderr)
                continue
            argv = ["-c", "-6", str(inp)] if prog in ("gzip", "minigzip") else ["-c", "-9", str(inp)]
        streams = exact_streams(exe, argv, args.exact_length, args.exact_rate, args.min_stream)
        # The streams with the most values, at most 12 per program.
        for key in sorted(streams, key=lambda k: -len(streams[k]))[:12]:
            real.append((f"{prog} {key}", streams[key]))  # type: ignore[arg-type]
    if real:
        results["real"] = run_all(real, args.trials)
        print_table("real value streams from exact mode", results["real"])
    path = save("hotlists", {"machine": machine(), "args": vars(args), "results": results,
                             "stream_lengths": {k: len(v) for k, v in real}})
    print(f"\nraw data: {path}")


if __name__ == "__main__":
    main()
