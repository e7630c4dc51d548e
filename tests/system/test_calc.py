"""`cyclescope calc` on kernels with known execution counts, profiled for real."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.system.helpers import cs

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]


@pytest.fixture(scope="module")
def kernels_db(tmp_path_factory: pytest.TempPathFactory, compile_c: Callable[..., Path]) -> Path:
    exe = compile_c("kernels", "-O2", "-g", out="kernels")
    db = tmp_path_factory.mktemp("calc") / "db"
    for which in ("chain", "divide", "branchy"):
        cs("record", "--db", str(db), "-q", "-F", "5000", "--append", "--", str(exe), which)
    return db


def calc(db: Path, proc: str) -> dict:
    return json.loads(cs("calc", proc, "--db", str(db), "--json").stdout)


def test_a_stall_free_loop_is_counted_within_a_few_percent(kernels_db: Path) -> None:
    doc = calc(kernels_db, "chain")
    loop = max(doc["blocks"], key=lambda b: b["samples"])
    # chain(300000000) runs its loop body exactly 300M times.
    assert loop["confidence"] == "high"
    assert loop["executions"] == pytest.approx(300e6, rel=0.15)
    assert doc["summary"]["actual_cpi"] == pytest.approx(doc["summary"]["best_cpi"], rel=0.25)


def test_divides_are_blamed_on_the_divider(kernels_db: Path) -> None:
    doc = calc(kernels_db, "divide")
    loop = max(doc["blocks"], key=lambda b: b["samples"])
    idiv = next(i for i in loop["instructions"] if i["instruction"].startswith("idiv"))
    assert idiv["samples"]["cpu-clock"] > 0.5 * loop["samples"]  # samples land on the divide itself
    assert loop["executions"] == pytest.approx(30e6, rel=0.25)


def test_mispredicts_are_candidates_at_the_heads_of_data_dependent_blocks(kernels_db: Path) -> None:
    doc = calc(kernels_db, "branchy")
    culprits = {c for b in doc["blocks"] for i in b["instructions"] for c in i["culprits"]}
    assert "branch mispredict" in culprits
    text = cs("calc", "branchy", "--db", str(kernels_db)).stdout
    assert "*** Best-case" in text and "*** branch mispredict" in text and "block " in text


def test_calc_over_an_image_and_a_missing_procedure(kernels_db: Path) -> None:
    out = cs("calc", "--image", "kernels", "--db", str(kernels_db)).stdout
    assert "chain" in out and "divide" in out and "best CPI" in out
    p = cs("calc", "nosuch", "--db", str(kernels_db), check=False)
    assert p.returncode == 4 and "no procedure named 'nosuch'" in p.stderr
