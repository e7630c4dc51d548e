"""Decoding ring-buffer bytes built in the test, record by record."""

from __future__ import annotations

import numpy as np
import pytest

from cyclescope.perf.abi import X86_REGS_USER_MASK, RecordType, Sample
from cyclescope.perf.records import (
    CommRecord,
    LostRecord,
    MmapRecord,
    RecordDecoder,
    SampleLayout,
    TaskRecord,
    ThrottleRecord,
)
from tests import perfbytes as pb

LAYOUT = SampleLayout(pb.ST)


def test_fixed_samples_decode_in_bulk_with_every_field() -> None:
    raw = b"".join(pb.sample(7, 0x400000 + i, 100 + i % 3, 200 + i, 1000 + i, i % 2) for i in range(1000))
    batch = RecordDecoder(LAYOUT).decode(raw)
    s = batch.samples
    assert len(s) == 1000 and not batch.side and batch.truncated == 0 and batch.malformed == 0
    assert s["ip"].tolist() == [0x400000 + i for i in range(1000)]
    assert s["pid"].tolist() == [100 + i % 3 for i in range(1000)]
    assert s["tid"].tolist() == [200 + i for i in range(1000)]
    assert s["time"].tolist() == [1000 + i for i in range(1000)]
    assert s["cpu"].tolist() == [i % 2 for i in range(1000)]
    assert set(s["id"].tolist()) == {7}
    assert set(s["cpumode"].tolist()) == {2}
    assert set(s["extra"].tolist()) == {-1}


def test_side_records_between_samples_keep_order_and_fields() -> None:
    bid = bytes(range(20))
    raw = (
        pb.sample(1, 0x1000, 5, 5, 10, 0)
        + pb.comm(5, 5, "prog", 11, exec_=True)
        + pb.mmap2(5, 5, 0x7F0000, 0x2000, 0x1000, "/usr/bin/prog", 12, build_id=bid)
        + pb.mmap2(5, 5, 0x800000, 0x1000, 0, "/lib/x.so", 13)
        + pb.sample(1, 0x7F0010, 5, 5, 14, 1)
        + pb.fork(6, 5, 6, 5, 15)
        + pb.exit_(6, 5, 6, 5, 16)
        + pb.lost(1, 42, 17)
        + pb.lost_samples(3, 18)
        + pb.throttle(1, 19)
        + pb.throttle(1, 20, on=False)
        + pb.sample(1, 0xFFFFFFFF81000010, -1, 0, 21, 0, misc=1)
    )
    b = RecordDecoder(LAYOUT).decode(raw)
    assert b.samples["ip"].tolist() == [0x1000, 0x7F0010, 0xFFFFFFFF81000010]
    assert b.samples["cpumode"].tolist() == [2, 2, 1]
    kinds = [type(r).__name__ for r in b.side]
    assert kinds == ["CommRecord", "MmapRecord", "MmapRecord", "TaskRecord", "TaskRecord", "LostRecord",
                     "LostRecord", "ThrottleRecord", "ThrottleRecord"]
    c = b.side[0]
    assert isinstance(c, CommRecord) and c.comm == "prog" and c.exec and c.time == 11
    m = b.side[1]
    assert isinstance(m, MmapRecord)
    assert (m.pid, m.addr, m.length, m.pgoff, m.filename, m.build_id) == (5, 0x7F0000, 0x2000, 0x1000,
                                                                         "/usr/bin/prog", bid)
    assert m.executable and m.time == 12
    m2 = b.side[2]
    assert isinstance(m2, MmapRecord) and m2.build_id is None and m2.inode == 1234
    f = b.side[3]
    assert isinstance(f, TaskRecord) and f.kind == RecordType.FORK and (f.pid, f.ppid) == (6, 5)
    lo = b.side[5]
    assert isinstance(lo, LostRecord) and lo.kind == RecordType.LOST and lo.lost == 42 and lo.id == 1
    ls = b.side[6]
    assert isinstance(ls, LostRecord) and ls.kind == RecordType.LOST_SAMPLES and ls.lost == 3
    th = b.side[7]
    assert isinstance(th, ThrottleRecord) and th.throttled and not b.side[8].throttled  # type: ignore[union-attr]


def test_a_partial_record_at_the_end_is_left_alone() -> None:
    raw = pb.sample(1, 1, 1, 1, 1, 0) + pb.sample(1, 2, 1, 1, 2, 0)[:20]
    b = RecordDecoder(LAYOUT).decode(raw)
    assert len(b.samples) == 1 and b.truncated == 20


def test_an_impossible_size_stops_decoding_and_is_counted() -> None:
    raw = pb.sample(1, 1, 1, 1, 1, 0) + b"\x09\x00\x00\x00\x00\x00\x04\x00" + b"\0" * 64
    b = RecordDecoder(LAYOUT).decode(raw)
    assert len(b.samples) == 1 and b.malformed == 1


def test_unknown_record_types_are_skipped() -> None:
    raw = pb.record(99, 0, b"\0" * 24) + pb.sample(1, 5, 1, 1, 1, 0)
    b = RecordDecoder(LAYOUT).decode(raw)
    assert b.samples["ip"].tolist() == [5]


def test_runs_longer_than_the_scan_window_are_found_whole() -> None:
    raw = b"".join(pb.sample(1, i, 1, 1, i, 0) for i in range(5000)) + pb.comm(1, 1, "x", 1) + b"".join(
        pb.sample(1, i, 1, 1, i, 0) for i in range(300)
    )
    b = RecordDecoder(LAYOUT).decode(raw)
    assert len(b.samples) == 5300 and len(b.side) == 1


def test_variable_samples_carry_callchain_registers_and_stack() -> None:
    st = pb.ST | int(Sample.CALLCHAIN | Sample.REGS_USER | Sample.STACK_USER)
    layout = SampleLayout(st, regs_user_mask=X86_REGS_USER_MASK)
    regs = list(range(20))
    raw = pb.sample_regs_stack(3, 0x4010, 9, 9, 77, 1, regs, b"\x01\x02\x03", chain=[0x4010, 0x4020])
    b = RecordDecoder(layout).decode(raw)
    assert b.samples["ip"].tolist() == [0x4010] and b.samples["extra"].tolist() == [0]
    ex = b.extras[0]
    assert ex.callchain == (0x4010, 0x4020)
    assert ex.regs_abi == 2 and list(ex.regs) == regs
    assert ex.stack == b"\x01\x02\x03" and ex.stack_dyn_size == 3


def test_unsupported_sample_bits_are_refused() -> None:
    with pytest.raises(ValueError):
        RecordDecoder(SampleLayout(pb.ST | int(Sample.RAW)))


def test_fixed_dtype_matches_the_abi_size() -> None:
    assert LAYOUT.fixed_dtype().itemsize == len(pb.sample(1, 1, 1, 1, 1, 0)) == 48
    assert LAYOUT.sample_id_size() == 32


def test_decoding_accepts_memoryview_and_bytearray() -> None:
    raw = bytearray(pb.sample(1, 9, 1, 1, 1, 0))
    assert RecordDecoder(LAYOUT).decode(memoryview(raw)).samples["ip"].tolist() == [9]
    assert np.asarray(RecordDecoder(LAYOUT).decode(raw).samples["ip"]).tolist() == [9]
