"""Talking to a running daemon: `cyclescope flush`, `epoch`, `status`, `stop`.

An abstract Unix socket named after the database path, so there is no socket
file to clean up after a crash. Only root and the daemon's own user may send
commands (checked with SO_PEERCRED).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from cyclescope.errors import CycleScopeError


def address(db_root: Path) -> bytes:
    h = hashlib.sha1(str(db_root.resolve()).encode()).hexdigest()[:20]
    return b"\0cyclescope-" + h.encode()


class ControlServer:
    def __init__(self, db_root: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(address(db_root))
        except OSError:
            self.sock.close()
            raise CycleScopeError(f"a cyclescope daemon is already running on {db_root}") from None
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.uid = os.getuid()

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, dict[str, Any]] | None:
        """One pending request, or None. Refuses other users' requests."""
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return None
        conn.settimeout(2.0)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        try:
            line = _read_line(conn)
            req = json.loads(line) if line else {}
        except (OSError, ValueError):
            conn.close()
            return None
        if uid not in (0, self.uid):
            reply(conn, {"ok": False, "error": "permission denied"})
            return None
        return conn, req

    def close(self) -> None:
        self.sock.close()


def _read_line(conn: socket.socket, limit: int = 65536) -> str:
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def reply(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass
    finally:
        conn.close()


def request(db_root: Path, cmd: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any] | None:
    """Send one command; None when no daemon listens for this database."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout_s)
    try:
        s.connect(address(db_root))
    except (ConnectionRefusedError, FileNotFoundError):
        s.close()
        return None
    try:
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        line = _read_line(s, 1 << 22)
    except TimeoutError:
        raise CycleScopeError(f"the daemon did not answer '{cmd}' within {timeout_s:.0f} s") from None
    finally:
        s.close()
    try:
        out = json.loads(line)
    except ValueError:
        raise CycleScopeError(f"the daemon sent an unreadable answer to '{cmd}'") from None
    return out if isinstance(out, dict) else None
