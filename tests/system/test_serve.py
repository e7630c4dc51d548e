"""`cyclescope serve` in a real browser: headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium) against the server started by its command, on a database recorded for real.

Screenshots of each view go to test-artifacts/serve/ (docs/web.md shows copies of them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.system.helpers import cs, env, prof_json

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "serve"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def start_server(db: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", "cyclescope", "serve", "--db", str(db), "--port", "0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert p.stdout is not None
    url = p.stdout.readline().strip()
    assert url.startswith("http://"), (url, p.stderr.read() if p.poll() is not None and p.stderr else "")
    return p, url


def stop(p: subprocess.Popen[str]) -> str:
    p.terminate()
    try:
        _, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    return err


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Epoch 1: `shift a` (steady() 80%, grows() 20%); epoch 2: `shift b` (the reverse); with stacks."""
    d = tmp_path_factory.mktemp("serve")
    exe = d / "shift"
    subprocess.run(["gcc", "-O2", "-g", "-fno-omit-frame-pointer", "-o", str(exe),
                    str(Path(__file__).parents[1] / "programs" / "shift.c")], check=True)
    db = d / "db"
    for mode in ("a", "b"):
        cs("record", "--db", str(db), "-q", "-F", "2000", "-g", "fp", "--", str(exe), mode, "150000")
    return db


@pytest.fixture(scope="module")
def server(recorded: Path) -> Iterator[str]:
    p, url = start_server(recorded)
    yield url
    stop(p)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/setup installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    o = webdriver.ChromeOptions()
    o.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="cyclescope-chromium-")
    # As root, and without the background connections this machine's closed network refuses.
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1280,1000", f"--user-data-dir={profile}"):
        o.add_argument(a)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=o)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def open_view(drv: Any, base: str, hash_: str, timeout: float = 60) -> None:
    """Go to a view and wait until it has rendered (main's aria-busy cleared)."""
    from selenium.webdriver.support.ui import WebDriverWait

    before = drv.execute_script("return document.body && document.body.dataset.rendered || ''")
    drv.get(base + "/#/" + hash_)
    WebDriverWait(drv, timeout).until(lambda d: d.execute_script(
        "const m = document.querySelector('main');"
        "return m && m.getAttribute('aria-busy') === 'false' && document.body.dataset.rendered !== arguments[0]",
        before) or False)


def screenshot(drv: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    drv.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def base_of(url: str) -> str:
    return url.split("/?", 1)[0]


def logged_in(drv: Any, url: str) -> str:
    drv.get(url)  # the token in the URL is traded for a cookie
    return base_of(url)


def test_the_overview_lists_the_hot_procedure(server: str, browser: Any, recorded: Path) -> None:
    base = logged_in(browser, server)
    open_view(browser, base, "overview?epochs=1")
    first = browser.find_element("css selector", "table.procs tbody tr a.proc").text
    top = prof_json(recorded, "--epoch", "1")["rows"][0]["procedure"]
    assert first == top
    assert "token" not in browser.current_url  # taken out of the address bar
    assert browser.find_elements("css selector", "#timeline canvas")  # the samples over time, drawn
    # From the collector's timeline: CPUs busy per process, the recorded program among them.
    assert "CPUs busy over time, by process" in browser.find_element("css selector", "main").text
    legend = [e.text for e in browser.find_elements("css selector", "#timeline .u-legend .u-label")]
    assert "total" in legend and "shift" in legend, legend
    screenshot(browser, "overview")


def test_a_frame_opens_its_listing_with_the_hot_instruction_first(server: str, browser: Any, recorded: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    base = logged_in(browser, server)
    open_view(browser, base, "flame?epochs=2")
    screenshot(browser, "flame")
    frame = browser.find_element("css selector", '#flame g.frame[name="grows"] rect')
    ActionChains(browser).double_click(frame).perform()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 60).until(lambda d: "#/proc" in d.current_url and d.execute_script(
        "const m = document.querySelector('main'); return m && m.getAttribute('aria-busy') === 'false'"))
    assert browser.find_element("css selector", "main h1").text == "grows"
    doc = json.loads(cs("list", "--db", str(recorded), "--epoch", "2", "--json", "grows").stdout)
    hottest = max(doc["instructions"], key=lambda i: i["samples"]["cpu-clock"])
    first = browser.find_element("css selector", "table.hot tbody tr td a.addr").text
    assert int(first, 16) == hottest["address"]
    # calc's columns and the control-flow graph arrive after the listing.
    WebDriverWait(browser, 120).until(lambda d: d.find_elements("css selector", ".cfg svg")
                                      or d.find_elements("css selector", ".calc .error"))
    assert browser.find_elements("css selector", "pre.figure4"), "calc's summary is missing"
    screenshot(browser, "procedure")


def test_search_marks_the_matching_frames_and_zoom_keeps_them(server: str, browser: Any, recorded: Path) -> None:
    base = logged_in(browser, server)
    open_view(browser, base, "flame?epochs=2")
    box = browser.find_element("css selector", "#search")
    box.send_keys("^grow")

    def marked() -> set[str]:
        return {str(g.get_attribute("name")) for g in browser.find_elements("css selector", "#flame g.frame.match")}

    assert marked() == {"grows"}
    share = browser.find_element("css selector", "#searchinfo").text
    grows = next(r for r in prof_json(recorded, "--epoch", "2")["rows"] if r["procedure"] == "grows")
    assert share.startswith("matches "), share
    assert abs(float(share.split()[1].rstrip("%")) - grows["percent"]["cpu-clock"]) < 2.0, share
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).click(browser.find_element("css selector", '#flame g.frame[name="main"] rect')).perform()
    assert browser.find_element("css selector", "#details strong").text == "main"  # zoomed in on main
    assert marked() == {"grows"}
    box.clear()
    box.send_keys("grows(")  # not a regular expression: taken literally, matches nothing, no error
    assert marked() == set()
    assert browser.find_element("css selector", "#searchinfo").text == "matches 0.00% of the samples"


def test_the_diff_view_colours_the_changed_function(server: str, browser: Any) -> None:
    base = logged_in(browser, server)
    open_view(browser, base, "diff?a=1&b=2")
    screenshot(browser, "diff")

    def fill(name: str) -> str:
        el = browser.find_element("css selector", f'#diffflame g.frame[name="{name}"] rect')
        return str(el.get_attribute("fill"))

    assert fill("grows").startswith("rgba(220, 40, 40"), fill("grows")  # more of B's samples: red
    assert fill("steady").startswith("rgba(40, 90, 220"), fill("steady")  # fewer: blue
    assert fill("main") == "var(--neutral)"  # the whole program: the same share in both
    flagged = [e.text for e in browser.find_elements("css selector", "main table.data tbody tr td:first-child")]
    assert "grows" in flagged and "steady" in flagged


def test_every_other_view_renders(server: str, browser: Any) -> None:
    base = logged_in(browser, server)
    for name, view in (("stats", "stats"), ("values", "values"), ("icicle", "flame?epochs=2&icicle=1"),
                       ("sandwich", "flame?epochs=2&sandwich=main")):
        open_view(browser, base, view)
        screenshot(browser, name)
        errors = [e.text for e in browser.find_elements("css selector", "main .error")]
        if name == "values":  # recorded without --values: the view says so
            assert errors and "no value samples" in errors[0]
        else:
            assert not errors, (name, errors)
    # Script errors fail; a refused request (the values view's 404) is shown on the page, as checked.
    severe = [m for m in browser.get_log("browser") if m["level"] == "SEVERE" and m.get("source") != "network"]
    assert not severe, severe


def test_python_functions_show_by_line_in_the_flame_graph(browser: Any, tmp_path: Path) -> None:
    """A CPython program recorded through the eBPF path (its Python frames read by the program):
    the flame graph offers "Python lines", and then names each Python frame with its line."""
    from cyclescope.collect.ebpf import BpfUnavailable, load

    try:
        load(1 << 10, 0).close()
    except (BpfUnavailable, OSError) as e:
        pytest.skip(f"the eBPF path cannot run here: {e}")
    script = Path(__file__).parents[1] / "programs" / "pyshares.py"
    db = tmp_path / "db"
    cs("record", "--db", str(db), "-q", "--collector", "bpf", "--no-loop-counts", "-g", "fp", "--",
       sys.executable, str(script), "60", timeout=300)
    p, url = start_server(db)
    try:
        base = logged_in(browser, url)
        open_view(browser, base, "flame")
        names = {str(g.get_attribute("name")) for g in browser.find_elements("css selector", "#flame g.frame")}
        assert f"py::seventy:{script}" in names, sorted(names)[:20]
        from selenium.webdriver.support.ui import WebDriverWait

        before = browser.execute_script("return document.body.dataset.rendered")
        browser.find_element("css selector", "#python-lines").click()
        WebDriverWait(browser, 60).until(lambda d: d.execute_script(
            "const m = document.querySelector('main');"
            "return m && m.getAttribute('aria-busy') === 'false' && document.body.dataset.rendered !== arguments[0]",
            before) or False)
        assert "lines=1" in browser.current_url
        screenshot(browser, "flame-python-lines")
        names = {str(g.get_attribute("name")) for g in browser.find_elements("css selector", "#flame g.frame")}
        text = script.read_text().splitlines()
        first = text.index("def seventy(n: int) -> int:") + 1
        lines = {int(n.rsplit(":", 1)[1]) for n in names if n.startswith(f"py::seventy:{script}:")}
        assert lines and lines <= set(range(first, first + 5)), (lines, first)
        assert f"py::seventy:{script}" not in names
        assert browser.find_element("css selector", "#python-lines").text == "Python functions"
    finally:
        stop(p)


def request(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_a_request_without_the_token_is_refused(server: str) -> None:
    base = base_of(server)
    token = server.split("token=", 1)[1]
    assert request(base + "/")[0] == 403
    assert request(base + "/api/overview")[0] == 403
    assert request(base + "/api/overview?token=" + "x" * len(token))[0] == 403
    status, body = request(base + "/api/epochs", {"Authorization": "token " + token})
    assert status == 200 and json.loads(body)["epochs"]
    # A page elsewhere that rebinds its own name to 127.0.0.1 sends its own Host: refused.
    assert request(base + "/api/epochs", {"Authorization": "token " + token, "Host": "evil.example"})[0] == 403


def _listening(port: int) -> list[str]:
    """The local addresses listening on ``port`` (IPv4, from /proc/net/tcp)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            out.append(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
    return out


def test_a_bind_beyond_loopback_needs_the_flag_and_warns(server: str, recorded: Path) -> None:
    port = int(re.search(r":(\d+)/", server).group(1))  # type: ignore[union-attr]
    assert _listening(port) == ["127.0.0.1"]
    p, url = start_server(recorded, "--host", "0.0.0.0")
    try:
        port2 = int(re.search(r":(\d+)/", url).group(1))  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while not _listening(port2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening(port2) == ["0.0.0.0"]
    finally:
        err = stop(p)
    assert "warning: listening on 0.0.0.0, not loopback" in err


def test_downloads_are_what_export_writes(server: str, recorded: Path) -> None:
    base = base_of(server)
    token = server.split("token=", 1)[1]
    status, body = request(base + "/api/download/collapsed?epochs=2", {"Authorization": "token " + token})
    assert status == 200
    assert body == cs("export", "collapsed", "--db", str(recorded), "--epoch", "2").stdout
