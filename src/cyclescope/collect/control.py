"""Talking to a running daemon: `cyclescope flush`, `epoch`, `status`, `stop`.

The channel is a Unix socket at ``DB/control/daemon.sock``. The ``control`` directory is the
daemon's, mode 0700, inside a database directory no other user can write (db/layout.py), so
only the daemon's user and root can reach the socket, and nobody else can bind its name first.
A lock held for the daemon's life (``control/daemon.lock``) makes it the only daemon of the
database; a socket a crashed daemon left behind is replaced. Both sides check who is at the
other end (SO_PEERCRED): the daemon serves root and its own user; a client believes a daemon
run by root, by itself or by the database's owner.

Requests are one JSON object on one line, at most MAX_REQUEST bytes, read within a total deadline
(a client that trickles bytes is cut off, however slowly it sends); they are read and checked on
threads of their own, at most MAX_CLIENTS at once, and only well-formed commands reach the
sampling loop, through a queue it polls (the pipe ``fileno``). Anything malformed gets an error
answer; nothing a client sends can stop the daemon except ``stop``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cyclescope.errors import CycleScopeError

CONTROL_DIR = "control"
SOCKET_NAME = "daemon.sock"
LOCK_NAME = "daemon.lock"
MAX_REQUEST = 4096
MAX_REPLY = 1 << 20
REQUEST_DEADLINE_S = 2.0
MAX_CLIENTS = 8
ANSWER_TIMEOUT_S = 600.0  # a flush of a big table, or a compaction's turn at the lock
# command -> its arguments and their types
COMMANDS: dict[str, dict[str, type]] = {"flush": {}, "epoch": {"name": str}, "status": {}, "stop": {}}
MAX_NAME = 200


def socket_path(db_root: Path) -> Path:
    return db_root / CONTROL_DIR / SOCKET_NAME


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def parse_request(raw: bytes) -> dict[str, Any]:
    """A request's command and arguments, checked; ValueError saying what is wrong."""
    try:
        req = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not a JSON object") from None
    if not isinstance(req, dict):
        raise ValueError("not a JSON object")
    cmd = req.get("cmd")
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        raise ValueError(f"unknown command {cmd!r}" if isinstance(cmd, str) else "no command")
    args: dict[str, Any] = {"cmd": cmd}
    for k, v in req.items():
        if k == "cmd":
            continue
        want = COMMANDS[cmd].get(k)
        if want is None:
            raise ValueError(f"'{cmd}' takes no argument {k!r}")
        if not isinstance(v, want):
            raise ValueError(f"'{cmd}': {k} must be a {want.__name__}")
        if isinstance(v, str) and (len(v) > MAX_NAME or any(ord(c) < 32 for c in v)):
            raise ValueError(f"'{cmd}': {k} must be at most {MAX_NAME} printable characters")
        args[k] = v
    return args


@dataclass
class Pending:
    """A checked request waiting for the sampling loop's answer."""

    request: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] = field(default_factory=dict)

    def reply(self, obj: dict[str, Any]) -> None:
        self.answer = obj
        self.done.set()


class ControlServer:
    def __init__(self, db_root: Path) -> None:
        from cyclescope.db.layout import ensure_dir

        d = ensure_dir(db_root, db_root / CONTROL_DIR, 0o700)
        os.chmod(d, 0o700)
        self.uid = os.geteuid()
        self._lock_fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            raise CycleScopeError(f"a cyclescope daemon is already running on {db_root}"
                                  + (f" (pid {other})" if other.isdigit() else "")) from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)
        self.path = d / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a daemon that died: we hold the lock, nobody uses it
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o077)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._ino = os.stat(self.path).st_ino  # close() removes the socket only if it is still this one
        self.sock.listen(MAX_CLIENTS)
        self.sock.settimeout(0.25)
        self._queue: queue.Queue[Pending] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self.refused = 0  # requests answered with an error (malformed, late, not allowed, too many)
        self._thread = threading.Thread(target=self._accept_loop, name="control", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when requests wait for the sampling loop (``pending``)."""
        return self._wake_r

    def pending(self) -> list[Pending]:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.sock.close()
        for p in self.pending():
            p.reply({"ok": False, "error": "the daemon is stopping"})
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._ino:
                self.path.unlink()
        for fd in (self._wake_r, self._wake_w, self._lock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- the server's threads ---------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            if not self._clients.acquire(blocking=False):
                self.refused += 1
                _send(conn, {"ok": False, "error": "busy: too many requests at once"})
                continue
            threading.Thread(target=self._serve_one, args=(conn,), name="control-client", daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                return
            if uid not in (0, self.uid):
                self.refused += 1
                _send(conn, {"ok": False, "error": "permission denied"})
                return
            try:
                raw = _read_line(conn, MAX_REQUEST, time.monotonic() + REQUEST_DEADLINE_S)
                req = parse_request(raw)
            except ValueError as e:
                self.refused += 1
                _send(conn, {"ok": False, "error": str(e)})
                return
            p = Pending(req)
            self._queue.put(p)
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")
            if not p.done.wait(ANSWER_TIMEOUT_S):
                p.answer = {"ok": False, "error": "the daemon did not get to the request in time"}
            _send(conn, p.answer)
        finally:
            self._clients.release()


def _read_line(conn: socket.socket, limit: int, deadline: float) -> bytes:
    """Bytes up to the first newline; ValueError past ``limit`` bytes or ``deadline`` (monotonic)."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError("request not complete in time")
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            raise ValueError("request not complete in time") from None
        except OSError as e:
            raise ValueError(f"connection failed ({e.strerror})") from None
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"request longer than {limit} bytes")
    return buf.split(b"\n", 1)[0]


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.settimeout(REQUEST_DEADLINE_S)
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass
    finally:
        conn.close()


def request(db_root: Path, cmd: str, timeout_s: float = ANSWER_TIMEOUT_S, **args: Any) -> dict[str, Any] | None:
    """Send one command; None when no daemon listens for this database. The answer is a JSON
    object with a boolean ``ok``; anything else, or a daemon run by a user we do not trust, is an
    error."""
    path = socket_path(db_root)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(min(timeout_s, 5.0))
    try:
        s.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        s.close()
        return None
    except PermissionError:
        s.close()
        raise CycleScopeError(f"{path}: permission denied (the daemon serves root and its own user)") from None
    try:
        uid = peer_uid(s)
        try:
            owner = os.stat(db_root).st_uid
        except OSError:
            owner = -1
        if uid not in (0, os.geteuid(), owner):
            raise CycleScopeError(f"{path}: answered by uid {uid}, neither root, you, nor the database's owner; "
                                  "not trusting it")
        # A busy daemon answers at once and closes (too many requests): its answer is still to read.
        with contextlib.suppress(BrokenPipeError):
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        raw = _read_line(s, MAX_REPLY, time.monotonic() + timeout_s)
    except ValueError as e:
        raise CycleScopeError(f"the daemon did not answer '{cmd}' properly: {e}") from None
    except OSError as e:
        raise CycleScopeError(f"talking to the daemon failed: {e.strerror or e}") from None
    finally:
        s.close()
    try:
        out = json.loads(raw)
    except ValueError:
        raise CycleScopeError(f"the daemon sent an unreadable answer to '{cmd}'") from None
    if not isinstance(out, dict) or not isinstance(out.get("ok"), bool):
        raise CycleScopeError(f"the daemon sent an unreadable answer to '{cmd}'")
    return out


def field_of(answer: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """One field of an answer, of the type expected (CycleScopeError otherwise)."""
    v = answer.get(name)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise CycleScopeError(f"the daemon's answer has no proper '{name}'")
    return v
