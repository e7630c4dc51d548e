"""Pure decoding of perf ring-buffer bytes into typed records.

Nothing here touches the kernel: tests build the bytes themselves.

Samples come out as a numpy structured array (one row per sample), decoded in
bulk: a run of consecutive fixed-size sample records is found with a strided
view over the buffer and converted with one ``np.frombuffer`` call, so the
per-record Python cost is paid only by the rare side records (mmap, comm, fork,
exit, lost, throttle). Samples that carry variable-size parts (callchains, user
registers and stacks) are decoded one by one into :class:`SampleExtras`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from cyclescope.perf.abi import (
    MISC_COMM_EXEC,
    MISC_CPUMODE_MASK,
    MISC_MMAP_BUILD_ID,
    RecordType,
    Sample,
    regs_in_mask,
)

HEADER = struct.Struct("<IHH")

# Plain ints for the hot paths (IntFlag arithmetic is slow).
_IDENTIFIER, _IP, _TID, _TIME = int(Sample.IDENTIFIER), int(Sample.IP), int(Sample.TID), int(Sample.TIME)
_ADDR, _ID, _STREAM_ID, _CPU, _PERIOD = (int(Sample.ADDR), int(Sample.ID), int(Sample.STREAM_ID), int(Sample.CPU),
                                         int(Sample.PERIOD))
_CALLCHAIN, _REGS_USER, _STACK_USER = int(Sample.CALLCHAIN), int(Sample.REGS_USER), int(Sample.STACK_USER)

# The columns every decoded sample has, whatever the attr asked for. Missing
# fields are zero.
SAMPLE_DTYPE = np.dtype(
    [
        ("id", "<u8"),
        ("ip", "<u8"),
        ("pid", "<i4"),
        ("tid", "<i4"),
        ("time", "<u8"),
        ("cpu", "<u4"),
        ("cpumode", "u1"),
        ("extra", "<i4"),  # index into DecodedBatch.extras, or -1
        ("regs", "<i4"),  # row of DecodedBatch.regs / .stack (user registers and stack), or -1
    ]
)


@dataclass(frozen=True)
class SampleLayout:
    """What a sample record holds, derived from the attr it was opened with."""

    sample_type: int
    regs_user_mask: int = 0
    read_format: int = 0
    stack_user: int = 0  # bytes of user stack asked for (attr.sample_stack_user)

    @property
    def variable(self) -> bool:
        """True when sample records do not all have the same size."""
        var = Sample.CALLCHAIN | Sample.REGS_USER | Sample.STACK_USER | Sample.RAW | Sample.BRANCH_STACK
        return bool(self.sample_type & var) or bool(self.sample_type & Sample.READ)

    @property
    def regs_fixed(self) -> bool:
        """User registers and stack but no callchain: the records of user-mode samples all have one
        size (the kernel copies the asked stack size and says in dyn_size how much was valid), so
        they decode in bulk too; samples without user registers (kernel threads) come one by one."""
        st = self.sample_type
        return (bool(st & Sample.REGS_USER) and not st & (Sample.CALLCHAIN | Sample.RAW | Sample.BRANCH_STACK
                                                           | Sample.READ)
                and (not st & Sample.STACK_USER or self.stack_user % 8 == 0))

    def regs_dtype(self) -> np.dtype:
        """numpy dtype of a sample record with user registers (abi != 0) and a full stack copy."""
        base = self._fixed_fields()
        n = len(regs_in_mask(self.regs_user_mask))
        base += [("abi", "<u8"), ("uregs", "<u8", (n,))]
        if self.sample_type & Sample.STACK_USER:
            base.append(("ssize", "<u8"))
            if self.stack_user:
                base += [("stack", "u1", (self.stack_user,)), ("dyn", "<u8")]
        return np.dtype(base)

    @property
    def unsupported(self) -> int:
        supported = (
            Sample.IDENTIFIER | Sample.IP | Sample.TID | Sample.TIME | Sample.ADDR | Sample.ID
            | Sample.STREAM_ID | Sample.CPU | Sample.PERIOD | Sample.CALLCHAIN
            | Sample.REGS_USER | Sample.STACK_USER
        )
        return self.sample_type & ~int(supported)

    def fixed_dtype(self) -> np.dtype:
        """numpy dtype of a whole fixed-size sample record (header included)."""
        if self.variable:
            raise ValueError("sample records of this layout vary in size")
        return np.dtype(self._fixed_fields())

    def _fixed_fields(self) -> list[tuple[str, str] | tuple[str, str, tuple[int, ...]]]:
        st = self.sample_type
        fields: list[tuple[str, str]] = [("type", "<u4"), ("misc", "<u2"), ("size", "<u2")]
        if st & Sample.IDENTIFIER:
            fields.append(("identifier", "<u8"))
        if st & Sample.IP:
            fields.append(("ip", "<u8"))
        if st & Sample.TID:
            fields += [("pid", "<i4"), ("tid", "<i4")]
        if st & Sample.TIME:
            fields.append(("time", "<u8"))
        if st & Sample.ADDR:
            fields.append(("addr", "<u8"))
        if st & Sample.ID:
            fields.append(("sid", "<u8"))
        if st & Sample.STREAM_ID:
            fields.append(("stream_id", "<u8"))
        if st & Sample.CPU:
            fields += [("cpu", "<u4"), ("res", "<u4")]
        if st & Sample.PERIOD:
            fields.append(("period", "<u8"))
        return fields  # type: ignore[return-value]

    def sample_id_size(self) -> int:
        """Size of the sample_id trailer that side records carry (sample_id_all)."""
        st = self.sample_type
        n = 0
        for bit in (Sample.TID, Sample.TIME, Sample.ID, Sample.STREAM_ID, Sample.CPU, Sample.IDENTIFIER):
            if st & bit:
                n += 8
        return n


# --- side records ---------------------------------------------------------------


class SampleId(NamedTuple):
    """The sample_id trailer of a side record (zeros where not requested)."""

    pid: int = 0
    tid: int = 0
    time: int = 0
    id: int = 0
    cpu: int = 0


class MmapRecord(NamedTuple):
    pid: int
    tid: int
    addr: int
    length: int
    pgoff: int
    filename: str
    build_id: bytes | None  # from MMAP2 with PERF_RECORD_MISC_MMAP_BUILD_ID
    prot: int
    flags: int
    inode: int
    executable: bool
    cpumode: int
    sid: SampleId

    @property
    def time(self) -> int:
        return self.sid.time


class CommRecord(NamedTuple):
    pid: int
    tid: int
    comm: str
    exec: bool
    sid: SampleId

    @property
    def time(self) -> int:
        return self.sid.time


class TaskRecord(NamedTuple):
    """FORK or EXIT."""

    kind: RecordType
    pid: int
    ppid: int
    tid: int
    ptid: int
    task_time: int
    sid: SampleId

    @property
    def time(self) -> int:
        return self.task_time or self.sid.time


class LostRecord(NamedTuple):
    """LOST (the ring buffer was full) or LOST_SAMPLES (dropped before the buffer)."""

    kind: RecordType
    id: int
    lost: int
    sid: SampleId

    @property
    def time(self) -> int:
        return self.sid.time


class ThrottleRecord(NamedTuple):
    throttled: bool
    event_time: int
    id: int
    sid: SampleId

    @property
    def time(self) -> int:
        return self.event_time or self.sid.time


class OtherRecord(NamedTuple):
    type: int
    size: int

    @property
    def time(self) -> int:
        return 0


SideRecord = MmapRecord | CommRecord | TaskRecord | LostRecord | ThrottleRecord | OtherRecord


@dataclass(frozen=True)
class SampleExtras:
    """Variable-size parts of one sample: callchain, user registers, user stack."""

    callchain: tuple[int, ...] = ()
    regs_abi: int = 0
    regs: tuple[int, ...] = ()
    stack: bytes = b""
    stack_dyn_size: int = 0


@dataclass
class DecodedBatch:
    samples: np.ndarray
    side: list[SideRecord] = field(default_factory=list)
    extras: list[SampleExtras] = field(default_factory=list)
    # User registers (one row per sample with registers, columns in regs_in_mask order), the
    # user stack copies (zero-padded to the asked size) and how many bytes of each are valid.
    regs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint64))
    stack: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))
    stack_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    truncated: int = 0  # bytes at the end that did not hold a whole record
    malformed: int = 0  # records whose size field was impossible


# --- decoding -------------------------------------------------------------------


def _cstr(raw: bytes) -> str:
    end = raw.find(b"\0")
    if end >= 0:
        raw = raw[:end]
    return raw.decode("utf-8", "surrogateescape")


class RecordDecoder:
    """Decodes the records of one stream of events sharing a sample layout."""

    def __init__(self, layout: SampleLayout) -> None:
        if layout.unsupported:
            raise ValueError(f"unsupported sample_type bits: {layout.unsupported:#x}")
        self.layout = layout
        self._variable = layout.variable
        self._regs_fixed = layout.regs_fixed
        if self._regs_fixed:
            self._dtype: np.dtype | None = layout.regs_dtype()
        else:
            self._dtype = None if self._variable else layout.fixed_dtype()
        self._sid_size = layout.sample_id_size()
        self._regs = regs_in_mask(layout.regs_user_mask)
        # The sample_id trailer as one struct, and where each field sits in it: IntFlag
        # arithmetic per record costs more than the rest of decoding a side record.
        st = int(layout.sample_type)
        fmt = "<"
        where: dict[str, int] = {}
        for bit, name, code in ((Sample.TID, "pid", "ii"), (Sample.TIME, "time", "Q"), (Sample.ID, "sid", "Q"),
                                (Sample.STREAM_ID, "stream", "Q"), (Sample.CPU, "cpu", "II"),
                                (Sample.IDENTIFIER, "ident", "Q")):
            if st & int(bit):
                where[name] = len(fmt) - 1
                fmt += code
        self._sid = struct.Struct(fmt)
        self._sid_where = where
        self._st = st

    # sample_id trailer ----------------------------------------------------------
    def _sample_id(self, buf: memoryview | bytes, end: int) -> SampleId:
        v = self._sid.unpack_from(buf, end - self._sid_size)
        w = self._sid_where
        pid = tid = time = sid = cpu = 0
        if "pid" in w:
            pid, tid = v[w["pid"]], v[w["pid"] + 1]
        if "time" in w:
            time = v[w["time"]]
        if "sid" in w:
            sid = v[w["sid"]]
        if "cpu" in w:
            cpu = v[w["cpu"]]
        if "ident" in w:
            sid = v[w["ident"]]
        return SampleId(pid, tid, time, sid, cpu)

    # side records ---------------------------------------------------------------
    def decode_side(self, buf: memoryview | bytes, off: int, rtype: int, misc: int, size: int) -> SideRecord:
        end = off + size
        body = off + 8
        if rtype in (RecordType.MMAP, RecordType.MMAP2):
            pid, tid, addr, length, pgoff = struct.unpack_from("<iiQQQ", buf, body)
            p = body + 32
            build_id: bytes | None = None
            prot = flags = inode = 0
            if rtype == RecordType.MMAP2:
                if misc & MISC_MMAP_BUILD_ID:
                    bid_size = buf[p]
                    build_id = bytes(buf[p + 4 : p + 4 + min(bid_size, 20)]) or None
                else:
                    _maj, _min, inode, _gen = struct.unpack_from("<IIQQ", buf, p)
                p += 24
                prot, flags = struct.unpack_from("<II", buf, p)
                p += 8
            name = _cstr(bytes(buf[p : end - self._sid_size]))
            executable = bool(prot & 0x4) if rtype == RecordType.MMAP2 else not (misc & (1 << 13))
            return MmapRecord(
                pid, tid, addr, length, pgoff, name, build_id, prot, flags, inode,
                executable, misc & MISC_CPUMODE_MASK, self._sample_id(buf, end),
            )
        if rtype == RecordType.COMM:
            pid, tid = struct.unpack_from("<ii", buf, body)
            name = _cstr(bytes(buf[body + 8 : end - self._sid_size]))
            return CommRecord(pid, tid, name, bool(misc & MISC_COMM_EXEC), self._sample_id(buf, end))
        if rtype in (RecordType.FORK, RecordType.EXIT):
            pid, ppid, tid, ptid, t = struct.unpack_from("<iiiiQ", buf, body)
            return TaskRecord(RecordType(rtype), pid, ppid, tid, ptid, t, self._sample_id(buf, end))
        if rtype == RecordType.LOST:
            eid, lost = struct.unpack_from("<QQ", buf, body)
            return LostRecord(RecordType.LOST, eid, lost, self._sample_id(buf, end))
        if rtype == RecordType.LOST_SAMPLES:
            (lost,) = struct.unpack_from("<Q", buf, body)
            sid = self._sample_id(buf, end)
            return LostRecord(RecordType.LOST_SAMPLES, sid.id, lost, sid)
        if rtype in (RecordType.THROTTLE, RecordType.UNTHROTTLE):
            t, eid, _stream = struct.unpack_from("<QQQ", buf, body)
            return ThrottleRecord(rtype == RecordType.THROTTLE, t, eid, self._sample_id(buf, end))
        return OtherRecord(rtype, size)

    # one variable-size sample ---------------------------------------------------
    def decode_sample(
        self, buf: memoryview | bytes, off: int, misc: int, size: int
    ) -> tuple[tuple[int, ...], SampleExtras | None]:
        st = self._st
        p = off + 8
        ident = ip = time = cpu = 0
        pid = tid = 0
        if st & _IDENTIFIER:
            (ident,) = struct.unpack_from("<Q", buf, p)
            p += 8
        if st & _IP:
            (ip,) = struct.unpack_from("<Q", buf, p)
            p += 8
        if st & _TID:
            pid, tid = struct.unpack_from("<ii", buf, p)
            p += 8
        if st & _TIME:
            (time,) = struct.unpack_from("<Q", buf, p)
            p += 8
        if st & _ADDR:
            p += 8
        if st & _ID:
            (ident,) = struct.unpack_from("<Q", buf, p)
            p += 8
        if st & _STREAM_ID:
            p += 8
        if st & _CPU:
            (cpu,) = struct.unpack_from("<I", buf, p)
            p += 8
        if st & _PERIOD:
            p += 8
        extras = None
        if self._variable:
            chain: tuple[int, ...] = ()
            regs_abi = 0
            regs: tuple[int, ...] = ()
            stack = b""
            dyn = 0
            if st & _CALLCHAIN:
                (nr,) = struct.unpack_from("<Q", buf, p)
                p += 8
                if p + 8 * nr > off + size:
                    raise ValueError("callchain longer than its record")
                chain = struct.unpack_from(f"<{nr}Q", buf, p)
                p += 8 * nr
            if st & _REGS_USER:
                (regs_abi,) = struct.unpack_from("<Q", buf, p)
                p += 8
                if regs_abi:
                    n = len(self._regs)
                    regs = struct.unpack_from(f"<{n}Q", buf, p)
                    p += 8 * n
            if st & _STACK_USER:
                (ssize,) = struct.unpack_from("<Q", buf, p)
                p += 8
                if ssize:
                    (dyn,) = struct.unpack_from("<Q", buf, p + ssize)  # dyn_size follows the data
                    stack = bytes(buf[p : p + min(dyn, ssize)])
                    p += ssize + 8
            extras = SampleExtras(chain, regs_abi, regs, stack, dyn)
        return (ident, ip, pid, tid, time, cpu, misc & MISC_CPUMODE_MASK), extras

    # the whole buffer -----------------------------------------------------------
    def decode(self, data: bytes | bytearray | memoryview) -> DecodedBatch:
        buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        n = len(buf)
        off = 0
        chunks: list[np.ndarray] = []
        rows: list[tuple[int, ...]] = []
        side: list[SideRecord] = []
        extras: list[SampleExtras] = []
        malformed = 0
        dtype = self._dtype
        ssize = dtype.itemsize if dtype is not None else 0
        sample_t = int(RecordType.SAMPLE)
        while off + 8 <= n:
            rtype, misc, size = HEADER.unpack_from(buf, off)
            if size < 8:
                malformed += 1
                break  # cannot resynchronise without a valid size
            if off + size > n:
                break
            if rtype == sample_t and dtype is not None and size == ssize:
                run = _fixed_run(buf, off, ssize, n, sample_t)
                chunks.append(np.frombuffer(buf, dtype=dtype, count=run, offset=off))
                off += run * ssize
                continue
            if rtype == sample_t:
                try:
                    row, ex = self.decode_sample(buf, off, misc, size)
                except (ValueError, struct.error):
                    malformed += 1
                else:
                    if ex is not None:
                        extras.append(ex)
                        row = (*row, len(extras) - 1)
                    else:
                        row = (*row, -1)
                    rows.append(row)
            else:
                try:
                    side.append(self.decode_side(buf, off, rtype, misc, size))
                except (ValueError, struct.error, IndexError):
                    malformed += 1
            off += size
        samples, regs, stack, stack_len = self._assemble(chunks, rows, extras)
        return DecodedBatch(samples, side, extras, regs, stack, stack_len, truncated=n - off, malformed=malformed)

    def _assemble(self, chunks: list[np.ndarray], rows: list[tuple[int, ...]], extras: list[SampleExtras]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        total = sum(len(c) for c in chunks) + len(rows)
        out = np.zeros(total, dtype=SAMPLE_DTYPE)
        out["extra"] = -1
        out["regs"] = -1
        nregs = len(self._regs)
        ssz = self.layout.stack_user if self._st & _STACK_USER else 0
        regs_parts: list[np.ndarray] = []
        stack_parts: list[np.ndarray] = []
        len_parts: list[np.ndarray] = []
        pos = 0
        if chunks:
            c = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]  # one copy, then the fields once
            k = len(c)
            dst = out[:k]
            names = c.dtype.names or ()
            if "identifier" in names:
                dst["id"] = c["identifier"]
            elif "sid" in names:
                dst["id"] = c["sid"]
            for src, col in (("ip", "ip"), ("pid", "pid"), ("tid", "tid"), ("time", "time"), ("cpu", "cpu")):
                if src in names:
                    dst[col] = c[src]
            dst["cpumode"] = c["misc"] & MISC_CPUMODE_MASK
            if "uregs" in names:
                dst["regs"] = np.arange(k, dtype=np.int32)
                regs_parts.append(c["uregs"])
                if "stack" in names:
                    stack_parts.append(c["stack"])
                    len_parts.append(np.minimum(c["dyn"], ssz).astype(np.uint32))
                elif ssz:
                    stack_parts.append(np.zeros((k, ssz), np.uint8))
                    len_parts.append(np.zeros(k, np.uint32))
            pos = k
        if rows:
            arr = np.array(rows, dtype=[(name, SAMPLE_DTYPE[name]) for name in SAMPLE_DTYPE.names or ()
                                        if name != "regs"])
            dst = out[pos:]
            for name in arr.dtype.names or ():
                dst[name] = arr[name]
            if nregs:
                # Samples decoded one by one: their registers and stacks join the bulk rows.
                base = sum(len(r) for r in regs_parts)
                ex_idx = arr["extra"]
                rr, which, exs = [], [], []
                for j, e in enumerate(ex_idx.tolist()):
                    if e < 0:
                        continue
                    ex = extras[e]
                    if not ex.regs_abi or len(ex.regs) != nregs:
                        continue
                    which.append(j)
                    rr.append(ex.regs)
                    exs.append(ex)
                if which:
                    # One allocation for the batch's stacks, each copied once (8 KiB a sample with
                    # --call-graph dwarf: per-row arrays cost more than the copies).
                    st_rows = np.zeros((len(which), ssz), np.uint8)
                    ll = np.zeros(len(which), np.uint32)
                    if ssz:
                        for j, ex in enumerate(exs):
                            if ex.stack:
                                b = np.frombuffer(ex.stack, np.uint8, count=min(len(ex.stack), ssz))
                                st_rows[j, : len(b)] = b
                                ll[j] = len(b)
                    dst["regs"][np.array(which)] = base + np.arange(len(which), dtype=np.int32)
                    regs_parts.append(np.array(rr, dtype=np.uint64).reshape(len(which), nregs))
                    stack_parts.append(st_rows)
                    len_parts.append(ll)
        regs = np.concatenate(regs_parts) if regs_parts else np.zeros((0, nregs), np.uint64)
        stack = np.concatenate(stack_parts) if stack_parts else np.zeros((0, ssz), np.uint8)
        stack_len = np.concatenate(len_parts) if len_parts else np.zeros(0, np.uint32)
        return out, regs, stack, stack_len


def _fixed_run(buf: memoryview | bytes, off: int, ssize: int, n: int, sample_t: int) -> int:
    """Number of consecutive fixed-size sample records starting at ``off``.

    The first few headers are checked one by one (short runs are common when
    processes come and go); then headers at off, off+ssize, off+2*ssize, ...
    are checked through strided views, up to the first that is not a sample of
    that size.
    """
    limit = (n - off) // ssize
    start = 1
    while start < min(limit, 16):
        t, _, sz = HEADER.unpack_from(buf, off + start * ssize)
        if t != sample_t or sz != ssize:
            return start
        start += 1
    window = 256
    while start < limit:
        count = min(window, limit - start)
        base = off + start * ssize
        types = np.ndarray((count,), dtype="<u4", buffer=buf, offset=base, strides=(ssize,))
        sizes = np.ndarray((count,), dtype="<u2", buffer=buf, offset=base + 6, strides=(ssize,))
        bad = np.flatnonzero((types != sample_t) | (sizes != ssize))
        if len(bad):
            return start + int(bad[0])
        start += count
        window = min(window * 4, 1 << 20)
    return limit
