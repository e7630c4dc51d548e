"""BOLT's no-LBR fdata from per-instruction samples (report/bolt_fdata.py), on synthetic symbols."""

from __future__ import annotations

import numpy as np

from cyclescope.report.bolt_fdata import bolt_names, render


def test_fdata_lines_are_function_relative_and_skip_what_no_symbol_covers() -> None:
    starts = np.array([0x1000, 0x1100, 0x1200], np.uint64)
    ends = np.array([0x1080, 0x1180, 0x1300], np.uint64)
    names = ["main", "operator new(unsigned long)", "leaf/a.c/1"]
    offs = np.array([0x1204, 0x1000, 0x1090, 0x1013, 0x1100, 0x5000], np.uint64)
    counts = np.array([7, 3, 4, 2, 1, 9], np.int64)
    res = render(["cpu-clock"], offs, counts, starts, ends, names)
    assert res.text == ("no_lbr cpu-clock\n"
                        "1 main 0 3\n"
                        "1 main 13 2\n"
                        "1 operator\\ new(unsigned\\ long) 0 1\n"
                        "1 leaf/a.c/1 4 7\n")
    assert (res.functions, res.samples, res.outside, res.plt) == (3, 13, 13, 0)


def test_plt_stubs_are_left_out_as_bolt_keeps_no_profile_for_them() -> None:
    starts = np.array([0x1030, 0x1060], np.uint64)
    ends = np.array([0x1040, 0x1080], np.uint64)
    offs = np.array([0x1030, 0x1036, 0x1064], np.uint64)
    res = render(["cpu-clock"], offs, np.array([2, 1, 5], np.int64), starts, ends, ["printf@plt", "main"])
    assert res.text == "no_lbr cpu-clock\n1 main 4 5\n"
    assert (res.functions, res.samples, res.outside, res.plt) == (1, 5, 0, 3)


def test_local_functions_get_the_unique_names_bolt_gives_them() -> None:
    starts = np.array([0x10, 0x20, 0x30, 0x40], np.uint64)
    local = {0x20: ("helper", "a.c"), 0x30: ("helper", "a.c"), 0x40: ("init", "")}
    assert bolt_names(starts, ["main", "helper", "helper", "init"], local) == [
        "main", "helper/a.c/1", "helper/a.c/2", "init/1"]
