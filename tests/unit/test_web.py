"""The web UI without a browser: the flame graph's trees, the server's guard (token, Host, headers)
on a real uvicorn server over an empty database, and the committed bundle against its sources."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from cyclescope.app.stacks import diff_tree, flame_json, fold, named_arrays
from cyclescope.report.flame import fold_arrays

REPO = Path(__file__).resolve().parents[2]
TOKEN = "unit-test-token-0123456789"


def test_fold_sums_callees_into_callers() -> None:
    t = fold(Counter({("main", "a", "leaf"): 3, ("main", "b", "leaf"): 2, ("main",): 1}), "all")
    assert t["value"] == 6
    (main,) = t["children"]
    assert main["name"] == "main" and main["value"] == 6
    kids = {k["name"]: k for k in main["children"]}
    assert kids["a"]["value"] == 3 and kids["b"]["value"] == 2
    assert kids["a"]["children"][0] == {"name": "leaf", "value": 3, "children": []}


def test_fold_takes_stacks_deeper_than_the_recursion_limit() -> None:
    deep = tuple(f"f{i}" for i in range(5000))
    t = fold(Counter({deep: 1}), "all")
    n, depth = t, 0
    while n["children"]:
        n, depth = n["children"][0], depth + 1
    assert depth == 5000


def test_diff_tree_colours_only_significant_changes() -> None:
    a = Counter({("main", "steady"): 8000, ("main", "grows"): 2000, ("main", "same"): 500})
    b = Counter({("main", "steady"): 2000, ("main", "grows"): 8000, ("main", "same"): 505})
    t = diff_tree(a, b, alpha=0.05, min_change=0.001)
    assert t["totals"] == {"a": 10500, "b": 10505}
    (main,) = t["children"]
    kids = {k["name"]: k for k in main["children"]}
    assert kids["grows"]["delta"] > 0 and kids["steady"]["delta"] < 0
    assert kids["same"]["delta"] == 0 and main["delta"] == 0
    assert kids["grows"]["a"] == 2000 and kids["grows"]["value"] == 8000
    assert abs(kids["grows"]["share_b"] - 8000 / 10505) < 1e-9


def test_diff_tree_keeps_what_only_a_had_with_no_width() -> None:
    t = diff_tree(Counter({("main", "gone"): 1000, ("main", "x"): 1000}), Counter({("main", "x"): 1000}))
    kids = {k["name"]: k for k in t["children"][0]["children"]}
    assert kids["gone"]["value"] == 0 and kids["gone"]["a"] == 1000 and kids["gone"]["delta"] < 0


def _walk(t: dict) -> list[dict]:
    out, todo = [], [t]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(n["children"])
    return out


def _pruned(named: Counter[tuple[str, ...]], max_nodes: int) -> dict:
    names, splits, frames, weights = named_arrays([named])
    return flame_json(fold_arrays(splits, frames, weights), names, max_nodes)


def test_the_flame_tree_keeps_the_widest_frames_as_one_tree() -> None:
    # 1,000 distinct stacks main -> fI -> gI (I samples each): 2,001 frames below the root.
    named = Counter({("main", f"f{i}", f"g{i}"): i for i in range(1, 1001)})
    total = sum(named.values())
    p = _pruned(named, 101)
    nodes = _walk(p)
    assert len(nodes) == 101
    assert p["value"] == total and p["children"][0]["value"] == total  # callers keep their full width
    kept = {n["name"] for n in nodes}
    # below main, the widest: f1000, g1000, f999, g999, ... f952, g952, and of f951 and g951 (tied at
    # the cut) the caller
    assert {"f1000", "g1000", "f952", "g952", "f951"} <= kept and not {"g951", "f950"} & kept
    assert all("f" + n[1:] in kept for n in kept if n.startswith("g"))  # no callee without its caller
    assert p["pruned"] == {"frames": 2002 - 101, "of": 2002, "largest": 951.0}
    names = [k["name"] for k in p["children"][0]["children"]]
    assert names == sorted(names)  # children in name order: the page does not sort them again


def test_a_small_tree_is_whole_and_the_diff_tree_pruned_by_either_side() -> None:
    t = _pruned(Counter({("main", "a"): 3}), 10)
    assert t["pruned"]["frames"] == 0 and t["children"][0]["children"][0]["name"] == "a"
    a = Counter({("main", f"only_a{i}"): 100 + i for i in range(50)})
    b = Counter({("main", f"only_b{i}"): 1 for i in range(50)})
    d = diff_tree(a, b, max_nodes=12)
    names = {n["name"] for n in _walk(d)}
    assert len(names) == 12 and "only_a49" in names  # width 0 in B, kept by its width in A


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import uvicorn

    from cyclescope.db.layout import Database
    from cyclescope.web.server import Site, make_app

    db = Database.create_or_open(tmp_path_factory.mktemp("web") / "db")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(Site(db, TOKEN, port=port)), log_level="error", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(10)
    sock.close()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a: object, **k: object) -> None:
        return None


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_token_is_traded_for_a_cookie_and_taken_out_of_the_url(server: str) -> None:
    status, headers, _ = get(server + "/?token=" + TOKEN + "&x=1")
    assert status == 303 and headers["location"] == "/?x=1"
    cookie = headers["set-cookie"]
    assert f"={TOKEN}" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    name = cookie.split("=", 1)[0]
    status, headers, body = get(server + "/", {"Cookie": f"{name}={TOKEN}"})
    assert status == 200 and b"/static/app.js" in body
    assert "default-src 'self'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"


def test_without_the_token_nothing_is_served(server: str) -> None:
    for path in ("/", "/static/app.js", "/api/epochs", "/api/overview"):
        status, headers, body = get(server + path)
        assert status == 403 and b"access token" in body, path
        assert "content-security-policy" in headers
    assert get(server + "/api/epochs", {"Authorization": "token wrong-token-wrong-token"})[0] == 403
    assert get(server + "/api/epochs", {"Authorization": "Bearer " + TOKEN})[0] == 200


def test_a_foreign_host_name_is_refused_on_loopback(server: str) -> None:
    status, _, body = get(server + "/api/epochs", {"Authorization": "token " + TOKEN, "Host": "attacker.example:80"})
    assert status == 403 and b"loopback" in body
    assert get(server + "/api/epochs", {"Authorization": "token " + TOKEN, "Host": "localhost"})[0] == 200


def test_errors_are_one_line_json_with_a_status(server: str) -> None:
    auth = {"Authorization": "token " + TOKEN}
    status, _, body = get(server + "/api/listing", auth)
    assert status == 400 and "name" in json.loads(body)["error"]
    status, _, body = get(server + "/api/overview?limit=x", auth)
    assert status == 400 and "limit" in json.loads(body)["error"]
    status, _, body = get(server + "/api/download/svg", auth)
    assert status == 404 and "no such download" in json.loads(body)["error"]
    status, _, body = get(server + "/api/epochs", auth)
    assert status == 200 and json.loads(body)["epochs"] == []


def test_the_bundle_was_built_from_the_sources_in_the_repository() -> None:
    """scripts/build-web records its sources' digest: editing frontend/ without rebuilding fails here."""
    front = REPO / "frontend"
    files = [*sorted((front / "src").rglob("*")), front / "package-lock.json"]
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(front)).encode() + b"\0" + f.read_bytes())
    recorded = (REPO / "src/cyclescope/web/static/SOURCES.sha256").read_text().strip()
    assert recorded == h.hexdigest(), "frontend/ changed since the bundle was built: run scripts/build-web"
