"""Writing tables in a pipe: aligned plain text (report/render.py)."""

from __future__ import annotations

import io

from cyclescope.report.render import Col, Table, write_table


def test_note_rows_run_on_instead_of_widening_their_column() -> None:
    # calc's block headers sit in the instruction column; padding every instruction to a header's
    # width made rows of 150 characters in a pipe.
    t = Table([Col("address"), Col("instruction", "left"), Col("samples"), Col("culprits", "left")], [
        ["", "block 10: F=1.00, ~1,000 executions (high confidence, clean-blocks)", "", ""],
        ["10", "mov rax, qword ptr [rdi]", "12", "d"],
        ["14", "ret", "", ""],
        ["", "one in the last column widens it", "", "as a cell"],
    ], preamble=["title"])
    out = io.StringIO()
    write_table(t, out, tty=False)
    assert out.getvalue() == (
        "title\n"
        "\n"
        "address  instruction                       samples  culprits\n"
        "         block 10: F=1.00, ~1,000 executions (high confidence, clean-blocks)\n"
        "     10  mov rax, qword ptr [rdi]               12  d\n"
        "     14  ret\n"
        "         one in the last column widens it           as a cell\n"
    )
