"""The eBPF path's samples for the loop counter (collect/loopwatch.py), without the kernel: the
records' decoding, the ranges a process is watched in, and that the samples the program sends (the
watched ones and the next one on their CPU) give the loop counter the tallies every sample would."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from cyclescope.analysis.loopcount import LoopCounter
from cyclescope.collect.ebpf import LC_FOLLOWER, LC_RANGES, LC_REC_DTYPE, LC_WATCHED
from cyclescope.collect.loopwatch import RAW_SIZE, RECORD_SIZE, LoopWatch, decode, process_ranges, ring_pages
from cyclescope.images.maps import ProcessState
from cyclescope.perf.abi import RecordType
from tests.unit.test_loops import CHAIN, CHAIN_AT, FakeBinary, FakeSource, regs


def record(pid: int, tid: int, t: int, ip: int, flags: int) -> bytes:
    rec = np.zeros(1, LC_REC_DTYPE)
    rec["pid"], rec["tid"], rec["time"], rec["ip"], rec["flags"], rec["period"] = pid, tid, t, ip, flags, 1000
    rec["regs"][0, 3] = t  # rdx
    body = rec.tobytes() + b"\0" * (RAW_SIZE - LC_REC_DTYPE.itemsize)
    return struct.pack("<IHHI", RecordType.SAMPLE, 0, RECORD_SIZE, RAW_SIZE) + body


def test_records_decode_whole_and_around_a_lost_record() -> None:
    assert RECORD_SIZE % 8 == 0 and RECORD_SIZE == 8 + 4 + RAW_SIZE
    a, b = record(7, 8, 100, 0x1350, LC_WATCHED), record(7, 9, 200, 0x1360, LC_FOLLOWER)
    recs, lost = decode(a + b)
    assert lost == 0 and recs["tid"].tolist() == [8, 9] and recs["regs"][:, 3].tolist() == [100, 200]
    lost_rec = struct.pack("<IHHQQ", RecordType.LOST, 0, 24, 1, 5)
    recs, lost = decode(a + lost_rec + b + b"\x09\0\0\0")  # a torn record at the end is left out
    assert lost == 5 and recs["ip"].tolist() == [0x1350, 0x1360] and recs["flags"].tolist() == [LC_WATCHED,
                                                                                               LC_FOLLOWER]
    assert len(decode(b"")[0]) == 0


def test_rings_hold_two_seconds_of_samples_within_bounds() -> None:
    assert ring_pages(1000) == 128 and ring_pages(5000) == 512 and ring_pages(20000) == 512
    assert ring_pages(10) == 16


def test_above_two_thousand_samples_a_second_one_window_in_several_is_watched() -> None:
    from cyclescope.collect.loopwatch import window_share

    assert window_share(1000) == 1 and window_share(2000) == 1 and window_share(5000) == 3
    assert window_share(16000) == 8 and window_share(20000) == 10


def test_a_process_is_watched_where_it_maps_the_procedures() -> None:
    st = ProcessState(1, 0)
    st.insert(0x555000001000, 0x555000003000, 0x555000000000, 3)  # image 3's text, loaded at 0x555000000000
    st.insert(0x7F0000000000, 0x7F0000100000, 0x7F0000000000 - 0x20000, 4)  # image 4 (libc-like)
    procs = {3: [(0x1340, 0x1370, 10.0), (0x5000, 0x5100, 99.0)],  # the second lies outside the mapping
             4: [(0x20010, 0x20040, 5.0)]}
    assert process_ranges(st, procs) == [(0x555000001340, 0x555000001370), (0x7F0000000010, 0x7F0000000040)]
    # At most the limit, the heaviest kept.
    many = {3: [(0x1000 + 16 * k, 0x1008 + 16 * k, float(k)) for k in range(40)]}
    got = process_ranges(st, many)
    assert len(got) == LC_RANGES and got[0] == (0x555000001000 + 16 * 24, 0x555000001008 + 16 * 24)


def test_the_kernels_rows_choose_what_is_analyzed_and_watched() -> None:
    """note() takes the eBPF path's rows (counts per offset, no registers): the procedure is
    analyzed once it has enough samples, and watched once its loop, which a register counts, is known."""
    lc = LoopCounter(FakeSource(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", False, background=False,
                     analyze_after=32)
    lc.note(np.array([1, 1]), np.array([0x1350, 0x1357], np.uint64), np.array([10, 10]))
    assert lc.watched() == {} and lc.bounds(1) is None  # 20 samples in the image: not opened yet
    lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([20]))  # opened: 20 in the procedure
    assert lc.bounds(1) is not None and lc.watched() == {}
    lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([20]))  # 40: analyzed
    got = lc.watched()
    assert list(got) == [(1, CHAIN_AT)] and got[(1, CHAIN_AT)][0] == CHAIN_AT + len(CHAIN)
    assert got[(1, CHAIN_AT)][1] == pytest.approx(20 * 0.9 + 20)  # decayed samples: the watch's weight
    assert not lc.busy()
    lc.note(np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.int64))  # a drain without it
    assert lc.watched()[(1, CHAIN_AT)][1] == pytest.approx((20 * 0.9 + 20) * 0.9)


CHASE = bytes.fromhex("488b3f4885ff75f8c3")  # mov rdi, [rdi]; test rdi, rdi; jne back; ret: no counter
CHASE_AT = 0x2000


@pytest.mark.parametrize("partial", [False, True])
def test_on_the_ebpf_path_a_loop_without_a_counter_keeps_no_table(partial: bool) -> None:
    """Only watched procedures' samples bring registers there, so a procedure whose loops no register
    counts is never watched and its table is not held (per task it is: every sample comes)."""
    lc = LoopCounter(FakeSource(FakeBinary(CHASE, CHASE_AT)), lambda i: f"img{i}", False, background=False,
                     analyze_after=1)
    lc.partial = partial
    for _ in range(2):
        lc.note(np.array([1]), np.array([CHASE_AT], np.uint64), np.array([50]))
    t = lc.table(1, CHASE_AT)
    assert t is not None and lc.watched() == {}
    assert t.empty == partial  # per task: its loop, with no counter
    assert not any(t.counters)


def test_a_procedure_sampled_now_and_then_is_never_analyzed() -> None:
    """On the eBPF path a procedure is analyzed for its recent samples, not its samples since the
    start: three a drain decay to under 32 for good, where they would pass it by the eleventh."""
    lc = LoopCounter(FakeSource(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", False, background=False,
                     analyze_after=32)
    lc.note(np.array([1]), np.array([0x10], np.uint64), np.array([32]))  # the image opened (outside procedures)
    for _ in range(50):
        lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([3]))
    assert lc.table(1, CHAIN_AT) is None and lc.watched() == {}
    lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([10]))  # busier now: 10 + 27
    assert lc.table(1, CHAIN_AT) is not None and list(lc.watched()) == [(1, CHAIN_AT)]


def test_system_wide_images_wait_for_the_analyses_budget() -> None:
    """Opening an image not in the user's cache takes the worker up to a second and a half of CPU
    (libarrow's symbols): system-wide it counts in the analyses' tenth of a CPU, and an image past
    its samples' threshold waits for a drain within it."""
    lc = LoopCounter(FakeSource(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", False, background=False,
                     analyze_after=32)
    lc.analysis_s = 10.0  # ten seconds of a CPU spent in the first second
    lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([40]))
    assert lc.bounds(1) is None and lc.deferred == 1
    lc.analysis_s = 0.0
    lc._inflight = 4  # as many requests with the worker as it may have: their cost is not known yet
    lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([1]))
    assert lc.bounds(1) is None and lc.deferred == 2
    lc._inflight = 0
    lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([1]))
    assert lc.bounds(1) is not None


def test_an_image_without_procedures_is_noted_and_never_watched() -> None:
    class Empty(FakeSource):
        def bounds(self, img: int) -> tuple[np.ndarray, np.ndarray] | None:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint64)

    lc = LoopCounter(Empty(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", False, background=False,
                     analyze_after=1)
    for _ in range(2):
        lc.note(np.array([1]), np.array([0x1350], np.uint64), np.array([50]))
    assert lc.watched() == {} and not lc.busy()
    # Its samples with registers (a follower there, say) count nowhere and break nothing.
    lc.add(np.array([7, 7]), np.array([1, 2], np.uint64), np.zeros(2), np.ones(2, np.int64),
           np.array([0x1350, 0x1357], np.uint64), np.full(2, 1000.0), np.array([regs(1), regs(2)], np.uint64))
    lc.finish()
    assert lc.take().num_rows == 0


def _stream(seed: int) -> list[tuple[int, int, int, int]]:
    """Two CPUs sampled every 1,000 ns (CPU 1 half a period after CPU 0), running threads 7, 8 and
    9, one thread on one CPU at a time, switching now and then (thread 7 moves between CPUs):
    (cpu, time, tid, offset), thread 7 in the loop (counter rdx one a ns) or, a third of the time,
    outside it (where its next sample is no pair), the others outside every procedure."""
    rnd = random.Random(seed)
    out = []
    on = [7, 8]  # the thread on each CPU
    for step in range(400):
        for cpu in (0, 1):
            if rnd.random() < 0.15:
                on[cpu] = rnd.choice([t for t in (7, 8, 9) if t != on[1 - cpu]])
            tid = on[cpu]
            off = 0x1350 if tid == 7 and rnd.random() < 0.67 else 0x9000
            out.append((cpu, 1000 + 1000 * step + 500 * cpu, tid, off))
    return out


def _tally(rows: list[tuple[int, int, int, int]]) -> dict[str, float]:
    lc = LoopCounter(FakeSource(FakeBinary(CHAIN, CHAIN_AT)), lambda i: f"img{i}", False, background=False,
                     analyze_after=1)
    lc.partial = True
    rows = sorted(rows, key=lambda r: (r[1], r[0]))
    for k in range(0, len(rows), 97):  # in drains
        part = rows[k : k + 97]
        lc.add(np.array([r[2] for r in part]), np.array([r[1] for r in part], np.uint64),
               np.array([r[0] for r in part]), np.ones(len(part), np.int64),
               np.array([r[3] for r in part], np.uint64), np.full(len(part), 1000.0),
               np.array([regs(r[1], rdi=1000) for r in part], np.uint64))
    lc.finish()
    t = lc.take().to_pydict()
    return {k: v[0] for k, v in t.items() if k not in ("image", "header")}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_watched_samples_and_their_followers_tally_as_every_sample(seed: int) -> None:
    rows = _stream(seed)
    sent = []
    for cpu in (0, 1):  # the program's rule, per CPU in time order
        follow = False
        for r in [r for r in rows if r[0] == cpu]:
            watched = r[3] == 0x1350
            if watched or follow:
                sent.append(r)
            follow = watched
    assert len(sent) < len(rows)
    every, some = _tally(rows), _tally(sent)
    assert every["pairs"] > 50 and every["followed"] > every["next_own"] >= every["pairs"]
    assert some == every
    alone = _tally([r for r in sent if r[3] == 0x1350])  # without the followers the tallies go wrong
    assert alone["followed"] < every["followed"]


class FakeBpf:
    def __init__(self, fail: bool = False) -> None:
        self.watches: dict[int, list[tuple[int, int]]] = {}
        self.calls = 0
        self.fail = fail

    def watch_loops(self, pid: int, ranges: list[tuple[int, int]]) -> None:
        self.calls += 1
        if self.fail:
            raise OSError(28, "No space left on device")
        self.watches[pid] = ranges

    def unwatch_loops(self, pid: int) -> None:
        self.watches.pop(pid, None)


def _watch(bpf: FakeBpf) -> LoopWatch:
    w = LoopWatch.__new__(LoopWatch)  # no output events: update and forget only
    w.bpf, w.rings, w.installed = bpf, [], {}  # type: ignore[assignment]
    w._seen, w._watched, w._generation = {}, {}, 0
    from cyclescope.collect.loopwatch import WatchStats

    w.stats = WatchStats()
    return w


def test_processes_are_watched_once_and_forgotten_at_exit() -> None:
    bpf = FakeBpf()
    w = _watch(bpf)
    st = ProcessState(5, 0)
    st.insert(0x400000, 0x402000, 0, 1)
    watched = {(1, 0x401000): (0x401040, 3.0)}
    w.update({5: st}, [5, 6], watched)  # pid 6 has no mappings known: left alone
    assert bpf.watches == {5: [(0x401000, 0x401040)]} and w.stats.processes == 1
    w.update({5: st}, [5], watched)
    assert bpf.calls == 1  # nothing changed: not sent again
    st.insert(0x700000, 0x701000, 0x700000, 2)  # a library mapped: looked at again, the same ranges
    w.update({5: st}, [5], watched)
    assert bpf.calls == 1 and bpf.watches[5] == [(0x401000, 0x401040)]
    w.forget(5)
    assert bpf.watches == {} and w.stats.processes == 0


def test_a_process_sampled_in_the_drain_of_its_exit_is_not_watched_again() -> None:
    """Its exit record is read before its last samples are handed over, so it is among the
    sampled pids once more; watched again, it held its entry of the program's map for good (a
    daemon under gcc's process churn filled the 4,096 entries in two minutes)."""
    bpf = FakeBpf()
    w = _watch(bpf)
    watched = {(1, 0x401000): (0x401040, 3.0)}
    states = {}
    for pid in (5, 6, 7):
        states[pid] = ProcessState(pid, 0)
        states[pid].insert(0x400000, 0x402000, 0, 1)
    w.update(states, [5, 6, 7], watched)
    assert set(bpf.watches) == {5, 6, 7}
    states[5].exited_ns = 1  # exited: the mapper keeps it a while for late samples
    w.forget(5)
    w.update(states, [5, 6], watched)
    del states[6]  # gone without an exit record read (the mapper reaped it)
    w.update(states, [7], watched)
    assert set(bpf.watches) == {7} and set(w.installed) == {7} and w.stats.processes == 1


def test_a_full_watch_map_loses_that_process_and_says_so() -> None:
    bpf = FakeBpf(fail=True)
    w = _watch(bpf)
    st = ProcessState(5, 0)
    st.insert(0x400000, 0x402000, 0, 1)
    w.update({5: st}, [5], {(1, 0x401000): (0x401040, 3.0)})
    assert w.installed == {} and w.stats.errors and "pid 5" in w.stats.errors[0]
