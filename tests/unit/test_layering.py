"""The packages' dependencies point one way (docs/design.md, "Layers"): every import of cyclescope's
own modules, at the top of a file, inside a function or under TYPE_CHECKING, names a package on
a lower layer or its own; and the command modules of cli/ do not import each other (what two
commands share lives in app/, cli/base.py or cli/sampling.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import cyclescope

ROOT = Path(cyclescope.__file__).parent

# Lowest first; packages on one layer may not import each other.
LAYERS: list[set[str]] = [
    {"errors", "parquet", "arrays"},  # errors.py; Parquet files without pyarrow.fs; grouping small arrays
    {"perf"},  # the kernel's record formats
    {"images"},  # ELF, DWARF, kernel maps, processes' mappings
    {"db"},  # the profile database: segments, epochs, tallies, values, stacks
    # symbols and code of recorded images (from disk or the database's archive); a fleet's shipping,
    # distributed engine and retention
    {"binaries", "fleet"},
    {"collect"},  # sampling: sessions, the drain loop, its processors
    {"analysis", "values"},  # calc and its evidence; value capture
    {"report"},  # tables, JSON and export formats built from the above
    {"app"},  # what the front ends do with a profile
    {"web"},  # the web UI's routes over app (started by `cyclescope serve`, which is why cli sits above it)
    {"cli"},  # argument parsing and rendering
    {"__main__"},
]
RANK = {p: i for i, layer in enumerate(LAYERS) for p in layer}
# cli modules any command may import: shared helpers, record's exact mode, and the entry point
# (the demo runs `record` and `prof` through it).
CLI_SHARED = {"base", "sampling", "exact", "main"}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if node.module == "cyclescope":  # from cyclescope import x: x is a package or a module
                names = [f"cyclescope.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names[:1] if n.startswith("cyclescope.")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("cyclescope.")]
    return out


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "proto" not in p.parts)


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in _sources()} - {"__init__"}
    assert packages <= set(RANK), f"give these a layer: {sorted(packages - set(RANK))}"


def test_imports_point_down() -> None:
    bad = []
    for path in _sources():
        src = _package(path)
        if src == "__init__":
            continue
        for line, mod in _imports(path):
            dst = mod.split(".")[1]
            if dst in RANK and dst != src and RANK[dst] >= RANK[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} ({src} is not above {dst})")
    assert not bad, "\n".join(bad)


def test_commands_do_not_import_each_other() -> None:
    bad = []
    for path in sorted((ROOT / "cli").glob("*.py")):
        if path.stem in CLI_SHARED or path.stem == "__init__":
            continue
        for line, mod in _imports(path):
            parts = mod.split(".")
            if parts[1] == "cli" and len(parts) > 2 and parts[2] not in CLI_SHARED:
                bad.append(f"cli/{path.name}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_import_that_points_up(tmp_path: Path) -> None:
    """The parser finds imports inside functions and under TYPE_CHECKING (what the rules rest on)."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclescope.cli.base import x\n"
                 "def g():\n    import cyclescope.app.profile\n")
    assert [m for _, m in _imports(f)] == ["cyclescope.cli.base", "cyclescope.app.profile"]
