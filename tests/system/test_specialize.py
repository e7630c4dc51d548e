"""Goal-directed value profiling on a program with planted semi-invariants (tests/programs/specialize.c):
`specialize` over a plain profile keeps few candidates, `record --goal` profiles only those, and
`specialize` then finds the planted divisor and mode with their source lines."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.system.helpers import cs, cs_popen

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    d = tmp_path_factory.mktemp("specialize")
    exe = d / "specialize"
    src = Path(__file__).parents[1] / "programs" / "specialize.c"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(src)], check=True, capture_output=True)
    return exe


def test_the_goal_finds_the_planted_invariants_and_profiles_only_the_kept_candidates(program: Path,
                                                                                   tmp_path: Path) -> None:
    first, second, plan = tmp_path / "plain", tmp_path / "goal", tmp_path / "plan.json"
    cs("record", "--db", str(first), "-q", "-F", "2000", "--", str(program), "1500000", timeout=300)
    p = cs("specialize", "--db", str(first), "--plan", str(plan), "--json", timeout=300)
    report = json.loads(p.stdout)
    counts = report["counts"]
    # Static elimination keeps a small share of the candidates (the paper: under 1% on SPEC). Which
    # share moves with calc's counts and with which procedures are hot enough to be candidates: on
    # a Xeon six plain recordings kept 3.6-6.0% of 166-238; on a Zen 5 VM sixteen kept 7-12 (all in
    # the two planted procedures) of 141-1,031, 0.8-8.5%, the most where only those two procedures
    # are candidates and both keep their entry's arguments (12 of 141; an 8% bound failed there on
    # main, one recording in five).
    assert 0 < counts["kept"] <= 0.12 * counts["candidates"], counts
    doc = json.loads(plan.read_text())
    assert {(pt["procedure"], pt["what"]) for pt in doc["points"]} >= {("bucket_sum", "rdx"), ("scaled", "rdx")}

    p = cs("record", "--db", str(second), "-F", "2000", "--goal", str(plan), "--", str(program), "1500000",
           timeout=300)
    assert "goal:" in p.stderr
    vals = json.loads(cs("values", "--db", str(second), "--json").stdout)
    kinds = {r["kind"] for r in vals["rows"]}
    # Nothing but the plan's candidates: captured at samples (goal:) or, where the plan found one cheap
    # enough, at every execution by a probe (exact:). Which, moves with the plain recording's counts:
    # under load one recording in several planned a probe.
    assert kinds and all(k.startswith(("goal:", "exact:")) for k in kinds), kinds
    report = json.loads(cs("specialize", "--db", str(second), "--json", timeout=300).stdout)
    found = {(o["procedure"], o["what"]): o for o in report["opportunities"]}
    div = found.get(("bucket_sum", "rdx"))
    mode = found.get(("scaled", "rdx"))
    assert div is not None and mode is not None, list(found)
    assert div["value"] == 16 and div["prob"] > 0.85  # 97% of the calls
    assert mode["value"] == 2 and mode["prob"] > 0.9  # 99%
    assert div["source"] == "specialize.c:26" and mode["source"] == "specialize.c:34"
    assert div["net"] > 0 and mode["net"] > 0


def test_a_bad_plan_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    p = cs("record", "--db", str(tmp_path / "db"), "--goal", str(bad), "--", "true", check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a plan" in lines[0], p.stderr


def _xorshift() -> Iterator[int]:
    """The test programs' generator (tests/programs/*.c: next_rand, nr), from the same seed."""
    m = (1 << 64) - 1
    s = 88172645463325252
    while True:
        s ^= (s << 13) & m
        s ^= s >> 7
        s ^= (s << 17) & m
        yield s


def _planted_truth(rounds: int, n: int) -> tuple[int, int]:
    """specialize.c's calls with div 16 and with mode 2, from its xorshift sequence."""
    rand = _xorshift()
    for _ in range(n):
        next(rand)
    div16 = mode2 = 0
    for _ in range(rounds):
        u = next(rand) % 100
        div = 16 if u < 97 else 3 + next(rand) % 96
        div16 += div == 16
        mode2 += u != 0
    return div16, mode2


def test_probes_capture_every_execution_of_the_cheap_candidates(program: Path, tmp_path: Path) -> None:
    """With many elements per call the entries are rare enough to probe: every call's divisor and
    mode are captured (the counts equal the program's own sequence), and `specialize` says so; the
    daemon's system-wide probes count the same."""
    rounds, n = 3000, 65536
    first, second, plan = tmp_path / "plain", tmp_path / "goal", tmp_path / "plan.json"
    cs("record", "--db", str(first), "-q", "-F", "2000", "--", str(program), str(rounds), "x", str(n), timeout=300)
    cs("specialize", "--db", str(first), "--plan", str(plan), "--json", timeout=300)
    doc = json.loads(plan.read_text())
    sites = {(p["procedure"], p["what"]) for p in doc["points"] if p.get("probe")}
    assert {("bucket_sum", "rdx"), ("scaled", "rdx")} <= sites, doc["points"]
    # A budget of a whole CPU: the sites are probed whatever rate the plain recording gave them
    # (anchors may have had no window on a busy machine), and none is closed for its cost.
    p = cs("record", "--db", str(second), "-F", "2000", "--goal", str(plan), "--goal-budget", "1", "--",
           str(program), str(rounds), "x", str(n), timeout=300)
    assert "exact:" in p.stderr and "lost" not in p.stderr.split("exact:")[1].split(";")[0], p.stderr
    rows = json.loads(cs("values", "--db", str(second), "--json").stdout)["rows"]
    # At each probe's site: the instruction after the definition, or one further on in its block
    # that the kernel emulates (app/specialize.probe_site), where the register still holds the value.
    exact = {(r["where"].split("+")[0], r["kind"]): r for r in rows if r["kind"].startswith("exact:")}
    div, mode = exact[("bucket_sum", "exact:rdx")], exact[("scaled", "exact:rdx")]
    at = {(p["procedure"], p["what"]): p["probe"]["at"] for p in doc["points"] if p.get("probe")}
    assert div["offset"] == at[("bucket_sum", "rdx")] and mode["offset"] == at[("scaled", "rdx")]
    div16, mode2 = _planted_truth(rounds, n)
    assert div["vtot"] == rounds and mode["vtot"] == rounds
    top = {h["value"]: h["count"] for h in div["hotlist"]}
    assert top["16"] == div16 and {h["value"]: h["count"] for h in mode["hotlist"]}["2"] == mode2
    # --phi 0: whether an opportunity clears phi (0.1% of the run's cycles) rests on calc's count of the
    # loop the value folds, and scaled's loop, 196.6M trips, was counted from 347K to 52M in 1-s
    # recordings on a Xeon (the repair outvoted its one estimate from 383 samples with two of 0 from
    # blocks the samples skid past): 1 recording in 20 left it under phi. What is tested here is that
    # the report carries the probes' exact counts.
    report = json.loads(cs("specialize", "--db", str(second), "--json", "--phi", "0", timeout=300).stdout)
    found = {(o["procedure"], o["what"]): o for o in report["opportunities"]}
    assert found[("bucket_sum", "rdx")]["exact"] and found[("bucket_sum", "rdx")]["prob"] == round(div16 / rounds, 6)
    assert found[("scaled", "rdx")]["value"] == 2 and found[("scaled", "rdx")]["observed"] == rounds

    # The daemon probes system-wide (every task, per CPU): the same counts. The program runs for a few
    # of the daemon's drains (about 3 s): a process first seen after it exited has no known owner,
    # and values without an owner are not kept.
    longer = 3 * rounds
    div16_longer, _ = _planted_truth(longer, n)
    db = tmp_path / "daemon"
    d = cs_popen("daemon", "--db", str(db), "-F", "500", "--archive", "none", "--goal", str(plan),
                 "--goal-budget", "1")
    try:
        t0 = time.monotonic()
        while cs("status", "--db", str(db), check=False).returncode != 0:
            assert time.monotonic() - t0 < 30 and d.poll() is None, "the daemon did not come up"
            time.sleep(0.2)
        subprocess.run([str(program), str(longer), "x", str(n)], check=True, capture_output=True, timeout=120)
        d.send_signal(signal.SIGTERM)
        _, err = d.communicate(timeout=180)
        assert d.returncode == 0 and "exact:" in err, err
    finally:
        if d.poll() is None:
            d.kill()
            d.communicate()
    rows = json.loads(cs("values", "--db", str(db), "--json").stdout)["rows"]
    daemon = {(r["where"].split("+")[0], r["kind"]): r for r in rows if r["kind"].startswith("exact:")}
    # Every hit is counted, or said lost (a ring that overflowed: a hot site whose rate the plan did
    # not know is probed at a whole CPU's budget, floods the rings until the police closes it at
    # the next drain, and takes some of the cheap sites' hits with it). The probes' rings wake the
    # daemon when half full: drained once a second, they overflowed here with the cheap sites
    # alone (8,040-8,140 of the 9,000 calls counted, the loss only partly reported).
    exact_line = next((x for x in err.split("; ") if "exact:" in x), err)
    lost = int(m.group(1).replace(",", "")) if (m := re.search(r"([\d,]+) lost", exact_line)) else 0
    got = daemon[("bucket_sum", "exact:rdx")]["vtot"]
    assert longer - lost <= got <= longer, (got, exact_line)
    count16 = {h["value"]: h["count"] for h in daemon[("bucket_sum", "exact:rdx")]["hotlist"]}["16"]
    assert div16_longer - (longer - got) <= count16 <= div16_longer, (count16, div16_longer, got)


def _difference_truth(rounds: int, n: int) -> int:
    """difference.c's calls with x == y, from its xorshift sequence."""
    rand = _xorshift()
    for _ in range(n):
        next(rand)
    equal = 0
    for _ in range(rounds):
        x = next(rand) % 1000
        y = x if next(rand) % 100 < 95 else next(rand) % 1000
        equal += x == y
    return equal


def test_a_difference_of_two_registers_is_captured_together(tmp_path: Path) -> None:
    """`cmp rdx, rcx` in mix's loop compares two arguments equal on 95% of the calls: the plan takes
    the two registers together, samples see the difference in the loop, and a probe at the entry
    sees every call's (its count of 0 equals the program's own sequence)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    exe = tmp_path / "difference"
    src = Path(__file__).parents[1] / "programs" / "difference.c"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(src)], check=True, capture_output=True)
    rounds, n = 3000, 262144
    args = [str(exe), str(rounds), str(n)]
    plan = tmp_path / "plan.json"
    cs("record", "--db", str(tmp_path / "plain"), "-q", "-F", "2000", "--", *args, timeout=300)
    cs("specialize", "--db", str(tmp_path / "plain"), "mix", "--plan", str(plan), timeout=300)
    points = {p["what"]: p for p in json.loads(plan.read_text())["points"]}
    diff = points.get("rdx-rcx")
    assert diff is not None and diff["kind"] == "difference", points
    assert {r for _, r in diff["at"]} == {"rdx-rcx"} and len(diff["at"]) > 3  # live beyond the cmp itself
    # Samples only: the difference wherever a sample finds both registers unchanged.
    cs("record", "--db", str(tmp_path / "sampled"), "-q", "-F", "2000", "--goal", str(plan), "--goal-budget", "0",
       "--", *args, timeout=300)
    rows = json.loads(cs("values", "--db", str(tmp_path / "sampled"), "--json", "--limit", "0").stdout)["rows"]
    sampled = [r for r in rows if r["kind"] == "goal:rdx-rcx"]
    assert sampled and sum(r["vtot"] for r in sampled) >= 30
    top = max(sampled, key=lambda r: r["vtot"])["hotlist"][0]
    assert top["value"] == "0" and top["share"] > 0.8
    # A probe at the entry: every call. The plan's rate for it is calc's count of the entry, ahead of
    # a loop of 262,144 trips: where the anchor saw too little of a one-second run, the model's guess,
    # 0 ("unknown": probed with a whole CPU) in 24 plain recordings of 25 and 1.4 million in one (a
    # site of 25 CPUs' traps, left to the samples: issue 30's shortfall, not this test's subject).
    # The capture is tested here: the plan says the rate is unknown.
    doc = json.loads(plan.read_text())
    for p in doc["points"]:
        if p["what"] == "rdx-rcx" and p.get("probe"):
            p["probe"]["rate"] = 0.0
    plan.write_text(json.dumps(doc))
    summary = cs("record", "--db", str(tmp_path / "exact"), "-F", "2000", "--goal", str(plan), "--goal-budget", "1",
                 "--", *args, timeout=300).stderr
    rows = json.loads(cs("values", "--db", str(tmp_path / "exact"), "--json", "--limit", "0").stdout)["rows"]
    exact = [r for r in rows if r["kind"] == "exact:rdx-rcx"]
    assert len(exact) == 1 and exact[0]["where"].split("+")[0] == "mix" and exact[0]["vtot"] == rounds, (
        diff.get("probe"), summary)
    assert exact[0]["offset"] == diff["probe"]["at"]  # the entry's block, where the kernel emulates the hit
    counts = {h["value"]: h["count"] for h in exact[0]["hotlist"]}
    assert counts["0"] == _difference_truth(rounds, n)
    report = json.loads(cs("specialize", "--db", str(tmp_path / "exact"), "mix", "--json", timeout=300).stdout)
    found = {o["what"]: o for o in report["opportunities"]}
    assert found["rdx-rcx"]["value"] == 0 and found["rdx-rcx"]["exact"], found
    assert found["rdx-rcx"]["source"] == "difference.c:21"


def test_a_load_that_reads_what_the_store_before_it_wrote_is_found(tmp_path: Path) -> None:
    """Load avoidance: accumulate stores through p and loads through q, the same cell on 95% of the
    calls; the plan compares the two addresses, and the samples find them equal."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    exe = tmp_path / "loads"
    src = Path(__file__).parents[1] / "programs" / "loads.c"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(src)], check=True, capture_output=True)
    args = [str(exe), "3000000"]
    plan = tmp_path / "plan.json"
    cs("record", "--db", str(tmp_path / "plain"), "-q", "-F", "2000", "--", *args, timeout=300)
    cs("specialize", "--db", str(tmp_path / "plain"), "accumulate", "--plan", str(plan), timeout=300)
    loads = [p for p in json.loads(plan.read_text())["points"] if p["kind"] == "load"]
    assert len(loads) == 1 and loads[0]["what"].startswith("same-as-"), loads
    assert [m[0] for m in loads[0]["mems"]] == ["rdi", "rsi"]  # the store's address, the load's
    cs("record", "--db", str(tmp_path / "goal"), "-q", "-F", "2000", "--goal", str(plan), "--", *args,
       timeout=300)
    report = json.loads(cs("specialize", "--db", str(tmp_path / "goal"), "accumulate", "--json", timeout=300).stdout)
    found = {o["what"]: o for o in report["opportunities"]}
    load = found.get(loads[0]["what"])
    assert load is not None and load["kind"] == "load", found
    assert load["value"] == 0 and load["prob"] > 0.8 and load["source"] == "loads.c:22"
