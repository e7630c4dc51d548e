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


def test_a_name_longer_than_the_cap_runs_on_in_its_row_and_is_never_cut() -> None:
    from cyclescope.report.render import PLAIN_WRAP_MAX

    long = "std::variant<" + "parquet::arrow::ListPathNode<int>, " * 40 + ">"
    t = Table([Col("samples"), Col("procedure", "left", wrap=True), Col("image", "left", wrap=True)], [
        ["10", "main", "/bin/x"],
        ["5", long, "/lib/libarrow.so"],
        ["1", "helper", "/bin/x"],
    ])
    out = io.StringIO()
    write_table(t, out, tty=False)
    lines = out.getvalue().splitlines()
    assert lines[0] == "samples  procedure  image"
    assert lines[1] == "     10  main       /bin/x" and lines[3] == "      1  helper     /bin/x"
    assert lines[2] == f"      5  {long}  /lib/libarrow.so"  # whole, in its own row only
    assert len(long) > PLAIN_WRAP_MAX
