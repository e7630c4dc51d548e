"""The daemon's control channel: checked requests, deadlines, garbage, trust in both directions."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cyclescope.collect import control
from cyclescope.db.layout import Database
from cyclescope.errors import CycleScopeError


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Database, control.ControlServer, list[dict]]]:
    """A control server with a stand-in for the sampling loop that answers what reaches it."""
    db = Database.create_or_open(tmp_path / "db")
    srv = control.ControlServer(db.root)
    seen: list[dict] = []
    stop = threading.Event()

    def loop() -> None:
        import select

        while not stop.is_set():
            r, _, _ = select.select([srv.fileno()], [], [], 0.05)
            if r:
                for p in srv.pending():
                    seen.append(p.request)
                    p.reply({"ok": True, "echo": p.request["cmd"], "epoch": 3, "samples": 10, "rows": 2,
                             "seconds": 0.1})

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield db, srv, seen
    stop.set()
    t.join()
    srv.close()


def raw_exchange(db: Database, data: bytes, wait: float = 5.0) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(wait)
    s.connect(str(control.socket_path(db.root)))
    with contextlib.suppress(BrokenPipeError):  # a busy server answers at once and closes: read it
        s.sendall(data)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
    s.close()
    return json.loads(buf)


def test_a_well_formed_request_is_answered_by_the_loop(served: tuple) -> None:
    db, _srv, seen = served
    r = control.request(db.root, "flush", timeout_s=5)
    assert r is not None and r["ok"] and r["echo"] == "flush"
    assert control.request(db.root, "epoch", timeout_s=5, name="after-upgrade")["echo"] == "epoch"  # type: ignore[index]
    assert seen == [{"cmd": "flush"}, {"cmd": "epoch", "name": "after-upgrade"}]


@pytest.mark.parametrize("data,error", [
    (b"[1]\n", "not a JSON object"),
    (b"{}\n", "no command"),
    (b'{"cmd": 5}\n', "no command"),
    (b'{"cmd": "reboot"}\n', "unknown command 'reboot'"),
    (b'{"cmd": "epoch", "name": 123}\n', "name must be a str"),
    (b'{"cmd": "flush", "extra": 1}\n', "takes no argument 'extra'"),
    (b'{"cmd": "epoch", "name": "a\\nb"}\n', "printable"),
    (b"\xff\xfe\n", "not a JSON object"),
    (b"x" * 10000 + b"\n", "longer than"),
])
def test_garbage_gets_an_error_answer_and_never_reaches_the_loop(served: tuple, data: bytes, error: str) -> None:
    db, srv, seen = served
    r = raw_exchange(db, data)
    assert r["ok"] is False and error in r["error"]
    assert seen == [] and srv.refused >= 1
    assert control.request(db.root, "status", timeout_s=5)["ok"]  # type: ignore[index]  # still serving


def test_a_client_trickling_bytes_is_cut_off_and_stalls_no_one(served: tuple) -> None:
    db, _srv, _seen = served
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(str(control.socket_path(db.root)))
    t0 = time.monotonic()
    answers = []
    for _ in range(4):  # one byte every 0.6 s would reset a per-read timeout forever
        try:
            slow.sendall(b"{")
        except OSError:
            break
        t = time.monotonic()
        answers.append(control.request(db.root, "status", timeout_s=5))
        assert time.monotonic() - t < 1.0  # others are served meanwhile
        time.sleep(0.6)
    slow.settimeout(5)
    reply = json.loads(slow.recv(4096))
    assert reply["ok"] is False and "in time" in reply["error"]
    assert time.monotonic() - t0 < control.REQUEST_DEADLINE_S + 2.5
    assert all(a and a["ok"] for a in answers)


def test_too_many_clients_at_once_are_told_so(served: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    db, _srv, _seen = served
    # Idle clients hold their places until the request deadline: long enough here for a busy machine.
    monkeypatch.setattr(control, "REQUEST_DEADLINE_S", 30.0)
    idle = []
    for _ in range(control.MAX_CLIENTS):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(control.socket_path(db.root)))
        idle.append(s)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the server has taken every idle client in
        if sum(t.name == "control-client" for t in threading.enumerate()) >= control.MAX_CLIENTS:
            break
        time.sleep(0.02)
    r = raw_exchange(db, b'{"cmd": "status"}\n')
    assert r["ok"] is False and "busy" in r["error"]
    # The client the commands use reads that answer too, though the server may close before it sends.
    r = control.request(db.root, "status", timeout_s=5)
    assert r is not None and r["ok"] is False and "busy" in r["error"]
    for s in idle:
        s.close()


def test_one_daemon_per_database(served: tuple) -> None:
    db, _srv, _seen = served
    with pytest.raises(CycleScopeError, match=rf"already running .*pid {os.getpid()}"):
        control.ControlServer(db.root)


def test_a_socket_left_by_a_dead_daemon_is_replaced(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - a daemon killed with -9: the socket file stays, the lock goes
        control.ControlServer(db.root)
        os._exit(0)
    os.waitpid(pid, 0)
    assert control.socket_path(db.root).exists()
    assert control.request(db.root, "status", timeout_s=2) is None  # nobody listens: "no daemon"
    srv2 = control.ControlServer(db.root)
    srv2.close()


def test_the_client_does_not_trust_a_daemon_run_by_another_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to listen as another user (the test plays an unprivileged squatter)")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="cs-squat-"))  # a directory nobody can reach
    base.chmod(0o755)
    db = Database.create_or_open(base / "db")
    d = db.root / control.CONTROL_DIR
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)  # as if a user had won the socket's name
    path = str(control.socket_path(db.root))
    ready = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the squatter
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(1)
            os.write(ready[1], b"x")
            c, _ = s.accept()
            c.recv(4096)
            c.sendall(b'{"ok": true, "epoch": 42, "samples": 0, "rows": 0, "seconds": 0}\n')
            time.sleep(1)
        finally:
            os._exit(0)
    os.close(ready[1])
    got = os.read(ready[0], 1)
    try:
        assert got == b"x", "the squatter could not listen"
        with pytest.raises(CycleScopeError, match=r"answered by uid 65534.*not trusting it"):
            control.request(db.root, "flush", timeout_s=5)
    finally:
        os.waitpid(pid, 0)
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_root_writer_refuses_a_database_another_user_can_write(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the check is for root writers only")
    root = tmp_path / "db"
    Database.create_or_open(root)
    os.chmod(root, 0o777)
    with pytest.raises(CycleScopeError, match="writable by every user"):
        Database.create_or_open(root)
    os.chmod(root, 0o755)
    os.chown(root, 65534, 65534)
    with pytest.raises(CycleScopeError, match="owned by uid 65534"):
        Database.create_or_open(root)
