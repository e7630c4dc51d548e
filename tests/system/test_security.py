"""A root daemon on a machine shared with users who try to take it over (run as those users)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.system.helpers import cs, cs_popen
from tests.system.test_daemon import wait_for_daemon

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]

NOBODY = 65534



@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's own are root's, mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test runs a root daemon and attacks it as the user nobody")
    d = Path(tempfile.mkdtemp(prefix="cs-sec-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(argv: list[str]) -> subprocess.Popen[bytes]:
    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    return subprocess.Popen(argv, preexec_fn=drop, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


ATTACK = r"""
import os, sys, time
db, target, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
tried = refused = 0
end = time.time() + secs
while time.time() < end:
    for root, dirs, files in os.walk(db):
        for name in files + dirs + [".tmp-attack"]:
            p = os.path.join(root, name)
            tried += 1
            try:
                if os.path.lexists(p) and not os.path.isdir(p):
                    os.unlink(p)
                os.symlink(target, p)
            except OSError:
                refused += 1
print(tried, refused, file=sys.stderr)
"""


def test_a_user_cannot_take_over_files_through_the_value_store(shared_dir: Path) -> None:
    src = Path(__file__).parents[1] / "programs" / "spin_for.c"
    exe = shared_dir / "spin"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(src)], check=True)
    target = shared_dir / "target"
    target.write_text("root's\n")
    target.chmod(0o644)
    before = target.stat()
    db = shared_dir / "db"
    # A value directory as versions before this one left it: owned by the user, a link inside.
    cs("record", "--db", str(db), "-q", "--", "true")
    host = os.uname().nodename
    legacy = db / "epoch=000002" / f"host={host}" / "values" / f"uid={NOBODY}"
    (db / "epoch=000002").mkdir(mode=0o755)
    (db / "epoch=000002" / "epoch.json").write_text('{"id": 2, "shared": true}')
    legacy.mkdir(parents=True, mode=0o755)
    os.chown(legacy, NOBODY, NOBODY)
    os.symlink(target, legacy / ".tmp-planted")
    attack = shared_dir / "attack.py"
    attack.write_text(ATTACK)
    d = cs_popen("daemon", "--db", str(db), "-F", "1000", "--flush-interval", "0.5", "--values", "operands",
                 "--values-users", "nobody")
    try:
        wait_for_daemon(db)
        work = as_nobody([str(exe), "5"])
        t0 = time.monotonic()
        while not list(legacy.glob("vals-*")) and time.monotonic() - t0 < 30:
            time.sleep(0.1)  # the daemon's first values for the user: it has taken the directory back
        assert legacy.stat().st_uid == 0 and not (legacy / ".tmp-planted").exists()
        thief = as_nobody(["python3", str(attack), str(db), str(target), "3"])
        work.wait(timeout=60)
        _, err = thief.communicate(timeout=60)
        tried, refused = (int(x) for x in err.decode().split()[-2:])
        assert tried > 100 and refused == tried  # not one entry of the database could be made a link
        time.sleep(1.0)
        assert d.poll() is None  # alive
        assert cs("status", "--db", str(db)).returncode == 0
    finally:
        d.send_signal(signal.SIGTERM)
        _, derr = d.communicate(timeout=60)
    assert d.returncode == 0, derr
    after = target.stat()
    assert (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (0, 0, 0o644) == (
        before.st_uid, before.st_gid, stat.S_IMODE(before.st_mode))
    assert target.read_text() == "root's\n"
    files = list(db.glob(f"epoch=*/host=*/values/uid={NOBODY}/vals-*.parquet"))
    assert files, "the user's values were not written"
    for f in files:
        st = f.stat()
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o600
        dst = f.parent.stat()
        assert dst.st_uid == 0 and not dst.st_mode & 0o022
    # Others may not read them; the owner may (through the report, as that user).
    assert as_nobody(["cat", str(files[0])]).wait(timeout=10) == 0


def test_a_user_cannot_squat_the_control_socket_or_forge_answers(shared_dir: Path) -> None:
    db = shared_dir / "db"
    cs("record", "--db", str(db), "-q", "--", "true")
    squat = r"""
import os, socket, sys
db = sys.argv[1]
made = 0
for path in (os.path.join(db, "control"), os.path.join(db, "control", "daemon.sock")):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        s = socket.socket(socket.AF_UNIX); s.bind(path); made += 1
    except OSError:
        pass
print(made, file=sys.stderr)
"""
    script = shared_dir / "squat.py"
    script.write_text(squat)
    p = as_nobody(["python3", str(script), str(db)])
    _, err = p.communicate(timeout=30)
    assert err.decode().strip() == "0"
    d = cs_popen("daemon", "--db", str(db), "-F", "200", "--flush-interval", "3600")
    try:
        st = wait_for_daemon(db)
        assert st["pid"] == d.pid
        # The user cannot even reach the socket.
        probe = as_nobody(["python3", "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX); "
                           f"s.connect('{db}/control/daemon.sock')"])
        assert probe.wait(timeout=30) != 0
    finally:
        d.send_signal(signal.SIGTERM)
        d.communicate(timeout=60)
    assert d.returncode == 0
