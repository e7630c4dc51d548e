"""A fleet on one machine: daemons of two host names, as separate processes, ship to one
`serve --ingest` on loopback; shipping killed with SIGKILL over and over loses and doubles
nothing; prof and stats give the same answers on Dask as on DuckDB."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cyclescope.db.layout import Database
from cyclescope.db.query import Selection, open_profile, query_counts
from tests.system.helpers import cs, cs_popen

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]


def counts(root: Path, host: str | None = None) -> dict[tuple[str, str, int], int]:
    db = Database.open(root)
    t = query_counts(open_profile(db, Selection(epochs="all", hosts=(host,) if host else ())))
    return {(i, e, int(o)): int(c) for i, e, o, c in zip(t.column("image").to_pylist(), t.column("event").to_pylist(),
                                                         t.column("offset").to_pylist(), t.column("count").to_pylist(),
                                                         strict=True)}


def wait_for(db: Path, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cs("status", "--db", str(db), "--json", check=False).returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the daemon of {db} did not come up")


def test_daemons_ship_to_one_server_and_a_killed_ship_loses_nothing(spinner: int, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("fleet-token-" + "x" * 20 + "\n")
    central = tmp_path / "central"
    srv = cs_popen("serve", "--db", str(central), "--ingest", "--ingest-token-file", str(token), "--port", "0")
    daemons: list[subprocess.Popen[str]] = []
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().strip().split("/?", 1)[0]
        assert url.startswith("http://127.0.0.1:"), url
        locals_ = {f"host{i}": tmp_path / f"local{i}" for i in (1, 2)}
        for host, db in locals_.items():
            daemons.append(cs_popen("daemon", "--db", str(db), "--host", host, "-F", "200", "--flush-interval", "1",
                                    "--archive", "none", "--ship-to", url, "--ship-token-file", str(token)))
        for db in locals_.values():
            wait_for(db)
        time.sleep(4)
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for d in daemons:
            _, err = d.communicate(timeout=180)
            assert d.returncode == 0, err
        # What the daemons' last passes did not get to (a pass is skipped while one runs).
        for db in locals_.values():
            cs("ship", "--db", str(db), "--to", url, "--token-file", str(token), "--quiet")
        for host, db in locals_.items():
            mine = counts(db)
            assert sum(mine.values()) > 100
            assert counts(central, host) == mine, host
        status = cs("ship", "--db", str(locals_["host1"]), "--to", url, "--token-file", str(token), "--json")
        assert json.loads(status.stdout)["stored"] == 0  # nothing left to send
    finally:
        for d in daemons:
            if d.poll() is None:
                d.kill()
                d.communicate()
        srv.terminate()
        srv.communicate(timeout=30)

    # SIGKILL in the middle of shipping, again and again, to a shared path: then one whole pass.
    local, dest = locals_["host1"], tmp_path / "shared"
    rng = random.Random(7)
    for _ in range(6):
        p = cs_popen("ship", "--db", str(local), "--to", str(dest))
        time.sleep(rng.uniform(0.3, 1.0))
        p.kill()
        p.communicate()
    cs("ship", "--db", str(local), "--to", str(dest))
    assert counts(dest, "host1") == counts(local)

    # The distributed engine answers as the embedded one.
    for args in (["prof", "-E", "all"], ["prof", "-E", "all", "--host", "host2"], ["stats", "--by", "host"]):
        duck = json.loads(cs(*args, "--db", str(central), "--json").stdout)
        dask = json.loads(cs(*args, "--db", str(central), "--json", "--engine", "dask", timeout=300).stdout)
        assert dask["rows"] == duck["rows"], args
