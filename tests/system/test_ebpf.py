"""The eBPF collection path against the ring path on the same programs, and Python frames from
CPython's perf maps (`python -X perf`) in stacks."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.system.helpers import cs, cs_popen, env, folded, prof_json, samples_of

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]
PROGRAMS = Path(__file__).parents[1] / "programs"


@pytest.fixture(scope="module")
def bpf_loads() -> None:
    from cyclescope.collect.ebpf import BpfUnavailable, load

    try:
        load(1 << 10, 0).close()
    except (BpfUnavailable, OSError) as e:
        pytest.skip(f"the eBPF path cannot run here: {e}")


@pytest.fixture(scope="module")
def callgraph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    exe = tmp_path_factory.mktemp("cg") / "callgraph"
    subprocess.run(["gcc", "-O2", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", "-o", str(exe),
                    str(PROGRAMS / "callgraph.c")], check=True, capture_output=True)
    return exe


def under(stacks: Counter[str], frame: str) -> float:
    total = sum(stacks.values())
    return sum(n for s, n in stacks.items() if frame in s.split(";")) / total


@pytest.mark.usefixtures("bpf_loads")
def test_the_kernel_side_counts_what_the_rings_count(callgraph: Path, tmp_path: Path) -> None:
    """Same program, both paths, frame-pointer stacks: the same shares of procedures and stacks."""
    shares = {}
    for path in ("bpf", "perf"):
        db = tmp_path / path
        p = cs("record", "--db", str(db), "--collector", path, "--no-loop-counts", "-g", "fp", "--",
               str(callgraph), "600000", timeout=300)
        assert "lost 0;" in p.stderr
        report = prof_json(db)
        total = sum(r["samples"]["cpu-clock"] for r in report["rows"])
        assert total > 1000
        st = folded(cs("export", "collapsed", "--db", str(db), "--process", "callgraph").stdout)
        assert sum(st.values()) >= 0.95 * total  # every sample has its stack
        shares[path] = (samples_of(report, "leaf") / total, under(st, "outer"), under(st, "main"))
        # The timeline holds the same samples, per 100 ms window, and their CPU time: never more
        # than the one CPU a single thread can use (less on a busy machine).
        tl = json.loads(cs("timeline", "--db", str(db), "--json", "--process", "callgraph", "--step", "100").stdout)
        own = sum(samples_of(report, r["procedure"]) for r in prof_json(db, "--process", "callgraph")["rows"])
        assert abs(sum(tl["total"]["samples"]) - own) <= 0.02 * own
        busy = sorted(tl["total"]["cpus"])
        assert busy[len(busy) // 2] > 0.1 and busy[-1] < 1.3
    (leaf_b, outer_b, main_b), (leaf_p, outer_p, main_p) = shares["bpf"], shares["perf"]
    assert leaf_b > 0.8 and abs(leaf_b - leaf_p) < 0.05
    assert outer_b > 0.5 and abs(outer_b - outer_p) < 0.05  # leaf is called under outer two times in three
    assert main_b > 0.95 and main_p > 0.95


@pytest.mark.usefixtures("bpf_loads")
def test_system_wide_through_the_kernel_side_and_the_daemons_status(callgraph: Path, tmp_path: Path) -> None:
    db = tmp_path / "db"
    p = cs("record", "--db", str(db), "-a", "--collector", "bpf", "--no-loop-counts", "--", str(callgraph),
           "400000", timeout=300)
    assert "lost 0;" in p.stderr
    report = prof_json(db, "--process", "callgraph")
    assert samples_of(report, "leaf") > 500
    # System-wide, the default is the kernel side (loop counts too: the program sends the samples
    # they need); per task, with loop counts on (the default), --collector bpf is refused in one line.
    p = cs("daemon", "--db", str(tmp_path / "d"), "-d", "1")
    assert "counted in the kernel by eBPF" in p.stderr
    bad = cs("record", "--db", str(db), "--collector", "bpf", "--", "true", check=False)
    assert bad.returncode == 2 and "--no-loop-counts" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.usefixtures("bpf_loads")
def test_system_wide_loop_counts_come_from_the_kernel_side(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """`record -a` counts samples in the kernel and, for the procedures whose loops a register
    counts, has the program send their samples' registers (and the next sample on each CPU):
    chain's loop, run exactly 2.4 billion times, is counted from its counter as it is per task,
    and the process is watched from the first drain, a quarter second in."""
    exe = compile_c("kernels", "-O2", "-g", out="kernels")
    # The watch starts once the binary's loop table is in the cache: a first sight of it, system-wide
    # beside everything else the worker analyses, took 4.5-5 s here (run alone, this test saw none
    # in its 3 s; after test_calc's recordings of the same binary, from the first drain). A short
    # recording per task puts it there first.
    cs("record", "--db", str(tmp_path / "warm"), "-q", "-F", "1000", "--", str(exe), "chain", "1", timeout=300)
    db = tmp_path / "db"
    p = cs("record", "--db", str(db), "-a", "-F", "1000", "--", str(exe), "chain", "8", timeout=300)
    assert "lost 0;" in p.stderr and "loop counts:" in p.stderr, p.stderr
    doc = json.loads(cs("calc", "chain", "--db", str(db), "--json").stdout)
    loop = max(doc["blocks"], key=lambda b: b["samples"])
    assert loop["method"] == "loop-counter", doc["notes"]
    # 1 kHz system-wide beside whatever else runs: pairs come from the slices the thread ran
    # without a break on one CPU; measured 0.98-1.02 of exact on a Zen 5 VM, five runs quiet and five
    # beside two busy loops.
    assert loop["executions"] == pytest.approx(2.4e9, rel=0.1)
    # Without loop counts, nothing is sent and calc falls back to its model.
    p = cs("record", "--db", str(tmp_path / "flat"), "-a", "-F", "1000", "--no-loop-counts", "--", str(exe),
           "chain", "2", timeout=300)
    assert "loop counts:" not in p.stderr
    doc = json.loads(cs("calc", "chain", "--db", str(tmp_path / "flat"), "--json").stdout)
    assert max(doc["blocks"], key=lambda b: b["samples"])["method"] != "loop-counter"


def pythons(versions: tuple[str, ...] = ("3.12", "3.13")) -> list[str]:
    """CPython interpreters of these versions here (by default 3.12 and 3.13: -X perf came with
    3.12): on PATH or under pyenv."""
    out = []
    for v in versions:
        found = sorted(glob.glob(f"/root/.pyenv/versions/{v}*/bin/python{v}"))  # pyenv's shims may refuse
        exe = found[0] if found else shutil.which(f"python{v}")
        if exe and "/shims/" not in exe:
            out.append(exe)
    return out


@pytest.mark.parametrize("python", pythons() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no CPython 3.12 or 3.13 here (their -X perf writes the perf maps)"))])
def test_python_frames_from_perf_maps_are_named_and_stacks_are_complete(python: str, tmp_path: Path) -> None:
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "--collector", "perf", "--no-loop-counts", "-g", "dwarf,32768", "-F", "2000",
       "--", python, "-X", "perf", str(PROGRAMS / "pyshares.py"), "40", timeout=300)
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    script = str(PROGRAMS / "pyshares.py")
    py = {f: under(st, f"py::{f}:{script}") for f in ("main", "seventy", "twenty", "ten")}
    # The interpreter's start-up and finalization are 13-16% of the samples (the most on a busy
    # machine): the rest is under main. No frame is skipped: the functions' samples are all under
    # main (a trampoline's stale rbp skipped it and the C frames around it in 14 of them once).
    assert py["main"] > 0.75, st.most_common(5)
    inner = {s: n for s, n in st.items()
             if any(f"py::{f}:{script}" in s.split(";") for f in ("seventy", "twenty", "ten"))}
    skipped = {s: n for s, n in inner.items() if f"py::main:{script}" not in s.split(";")}
    assert sum(skipped.values()) <= 0.01 * sum(inner.values()), sorted(skipped.items(), key=lambda x: -x[1])[:2]
    # Shares among the three (70/20/10 of the work; generous margins for a busy machine).
    inside = py["seventy"] + py["twenty"] + py["ten"]
    assert abs(py["seventy"] / inside - 0.7) < 0.1 and abs(py["ten"] / inside - 0.1) < 0.07
    # Complete: from _start through the interpreter's C frames to the Python frames.
    under_main = [s.split(";") for s in st.elements() if f"py::main:{script}" in s]
    assert sum(f[0] == "_start" for f in under_main) / len(under_main) > 0.9
    assert not any("perf-" in s and ".map+" in s for s in st)  # every JIT frame is named


def interpreters_without_perf_maps() -> list[str]:
    """CPython 3.10-3.13 interpreters here: this one (3.11 on these machines) and pyenv's (3.10
    has no native_thread_id: its thread is found through glibc's struct pthread)."""
    import os
    import sys

    out = [os.path.realpath(sys.executable)] if (3, 10) <= sys.version_info[:2] <= (3, 13) else []
    return out + [p for p in pythons(("3.10", "3.12", "3.13")) if os.path.realpath(p) not in out]


@pytest.mark.usefixtures("bpf_loads")
def test_default_options_name_a_python_programs_frames(tmp_path: Path) -> None:
    """`record -g fp -- python app.py`, nothing else: the eBPF path (loop counts off, and said so),
    whose program alone reads Python frames; with --collector perf, the rings (loop counts on) and
    no Python frame (no -X perf)."""
    if not (3, 10) <= sys.version_info[:2] <= (3, 13):
        pytest.skip(f"the eBPF program reads CPython 3.10-3.13, not {sys.version.split()[0]}")
    script = str(PROGRAMS / "pyshares.py")
    db = tmp_path / "db"
    p = cs("record", "--db", str(db), "-g", "fp", "--", sys.executable, script, "100", timeout=300)
    assert "runs CPython: its Python frames are read by the eBPF path" in p.stderr, p.stderr
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    named = sum(n for s, n in st.items() if f"py::seventy:{script}" in s.split(";"))
    assert named > 0.4 * sum(st.values()), st.most_common(3)
    rings = tmp_path / "rings"
    p = cs("record", "--db", str(rings), "-g", "fp", "--collector", "perf", "--", sys.executable, script, "30",
           timeout=300)
    assert "runs CPython" not in p.stderr
    assert not any("py::" in s for s in folded(cs("export", "collapsed", "--db", str(rings)).stdout))


@pytest.mark.usefixtures("bpf_loads")
@pytest.mark.parametrize("python", interpreters_without_perf_maps())
def test_python_frames_read_from_the_interpreter_without_x_perf(python: str, tmp_path: Path) -> None:
    """No -X perf: the eBPF program reads the thread's frames from the interpreter's memory."""
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "--collector", "bpf", "--no-loop-counts", "-g", "fp", "--",
       python, str(PROGRAMS / "pyshares.py"), "300", timeout=300)
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    script = str(PROGRAMS / "pyshares.py")
    named = {s: n for s, n in st.items() if f"py::main:{script}" in s.split(";")}
    # The drain that describes the process to the program comes once its interpreter has started
    # (every 50 ms until then); samples before it have no Python frames.
    assert sum(named.values()) > 0.6 * sum(st.values()), st.most_common(5)
    # Root first: the module, main, then one of the three functions.
    assert all(s.split(";")[:2] == [f"py::<module>:{script}", f"py::main:{script}"] for s in named)
    share = {f: sum(n for s, n in named.items() if f"py::{f}:{script}" in s.split(";")) for f in ("seventy", "ten")}
    inside = sum(n for s, n in named.items() if any(f"py::{f}:" in s for f in ("seventy", "twenty", "ten")))
    assert abs(share["seventy"] / inside - 0.7) < 0.1 and abs(share["ten"] / inside - 0.1) < 0.07
    # Lines: every sample in seventy() is on one of its lines.
    text = (PROGRAMS / "pyshares.py").read_text().splitlines()
    first = text.index("def seventy(n: int) -> int:") + 1
    with_lines = folded(cs("export", "collapsed", "--db", str(db), "--offsets").stdout)
    lines = {int(f.rsplit(":", 1)[1]) for s in with_lines for f in s.split(";") if f.startswith("py::seventy:")}
    assert lines and lines <= set(range(first, first + 5)), (lines, first)  # its def line: entering it
    # prof --stacks --lines: the functions by line, each its samples as the innermost Python frame.
    doc = json.loads(cs("prof", "--db", str(db), "--stacks", "--lines", "--json").stdout)
    own = {f: sum(r["self"]["cpu-clock"] for r in doc["rows"] if r["function"].startswith(f"py::{f}:{script}:"))
           for f in ("seventy", "twenty", "ten")}
    assert abs(own["seventy"] / sum(own.values()) - 0.7) < 0.1, own
    assert {int(r["function"].rsplit(":", 1)[1]) for r in doc["rows"]
            if r["function"].startswith(f"py::seventy:{script}:")} == lines


@pytest.mark.usefixtures("bpf_loads")
@pytest.mark.parametrize("python", interpreters_without_perf_maps())
def test_python_frames_sit_among_the_native_frames_with_dwarf_stacks(python: str, tmp_path: Path) -> None:
    """With -g dwarf the native walk is whole: each run of the evaluation loop gets its own Python
    frames, and the stack goes on from the interpreter's C frames down to _start."""
    db = tmp_path / "db"
    # A first, short recording builds the interpreter's unwind rows into the tests' fresh cache
    # (libpython: most of a second, walked by frame pointers meanwhile).
    for rounds, at in (("20", tmp_path / "warm"), ("300", db)):
        cs("record", "--db", str(at), "-q", "--collector", "bpf", "--no-loop-counts", "-g", "dwarf", "--",
           python, str(PROGRAMS / "pyshares.py"), rounds, timeout=300)
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    script = str(PROGRAMS / "pyshares.py")
    named = {tuple(s.split(";")): n for s, n in st.items() if f"py::seventy:{script}" in s.split(";")}
    total = sum(named.values())
    assert total > 100, st.most_common(3)
    whole = sum(n for f, n in named.items() if f[0] == "_start")
    assert whole > 0.9 * total, sorted(((n, ";".join(f)) for f, n in named.items() if f[0] != "_start"),
                                       reverse=True)[:2]
    for f in named:
        if f[0] != "_start":
            continue
        i, j, k = (f.index(f"py::{x}:{script}") for x in ("<module>", "main", "seventy"))
        assert i < j < k, f  # root first: the module, main, seventy
        assert "PyEval_EvalCode" in f[:i]  # the interpreter's C frames below the module
        # 3.10 runs the loop once per Python call: the interpreter's C frames between main and
        # seventy; later versions run both in one (main, then seventy).
        assert (not f[k - 1].startswith("py::")) if "3.10" in python else f[k - 1] == f[j], f


@pytest.mark.usefixtures("bpf_loads")
@pytest.mark.parametrize("python", interpreters_without_perf_maps())
def test_a_short_python_program_is_named_from_its_start_to_its_exit(python: str, tmp_path: Path) -> None:
    """pylast.py: first() for 0.5 s, then last() for 0.05 s, and exit. The program is described as
    its runtime starts (looked at every 5 ms until then), and last()'s code object, first seen
    after the last drain, is named from the memory the program copied as the process exited. The
    drains come about 10, 50 and 300 ms after the runtime starts, then a second later, and the
    names are read from the copies only where no drain came while last() ran: on a busy machine
    one may (3.11 once in a run of the suite beside two busy loops), and last() is named from the
    live process then. So the copies are asked for, and the names either way (tests/unit/
    test_pyframes.py names frames from copies)."""
    db = tmp_path / "db"
    r = cs("record", "--db", str(db), "--collector", "bpf", "--no-loop-counts", "-g", "fp", "-F", "2000", "--",
           python, str(PROGRAMS / "pylast.py"), "0.5", "0.05", timeout=120)
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    script = str(PROGRAMS / "pylast.py")
    first, last = (sum(n for s, n in st.items() if f"py::{f}:{script}" in s.split(";")) for f in ("first", "last"))
    # 2,000 samples a second of CPU: about 1,000 and 100 on a quiet machine. Without the copies at
    # exit last() had none; with a drain every 50 ms until the runtime started, first() had 0-30.
    assert last > 30 and first > last, (first, last, st.most_common(4))
    m = re.search(r"([\d,]+) code objects copied \(module bodies as they ran, others as their processes exited\)",
                  r.stderr)
    assert m and int(m.group(1).replace(",", "")) > 0, r.stderr


# record, with the process killed as the drain that first sees its last() names its frames (below)
RACE = """
import os, signal, sys, time
from cyclescope.cli.main import entry
from cyclescope.collect.procmem import ProcessMemory
from cyclescope.collect.pyframes import OFFSETS, PY_ADDR, PY_ENTRY, PythonFrames

orig, after, line = PythonFrames.stacks, float(sys.argv[1]), int(sys.argv[2])
seen, lines, done = {}, {}, []

def is_last(self, pid, tagged):
    # last()'s code object, known by its first line (read here, as the collector has not yet)
    if tagged not in lines:
        o = OFFSETS[self.procs[pid].version]
        raw = ProcessMemory(pid).read((tagged & PY_ADDR) + o["code_firstlineno"], 4)
        lines[tagged] = raw is not None and int.from_bytes(raw, "little") == line
    return lines[tagged]

def stacks(self, pids, natives, pys):
    pys = list(pys)
    for r, (pid, py) in enumerate(zip(pids, pys)):
        if pid not in self.procs or done:
            continue
        seen.setdefault(pid, time.monotonic())  # its first frames: as its runtime started
        if not any(is_last(self, pid, py[k] & ~PY_ENTRY) for k in range(0, len(py), 2)):
            continue
        if time.monotonic() - seen[pid] < after:
            pys[r] = ()  # too soon: last() stays unread (these samples without Python frames)
            continue
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # gone, its memory with it
        done.append(pid)
    return orig(self, pids, natives, pys)

PythonFrames.stacks = stacks
sys.argv[1:] = sys.argv[3:]
entry()
"""


@pytest.mark.usefixtures("bpf_loads")
@pytest.mark.parametrize("python", interpreters_without_perf_maps()[-1:])
def test_a_process_that_exits_while_its_frames_are_named_keeps_its_names(python: str, tmp_path: Path) -> None:
    """The race the copies at exit must also cover: a drain takes the stacks with last()'s first
    samples while the process runs, and the process exits before the drain reads last()'s code
    object from its memory. Here it is killed as the first drain to name last() (known by its
    first line) starts to, a second or more after the process's first frames (first() spins for
    0.5 s; a drain that sees last() sooner has last()'s frames taken out, so that it leaves last()
    unread). last()'s samples keep their name, from the memory copied as it exited."""
    db = tmp_path / "db"
    script = str(PROGRAMS / "pylast.py")
    text = (PROGRAMS / "pylast.py").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if t.startswith("def last"))
    p = subprocess.run([sys.executable, "-c", RACE, "1.0", str(line), "record", "--db", str(db), "--collector", "bpf",
                        "--no-loop-counts", "-g", "fp", "-F", "2000", "--", python, script, "0.5", "30"],
                       capture_output=True, text=True, env=env(), timeout=120)
    assert p.returncode != 0 and "code objects copied" in p.stderr, p.stderr  # killed, with copies
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    spin = {s: n for s, n in st.items() if f"py::spin:{script}" in s.split(";")}
    last = sum(n for s, n in spin.items() if f"py::last:{script}" in s.split(";"))
    unnamed = sum(n for s, n in spin.items() if not {f"py::first:{script}", f"py::last:{script}"} & set(s.split(";")))
    # Killed half a second or more after first() ended: 1,000 samples of last() or more on a quiet
    # machine (2,000 a second of its CPU), half of it beside two busy loops.
    assert last > 200 and unnamed < 0.02 * sum(spin.values()), (last, unnamed, Counter(spin).most_common(3), p.stderr)


@pytest.mark.usefixtures("bpf_loads")
def test_without_the_exit_tracepoint_the_program_loads_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose exit tracepoint the program cannot attach to (here one that does not
    exist): the program runs without the copies at exit, and says why."""
    from cyclescope.collect import ebpf

    agg = ebpf.load(1 << 10, 1 << 10)
    try:
        assert agg.exit_error is None and len(agg.take_codes()[0]) == 0
    finally:
        agg.close()
    monkeypatch.setattr(ebpf, "EXIT_TRACEPOINT", (b"sched", b"no_such_tracepoint"))
    agg = ebpf.load(1 << 10, 1 << 10)
    try:
        assert agg.exit_error is not None and "sched_process_exit" not in agg.exit_error
        assert "attaching" in agg.exit_error and len(agg.take_codes()[0]) == 0
    finally:
        agg.close()
    agg = ebpf.load(1 << 10, 0)  # no stacks, no Python frames: nothing to copy
    try:
        assert agg.exit_error == "no stacks: no Python frames"
    finally:
        agg.close()


@pytest.mark.usefixtures("bpf_loads")
def test_the_exit_program_leaves_other_tools_their_exit_events() -> None:
    """A tracepoint program that returns 0 drops the hit for every perf event of the tracepoint,
    other tools' too (perf record -e sched:sched_process_exit saw nothing while it was attached):
    with the exit program attached, another tracepoint event still gets its records."""
    from cyclescope.collect import ebpf, kernel

    tp = kernel.tracepoint_id("sched", "sched_process_exit")
    assert tp is not None

    def exits_seen() -> int:
        rings = []
        try:
            for cpu in sorted(os.sched_getaffinity(0)):
                fd = kernel.open_tracepoint_waker(tp, cpu, "pid > 0")
                rings.append((fd, kernel.RingBuffer(fd, 1)))
                kernel.ioctl_enable(fd)
            for _ in range(5):
                subprocess.run(["true"], check=True)
            return sum(len(ring.read()) for _, ring in rings)
        finally:
            for fd, ring in rings:
                ring.close()
                kernel.close_fd(fd)

    agg = ebpf.load(1 << 10, 1 << 10)
    try:
        assert agg.exit_error is None
        assert exits_seen() > 0
    finally:
        agg.close()


def test_tracepoints_are_found_where_tracefs_is_not_mounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine booted without systemd has no tracefs mounted (this project's VMs): tracepoint
    ids are read from a private mount made for the read, which leaves the mounts as they were,
    and the exit program attaches through it."""
    from cyclescope.collect import ebpf, kernel

    if os.geteuid() != 0:
        pytest.skip("mounting tracefs needs root")
    mounts = Path("/proc/self/mountinfo").read_text()
    monkeypatch.setattr(kernel, "TRACEFS", ("/nonexistent/tracing",))
    monkeypatch.setattr(kernel, "_tracepoint_ids", {})
    exit_id = kernel.tracepoint_id("sched", "sched_process_exit")
    assert isinstance(exit_id, int) and exit_id > 0
    assert kernel.tracepoint_id("sched", "no_such_tracepoint") is None
    why = kernel.no_tracepoint("sched", "no_such_tracepoint")
    assert why == "the kernel has no sched:no_such_tracepoint tracepoint"
    assert Path("/proc/self/mountinfo").read_text() == mounts
    try:
        agg = ebpf.load(1 << 10, 1 << 10)
    except (ebpf.BpfUnavailable, OSError) as e:
        pytest.skip(f"the eBPF path cannot run here: {e}")
    try:
        assert agg.exit_error is None
    finally:
        agg.close()
    assert Path("/proc/self/mountinfo").read_text() == mounts


def _execs_woken(monkeypatch: pytest.MonkeyPatch, bpf: bool) -> tuple[set[str], str | None]:
    """Which of a few programs executed woke PythonFrames' exec watch (watch_execs): through
    exec.bpf.c, or (``bpf`` false: its object made missing) through ftrace's filter on the name as
    executed. The programs live in a directory whose path says neither python nor .py."""
    import shutil
    import tempfile
    from types import SimpleNamespace

    from cyclescope.collect import ebpf
    from cyclescope.collect.pyframes import PythonFrames
    from cyclescope.images.registry import ImageTable

    if not bpf:
        monkeypatch.setattr(ebpf, "EXEC_OBJECT", Path("/nonexistent/exec.bpf.o"))
    python = os.path.realpath(sys.executable)
    home = Path(tempfile.mkdtemp(prefix="cs-exec-"))
    pf = PythonFrames(ImageTable(), SimpleNamespace(procs={}), SimpleNamespace(),  # type: ignore[arg-type]
                      start_cpus=tuple(sorted(os.sched_getaffinity(0))))
    try:
        pf.watch_execs()
        assert pf._execs, (pf.exec_error, pf.exec_bpf_error)
        scripts, links = ("console-tool", "run-me.py"), ("py-alias", "python-alias")
        for name in scripts:  # run by their #! line
            (home / name).write_text(f"#!{python}\npass\n")
            (home / name).chmod(0o755)
        for name in links:  # to the interpreter
            (home / name).symlink_to(python)
        shutil.copy("/bin/true", home / "plain")
        child_pids = {}
        for name in (*scripts, *links, "plain"):
            args = ["-c", "pass"] if name in links else []
            p = subprocess.Popen([str(home / name), *args])
            assert p.wait(timeout=60) == 0
            child_pids[p.pid] = name
        pf.take_execs()
        return {name for pid, name in child_pids.items() if pid in pf._exec_pids}, pf.exec_bpf_error
    finally:
        pf.close()
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.usefixtures("bpf_loads")
def test_a_python_executed_under_any_name_wakes_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """exec.bpf.c looks at the executable file the new program runs from: a console script's
    interpreter and a link's target say python whatever the name executed."""
    woken, why = _execs_woken(monkeypatch, bpf=True)
    assert why is None
    assert woken == {"console-tool", "run-me.py", "py-alias", "python-alias"}


def test_without_the_exec_program_the_filter_on_the_name_wakes_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where exec.bpf.c cannot load (a kernel without BTF), ftrace's filter on the name as
    executed: a name that says python or ends in .py."""
    woken, why = _execs_woken(monkeypatch, bpf=False)
    assert why is not None and "exec.bpf.o" in why
    assert woken == {"run-me.py", "python-alias"}


def _started_system_wide(tmp_path: Path, python: str, name: str, rounds: int,
                         script: bool = False) -> tuple[int, int]:
    """pyshares.py ROUNDS run by ``python`` under the command ``name`` (a symbolic link; with
    ``script``, a copy of pyshares.py of that name run by its #! line), started 2.5 s into `record -a
    --collector bpf -g fp`: its samples under py::main, and all of them. The command lives in a
    directory of its own: the exec filter matches the whole path, and pytest names tmp_path after
    the test ("test_a_python_started_..." matched every name)."""
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="cs-exec-"))
    try:
        return _started_in(home, tmp_path, python, name, rounds, script)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _started_in(home: Path, tmp_path: Path, python: str, name: str, rounds: int, script: bool) -> tuple[int, int]:
    import os
    import time

    exe = home / name
    if script:
        exe.write_text(f"#!{os.path.realpath(python)}\n" + (PROGRAMS / "pyshares.py").read_text())
        exe.chmod(0o755)
        cmd, path = [str(exe), str(rounds)], str(exe)
    else:
        exe.symlink_to(os.path.realpath(python))
        cmd, path = [str(exe), str(PROGRAMS / "pyshares.py"), str(rounds)], str(PROGRAMS / "pyshares.py")
    db = tmp_path / "db"
    rec = cs_popen("record", "--db", str(db), "-a", "--collector", "bpf", "-g", "fp", "-F", "1000", "-d", "6")
    time.sleep(2.5)  # sampling by then (its start-up takes about half a second)
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    _, err = rec.communicate(timeout=120)
    assert rec.returncode == 0, err
    st = folded(cs("export", "collapsed", "--db", str(db), "--process", name).stdout)
    return sum(n for s, n in st.items() if f"py::main:{path}" in s.split(";")), sum(st.values())


@pytest.mark.usefixtures("bpf_loads")
def test_a_python_started_while_recording_system_wide_is_named_to_its_end(tmp_path: Path) -> None:
    """System-wide, drains are a second apart: a process starting an interpreter brings the drain
    that describes it forward, and the samples of its last drain keep their Python frames (its exit
    is read in that drain: it is forgotten after them)."""
    import sys

    # Its own command name, told apart from the recorder's (the recorder's own interpreter file,
    # whose starts it probes from the start).
    named, total = _started_system_wide(tmp_path, sys.executable, "pyshares-py", 300)
    # The samples before the process is described have no Python frames. It is described as its
    # interpreter starts: the first CPython of a file seen (the recorder's own) put a uprobe on the
    # file's Py_InitializeFromConfig, whose ring wakes the collector. With 300 rounds 93-95% were
    # named under main, beside two busy loops too (the rest: the start-up's imports, finalization).
    # Before, when the rings' side records (read every 0.2 s) showed the interpreter mapped,
    # 76-90%, and with 150 rounds 55.9% once in a full run of the suite.
    assert total > 200 and named > 0.85 * total, (named, total)


def _another_interpreter() -> str | None:
    """A CPython 3.10-3.13 other than the recorder's own file (whose starts it probes from the start)."""
    import os
    import sys

    own = os.path.realpath(sys.executable)
    return next((p for p in pythons(("3.12", "3.13", "3.10")) if os.path.realpath(p) != own), None)


@pytest.mark.usefixtures("bpf_loads")
def test_the_first_python_of_its_file_is_named_from_its_exec_system_wide(tmp_path: Path) -> None:
    """A python executed by a name that says so wakes the collector at its exec (the
    sched_process_exec tracepoint, filtered in the kernel), though no process of its file was seen
    before: it is described as its runtime starts, not when the rings' side records are next read
    (every 0.2 s), and its libpython, mapped a moment after the exec, is looked for until found."""
    python = _another_interpreter()
    if python is None:
        pytest.skip("no CPython 3.10, 3.12 or 3.13 here besides the recorder's own")
    # "python" in the name as executed: the filter matches it (15 characters at most: a comm).
    named, total = _started_system_wide(tmp_path, python, "python-first", 150)
    # bench/pyshort.py --system-wide 150, three rounds each: 0.95-0.98 under main with 3.10, 3.12
    # and 3.13 (the rest: the start-up before the runtime, finalization); 0.66-0.83 before the
    # exec wakes, when the process was seen at the next read of the side records.
    assert total > 200 and named > 0.88 * total, (named, total)


@pytest.mark.usefixtures("bpf_loads")
@pytest.mark.parametrize("name", ["pyshares-run.py", "pyshares-cli"])
def test_the_first_python_of_its_file_run_as_a_script_is_named_from_its_exec_system_wide(tmp_path: Path,
                                                                                        name: str) -> None:
    """A script run by its #! line is executed under its own name, and its interpreter is the
    file the process runs: exec.bpf.c wakes the collector at its exec whatever the name (a
    console script's, without the .py suffix), ftrace's filter, its fallback, for a name ending in
    .py."""
    python = _another_interpreter()
    if python is None:
        pytest.skip("no CPython 3.10, 3.12 or 3.13 here besides the recorder's own")
    # 15 characters at most (a comm), without "python".
    named, total = _started_system_wide(tmp_path, python, name, 150, script=True)
    assert total > 200 and named > 0.88 * total, (named, total)


@pytest.mark.usefixtures("bpf_loads")
@pytest.mark.parametrize("python", interpreters_without_perf_maps()[:1])
def test_module_bodies_run_while_importing_are_named(python: str, tmp_path: Path) -> None:
    """A module's body runs once as it is imported, and importlib frees its code object right
    after: by the drain, the memory holds other objects. The program copies the code objects of
    module bodies at the samples that find them running, and those frames are named from the
    copies."""
    db = tmp_path / "db"
    imports = ("import asyncio, email.parser, http.client, xml.dom.minidom, unittest, argparse, decimal, json, "
               "typing, dataclasses")
    cs("record", "--db", str(db), "-q", "--collector", "bpf", "--no-loop-counts", "-g", "fp", "-F", "2000", "--",
       python, "-c", imports, timeout=120)
    st = folded(cs("export", "collapsed", "--db", str(db)).stdout)
    with_py = {s: n for s, n in st.items() if "py::" in s}
    unnamed = sum(n for s, n in with_py.items() if "py::[unnamed]" in s.split(";"))
    bodies = sum(n for s, n in with_py.items() if any(f.startswith("py::<module>:") and "/asyncio/" in f
                                                       for f in s.split(";")))
    # 4.6-9.6% of the samples with Python frames had an unnamed frame (four runs with CPython 3.11),
    # and 47-48 of about 110 ran under an asyncio module's body; before the copies, 85-90% and none.
    assert sum(with_py.values()) > 40, st.most_common(3)
    assert unnamed < 0.3 * sum(with_py.values()) and bodies > 0.15 * sum(with_py.values()), (unnamed, bodies)
