"""Parquet files written and read without pyarrow.parquet (cyclescope/parquet.py): the same bytes as
pyarrow.parquet writes with the same options, the same tables read back, the same errors."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cyclescope import parquet


def _table() -> pa.Table:
    rng = np.random.default_rng(3)
    return pa.table({
        "offset": pa.array(np.sort(rng.integers(0, 1 << 40, 5000)).astype(np.uint64)),
        "process": pa.array(rng.choice(["cc1", "as", "sh"], 5000)).dictionary_encode(),
        "count": pa.array(rng.integers(1, 100, 5000).astype(np.uint64)),
        "share": pa.array(rng.random(5000)),
    }).replace_schema_metadata({"cyclescope-test": "{}"})


OPTIONS = [
    {"compression": "zstd"},
    {"compression": "zstd", "compression_level": 6, "use_dictionary": ["process"],
     "column_encoding": {"offset": "DELTA_BINARY_PACKED", "count": "DELTA_BINARY_PACKED"},
     "write_statistics": ["process"], "data_page_size": 1 << 20},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_the_same_bytes_as_pyarrow_parquet(tmp_path: Path, options: dict[str, object]) -> None:
    t = _table()
    pq.write_table(t, tmp_path / "theirs.parquet", **options)  # type: ignore[arg-type]
    parquet.write_table(t, tmp_path / "ours.parquet", **options)
    assert (tmp_path / "ours.parquet").read_bytes() == (tmp_path / "theirs.parquet").read_bytes()
    with pq.ParquetWriter(tmp_path / "theirs2.parquet", t.schema, **options) as w:  # type: ignore[arg-type]
        w.write_table(t, row_group_size=1500)
        w.write_table(t.slice(10, 100), row_group_size=1500)
    buf = io.BytesIO()
    with parquet.Writer(buf, t.schema, **options) as ours:
        ours.write_table(t, row_group_size=1500)
        ours.write_table(t.slice(10, 100), row_group_size=1500)
    assert buf.getvalue() == (tmp_path / "theirs2.parquet").read_bytes()


def test_read_back(tmp_path: Path) -> None:
    t = _table()
    p = tmp_path / "t.parquet"
    parquet.write_table(t, p, compression="zstd")
    assert parquet.read_table(p).equals(pq.read_table(p))
    assert parquet.read_table(p, ["count", "offset"]).column_names == ["count", "offset"]
    md = parquet.read_metadata(p)
    assert md.num_rows == 5000 and md.metadata[b"cyclescope-test"] == b"{}"
    assert parquet.read_schema(p).names == t.column_names
    with parquet.File(str(p)) as f:
        assert f.schema.metadata[b"cyclescope-test"] == b"{}" and f.read().num_rows == 5000


def test_errors_are_pyarrow_parquets(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        parquet.read_metadata(tmp_path / "none.parquet")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file" * 10)
    with pytest.raises(pa.ArrowInvalid):
        parquet.read_table(bad)


def test_no_cloud_file_systems_imported(tmp_path: Path) -> None:
    """What the module is for: writing and reading a file imports neither pyarrow.parquet nor
    pyarrow.fs (S3, GCS, Azure, HDFS, OpenSSL)."""
    code = ("import sys, pyarrow as pa; from cyclescope import parquet;"
            "parquet.write_table(pa.table({'x': [1]}), sys.argv[1]); parquet.read_table(sys.argv[1]);"
            "print(sorted(m for m in sys.modules if m in ('pyarrow.parquet', 'pyarrow.fs', 'ssl')))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.parquet")], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("type_", [pa.int8(), pa.int32(), pa.int64(), pa.uint16(), pa.uint64(), pa.float32(),
                                   pa.float64(), pa.string(), pa.bool_()])
@pytest.mark.parametrize("n", [0, 1, 100])
def test_from_numpy_gives_what_pa_array_gives(type_: pa.DataType, n: int) -> None:
    rng = np.random.default_rng(n)
    if pa.types.is_string(type_):
        values = np.array([f"s{k}" for k in rng.integers(0, 5, n)])
    elif pa.types.is_boolean(type_):
        values = rng.integers(0, 2, n).astype(bool)
    else:
        values = rng.integers(0, 100, 2 * n)[::2]  # strided, int64: converted as the column's type
    got = parquet.from_numpy(values, type_)
    want = pa.array(values.tolist(), type_)
    assert got.type == type_ and got.equals(want)
    assert got.to_pylist() == want.to_pylist()


def test_building_a_recordings_tables_does_not_import_numpy_ma() -> None:
    """pa.array's check of numpy input for masked arrays imports numpy.ma (about 20 ms of a
    recording's first flush): a segment and a tally are built without it."""
    code = ("import sys, numpy as np;"
            "from cyclescope.db.segment import build_table; from cyclescope.db.tallies import TIMELINE, build;"
            "i = np.zeros(3, np.int64);"
            "build_table(['a'], i, np.arange(3, dtype=np.uint64), ['cpu-clock'], i, ['c'], i, np.ones(3));"
            "build(TIMELINE, {'process': ['p'], 'window_ms': np.array([1]), 'pid': np.array([2]),"
            " 'tid': np.array([2]), 'event': np.array(['cpu-clock']), 'samples': np.array([3]),"
            " 'period': np.array([1.5])});"
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_daemon_does_not_load_openssl_for_its_names(tmp_path: Path) -> None:
    """The collector's names (cache keys, symbol files, temporary files) take no OpenSSL: hashlib and
    secrets load libcrypto, 3.8 MiB of the daemon's resident memory. The digests are hashlib's. Nor
    does what a flush imports (the loop counter's tallies: not the model, which imports hashlib; not
    pyelftools, 2.7 MiB, whose parse of the vdso runs in a child)."""
    import hashlib

    from cyclescope import random_hex, sha1_hex

    assert sha1_hex(b"vmlinux\0mods") == hashlib.sha1(b"vmlinux\0mods").hexdigest()
    assert len(random_hex(6)) == 12 and random_hex(6) != random_hex(6)
    code = ("import sys; import cyclescope.cli.daemon, cyclescope.collect.daemon, cyclescope.analysis.progress;"
            "from cyclescope.db.layout import Database; from cyclescope.db import symbols;"
            "from cyclescope.images.cache import Cache; from cyclescope.images import kernel;"
            "db = Database.create_or_open(sys.argv[1]); db.temp_path(db.root); symbols.symbols_path(db, 'k');"
            "from pathlib import Path; Cache(Path(sys.argv[1] + '-cache')).path('k', 'x'); kernel.boot_stamp();"
            "print(sorted(m for m in ('_hashlib', 'secrets', 'ssl', 'elftools') if m in sys.modules),"
            " 'libcrypto' in open('/proc/self/maps').read())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "db")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False"
