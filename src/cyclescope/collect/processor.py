"""What the collection loop hands to the processors it is given, and what it asks of them.

The loop drains, decodes, maps and counts flat samples; anything more that is computed from the
samples of a drain (loop-iteration counts from consecutive samples: analysis/loopcount.py) is a
processor passed in by the front end, so that collect does not import the analyses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from cyclescope.db.layout import Database
    from cyclescope.images.registry import ImageTable


@dataclass(frozen=True)
class Drain:
    """One drain's samples after mapping: parallel arrays, one row per sample."""

    samples: np.ndarray  # records.SAMPLE_DTYPE: pid, tid, time, cpu, cpumode, regs (row in ``regs`` or -1)...
    event: np.ndarray  # event index (Session.events)
    period: np.ndarray  # float64: the period in force for each sample, in its event's units
    image: np.ndarray  # image index (ImageTable)
    offset: np.ndarray  # uint64 offset in the image
    regs: np.ndarray | None  # uint64 [rows, registers]: the user registers, perf's order (regs_columns)


@dataclass(frozen=True)
class Context:
    """What a processor learns when the collector starts."""

    table: ImageTable
    per_task: bool  # events follow tasks (their periods are the task's CPU time), not CPUs
    time_event: int  # index of the event whose samples measure time (cycles or a clock), or -1
    regs_columns: dict[str, int]  # register name (rax, ..., r15) -> column of Drain.regs


class Processor(Protocol):
    name: str
    needs_regs: bool  # the session must sample the user registers

    def bind(self, ctx: Context) -> None: ...

    def process(self, drain: Drain) -> None: ...

    def forget(self, pid: int, tid: int) -> None: ...

    def finish(self) -> None:
        """The run is ending: complete what waits (before the last flush)."""

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]: ...

    def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...
