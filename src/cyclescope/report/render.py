"""Writing reports: a rich table on a terminal, aligned plain text in a pipe, JSON.

Builders produce :class:`Table` values (pure data); only this module writes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass(frozen=True)
class Col:
    header: str
    align: str = "right"  # "left" or "right"
    style: str | None = None  # rich style on a terminal
    wrap: bool = False  # a long free-text column (names): ellipsis on a terminal, never cut in a pipe


# In a pipe a free-text column is as wide as its cells up to this; a longer cell runs on in its own
# row instead of padding every row to its width (a C++ template's name of 2,722 characters in
# libarrow made every line of `prof`'s output as long).
PLAIN_WRAP_MAX = 80


@dataclass
class Table:
    cols: list[Col]
    rows: list[list[str]]
    preamble: list[str] = field(default_factory=list)  # lines before the table
    footer: list[str] = field(default_factory=list)  # lines after it
    row_styles: list[str | None] = field(default_factory=list)


def fmt_count(n: float) -> str:
    return f"{round(n):,}" if abs(n) >= 1 or n == 0 else f"{n:.2f}"


def fmt_pct(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}%"


def is_tty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def write_table(t: Table, out: TextIO | None = None, tty: bool | None = None) -> None:
    out = out or sys.stdout
    tty = is_tty(out) if tty is None else tty
    if tty:
        _write_rich(t, out)
    else:
        _write_plain(t, out)


def _note_at(t: Table, r: list[str]) -> int | None:
    """The column of a note row: one non-empty cell, in a left-aligned column, nothing after it (calc's
    block headers and stall notes). It runs on past its column instead of widening it."""
    filled = [i for i, cell in enumerate(r) if cell]
    if len(filled) == 1 and t.cols[filled[0]].align == "left" and filled[0] < len(t.cols) - 1:
        return filled[0]
    return None


def _write_plain(t: Table, out: TextIO) -> None:
    for line in t.preamble:
        out.write(line + "\n")
    if t.preamble:
        out.write("\n")
    widths = [len(c.header) for c in t.cols]
    notes = [_note_at(t, r) for r in t.rows]
    for r, note in zip(t.rows, notes, strict=True):
        for i, cell in enumerate(r):
            if i != note and (len(cell) <= PLAIN_WRAP_MAX or not t.cols[i].wrap):
                widths[i] = max(widths[i], len(cell))

    last = len(t.cols) - 1
    specs = []
    for i, c in enumerate(t.cols):
        if c.align == "right":
            specs.append(f"{{:>{widths[i]}}}")
        else:
            specs.append("{}" if i == last else f"{{:<{widths[i]}}}")
    fmt = "  ".join(specs)
    lines = [fmt.format(*(c.header for c in t.cols)).rstrip()]
    for r, note in zip(t.rows, notes, strict=True):
        if note is None:
            lines.append(fmt.format(*r).rstrip())
        else:
            lines.append("".join(" " * widths[i] + "  " for i in range(note)) + r[note])
    out.write("\n".join(lines) + "\n")
    if t.footer:
        out.write("\n")
        for f in t.footer:
            out.write(f + "\n")


def _write_rich(t: Table, out: TextIO) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table as RTable
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=False)
    for line in t.preamble:
        console.print(Text(line, style="bold" if line is t.preamble[0] else "dim"))
    rt = RTable(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, header_style="bold")
    for c in t.cols:
        rt.add_column(
            c.header, justify="right" if c.align == "right" else "left", style=c.style,
            overflow="ellipsis" if c.wrap else "fold", no_wrap=c.wrap, ratio=1 if c.wrap else None,
        )
    for i, r in enumerate(t.rows):
        style = t.row_styles[i] if i < len(t.row_styles) else None
        rt.add_row(*r, style=style)
    console.print(rt)
    for f in t.footer:
        console.print(Text(f, style="dim"))


def write_json(obj: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    json.dump(obj, out, indent=1, sort_keys=False, default=_json_default)
    out.write("\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dict__"):
        return vars(o)
    raise TypeError(f"cannot serialise {type(o).__name__}")
