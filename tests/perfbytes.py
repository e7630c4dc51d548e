"""Building perf ring-buffer records byte by byte, as the kernel lays them out.

Written from include/uapi/linux/perf_event.h, independently of the decoder,
so that decoding tests compare against the ABI rather than against itself.
"""

from __future__ import annotations

import struct

from cyclescope.perf.abi import RecordType, Sample

ST = int(Sample.IDENTIFIER | Sample.IP | Sample.TID | Sample.TIME | Sample.CPU)


def _pad8(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 8)


def sample_id(pid: int, tid: int, time: int, ident: int, cpu: int) -> bytes:
    # sample_id_all trailer for ST: {pid,tid} {time} {cpu,res} {identifier}
    return struct.pack("<iiQIIQ", pid, tid, time, cpu, 0, ident)


def record(rtype: int, misc: int, body: bytes) -> bytes:
    return struct.pack("<IHH", rtype, misc, 8 + len(body)) + body


def sample(ident: int, ip: int, pid: int, tid: int, time: int, cpu: int, misc: int = 2) -> bytes:
    body = struct.pack("<QQiiQII", ident, ip, pid, tid, time, cpu, 0)
    return record(RecordType.SAMPLE, misc, body)


def sample_regs_stack(ident: int, ip: int, pid: int, tid: int, time: int, cpu: int, regs: list[int],
                      stack: bytes, chain: list[int] | None = None, misc: int = 2) -> bytes:
    """A sample with CALLCHAIN (if chain), REGS_USER (abi 2) and STACK_USER."""
    body = struct.pack("<QQiiQII", ident, ip, pid, tid, time, cpu, 0)
    if chain is not None:
        body += struct.pack(f"<Q{len(chain)}Q", len(chain), *chain)
    body += struct.pack(f"<Q{len(regs)}Q", 2, *regs)
    size = len(stack) + (-len(stack) % 8)
    body += struct.pack("<Q", size) + stack + b"\0" * (size - len(stack)) + struct.pack("<Q", len(stack))
    return record(RecordType.SAMPLE, misc, body)


def mmap2(pid: int, tid: int, addr: int, length: int, pgoff: int, filename: str, time: int,
          build_id: bytes | None = None, prot: int = 5, ident: int = 1, cpu: int = 0) -> bytes:
    body = struct.pack("<iiQQQ", pid, tid, addr, length, pgoff)
    misc = 2
    if build_id is not None:
        body += struct.pack("<BBH", len(build_id), 0, 0) + build_id.ljust(20, b"\0")
        misc |= 1 << 14
    else:
        body += struct.pack("<IIQQ", 8, 1, 1234, 0)
    body += struct.pack("<II", prot, 2)
    body += _pad8(filename.encode() + b"\0")
    body += sample_id(pid, tid, time, ident, cpu)
    return record(RecordType.MMAP2, misc, body)


def comm(pid: int, tid: int, name: str, time: int, exec_: bool = False, ident: int = 1, cpu: int = 0) -> bytes:
    body = struct.pack("<ii", pid, tid) + _pad8(name.encode() + b"\0") + sample_id(pid, tid, time, ident, cpu)
    return record(RecordType.COMM, (1 << 13) if exec_ else 0, body)


def fork(pid: int, ppid: int, tid: int, ptid: int, time: int, ident: int = 1, cpu: int = 0) -> bytes:
    body = struct.pack("<iiiiQ", pid, ppid, tid, ptid, time) + sample_id(pid, tid, time, ident, cpu)
    return record(RecordType.FORK, 0, body)


def exit_(pid: int, ppid: int, tid: int, ptid: int, time: int, ident: int = 1, cpu: int = 0) -> bytes:
    body = struct.pack("<iiiiQ", pid, ppid, tid, ptid, time) + sample_id(pid, tid, time, ident, cpu)
    return record(RecordType.EXIT, 0, body)


def lost(ident: int, n: int, time: int, cpu: int = 0) -> bytes:
    body = struct.pack("<QQ", ident, n) + sample_id(-1, -1, time, ident, cpu)
    return record(RecordType.LOST, 0, body)


def lost_samples(n: int, time: int, ident: int = 1, cpu: int = 0) -> bytes:
    body = struct.pack("<Q", n) + sample_id(-1, -1, time, ident, cpu)
    return record(RecordType.LOST_SAMPLES, 0, body)


def throttle(ident: int, time: int, on: bool = True, cpu: int = 0) -> bytes:
    body = struct.pack("<QQQ", time, ident, ident) + sample_id(-1, -1, time, ident, cpu)
    return record(RecordType.THROTTLE if on else RecordType.UNTHROTTLE, 0, body)
