"""The host side of shipping: the sealed files of this host's database sent to a shared one.

A pass sends every live file (segments, stacks, tallies: see place.file_kinds) and every symbol
table and archived binary the destination does not have yet, oldest first, and remembers what it
sent in a ledger (``DB/ship/<destination>.json``, rewritten atomically). Nothing needs the two
sides to agree beforehand, and nothing is lost or doubled whatever stops a pass: a file sent
again is recognised at the other end by its name and digest; a host's compaction, shipped later,
supersedes the flushes it covers there as it does here; a host that cannot reach the destination
stops the pass and sends the backlog at the next. A file the destination rejects (malformed) is
reported once and not sent again.

Destinations: a path (a database on this machine or on shared storage, written directly) or the
URL of `cyclescope serve --ingest` (HTTP, a bearer token).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cyclescope.db.layout import Database, files_named, live_segments, write_atomic
from cyclescope.errors import DataError, UsageError
from cyclescope.fleet.place import Central, Source, file_kinds, sha256_file


class Offline(Exception):
    """The destination cannot be reached now: the pass stops, the next one catches up."""


class Destination(Protocol):
    name: str

    def epochs(self) -> list[tuple[int, float]]: ...

    def send(self, src: Source, rel: str, path: Path) -> str: ...

    def send_side(self, rel: str, path: Path, private: bool) -> str: ...


class PathDestination:
    """A database reachable as a path (local disk, NFS, a mounted bucket)."""

    def __init__(self, path: str) -> None:
        self.name = str(Path(path).resolve())
        try:
            self.central = Central(Database.create_or_open(path))
        except OSError as e:
            raise Offline(f"{path}: {e.strerror}") from None

    def epochs(self) -> list[tuple[int, float]]:
        db = self.central.db
        return [(e, _float(db.epoch_info(e).get("created"))) for e in db.epochs()]

    def send(self, src: Source, rel: str, path: Path) -> str:
        return self._writing(path, lambda: self.central.place(src, rel, path))

    def send_side(self, rel: str, path: Path, private: bool) -> str:
        return self._writing(path, lambda: self.central.place_side(rel, path, private))

    def _writing(self, path: Path, write: Callable[[], str]) -> str:
        """``write()``; an OSError other than our file's vanishing (a compaction took it) means
        the destination cannot take it now."""
        try:
            return write()
        except OSError as e:
            if not path.exists():
                raise
            raise Offline(f"{self.name}: {e.strerror}") from None


class HttpDestination:
    """`cyclescope serve --ingest` at ``url``, with ``token``."""

    def __init__(self, url: str, token: str, timeout_s: float = 120.0) -> None:
        self.name = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, path: str, params: dict[str, str], body: Path | None = None) -> dict[str, object]:
        url = f"{self.name}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        headers = {"Authorization": f"Bearer {self.token}"}
        with contextlib.ExitStack() as stack:
            data = None
            if body is not None:  # streamed from the file: a large segment is not read into memory
                data = stack.enter_context(open(body, "rb"))
                headers["Content-Type"] = "application/octet-stream"
                headers["Content-Length"] = str(os.fstat(data.fileno()).st_size)
            req = urllib.request.Request(url, data=data, headers=headers,
                                         method="POST" if body is not None else "GET")
            return self._send(req)

    def _send(self, req: urllib.request.Request) -> dict[str, object]:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                out = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                msg = str(json.loads(text).get("error", text))
            except (ValueError, AttributeError):
                msg = text.strip().splitlines()[0] if text.strip() else e.reason
            if e.code in (400, 413, 422):
                raise DataError(msg) from None
            if e.code in (401, 403, 404, 405):
                raise UsageError(f"{self.name}: {msg} (is it `cyclescope serve --ingest`, with this token?)") from None
            raise Offline(f"{self.name}: HTTP {e.code} {msg}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise Offline(f"{self.name}: {getattr(e, 'reason', e)}") from None
        except ValueError:
            raise Offline(f"{self.name}: an answer that is not JSON") from None
        return out if isinstance(out, dict) else {}

    def epochs(self) -> list[tuple[int, float]]:
        got = self._call("/api/ingest/epochs", {}).get("epochs", [])
        return [(int(e["id"]), float(e.get("created") or 0.0)) for e in got if isinstance(e, dict)] \
            if isinstance(got, list) else []

    def send(self, src: Source, rel: str, path: Path) -> str:
        sha = sha256_file(path)
        params = {"host": src.host, "database": src.database, "epoch": str(src.epoch),
                  "created": repr(src.created), "path": rel, "sha256": sha}
        return str(self._call("/api/ingest", params, path).get("result", "stored"))

    def send_side(self, rel: str, path: Path, private: bool) -> str:
        return str(self._call("/api/ingest", {"path": rel, "private": "1" if private else "0"}, path)
                   .get("result", "stored"))


def _float(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


def destination(spec: str, token: str | None) -> Destination:
    """A path, or an http(s):// URL (which needs ``token``)."""
    if spec.startswith(("http://", "https://")):
        if not token:
            raise UsageError("shipping over HTTP needs the server's ingest token (--token-file FILE or "
                             "$CYCLESCOPE_INGEST_TOKEN)")
        return HttpDestination(spec, token)
    if "://" in spec:
        raise UsageError(f"{spec}: ship to a path (a mounted file system) or to an http(s):// URL")
    return PathDestination(spec)


@dataclass
class ShipReport:
    stored: int = 0
    duplicate: int = 0
    superseded: int = 0
    side: int = 0  # symbol tables and binaries stored
    bytes: int = 0
    rejected: list[str] = field(default_factory=list)
    vanished: int = 0  # compacted away between the listing and the send: the compaction follows
    offline: str | None = None  # why the pass stopped early
    new_epoch: int | None = None  # the local epoch made to follow the destination's
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        return self.stored + self.duplicate + self.superseded


def _ledger_path(local: Database, dest: Destination) -> Path:
    return local.root / "ship" / (hashlib.sha256(dest.name.encode()).hexdigest()[:16] + ".json")


def _files(local: Database) -> Iterator[tuple[str, Source | None, str, Path]]:
    """(ledger key, source, path under the host's directory, file) of each file to ship, epoch by
    epoch, oldest flushes first; then the side stores."""
    ident = local.identity()
    for ep in local.epochs():
        created = local.epoch_info(ep).get("created")
        for host in local.hosts(ep):
            src = Source(host, ident, ep, _float(created))
            hd = local.host_dir(ep, host)
            for kind in file_kinds():
                for ref in live_segments(files_named(hd / kind.subdir if kind.subdir else hd, kind.prefix)):
                    rel = f"{kind.subdir}/{ref.name}" if kind.subdir else ref.name
                    yield f"{ep}/{host}/{rel}", src, rel, ref.path
    for side in (local.symbols_dir, local.binaries_dir):
        try:
            names = sorted(f.name for f in side.iterdir() if not f.name.startswith(".tmp-"))
        except FileNotFoundError:
            continue
        for n in names:
            rel = f"{side.name}/{n}"
            yield f"side/{rel}", None, rel, side / n


def ship(local: Database, dest: Destination, follow: bool = False,
         progress: Callable[[int, str], None] | None = None) -> ShipReport:
    """One pass: send what ``dest`` lacks. ``follow``: when the destination has begun an epoch
    newer than this database's newest shared one, begin one here too, so that a daemon writing
    here files what it records next under the fleet's new epoch."""
    t0 = time.monotonic()
    report = ShipReport()
    lpath = _ledger_path(local, dest)
    try:
        done: dict[str, str] = json.loads(lpath.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        done = {}
    dirty = 0

    def save() -> None:
        local.ensure(lpath.parent)
        write_atomic(lpath, json.dumps({"destination": dest.name, "files": done}, indent=0).encode())

    present: set[str] = set()
    try:
        for key, src, rel, path in _files(local):
            present.add(key)
            if key in done:
                continue
            try:
                st = path.stat()
                size = st.st_size
                if src is None:
                    private = not st.st_mode & 0o004
                    result = dest.send_side(rel, path, private)
                    report.side += result == "stored"
                else:
                    result = dest.send(src, rel, path)
                    result = result if result in ("duplicate", "superseded") else "stored"
                    setattr(report, result, getattr(report, result) + 1)
                report.bytes += size if result == "stored" else 0
                done[key] = result
            except FileNotFoundError:
                report.vanished += 1
                continue
            except DataError as e:
                report.rejected.append(str(e))
                done[key] = "rejected"
            dirty += 1
            if progress is not None:
                progress(report.sent + report.side + len(report.rejected), rel)
            if dirty >= 64:
                save()
                dirty = 0
        if follow:
            report.new_epoch = _follow(local, dest)
        # Forget what is gone here (compacted away): the ledger stays as large as the database.
        # Only after a whole listing: a pass cut short has not seen every file.
        done = {k: v for k, v in done.items() if k in present}
    except Offline as e:
        report.offline = str(e)
    save()
    report.seconds = time.monotonic() - t0
    return report


def _follow(local: Database, dest: Destination) -> int | None:
    """A new local epoch when the destination's newest is not where our newest shared epoch goes
    (place.Central.epoch_for's rule: the newest begun no later than it, else the first)."""
    theirs = sorted(dest.epochs())
    mine = local.newest_shared_epoch()
    if not theirs or mine is None:  # no daemon's epoch here to follow with
        return None
    created = _float(local.epoch_info(mine).get("created"))
    goes_to = theirs[0][0]
    for ep, c in theirs:
        if c <= created:
            goes_to = ep
    if goes_to == theirs[-1][0]:
        return None
    return local.new_epoch(name=f"following {dest.name} epoch {theirs[-1][0]}")
