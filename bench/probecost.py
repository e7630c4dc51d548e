"""What a uprobe hit costs the probed task: a loop calls a trivial function N times, alone, under an
exact counter at the function's entry (anchors) and under a sampler that takes a register at every
hit (goal probes); the task's own CPU (user + system, from wait4) over N, rounds alternated. The
function's entry is single-stepped at a hit; ``counter-emulated`` counts the loop's conditional
jump instead, which the kernel emulates (images/disasm.uprobe_emulated): what trip windows, anchors
and goal probes pay where a block or an entry has such an instruction (``sampler-emulated``: a
sample with a register at each hit there).

    python bench/probecost.py [--save-as NAME]   # 200,000 calls, 5 rounds (as root)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import build, machine, median, save

CALLS_C = r"""
#include <stdlib.h>
volatile unsigned long sink;
__attribute__((noinline)) unsigned long f(unsigned long x) { return x * 3 + 1; }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    for (long i = 0; i < n; i++) sink += f(i);
    return 0;
}
"""


def one(exe: Path, entry: int, n: int, how: str, branch: int = 0) -> float:
    """The task's CPU seconds for ``n`` calls under ``how``: none, counter, counter-emulated (at
    file offset ``branch``), sampler or sampler-emulated."""
    from cyclescope.collect import kernel
    from cyclescope.collect.session import online_cpus
    from cyclescope.perf.abi import X86_REGS_USER_MASK, X86Reg

    pmu = kernel.uprobe_pmu_type()
    if pmu is None:
        raise SystemExit("this kernel has no uprobe PMU")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(r, 1)
        os.execv(str(exe), [str(exe), str(n)])
    fds: list[int] = []
    rings: list[Any] = []
    try:
        if how in ("counter", "counter-emulated"):
            fds.append(kernel.open_uprobe_counter(pmu, str(exe), entry if how == "counter" else branch, pid, -1))
            kernel.ioctl_enable(fds[0])
        elif how in ("sampler", "sampler-emulated"):
            assert X86_REGS_USER_MASK & (1 << X86Reg.DI)
            for cpu in online_cpus():
                owner = kernel.open_ring_owner(pid, cpu, True, 1 << 22)
                rings.append(kernel.RingBuffer(owner, 1024))
                fd = kernel.open_uprobe_sampler(pmu, str(exe), entry if how == "sampler" else branch, pid, cpu,
                                                1 << X86Reg.DI, True, True, 1 << 22)
                kernel.ioctl_set_output(fd, owner)
                fds += [fd, owner]
        os.write(w, b"x")
        _, _, ru = os.wait4(pid, 0)
        return ru.ru_utime + ru.ru_stime
    finally:
        for ring in rings:
            ring.close()
        for fd in fds:
            kernel.close_fd(fd)


def loop_branch(exe: Path) -> int:
    """The file offset of main's loop branch: its first conditional jump backwards (run once a call)."""
    from elftools.elf.elffile import ELFFile

    from cyclescope.images.disasm import disassemble, read_code, uprobe_emulated
    from cyclescope.images.elf import read_load_info

    with open(exe, "rb") as f:
        sym = next(x for x in ELFFile(f).get_section_by_name(".symtab").iter_symbols() if x.name == "main")
    start, end = int(sym["st_value"]), int(sym["st_value"] + sym["st_size"])
    for ins in disassemble(read_code(str(exe), start, end), start):
        t = ins.direct_target
        if ins.mnemonic.startswith("j") and ins.mnemonic != "jmp" and t is not None and t < ins.address:
            assert uprobe_emulated(ins.raw), ins.text
            off = read_load_info(str(exe)).file_offset(ins.address)
            assert off is not None
            return off
    raise SystemExit("no loop branch found in main")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--save-as", default="probecost", help="bench/out/NAME.json")
    a = ap.parse_args()
    from cyclescope.images.elf import read_load_info

    tmp = Path(tempfile.mkdtemp(prefix="cs-bench-probe-"))
    src = tmp / "calls.c"
    src.write_text(CALLS_C)
    exe = build(str(src), tmp / "calls")
    import subprocess

    nm = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    vaddr = next(int(line.split()[0], 16) for line in nm.splitlines() if line.endswith(" T f"))
    entry = read_load_info(str(exe)).file_offset(vaddr)
    assert entry is not None
    branch = loop_branch(exe)
    cpu: dict[str, list[float]] = {"none": [], "counter": [], "counter-emulated": [], "sampler": [],
                                   "sampler-emulated": []}
    for _ in range(a.rounds):
        for how in cpu:
            cpu[how].append(one(exe, entry, a.calls, how, branch))
    per_hit = {h: [(c - b) / a.calls * 1e6 for c, b in zip(cpu[h], cpu["none"], strict=True)]
               for h in ("counter", "counter-emulated", "sampler", "sampler-emulated")}
    for h, v in per_hit.items():
        print(f"{h:16s} {median(v):.2f} us a hit [{min(v):.2f}, {max(v):.2f}] over {a.rounds} rounds")
    print(f"saved {save(a.save_as, {'machine': machine(), 'calls': a.calls, 'cpu_s': cpu, 'us_per_hit': per_hit})}")


if __name__ == "__main__":
    main()
