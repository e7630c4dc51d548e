"""Exact capture of goal candidates through uprobes (values/probes.py), with a fake kernel: which
sites fit the budget, how they are opened, decoding their hits, closing those over budget, and the
hits counted without thinning in the hotlists."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from cyclescope.db.hotlist import N_EXACT, hotlist_size
from cyclescope.perf.abi import RecordType
from cyclescope.values.goal import GoalPoint, Plan, ProbeSpec, read_plan
from cyclescope.values.probes import HIT_COST_S, GoalProbes
from tests import perfbytes as pb


def point(proc: str, reg: str, rate: float, at: int, confidence: str = "high") -> GoalPoint:
    return GoalPoint("img", proc, reg, 0.5, [(at, reg)],
                     probe=ProbeSpec(at, reg, "/bin/prog", at, None, rate, confidence))


class FakeRing:
    def __init__(self) -> None:
        self.data = b""

    def read(self) -> bytes:
        out, self.data = self.data, b""
        return out

    def close(self) -> None:
        pass


class FakeKernel:
    def __init__(self) -> None:
        self.next_fd = 10
        self.opened: list[tuple[Any, ...]] = []
        self.rings: dict[int, FakeRing] = {}
        self.redirects: dict[int, int] = {}
        self.enabled: set[int] = set()
        self.closed: list[int] = []

    def _fd(self) -> int:
        self.next_fd += 1
        return self.next_fd

    def sampler(self, path: str, off: int, pid: int, cpu: int, mask: int, inherit: bool, on_exec: bool) -> int:
        fd = self._fd()
        self.opened.append((fd, path, off, pid, cpu, inherit, on_exec))
        return fd

    def ring(self, pid: int, cpu: int, inherit: bool) -> tuple[int, FakeRing]:
        fd = self._fd()
        self.rings[fd] = FakeRing()
        return fd, self.rings[fd]

    def redirect(self, fd: int, owner: int) -> None:
        self.redirects[fd] = owner

    def ident(self, fd: int) -> int:
        return 1000 + fd

    def enable(self, fd: int) -> None:
        self.enabled.add(fd)

    def close(self, fd: int) -> None:
        self.closed.append(fd)


def hit(ident: int, ip: int, pid: int, regs: list[int]) -> bytes:
    body = struct.pack("<QQiiQ", ident, ip, pid, pid, 1) + struct.pack(f"<Q{len(regs)}Q", 2, *regs)
    return pb.record(RecordType.SAMPLE, 2, body)


def test_the_cheapest_sites_are_probed_within_the_budget() -> None:
    # 0.01 of a CPU at 11 us a hit: about 900 hits a second in all
    plan = Plan([point("a", "rdi", 500.0, 0x10), point("b", "rsi", 300.0, 0x20), point("c", "rdx", 5e5, 0x30),
                 point("d", "rcx", 0.0, 0x40)])
    probes = GoalProbes(plan, budget=0.01, kernel=FakeKernel())
    chosen = probes.choose()
    assert [s.reg for s in chosen] == ["rsi", "rdi"]
    states = {s.reg: s.state for s in probes.sites}
    assert states["rdx"].startswith("too costly") and states["rcx"].startswith("rate unknown")
    # a whole CPU: unknown rates are tried too (the police closes what costs too much)
    assert {s.reg for s in GoalProbes(plan, budget=1.0).choose()} == {"rdi", "rsi", "rcx"}


def test_a_site_the_kernel_emulates_is_charged_its_own_cost() -> None:
    """A probe on an instruction the kernel emulates (a push, a conditional jump) costs a fraction of
    a single-stepped one: 200,000 executions a second fit 1% of a CPU at 50 ns a hit, not at 11 us."""
    emulated = point("a", "rdi", 2e5, 0x10)
    emulated.probe = ProbeSpec(0x10, "rdi", "/bin/prog", 0x10, None, 2e5, "high", emulated=True)
    stepped = point("b", "rsi", 2e5, 0x20)
    probes = GoalProbes(Plan([emulated, stepped]), budget=0.011, kernel=FakeKernel(), emulated_hit_cost_s=5e-8)
    assert [s.reg for s in probes.choose()] == ["rdi"]
    assert probes.sites[1].state.startswith("too costly")
    probes.sites[0].hits, probes.sites[1].hits = 1_000, 10
    assert probes.trap_s() == pytest.approx(1_000 * 5e-8 + 10 * HIT_COST_S)
    # Where the emulated cost was not measured, as any other.
    assert [s.reg for s in GoalProbes(Plan([emulated]), budget=0.011).choose()] == []


def test_a_guessed_rate_is_taken_as_it_is_and_said_to_be_a_guess() -> None:
    """A rate from a low-confidence count (the model's guess) decides as a measured one does, even
    with a whole CPU (probing guesses anyway probed hot loops: their hits overflowed the rings); the
    site's state says it was a guess."""
    plan = Plan([point("a", "rdi", 5e6, 0x10, "low"), point("b", "rsi", 5e6, 0x20, "high"),
                 point("c", "rdx", 300.0, 0x30, "low")])
    whole = GoalProbes(plan, budget=1.0)
    assert [s.reg for s in whole.choose()] == ["rdx"]
    states = {s.reg: s.state for s in whole.sites}
    assert states["rdi"] == "too costly (5,000,000 executions/s, calc guessed)"
    assert states["rsi"] == "too costly (5,000,000 executions/s)"


def test_per_task_probes_share_a_ring_per_cpu_and_wait_for_exec() -> None:
    plan = Plan([point("a", "rdi", 100.0, 0x10), point("b", "rsi", 100.0, 0x20)])
    k = FakeKernel()
    probes = GoalProbes(plan, budget=0.01, kernel=k)
    opened = probes.open((77,), (0, 1), on_exec=True)
    assert len(opened) == 2 and len(probes.rings) == 2 and len(k.opened) == 4
    assert all(pid == 77 and inherit and on_exec for _, _, _, pid, _, inherit, on_exec in k.opened)
    assert not k.enabled  # the command's exec enables them
    owners = {fd for fd, _ in probes.rings}
    assert set(k.redirects.values()) == owners
    assert all(p.exact for p in plan.points)
    # system-wide: every task on each CPU, enabled now
    k2 = FakeKernel()
    GoalProbes(Plan([point("a", "rdi", 100.0, 0x10)]), kernel=k2).open((), (0, 1), on_exec=False)
    assert {(pid, inherit) for _, _, _, pid, _, inherit, _ in k2.opened} == {(-1, False)} and len(k2.enabled) == 2


def test_hits_decode_to_each_sites_register_and_lost_hits_are_counted() -> None:
    plan = Plan([point("a", "rdi", 100.0, 0x10), point("b", "rsi", 100.0, 0x20)])
    k = FakeKernel()
    probes = GoalProbes(plan, kernel=k)
    probes.open((77,), (0,), on_exec=False)
    by_reg = {s.reg: s for s in probes.sites}
    id_a, id_b = 1000 + by_reg["rdi"].fds[0], 1000 + by_reg["rsi"].fds[0]
    # the sampled registers are rsi and rdi only, in perf's order (SI = 4 before DI = 5)
    ring = next(iter(k.rings.values()))
    # ids no open site has (an event of another kind redirected to the ring, below and above theirs) are dropped
    ring.data = (hit(id_a, 0x401010, 77, [5, 16]) + hit(1, 0x401010, 77, [5, 16]) + hit(id_b, 0x401020, 77, [9, 1])
                 + hit(id_b + 10**6, 0x401020, 77, [9, 1]) + hit(id_a, 0x401010, 78, [0, 16])
                 + pb.record(RecordType.LOST, 0, struct.pack("<QQ", id_a, 3) + struct.pack("<iiQQ", 77, 77, 2, id_a)))
    got = probes.poll()
    assert got.pid.tolist() == [77, 77, 78]
    assert [probes.sites[i].reg for i in got.site.tolist()] == ["rdi", "rsi", "rdi"]
    assert got.value.tolist() == [16, 9, 16]
    assert by_reg["rdi"].hits == 2 and by_reg["rsi"].hits == 1 and probes.lost == 3
    assert by_reg["rdi"].lost == 2 and by_reg["rsi"].lost == 1  # put down to the sites by their hits
    assert len(probes.poll()) == 0


def two_open_sites(budget: float) -> tuple[GoalProbes, FakeKernel, list[float]]:
    """Two sites of 100 executions a second, open for one task on one CPU, on a clock set by hand."""
    now = [0.0]
    plan = Plan([point("a", "rdi", 100.0, 0x10), point("b", "rsi", 100.0, 0x20)])
    k = FakeKernel()
    probes = GoalProbes(plan, budget=budget, kernel=k, clock=lambda: now[0])
    probes.open((77,), (0,), on_exec=False)
    return probes, k, now


def test_lost_hits_count_against_the_budget() -> None:
    """A site whose hits overflow the ring is closed for the hits lost too: they trapped as well
    (before, a hot site that lost 8 million hits in a minute kept trapping, unseen)."""
    probes, k, now = two_open_sites(budget=1.0)
    a, b = probes.sites
    ring = next(iter(k.rings.values()))
    ident = 1000 + a.fds[0]
    ring.data = hit(ident, 0x401010, 77, [5, 16]) + pb.lost(ident, 200_000, 2)
    now[0] = 1.0  # each may spend half a second of traps in a second, plus the allowance: 200,000 hits are 2.2 s
    probes.poll()
    assert a.lost == 200_000 and b.lost == 0
    assert probes.police() == [0] and b.state == "open"


def test_a_probe_over_its_budget_is_closed_and_its_candidate_goes_back_to_the_samples() -> None:
    probes, k, now = two_open_sites(budget=0.01)
    plan = probes.plan
    a, b = probes.sites
    now[0] = 10.0  # each may spend 0.05 s of traps in 10 s, plus the allowance
    a.hits = int((0.05 + 0.02) / HIT_COST_S) + 10
    b.hits = 100
    assert probes.police() == [0]
    assert a.state.startswith("closed: over budget") and not plan.points[0].exact and plan.points[1].exact
    probes.drop([1], "closed: switched off by rule (3)")
    assert not plan.points[1].exact
    probes.close()  # every probe and ring closed, once
    assert sorted(k.closed) == sorted([fd for fd, *_ in k.opened] + list(k.rings))


def test_plans_carry_probe_sites_and_older_plans_still_read(tmp_path: Any) -> None:
    import json

    doc = {"version": 3, "points": [{"image": "img", "procedure": "f", "what": "rdx", "min_prob": 0.4,
                                     "at": [[16, "rdx"]], "probe": {"at": 16, "reg": "rdx", "path": "/bin/x",
                                                                    "file_offset": 4112, "build_id": "ab",
                                                                    "rate": 12.5}}]}
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(doc))
    p = read_plan(f).points[0]
    assert p.probe == ProbeSpec(16, "rdx", "/bin/x", 4112, "ab", 12.5, "high")  # no confidence: high
    doc["points"][0]["probe"]["rate_confidence"] = "low"
    f.write_text(json.dumps(doc))
    assert read_plan(f).points[0].probe.rate_confidence == "low"  # type: ignore[union-attr]
    doc["version"] = 2
    del doc["points"][0]["probe"]
    f.write_text(json.dumps(doc))
    assert read_plan(f).points[0].probe is None


def test_exact_values_are_counted_not_thinned() -> None:
    from cyclescope.images.registry import ImageTable
    from cyclescope.values.capture import ValueCapture, ValueOptions

    assert hotlist_size("exact:rdx") == N_EXACT > hotlist_size("in:rdx")

    class Mapper:
        def __init__(self) -> None:
            self.procs: dict[int, Any] = {}

    cap = ValueCapture(ValueOptions(modules=(), length=0), Mapper(), ImageTable(), modules=[])
    cap._owners[77] = 1000
    values = np.array([16] * 970 + list(range(3, 33)), np.uint64)  # 30 distinct values, 16 among them
    n = len(values)
    kept = cap.add_exact(np.full(n, 77, np.int64), np.full(n, 1, np.int64), np.full(n, 0x10, np.uint64),
                         ["exact:rdi", "exact:rdx"], np.ones(n, np.int64), values)
    assert kept == n
    named, _ = cap.take(0.0, 1.0)[1000]
    lists = named.lists
    assert len(lists) == 1 and int(lists.total[0]) == n and float(lists.p[0]) == 1.0
    assert named.kinds[int(lists.keys["kind"][0])] == "exact:rdx"  # kinds[which[row]]
    counts = dict(zip(lists.values["v0"].tolist(), lists.counts.tolist(), strict=True))
    assert counts[16] == 971 and len(counts) == 30
