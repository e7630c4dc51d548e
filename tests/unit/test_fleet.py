"""A fleet without the kernel: hosts' databases of synthetic segments, stacks and tallies shipped
into one (directly and over `serve --ingest` on loopback), queried on DuckDB and on a local Dask
cluster, and merged by retention; what each step must never do is lose or double a sample."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cyclescope.collect.stacks import StackAggregator
from cyclescope.db.compact import compact
from cyclescope.db.layout import SOURCE_BLOCK, Database
from cyclescope.db.query import Selection, open_profile, query_counts
from cyclescope.db.stacks import compact_stacks, load_stacks, write_stacks
from cyclescope.db.tallies import TIMELINE, build, load_tally, write_tally
from cyclescope.errors import DataError
from cyclescope.fleet.place import Central, Source
from cyclescope.fleet.retain import merge_group, plan, retain
from cyclescope.fleet.ship import HttpDestination, Offline, PathDestination, ship
from cyclescope.perf.abi import PERF_CONTEXT_USER
from tests.unit.test_db import put

DAY = 86400.0


def counts(db: Database, epochs: str = "all", hosts: tuple[str, ...] = ()) -> dict[tuple[str, str, int], int]:
    t = query_counts(open_profile(db, Selection(epochs=epochs, hosts=hosts)))
    return {(i, e, int(o)): int(c) for i, e, o, c in zip(t.column("image").to_pylist(), t.column("event").to_pylist(),
                                                         t.column("offset").to_pylist(), t.column("count").to_pylist(),
                                                         strict=True)}


def host_db(root: Path, host: str, flushes: int, seed: int) -> Database:
    """A host's database: ``flushes`` segments of one epoch, with stacks and a timeline each."""
    db = Database.create_or_open(root)
    ep = db.ensure_epoch()
    rng = np.random.default_rng(seed)
    for _ in range(flushes):
        put(db, ep, [(int(rng.integers(1, 3)), int(rng.integers(0, 8)) * 4, 0, 1, int(rng.integers(1, 50)))
                     for _ in range(6)], host=host)
        agg = StackAggregator()
        agg.add(_Mapper(), np.array([7]), np.array([0x401000], np.uint64), np.array([0]),
                [(PERF_CONTEXT_USER, 0x401000, 0x402005)])
        write_stacks(db, ep, host, agg.take(), ["[unknown]", "aaaa1111bbbb2222"], ["cpu-clock"], {},
                     ["[unknown]", "prog"])
        write_tally(db, ep, host, TIMELINE, build(TIMELINE, {
            "process": ["prog"], "window_ms": [1000], "pid": [7], "tid": [7], "event": ["cpu-clock"],
            "samples": [int(rng.integers(1, 9))], "period": [1e6]}))
    return db


class _Mapper:
    def map_frames(self, pids: np.ndarray, addrs: np.ndarray, kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(len(addrs), np.int64), addrs.astype(np.uint64) - 0x400000


def merged_counts(*dbs: Database) -> Counter[tuple[str, str, int]]:
    out: Counter[tuple[str, str, int]] = Counter()
    for db in dbs:
        out.update(counts(db))
    return out


def test_two_hosts_ship_into_one_database_and_a_second_pass_sends_nothing(tmp_path: Path) -> None:
    a = host_db(tmp_path / "a", "alpha", 3, 1)
    b = host_db(tmp_path / "b", "beta", 2, 2)
    dest = PathDestination(str(tmp_path / "central"))
    ra, rb = ship(a, dest), ship(b, dest)
    assert (ra.stored, rb.stored) == (9, 6) and not ra.rejected and ra.offline is None  # 3 kinds per flush
    central = dest.central.db
    assert counts(central) == merged_counts(a, b)
    assert counts(central, hosts=("alpha",)) == counts(a)
    stacks = load_stacks(central, central.epochs())
    assert sum(stacks.counts.values()) == 5 and stacks.files == 5
    tl = load_tally(central, TIMELINE, central.epochs(), ["beta"])
    assert tl.table.num_rows == 1
    again = ship(a, dest)
    assert again.sent == 0 and again.stored == 0
    # The ledger lost: every file is sent again and recognised, nothing is counted twice.
    for f in (a.root / "ship").iterdir():
        f.unlink()
    again = ship(a, dest)
    assert again.duplicate == 9 and again.stored == 0
    assert counts(central) == merged_counts(a, b)


def test_a_hosts_compaction_supersedes_the_flushes_it_shipped(tmp_path: Path) -> None:
    a = host_db(tmp_path / "a", "alpha", 3, 3)
    dest = PathDestination(str(tmp_path / "central"))
    ship(a, dest)
    ep = a.epochs()[0]
    compact(a, ep, "alpha")
    compact_stacks(a, ep, "alpha")
    put(a, ep, [(1, 4, 0, 1, 5)], host="alpha")
    report = ship(a, dest)
    assert report.stored == 3  # the merged segment, the merged stack file, the new flush
    central = dest.central.db
    cep = central.epochs()[0]
    names = sorted(s.name for s in central.segments(cep, "alpha", live_only=False))
    base = SOURCE_BLOCK
    assert names == [f"seg-{base + 1:08d}-{base + 3:08d}.parquet", f"seg-{base + 4:08d}-{base + 4:08d}.parquet"]
    assert counts(central) == counts(a)
    assert sum(load_stacks(central, [cep]).counts.values()) == 3
    # A flush the compaction covers, arriving late (a lost ledger, a repeat): dropped.
    src = Source("alpha", a.identity(), ep, float(a.epoch_info(ep)["created"]))  # type: ignore[arg-type]
    other = host_db(tmp_path / "x", "alpha", 1, 9)
    seg = other.segments(other.epochs()[0], "alpha")[0].path
    assert dest.central.place(src, "seg-00000002-00000002.parquet", seg) == "superseded"
    assert counts(central) == counts(a)


def test_malformed_files_are_refused_and_the_rest_kept(tmp_path: Path) -> None:
    a = host_db(tmp_path / "a", "alpha", 2, 4)
    ep = a.epochs()[0]
    bad = a.host_dir(ep, "alpha") / "seg-00000009-00000009.parquet"
    bad.write_bytes(b"PAR1 this is not a segment")
    dest = PathDestination(str(tmp_path / "central"))
    report = ship(a, dest)
    assert len(report.rejected) == 1 and "seg-00000009-00000009.parquet: rejected" in report.rejected[0]
    assert report.stored == 6
    assert ship(a, dest).rejected == []  # said once, not again at every pass
    central = dest.central.db
    assert not any(".tmp-" in p.name for p in central.host_dir(central.epochs()[0], "alpha").iterdir())
    bad.unlink()
    assert counts(central) == counts(a)
    central_src = Source("alpha", a.identity(), ep, 0.0)
    with pytest.raises(DataError, match="not a file cyclescope ships"):
        dest.central.place(central_src, "../../etc/passwd", bad.parent / "stacks")
    with pytest.raises(DataError, match="host name"):
        dest.central.place(Source("../x", a.identity(), ep, 0.0), "seg-00000001-00000001.parquet",
                           a.segments(ep, "alpha")[0].path)


class _Flaky:
    """A destination that goes offline after ``n`` files."""

    def __init__(self, inner: PathDestination, n: int) -> None:
        self.inner, self.n, self.name = inner, n, inner.name

    def epochs(self) -> list[tuple[int, float]]:
        return self.inner.epochs()

    def send(self, src: Source, rel: str, path: Path) -> str:
        if self.n <= 0:
            raise Offline("unplugged")
        self.n -= 1
        return self.inner.send(src, rel, path)

    def send_side(self, rel: str, path: Path, private: bool) -> str:
        return self.inner.send_side(rel, path, private)


def test_a_host_that_was_offline_catches_up_without_loss_or_duplicates(tmp_path: Path) -> None:
    a = host_db(tmp_path / "a", "alpha", 4, 5)
    dest = PathDestination(str(tmp_path / "central"))
    report = ship(a, _Flaky(dest, 2))
    assert report.offline == "unplugged" and report.stored == 2
    assert counts(dest.central.db) != counts(a)
    report = ship(a, dest)
    assert report.offline is None and report.stored == 10
    assert counts(dest.central.db) == counts(a)


def test_sources_land_in_the_central_epoch_of_their_time(tmp_path: Path) -> None:
    central = Database.create_or_open(tmp_path / "central")
    e1, e2 = central.new_epoch(), central.new_epoch()
    for e, t in ((e1, 1000.0), (e2, 2000.0)):
        info = central.epoch_info(e)
        (central.epoch_dir(e) / "epoch.json").write_text(json.dumps({**info, "created": t}))
    c = Central(central)
    assert c.place_source(Source("h", "ab" * 8, 1, 500.0))[:2] == (e1, 1)  # older than all: the first
    assert c.place_source(Source("h", "ab" * 8, 2, 1500.0))[:2] == (e1, 2)  # a second block in e1
    assert c.place_source(Source("h", "ab" * 8, 3, 2500.0))[:2] == (e2, 1)
    assert Central(central).place_source(Source("h", "ab" * 8, 2, 1500.0))[:2] == (e1, 2)  # found again


def _age(db: Database, epoch: int, created: float) -> None:
    info = db.epoch_info(epoch)
    (db.epoch_dir(epoch) / "epoch.json").write_text(json.dumps({**info, "created": created}))


def test_retention_merges_a_days_epochs_by_addition(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    now = 100 * DAY
    for i in range(5):
        ep = db.new_epoch()
        _age(db, ep, now - 3 * DAY + i * 3600 if i < 4 else now)  # four epochs of one day, then today's
        for h in ("h1", "h2"):
            put(db, ep, [(1, 4 * i, 0, 1, 10 + i), (2, 8, 0, 2, 3)], host=h)
            put(db, ep, [(1, 4 * i, 0, 1, 1)], host=h)
    before = counts(db)
    assert plan(db, DAY, "day", now) == [[1, 2, 3, 4]]
    report = retain(db, DAY, "day", now=now)
    assert [m.epochs for m in report.merged] == [[1, 2, 3, 4]]
    assert db.epochs() == [1, 5] and db.epochs(hidden=True) == [1, 5]
    assert counts(db) == before
    assert [len(db.segments(1, h)) for h in ("h1", "h2")] == [1, 1]
    assert db.epoch_info(1)["grain"] == "day"
    assert plan(db, DAY, "day", now) == []
    # A week of merged days, then the budget: the oldest epoch goes, never the live one.
    report = retain(db, DAY, "week", max_bytes=1, now=now)
    assert report.dropped == [1] and db.epochs() == [5]


def test_a_merge_interrupted_after_its_commit_is_read_right_and_finished(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    for i in range(3):
        ep = db.new_epoch()
        _age(db, ep, 10 * DAY + i)
        put(db, ep, [(1, 4, 0, 1, 7)])
    db.new_epoch()
    before = counts(db)
    import cyclescope.fleet.retain as retain_mod

    real_remove = retain_mod._remove
    retain_mod._remove = lambda db, d: None  # type: ignore[assignment]  # "crash" after the exchange
    try:
        merge_group(db, [1, 2, 3], "day")
    finally:
        retain_mod._remove = real_remove
    assert db.epochs(hidden=True) == [1, 2, 3, 4] and db.epochs() == [1, 4]
    assert counts(db) == before  # the merged epoch hides what it replaced
    assert retain(db, 30 * DAY, "day").cleaned == 2
    assert db.epochs(hidden=True) == [1, 4] and counts(db) == before


def test_a_late_file_of_a_merged_source_is_dropped_or_refused(tmp_path: Path) -> None:
    a = host_db(tmp_path / "a", "alpha", 2, 6)
    dest = PathDestination(str(tmp_path / "central"))
    ship(a, dest)
    central = dest.central.db
    _age(central, central.epochs()[0], 10 * DAY)
    central.new_epoch()
    central.new_epoch()
    _age(central, 2, 10 * DAY + 1)
    retain(central, DAY, "day")
    assert central.epochs() == [1, 3] and counts(central) == counts(a)
    ep = a.epochs()[0]
    src = Source("alpha", a.identity(), ep, float(a.epoch_info(ep)["created"]))  # type: ignore[arg-type]
    c = Central(central)
    seg = a.segments(ep, "alpha")[0].path
    assert c.place(src, "seg-00000001-00000001.parquet", seg) == "superseded"
    with pytest.raises(DataError, match="merged"):
        c.place(src, "seg-00000001-00000003.parquet", seg)
    assert counts(central) == counts(a)


@pytest.fixture()
def ingest(tmp_path: Path) -> Iterator[tuple[str, Database]]:
    import uvicorn

    from cyclescope.web.server import Site, make_app

    db = Database.create_or_open(tmp_path / "central")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    site = Site(db, "v" * 24, port=port, ingest_token="i" * 24)
    srv = uvicorn.Server(uvicorn.Config(make_app(site), log_level="error", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", db
    srv.should_exit = True
    th.join(10)
    sock.close()


def test_shipping_over_http_with_the_ingest_token_only(tmp_path: Path, ingest: tuple[str, Database]) -> None:
    url, central = ingest
    a = host_db(tmp_path / "a", "alpha", 2, 7)
    b = host_db(tmp_path / "b", "beta", 2, 8)
    for wrong in ("v" * 24, "x" * 24):  # the viewers' token does not write
        with pytest.raises(Exception, match="token"):
            ship(a, HttpDestination(url, wrong))
    assert ship(a, HttpDestination(url, "i" * 24)).stored == 6
    assert ship(b, HttpDestination(url, "i" * 24)).stored == 6
    assert counts(central) == merged_counts(a, b)
    for f in (a.root / "ship").iterdir():
        f.unlink()
    assert ship(a, HttpDestination(url, "i" * 24)).duplicate == 6
    bad = a.host_dir(a.epochs()[0], "alpha") / "seg-00000007-00000007.parquet"
    bad.write_bytes(b"garbage")
    report = ship(a, HttpDestination(url, "i" * 24))
    assert len(report.rejected) == 1 and "rejected" in report.rejected[0]
    assert counts(central) == merged_counts(a, b)
    os.unlink(bad)
    report = ship(a, HttpDestination("http://127.0.0.1:9", "i" * 24))  # nobody listens there
    assert report.offline is not None


@pytest.fixture(scope="module")
def dask_engine() -> Iterator[object]:
    pytest.importorskip("distributed")
    from cyclescope.fleet.engine import DaskEngine

    eng = DaskEngine(workers=2)
    yield eng
    eng.close()


def test_dask_and_duckdb_agree_on_counts_and_stacks(tmp_path: Path, dask_engine: object) -> None:
    a = host_db(tmp_path / "a", "alpha", 5, 10)
    b = host_db(tmp_path / "b", "beta", 4, 11)
    dest = PathDestination(str(tmp_path / "central"))
    ship(a, dest)
    ship(b, dest)
    central = dest.central.db
    for sel in (Selection(epochs="all"), Selection(epochs="all", hosts=("beta",)),
                Selection(epochs="all", processes=("sh",)), Selection(epochs="all", images=("/lib/libc.so.6",))):
        for by_process in (False, True):
            duck = query_counts(open_profile(central, sel), by_process=by_process)
            dask = query_counts(open_profile(central, sel, dask_engine), by_process=by_process)  # type: ignore[arg-type]
            assert dask.to_pylist() == duck.to_pylist(), sel
    eng = dask_engine
    from cyclescope.db.stacks import stack_paths

    files = stack_paths(central, central.epochs())
    got = eng.stack_arrays(files, None, None).selection()  # type: ignore[attr-defined]
    assert got.counts == load_stacks(central, central.epochs()).counts and got.files == 9
    arrays = eng.stack_arrays(files, {"aaaa1111bbbb2222"}, None)  # type: ignore[attr-defined]
    assert arrays.selection().counts == load_stacks(central, central.epochs(), None, {"aaaa1111bbbb2222"}).counts
    assert len(arrays) == 1 and arrays.count.tolist() == [9.0]


def test_retention_merges_value_hotlists_and_keeps_them_their_owners(tmp_path: Path) -> None:
    import stat

    from cyclescope.db.values import ValuesMeta, load_values, value_files, write_values
    from tests.unit.test_values import _named

    db = Database.create_or_open(tmp_path / "db")
    uid = os.getuid()
    for i, vals in enumerate(([1, 1, 2], [1, 5])):
        ep = db.new_epoch()
        _age(db, ep, 10 * DAY + i)
        put(db, ep, [(1, 16, 0, 1, 3)])
        write_values(db, ep, "h1", _named([16] * len(vals), vals), ValuesMeta(uid, samples=len(vals)))
    db.new_epoch()
    retain(db, DAY, "day")
    assert db.epochs() == [1, 3]
    files = value_files(db, 1, "h1", uid)
    assert len(files) == 1 and stat.S_IMODE(files[0].path.stat().st_mode) == 0o600
    assert files[0].path.stat().st_uid == uid
    vs = load_values(db, [1])
    assert vs.meta is not None and vs.meta.samples == 5
    lists = vs.hotlists.lists
    assert {int(v[0]): n for v, n in lists.hotlist(0).counts.items()} == {1: 3, 2: 1, 5: 1}


def test_a_host_follows_the_shared_databases_epochs(tmp_path: Path) -> None:
    a = host_db(tmp_path / "a", "alpha", 1, 12)
    dest = PathDestination(str(tmp_path / "central"))
    assert ship(a, dest, follow=True).new_epoch is None  # the central epoch made for our first files
    central = dest.central.db
    time.sleep(0.01)
    fleet_epoch = central.new_epoch(name="hour 2")
    report = ship(a, dest, follow=True)
    assert report.new_epoch == 2 and a.newest_shared_epoch() == 2  # a daemon here switches at its next flush
    put(a, 2, [(1, 4, 0, 1, 9)], host="alpha")
    ship(a, dest, follow=True)
    assert counts(central, "all") == counts(a)
    assert [c for c in counts(central, str(fleet_epoch)).values()] == [9]
    assert ship(a, dest, follow=True).new_epoch is None


def test_the_same_code_runs_on_a_cluster_given_its_scheduler(tmp_path: Path) -> None:
    """A scheduler and two workers started apart (as on a cluster, here on loopback): prof's counts
    through --engine-address equal DuckDB's."""
    import subprocess
    import sys

    pytest.importorskip("distributed")
    from cyclescope.fleet.engine import DaskEngine

    a = host_db(tmp_path / "a", "alpha", 3, 13)
    info = tmp_path / "scheduler.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file", str(info),
                               "--host", "127.0.0.1", "--port", "0", "--no-dashboard"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    try:
        deadline = time.monotonic() + 60
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = json.loads(info.read_text())["address"]
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "2",
                                       "--nthreads", "1", "--no-dashboard"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        eng = DaskEngine(address)
        try:
            while eng.workers < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(eng.client.scheduler_info()["workers"]) == 2
            sel = Selection(epochs="all")
            got = query_counts(open_profile(a, sel, eng), by_process=True)
            assert got.to_pylist() == query_counts(open_profile(a, sel), by_process=True).to_pylist()
        finally:
            eng.close()
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
