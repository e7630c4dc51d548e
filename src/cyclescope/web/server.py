"""The HTTP side of `cyclescope serve`: a Starlette application whose JSON routes call the same
application functions as the CLI (cyclescope.app), and the bundled page that draws them.

Security, as Jupyter does it: a random token, given once in the URL printed at start, is traded for
an HTTP-only same-site cookie; every request without one of the two is refused. Bound to loopback,
the server also refuses Host headers that are not loopback names (a page elsewhere cannot reach it
by DNS rebinding). Value hotlists are read with the serving user's own permissions: a user sees the
value files the file system lets them read, no more (db.values)."""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from cyclescope.errors import CycleScopeError, NotFoundError, UsageError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.app.stacks import SelectedArrays
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Engine, Selection
    from cyclescope.fleet.place import Central

STATIC = Path(__file__).parent / "static"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
SECURITY_HEADERS = {
    # The page's own script and styles only; the graph layout engine (Graphviz in WebAssembly) needs
    # 'wasm-unsafe-eval'. Nothing is fetched from elsewhere.
    "Content-Security-Policy": ("default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; "
                                "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
                                "connect-src 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STACK_FORMATS = {"collapsed": ("text/plain; charset=utf-8", "txt"),
                 "speedscope": ("application/json", "speedscope.json"),
                 "pprof": ("application/octet-stream", "pb.gz")}


@dataclass
class Site:
    """What the routes share: the database, the token, and the symbol tables of earlier requests."""

    db: Database
    token: str
    loopback: bool = True
    port: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # one query at a time (one DuckDB connection)
    ingest_token: str | None = None  # `serve --ingest`: hosts ship files with this token (and only with it)
    engine: Engine | None = None  # `serve --engine dask`: where counts and stacks are summed
    central: Central | None = None  # `serve --ingest`: where shipped files are filed (its placements cached)
    _sym: Symbolizer | None = None

    @property
    def cookie(self) -> str:
        return f"cyclescope-token-{self.port}"

    def profile(self, sel: Selection, warnings: list[str] | None = None) -> Profile:
        """The selection opened afresh (the daemon may have written since), its images' symbol
        tables kept across requests (images are immutable under their key)."""
        from cyclescope.app.profile import open_profile
        from cyclescope.binaries.symbolize import Symbolizer

        if self._sym is None:
            self._sym = Symbolizer(self.db)
        return open_profile(self.db, sel, warnings.append if warnings is not None else _drop, self._sym, self.engine)


def _drop(_: str) -> None:
    pass


def selection(q: Any, prefix: str = "") -> Selection:
    """A Selection from query parameters: epochs (default all), host, process, image, event (each
    comma-separated)."""
    from cyclescope.db.query import Selection

    def many(name: str) -> tuple[str, ...]:
        return tuple(x for v in q.getlist(prefix + name) for x in v.split(",") if x)

    return Selection(epochs=q.get(prefix + "epochs") or "all", hosts=many("host"), processes=many("process"),
                     images=many("image"), events=many("event"))


# --- security --------------------------------------------------------------------------------------

def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth.split(None, 1)[1].strip() if auth.lower().startswith(("token ", "bearer ")) and " " in auth else None


def _authorized(site: Site, request: Request) -> bool:
    if request.url.path.startswith("/api/ingest"):
        # Shipping hosts write with the ingest token, in a header; a viewer's token does not write.
        given, want = [_bearer(request)], site.ingest_token
    else:
        given = [request.query_params.get("token"), request.cookies.get(site.cookie), _bearer(request)]
        want = site.token
    return want is not None and any(g is not None and hmac.compare_digest(g.encode(), want.encode()) for g in given)


def _host_allowed(site: Site, request: Request) -> bool:
    if not site.loopback:
        return True
    host = request.headers.get("host", "")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name in LOOPBACK_NAMES


class Guard:
    """ASGI middleware: the token (or its cookie) on every request, loopback Host names when bound to
    loopback, and the security headers on every response."""

    def __init__(self, app: Callable[..., Awaitable[None]], site: Site) -> None:
        self.app = app
        self.site = site

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        site = self.site
        resp: Response | None = None
        if not _host_allowed(site, request):
            resp = PlainTextResponse("cyclescope serve: this server answers to loopback names only "
                                     "(127.0.0.1, localhost)\n", status_code=403)
        elif not _authorized(site, request):
            resp = PlainTextResponse("cyclescope serve: access token missing or wrong: open the URL the server "
                                     "printed when it started (http://HOST:PORT/?token=...)\n", status_code=403)
        elif request.query_params.get("token") is not None and request.method == "GET" \
                and not request.url.path.startswith("/api/"):
            # Trade the token in the URL for a cookie, and take it out of the address bar and history.
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            url = request.url.path + ("?" + urllib.parse.urlencode(rest) if rest else "")
            resp = RedirectResponse(url, status_code=303)
            resp.set_cookie(site.cookie, site.token, httponly=True, samesite="strict", path="/")

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                have = {k.lower() for k, _ in headers}
                for k, v in SECURITY_HEADERS.items():
                    if k.lower().encode() not in have:
                        headers.append((k.lower().encode(), v.encode()))
                message = {**message, "headers": headers}
            await send(message)

        if resp is not None:
            await resp(scope, receive, send_with_headers)
        else:
            await self.app(scope, receive, send_with_headers)


# --- routes ----------------------------------------------------------------------------------------

def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)


def _errors(fn: Callable[[Site, Request], Any]) -> Callable[[Request], Any]:
    """A route body run under the site's lock, its CycleScopeErrors as a JSON error with the same
    one-line message the CLI prints."""

    def route(request: Request) -> Any:
        site: Site = request.app.state.site
        t0 = time.perf_counter()
        try:
            with site.lock:
                t1 = time.perf_counter()
                out = fn(site, request)
                resp = out if isinstance(out, Response) else _json(out)
        except NotFoundError as e:
            resp = _json({"error": str(e)}, 404)
        except (UsageError, ValueError) as e:
            resp = _json({"error": str(e)}, 400)
        except CycleScopeError as e:
            resp = _json({"error": str(e)}, 422)
        else:
            # The server's share of a request's time, for the browser's resource timing (bench/serve.py):
            # waiting for the lock, then the work and the JSON.
            resp.headers["Server-Timing"] = (f"wait;dur={(t1 - t0) * 1e3:.1f}, "
                                             f"app;dur={(time.perf_counter() - t1) * 1e3:.1f}")
        return resp

    return route


def _int(q: Any, name: str, default: int, lo: int = 0, hi: int = 1 << 30) -> int:
    raw = q.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise UsageError(f"{name} must be a whole number, not {raw!r}") from None
    if not lo <= v <= hi:
        raise UsageError(f"{name} must be between {lo} and {hi}")
    return v


def _float(q: Any, name: str, default: float, lo: float, hi: float) -> float:
    raw = q.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise UsageError(f"{name} must be a number, not {raw!r}") from None
    if not lo <= v <= hi:
        raise UsageError(f"{name} must be between {lo:g} and {hi:g}")
    return v


def epochs_route(site: Site, request: Request) -> Any:
    from cyclescope.app.overview import epochs_of

    return {"db": str(site.db.root), "epochs": [vars(e) for e in epochs_of(site.db)]}


def _processes_over_time(p: Profile) -> dict[str, Any] | None:
    """The selection's timeline per process (about 200 steps), or None where it has none (older
    recordings): the page then draws the samples of each segment."""
    from cyclescope.app.timeline import timeline

    try:
        return timeline(p, "process", None, top=6, buckets=200).to_json()
    except NotFoundError:
        return None


def overview_route(site: Site, request: Request) -> Any:
    from cyclescope.app.overview import overview

    limit = _int(request.query_params, "limit", 200, 1)
    warnings: list[str] = []
    p = site.profile(selection(request.query_params), warnings)
    out = overview(p).to_json(limit=limit)
    out["processes_over_time"] = _processes_over_time(p)
    out["db"] = str(site.db.root)
    out["warnings"] = warnings
    return out


def _stacks(site: Site, q: Any, prefix: str = "") -> tuple[Profile, SelectedArrays, str]:
    from cyclescope.app.stacks import select_stack_arrays

    sel = selection(q, prefix)
    p = site.profile(sel)
    st = select_stack_arrays(p, list(sel.images), list(sel.events))
    event = q.get("event") or (st.events[0] if st.events else "")
    return p, st, event


def flame_route(site: Site, request: Request) -> Any:
    from cyclescope.app.stacks import FLAT_NOTE, MAX_FLAME_NODES, flame_tree

    q = request.query_params
    p, st, event = _stacks(site, q)
    return {"event": event, "events": st.events, "flat": st.flat, "note": FLAT_NOTE if st.flat else None,
            "skipped": st.corrupt, "python": any(info.kind == "python" for info in st.infos.values()),
            "tree": flame_tree(p, st, event, focus=q.get("focus") or None,
                               max_nodes=_int(q, "max_nodes", MAX_FLAME_NODES, 100, 1_000_000),
                               python_lines=q.get("lines") == "1")}


def flame_diff_route(site: Site, request: Request) -> Any:
    from cyclescope.app.stacks import diff_flame_tree

    q = request.query_params
    sides = []
    event = q.get("event")
    for side in ("a", "b"):
        p, st, ev = _stacks(site, q, side + ".")
        event = event or ev
        sides.append((p, st))
    alpha = _float(q, "alpha", 0.05, 1e-9, 0.999)
    min_change = _float(q, "min_change", 0.1, 0, 100) / 100
    return {"event": event, "tree": diff_flame_tree(sides, event or "", alpha, min_change), "alpha": alpha,
            "min_change": min_change}


def diff_route(site: Site, request: Request) -> Any:
    from cyclescope.app.compare import set_counts
    from cyclescope.report.compare import build_diff

    q = request.query_params
    counts = []
    names = []
    event = q.get("event")
    for side in ("a", "b"):
        sel = selection(q, side + ".")
        ev, c = set_counts(site.profile(sel), event, False)
        event = event or ev
        counts.append(c)
        names.append(sel.epochs + (f"@{','.join(sel.hosts)}" if sel.hosts else ""))
    alpha = _float(q, "alpha", 0.05, 1e-9, 0.999)
    return build_diff(event or "?", names[0], names[1], counts[0], counts[1], alpha,
                      _float(q, "min_change", 0.1, 0, 100) / 100).to_json()


def listing_route(site: Site, request: Request) -> Any:
    from cyclescope.app.procedures import make_listing, resolve_target
    from cyclescope.app.values import listing_values

    q = request.query_params
    name = q.get("name")
    if not name:
        raise UsageError("name: which procedure (a name, or 0xSTART-0xEND)")
    sel = selection(q)
    p = site.profile(sel)
    target, notes = resolve_target(p, name, list(sel.images))
    lst = make_listing(p, target, [], True, notes)
    cols, cells, vnotes = listing_values(p, target.info.key, target.start, target.end)
    lst.value_columns, lst.values = cols, cells
    out = lst.to_json()
    del out["instructions"]  # the rows hold them (with the source lines between): the page reads those
    out["rows"] = [_row(r, cells) for r in lst.rows]
    out["value_columns"] = cols
    out["value_notes"] = vnotes
    return out


def _row(r: Any, cells: dict[int, list[str]]) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": r.kind, "text": r.text}
    if r.address is not None:
        d["address"] = r.address
    if r.counts:
        d["counts"] = list(r.counts)
    if r.pos is not None:
        d["file"], d["line"] = r.pos.file, r.pos.line
    if r.note:
        d["note"] = r.note
    if r.kind == "insn" and r.address in cells:
        d["values"] = cells[r.address]
    return d


def calc_route(site: Site, request: Request) -> Any:
    from cyclescope.app.calc import calc_target, cycles_event
    from cyclescope.app.procedures import resolve_target
    from cyclescope.report.calc import calc_to_json, summarize, summary_lines

    q = request.query_params
    name = q.get("name")
    if not name:
        raise UsageError("name: which procedure (a name, or 0xSTART-0xEND)")
    sel = selection(q)
    p = site.profile(sel)
    ev = cycles_event(p, q.get("cycles_event"))
    target, notes = resolve_target(p, name, list(sel.images))
    c = calc_target(p, target, ev)
    c.notes = notes + c.notes
    s = summarize(c)
    out = calc_to_json(c, s)
    out["summary_text"] = summary_lines(c, s)
    return out


def invariants_route(site: Site, request: Request) -> Any:
    from cyclescope.app.values import invariants_report, open_values

    q = request.query_params
    sel = selection(q)
    p = site.profile(sel)
    vs, modules = open_values(p)
    report = invariants_report(p, vs, modules, list(sel.images), _float(q, "min_prob", 0.6, 0.01, 1),
                            _int(q, "min_vtot", 30, 1), _float(q, "min_share", 1.0, 0, 100) / 100,
                            _int(q, "limit", 50, 0))
    return report.to_json()


def specialize_route(site: Site, request: Request) -> Any:
    from cyclescope.analysis.goal import PHI_SHARE
    from cyclescope.app.calc import cycles_event
    from cyclescope.app.specialize import specialize, specialize_targets

    q = request.query_params
    sel = selection(q)
    p = site.profile(sel)
    ev = cycles_event(p, q.get("cycles_event"))
    targets = specialize_targets(p, ev, q.get("name") or None, list(sel.images), _int(q, "limit", 5, 0))
    return specialize(p, targets, ev, None, _float(q, "phi", 100 * PHI_SHARE, 0, 100) / 100,
                      _int(q, "min_values", 30, 1)).to_json()


def stats_route(site: Site, request: Request) -> Any:
    from dataclasses import replace

    from cyclescope.app.compare import sample_sets, set_counts
    from cyclescope.errors import DataError
    from cyclescope.report.compare import build_stats

    q = request.query_params
    by = q.get("by") or "epoch"
    if by not in ("epoch", "host"):
        raise UsageError("by: epoch or host")
    base = selection(q)
    sets = sample_sets([site.db], base.epochs, by, list(base.hosts), replace(base, events=()))
    event = q.get("event")
    names, per_set, left_out = [], [], []
    for name, _, sel in sets:
        try:
            ev, counts = set_counts(site.profile(sel), event, q.get("images") == "1")
        except DataError as e:
            left_out.append(f"{name}: {e}")
            continue
        event = event or ev
        names.append(name)
        per_set.append(counts)
    if len(per_set) < 2:
        raise UsageError(f"stats needs at least two sample sets; found {len(per_set)} (by {by})")
    out = build_stats(event or "?", names, per_set, normalize=q.get("normalize") == "1").to_json()
    out["left_out"] = left_out
    return out


def download_route(site: Site, request: Request) -> Any:
    from cyclescope.app.stacks import export_stacks, select_stacks

    fmt = request.path_params["fmt"]
    if fmt not in STACK_FORMATS:
        raise NotFoundError(f"no such download: {fmt} (one of {', '.join(STACK_FORMATS)})")
    sel = selection(request.query_params)
    p = site.profile(sel)
    st = select_stacks(p, list(sel.images), list(sel.events))
    data = export_stacks(p, fmt, st)
    kind, ext = STACK_FORMATS[fmt]
    eps = "-".join(map(str, p.profile_set.epochs[:1] + p.profile_set.epochs[-1:])) if p.profile_set.epochs else "none"
    return Response(data, media_type=kind,
                    headers={"Content-Disposition": f'attachment; filename="cyclescope-{eps}.{ext}"'})


async def ingest_route(request: Request) -> Response:
    """`serve --ingest`: one file of a host's database (the body), filed into this database
    (fleet/place.py). Query: host, database, epoch, created (the source epoch), path (the file's
    path under the host's directory, or symbols/NAME, binaries/NAME), sha256, private (binaries
    not readable by all at the host). Answers {"result": "stored" | "duplicate" | "superseded"};
    a malformed file or request gets 422/400 and a one-line error, and nothing is kept of it."""
    import asyncio
    import os
    import secrets

    from cyclescope.fleet.place import MAX_FILE_BYTES, Central, parse_source

    site: Site = request.app.state.site
    q = request.query_params
    rel, sha = q.get("path", ""), q.get("sha256")
    tmp = site.db.root / f".tmp-ingest-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        size = 0
        with open(tmp, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    return _json({"error": f"{rel}: larger than {MAX_FILE_BYTES >> 20} MiB"}, 413)
                f.write(chunk)

        def place() -> str:
            if site.central is None:
                site.central = Central(site.db)
            central = site.central
            if rel.startswith(("symbols/", "binaries/")):
                return central.place_side(rel, tmp, private=q.get("private") == "1")
            src = parse_source(q.get("host", ""), q.get("database", ""), q.get("epoch", ""), q.get("created", ""))
            return central.place(src, rel, tmp, sha)

        try:
            result = await asyncio.to_thread(place)
        except UsageError as e:
            return _json({"error": str(e)}, 400)
        except CycleScopeError as e:
            return _json({"error": str(e)}, 422)
        return _json({"result": result})
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def ingest_epochs_route(request: Request) -> Response:
    """The epochs of this database with their creation times: a shipping host follows them."""
    site: Site = request.app.state.site
    db = site.db
    return _json({"epochs": [{"id": e, "created": db.epoch_info(e).get("created")} for e in db.epochs()]})


def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html")


def make_app(site: Site) -> Any:
    """The ASGI application of ``site``."""
    api = [
        ("/api/epochs", epochs_route), ("/api/overview", overview_route), ("/api/flame", flame_route),
        ("/api/flame/diff", flame_diff_route), ("/api/diff", diff_route), ("/api/listing", listing_route),
        ("/api/calc", calc_route), ("/api/invariants", invariants_route),
        ("/api/specialize", specialize_route), ("/api/stats", stats_route),
        ("/api/download/{fmt}", download_route),
    ]
    routes = [Route(path, _errors(fn)) for path, fn in api]
    if site.ingest_token is not None:
        routes.append(Route("/api/ingest", ingest_route, methods=["POST"]))
        routes.append(Route("/api/ingest/epochs", ingest_epochs_route))
    routes.append(Route("/", index))
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        routes.append(Route(f"/static/{name}", _static(name, kind)))
    app = Starlette(routes=routes)
    app.state.site = site
    return Guard(app, site)


def _static(name: str, kind: str) -> Callable[[Request], Response]:
    def serve(request: Request) -> Response:
        return FileResponse(STATIC / name, media_type=kind)

    return serve
