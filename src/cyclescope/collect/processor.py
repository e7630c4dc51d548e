"""What the collection loop hands to the processors it is given, and what it asks of them.

The loop drains, decodes, maps and counts flat samples; anything more that is computed from the
samples of a drain is a processor passed in by the front end: loop-iteration counts from
consecutive samples (analysis/loopcount.py), values at the interrupt (values/processor.py), call
stacks (collect/stacks.py). So collect imports neither the analyses nor value capture, and the
collector does not grow with each thing computed from samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from cyclescope.db.layout import Database
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageTable


@dataclass(frozen=True)
class Drain:
    """One drain's samples after mapping, one row per sample (the samples of events the session
    does not know are left out)."""

    samples: np.ndarray  # records.SAMPLE_DTYPE: pid, tid, time, cpu, cpumode, ip, regs (row in ``regs`` or -1)...
    event: np.ndarray  # event index (Session.events)
    period: np.ndarray  # float64: the period in force for each sample, in its event's units
    image: np.ndarray  # image index (ImageTable)
    offset: np.ndarray  # uint64 offset in the image
    comm: np.ndarray  # the command when the sample was taken (Mapper.comms index)
    regs: np.ndarray | None = None  # uint64 [rows, registers]: the user registers, perf's order (regs_columns)
    stack: np.ndarray | None = None  # uint8 [rows, bytes]: the user stack snapshots, rows as regs
    stack_len: np.ndarray | None = None  # the bytes of each snapshot that hold stack
    chains: list[tuple[int, ...] | None] | None = None  # callchains (PERF_SAMPLE_CALLCHAIN), if sampled
    # uint64: the samples each row stands for (the eBPF path counts equal samples in the kernel);
    # None: one each
    count: np.ndarray | None = None
    # timeline.TIMELINE_DTYPE: samples per thread and 100 ms window, where they were counted elsewhere
    # (the eBPF path); None: the samples above tell (collect/timeline.py)
    timeline: np.ndarray | None = None
    # per row: the Python frames the eBPF program read, as (code object, instruction) pairs (None:
    # none read; collect/pyframes.py names them)
    python: list[tuple[int, ...]] | None = None

    def __len__(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class Context:
    """What a processor learns when the collector starts."""

    table: ImageTable
    mapper: Mapper  # addresses to (image, offset), per process; the commands' names
    events: tuple[str, ...]  # the sampled events' labels, by index
    per_task: bool  # events follow tasks (their periods are the task's CPU time), not CPUs
    time_event: int  # index of the event whose samples measure time (cycles or a clock), or -1
    regs_columns: dict[str, int]  # register name (rax, ..., r15) -> column of Drain.regs
    vdso: bytes | None = None  # the vDSO's image (the same in every process)
    # Store the symbols of these images where they have no file to be read from later (kernel,
    # vdso, JIT maps): for images a processor's files name that the flat counts may not
    keep_symbols: Callable[[Iterable[int]], None] | None = None
    # Stacks' pids, native frames and Python frames' raw pairs -> the stacks to store
    # (collect/pyframes.py's PythonFrames.stacks: names the frames, splices them in); the eBPF path only
    python_stack: Callable[[Sequence[int], Sequence[tuple[tuple[int, int], ...]], Sequence[tuple[int, ...]]],
                           list[tuple[tuple[int, int], ...]]] | None = None
    # The tasks the per-task events follow (a command's first process, or each thread of -p's
    # processes); empty system-wide. ``on_exec``: the command has not exec'd yet (events opened for
    # it now must be enabled by its exec)
    tasks: tuple[int, ...] = ()
    on_exec: bool = False


class Processor(Protocol):
    name: str  # its key in the daemon's status
    needs_regs: bool  # the session must sample the user registers
    # Optional, read with getattr by Collector.run: ``first_drain_s``, how soon the first drain
    # should come for it (anchors: 0.25 s; otherwise the drain interval); ``wake_fds()``, the
    # descriptors of rings of its own whose wake-ups (half full) call for a drain (goal probes).
    # On the eBPF path system-wide (collect/loopwatch.py): ``watched()``, the procedures ((image,
    # start) -> (end, weight)) whose samples the program should send with their registers;
    # ``process_watched(drain)``, those samples, each with the next one on its CPU, as a Drain
    # with ``regs``; ``next_drain_s()``, how soon it wants the next drain (None: no hurry).

    def bind(self, ctx: Context) -> None: ...

    def process(self, drain: Drain) -> None: ...

    def forget(self, pid: int, tid: int) -> None:
        """Thread ``tid`` of process ``pid`` exited, or exec'd (then tid == pid): what was
        learnt of it no longer holds."""

    def finish(self) -> None:
        """The run is ending: complete what waits (before the last flush)."""

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]: ...

    def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def summary(self) -> str | None:
        """One line for the end of a run (None: nothing to say)."""
