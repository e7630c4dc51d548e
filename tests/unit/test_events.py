"""Event specifications, periods, the safe rate ceiling and period randomization."""

from __future__ import annotations

import numpy as np
import pytest

from cyclescope.collect.events import (
    PeriodRandomizer,
    cpu_hz,
    max_rate_hz,
    nominal_period,
    parse_event,
    parse_events,
)
from cyclescope.collect.session import PeriodTimeline
from cyclescope.errors import UsageError
from cyclescope.perf.abi import EventType, HwId, SwId


def test_parse_names_aliases_modifiers_and_terms() -> None:
    e = parse_event("cpu-clock")
    assert (e.type, e.config, e.time_based, e.hardware) == (EventType.SOFTWARE, SwId.CPU_CLOCK, True, False)
    c = parse_event("cpu-cycles:u")
    assert c.name == "cycles" and c.config == HwId.CPU_CYCLES and c.exclude_kernel and not c.exclude_user
    assert c.label == "cycles:u"
    k = parse_event("instructions:k")
    assert k.exclude_user and not k.exclude_kernel and k.label == "instructions:k"
    p = parse_event("cache-misses/period=1000/")
    assert p.period == 1000
    evs = parse_events(["cycles,cache-misses/period=7/", "imiss"])
    assert [x.label for x in evs] == ["cycles", "cache-misses", "l1i-misses"]


@pytest.mark.parametrize("text", ["nosuch", "cycles/foo=1/", "cycles/period=x/", "cycles/period=0/", "a b"])
def test_bad_specs_say_what_is_wrong(text: str) -> None:
    with pytest.raises(UsageError):
        parse_event(text)


def test_duplicates_are_refused() -> None:
    with pytest.raises(UsageError, match="twice"):
        parse_events(["cpu-clock,clock"])


def test_periods_from_rates() -> None:
    clock = parse_event("cpu-clock")
    assert nominal_period(clock, 5000, 2e9) == 200_000
    top = nominal_period(clock, 5000, 2e9, band=1 / 16)
    assert PeriodRandomizer(top, 1 / 16).mean == pytest.approx(200_000, rel=1e-4)
    assert nominal_period(parse_event("cycles"), 1000, 3e9) == 3_000_000
    assert nominal_period(parse_event("cache-misses"), 1000, 3e9) == 5_003  # rare events keep their period
    assert nominal_period(parse_event("cpu-clock/period=12345/"), 5000, 2e9) == 12345
    assert max_rate_hz(clock, 200_000, 1 / 16, 2e9) == pytest.approx(1e9 / (200_000 * 15 / 16))
    assert max_rate_hz(parse_event("cache-misses"), 5003, 0.0, 2e9) is None


def test_randomized_periods_are_uniform_in_the_band() -> None:
    r = PeriodRandomizer(64_000, 1 / 16, seed=3)
    draws = np.array([r.draw() for _ in range(20000)])
    assert draws.min() >= 60_000 and draws.max() <= 64_000
    assert abs(draws.mean() - 62_000) < 50
    assert len(set(draws.tolist())) > 3000  # not a handful of values
    hist, _ = np.histogram(draws, bins=8, range=(60_000, 64_001))
    assert hist.min() > 0.8 * hist.mean()
    assert PeriodRandomizer(100, 0.0).draw() == 100
    with pytest.raises(UsageError):
        PeriodRandomizer(100, 1.5)


def test_period_timeline_gives_the_period_in_force() -> None:
    t = PeriodTimeline()
    t.add(100, 10)
    t.add(200, 20)
    t.add(300, 30)
    assert t.at(np.array([50, 100, 150, 200, 299, 1000], np.uint64)).tolist() == [10, 10, 10, 20, 20, 30]
    t.compact(before=250)
    assert t.times == [200, 300]


def test_cpu_hz_reads_cpuinfo() -> None:
    assert cpu_hz("processor: 0\ncpu MHz\t\t: 2450.000\n") == 2.45e9
    assert cpu_hz("nothing") == 2.0e9


def test_rerandomizing_keeps_the_period_history_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon re-draws its periods five times a second for as long as it runs: the timeline keeps
    what samples still to come may need (a minute, and a per-task child's fork time), no more."""
    from cyclescope.collect import session as sess

    s = sess.Session(parse_events(["cpu-clock"]), sess.SystemWide((0,)), rate_hz=1000)
    s.events = list(s.requested)
    s.randomizers = [PeriodRandomizer(1_000_000, 0.1, seed=1)]
    s.timelines = [PeriodTimeline()]
    tl = s.timelines[0]
    clock = [10**9]
    monkeypatch.setattr(sess, "now_ns", lambda: clock[0])

    def run(seconds: int) -> None:
        for _ in range(5 * seconds):
            clock[0] += 200_000_000
            s.rerandomize()

    run(1800)
    assert len(tl.times) <= 5 * 60 + 2
    assert tl.times[0] <= clock[0] - sess.TIMELINE_KEEP_NS < tl.times[1]  # the entry in force a minute ago
    fork = clock[0]
    in_force = int(tl.at(np.array([fork], np.uint64))[0])
    s._fork_time[42] = fork  # a per-task child forked now keeps this period for its life
    run(600)
    assert int(tl.at(np.array([fork], np.uint64))[0]) == in_force and len(tl.times) > 5 * 600
    s.forget_pid(42)
    run(1)
    assert len(tl.times) <= 5 * 60 + 2


def test_loop_counting_samples_carry_the_top_of_the_user_stack() -> None:
    """With loop counts, each sample carries the user registers and the top STACK_BYTES of the user
    stack (the words where procedures spill the values analysis/progress.py follows); --loop-stack
    takes fewer bytes, or none; what is not a multiple of 8 up to STACK_BYTES is refused."""
    from cyclescope.collect import session as sess
    from cyclescope.errors import UsageError
    from cyclescope.perf.abi import STACK_BYTES, Sample

    target = sess.SystemWide((0,))
    s = sess.Session(parse_events(["cpu-clock"]), target, rate_hz=1000, user_regs=True)
    assert s.layout.sample_type & Sample.REGS_USER and s.layout.sample_type & Sample.STACK_USER
    assert s.layout.stack_user == STACK_BYTES == 256
    s = sess.Session(parse_events(["cpu-clock"]), target, rate_hz=1000, user_regs=True, loop_stack=0)
    assert s.layout.sample_type & Sample.REGS_USER and not s.layout.sample_type & Sample.STACK_USER
    assert sess.Session(parse_events(["cpu-clock"]), target, rate_hz=1000, user_regs=True,
                        loop_stack=64).layout.stack_user == 64
    for bad in (12, STACK_BYTES + 8, -8):
        with pytest.raises(UsageError, match="--loop-stack"):
            sess.Session(parse_events(["cpu-clock"]), target, rate_hz=1000, user_regs=True, loop_stack=bad)
    # no loop counts: neither
    s = sess.Session(parse_events(["cpu-clock"]), target, rate_hz=1000)
    assert not s.layout.sample_type & (Sample.REGS_USER | Sample.STACK_USER)
