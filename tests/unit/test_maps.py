"""Process maps and the time-ordered mapping of samples to (image, offset)."""

from __future__ import annotations

import numpy as np

from cyclescope.images.kernel import KernelMap, KernelRange
from cyclescope.images.maps import Mapper, ProcessState
from cyclescope.images.registry import Resolved, Unknown
from cyclescope.perf.records import SAMPLE_DTYPE, RecordDecoder, SampleLayout
from tests import perfbytes as pb


class FakeResolver:
    """Image i for path "/img/i"; the bias puts the mapping's start at vaddr 0x1000 + pgoff."""

    def __init__(self) -> None:
        self.forgotten: list[int] = []

    def resolve(self, pid: int, start: int, end: int, pgoff: int, path: str, build_id: bytes | None) -> Resolved:
        if path.startswith("//anon"):
            return Resolved(-int(Unknown.ANON) - 1, 0)
        idx = int(path.rsplit("/", 1)[1])
        return Resolved(idx, start - pgoff - 0x1000)

    def forget_pid(self, pid: int) -> None:
        self.forgotten.append(pid)


def mapper(kernel: list[KernelRange] | None = None) -> Mapper:
    ranges = kernel or []
    return Mapper(FakeResolver(), KernelMap(ranges), list(range(100, 100 + len(ranges))), proc_root="/nonexistent",
                  lazy_proc=False)


def decode(raw: bytes):
    b = RecordDecoder(SampleLayout(pb.ST)).decode(raw)
    return b.samples, b.side


def test_insert_replaces_overlaps_like_mmap() -> None:
    st = ProcessState(1, 0)
    st.insert(0x1000, 0x5000, 0, 1)
    st.insert(0x2000, 0x3000, 7, 2)  # punches a hole
    assert list(zip(st.starts, st.ends, st.images, strict=True)) == [
        (0x1000, 0x2000, 1), (0x2000, 0x3000, 2), (0x3000, 0x5000, 1)]
    st.insert(0x0, 0x2800, 9, 3)  # covers the first, trims the second's head
    assert list(zip(st.starts, st.ends, st.images, strict=True)) == [
        (0x0, 0x2800, 3), (0x2800, 0x3000, 2), (0x3000, 0x5000, 1)]
    assert st.biases[1] == 7  # trimming the head keeps the bias
    img, off = st.lookup(np.array([0x10, 0x2900, 0x4FFF, 0x5000], dtype=np.uint64))
    assert img.tolist() == [3, 2, 1, -int(Unknown.NO_MAPPING) - 1]
    assert off.tolist()[:3] == [0x10 - 9, 0x2900 - 7, 0x4FFF]


def test_samples_map_with_the_maps_in_force_at_their_time() -> None:
    m = mapper()
    raw = (
        pb.comm(10, 10, "old", 1, exec_=True)
        + pb.mmap2(10, 10, 0x400000, 0x1000, 0, "/img/1", 2)
        + pb.sample(1, 0x400010, 10, 10, 3, 0)
        + pb.comm(10, 10, "new", 4, exec_=True)
        + pb.mmap2(10, 10, 0x400000, 0x1000, 0, "/img/2", 5)
        + pb.sample(1, 0x400020, 10, 10, 6, 0)
    )
    samples, side = decode(raw)
    # Deliver the second sample first, as another CPU's buffer might.
    samples = samples[::-1].copy()
    out = m.map_batch(samples, side)
    assert out.image.tolist() == [2, 1]
    assert out.offset.tolist() == [0x1020, 0x1010]
    # Each sample carries the name in force when it was taken.
    assert [m.comms.names[c] for c in out.comm.tolist()] == ["new", "old"]


def test_fork_copies_maps_and_exit_reaps_after_grace() -> None:
    m = mapper()
    raw = (
        pb.mmap2(10, 10, 0x400000, 0x1000, 0, "/img/3", 1)
        + pb.fork(11, 10, 11, 10, 2)
        + pb.sample(1, 0x400100, 11, 11, 3, 0)
        + pb.exit_(11, 10, 11, 10, 4)
    )
    samples, side = decode(raw)
    out = m.map_batch(samples, side)
    assert out.image.tolist() == [3] and out.offset.tolist() == [0x1100]
    assert m.procs[11].exited_ns == 4
    assert m.procs[11].parent == 10 and m.procs[10].parent == 0  # who forked it (value owners: capture.py)
    assert m.reap(now_ns=4 + 10**9) == 0  # still in its grace period
    assert m.reap(now_ns=4 + 3 * 10**9) == 1 and 11 not in m.procs and 10 in m.procs


def test_thread_creation_shares_the_process_maps() -> None:
    m = mapper()
    raw = pb.mmap2(10, 10, 0x400000, 0x1000, 0, "/img/3", 1) + pb.fork(10, 10, 12, 10, 2)
    samples, side = decode(raw)
    m.map_batch(samples, side)
    assert set(m.procs) == {10}


def test_unknown_reasons_are_kept_as_offsets_of_image_zero() -> None:
    kr = KernelRange("[kernel.kallsyms]", "kb", 0xFFFFFFFF81000000, 0xFFFFFFFF82000000, 0xFFFFFFFF81000000)
    m = mapper([kr])
    raw = (
        pb.mmap2(10, 10, 0x400000, 0x1000, 0, "/img/1", 1)
        + pb.mmap2(10, 10, 0x500000, 0x1000, 0, "//anon", 1)
        + pb.sample(1, 0x999999, 10, 10, 2, 0)  # outside every mapping
        + pb.sample(1, 0x500010, 10, 10, 2, 0)  # anonymous code
        + pb.sample(1, 0x400010, 77, 77, 2, 0)  # a process nobody told us about
        + pb.sample(1, 0xFFFFFFFF81000100, 10, 10, 2, 0, misc=1)  # kernel text
        + pb.sample(1, 0xFFFFFFFFA0000000, 10, 10, 2, 0, misc=1)  # kernel, outside text
        + pb.sample(1, 0x1234, 10, 10, 2, 0, misc=3)  # hypervisor
    )
    samples, side = decode(raw)
    out = m.map_batch(samples, side)
    assert out.image.tolist() == [0, 0, 0, 100, 0, 0]
    assert out.offset.tolist() == [Unknown.NO_MAPPING, Unknown.ANON, Unknown.NO_PROCESS, 0x100, Unknown.KERNEL,
                                   Unknown.OTHER_MODE]


def test_empty_batches_still_apply_side_records() -> None:
    m = mapper()
    out = m.map_batch(np.zeros(0, SAMPLE_DTYPE), decode(pb.mmap2(10, 10, 0x400000, 0x1000, 0, "/img/1", 1))[1])
    assert len(out.image) == 0 and m.procs[10].images == [1]


def test_mapping_is_vectorized_over_many_samples() -> None:
    m = mapper()
    raw = pb.mmap2(10, 10, 0x400000, 0x100000, 0, "/img/4", 1) + b"".join(
        pb.sample(1, 0x400000 + 16 * i, 10, 10, 10 + i, i % 2) for i in range(20000))
    samples, side = decode(raw)
    out = m.map_batch(samples, side)
    assert (out.image == 4).all()
    assert out.offset.tolist() == [0x1000 + 16 * i for i in range(20000)]
