"""The live dashboard of `pagedlm serve`: /dashboard, /dashboard/state, /dashboard/events,
`pagedlm top`, the Grafana dashboard's metrics, and a real browser on the page.

The server here has a small KV cache (48 blocks of 16 tokens), so that requests sharing a
prefix share blocks, n > 1 forks, and a burst gets preempted.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY, TINY_ARGS, TINY_NAME, ServerProcess, _start

REPO = Path(__file__).resolve().parents[2]
STATES = ("free", "evictable", "owned", "shared", "copying", "reserved")
# Tiny Llama: 2 layers x 2 KV heads x 16 dims x K,V x float32 x 16 tokens = 8 KiB a block.
KV_MEMORY = "384K"


@pytest.fixture(scope="module")
def dash_server(tmp_path_factory, tiny_model_dir) -> Iterator[ServerProcess]:
    args = list(TINY_ARGS)
    args[args.index("--kv-cache-memory") + 1] = KV_MEMORY
    args[args.index("--max-model-len") + 1] = "640"
    yield from _start(tmp_path_factory, "dashboard", [
        tiny_model_dir, *args, "--served-model-name", TINY_NAME, "--max-num-seqs", "16",
        "--enable-prefix-caching"], api_key=API_KEY)


def _state(server: ServerProcess, **kw) -> dict:
    r = httpx.get(f"{server.url}/dashboard/state", headers=server.headers, timeout=30, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(server: ServerProcess, **body) -> dict:
    body = {"model": TINY_NAME, "temperature": 1.0, "ignore_eos": True, "seed": 1, **body}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _states(snapshot: dict) -> bytes:
    return base64.b64decode(snapshot["block_states"])


def _wait_idle(server: ServerProcess) -> dict:
    deadline = time.monotonic() + 30
    while True:
        state = _state(server)
        if not state["snapshot"]["sequences"]:
            return state
        assert time.monotonic() < deadline, state["snapshot"]["sequences"]
        time.sleep(0.1)


# ----- HTTP ---------------------------------------------------------------------------------


def test_every_dashboard_path_needs_the_key(dash_server):
    for path in ("/dashboard", "/dashboard/state", "/dashboard/events"):
        r = httpx.get(f"{dash_server.url}{path}", timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{dash_server.url}{path}?api_key=nope", timeout=30)
        assert wrong.status_code == 401, path
    # The query parameter is the dashboard's only: the API still wants the header.
    r = httpx.get(f"{dash_server.url}/v1/models?api_key={API_KEY}", timeout=30)
    assert r.status_code == 401


def test_the_page_is_one_self_contained_document(dash_server):
    r = httpx.get(f"{dash_server.url}/dashboard?api_key={API_KEY}", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "/*SCRIPT*/" not in page and "/*STYLE*/" not in page
    assert "window.pagedlmDashboard" in page and "<canvas" in page
    # Nothing fetched from elsewhere: no external script, stylesheet or font.
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet|https?://", page)


def test_state_matches_the_engine_while_requests_run(dash_server):
    idle = _wait_idle(dash_server)
    snap = idle["snapshot"]
    n = snap["stats"]["num_blocks_total"]
    assert len(_states(snap)) == n == sum(snap["counts"][s] for s in STATES)
    assert idle["info"]["model"] == TINY_NAME

    prompt = "A shared prefix that spans several blocks of the cache " * 4
    done = threading.Event()
    results = []

    def run():
        results.append(_complete(dash_server, prompt=prompt + " one", n=3, max_tokens=300))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    seen = None
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        snap = _state(dash_server)["snapshot"]
        rows = [r for r in snap["sequences"] if r["state"] == "running"]
        if len(rows) == 3:
            seen = snap
            break
        time.sleep(0.02)
    assert seen is not None, "never saw the three samples running"
    rows = seen["sequences"]
    assert len({r["request_id"] for r in rows}) == 1  # one request, three samples
    assert all(r["kind"] == "sample" and r["output_tokens"] >= 1 for r in rows)
    states = _states(seen)
    # The prompt's full blocks are shared by the three samples.
    shared = set(rows[0]["block_ids"]) & set(rows[1]["block_ids"]) & set(rows[2]["block_ids"])
    assert shared and all(states[b] & 7 == STATES.index("shared") for b in shared)
    refs = base64.b64decode(seen["ref_counts"])
    assert all(refs[b] == 3 for b in shared)
    held = {b for r in rows for b in r["block_ids"]}
    for b in held - shared:
        assert states[b] & 7 in (STATES.index("owned"), STATES.index("copying"))
    assert done.wait(120)
    after = _wait_idle(dash_server)["snapshot"]
    assert after["counts"]["owned"] == after["counts"]["shared"] == 0  # every block back


def test_events_stream_snapshots_and_stop_when_nobody_watches(dash_server):
    _wait_idle(dash_server)
    with httpx.stream("GET", f"{dash_server.url}/dashboard/events",
                      params={"api_key": API_KEY}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        events: list[tuple[str, dict]] = []
        done = threading.Event()

        def work():  # a few seconds of work for the tiny model (it preempts, too)
            threads = [threading.Thread(target=_complete, args=(dash_server,),
                                        kwargs=dict(prompt=f"stream me {i}", max_tokens=600))
                       for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done.set()

        worker = threading.Thread(target=work, daemon=True)
        name = None
        for line in lines:
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                if len(events) == 1:
                    worker.start()  # once the stream is open
                if done.is_set() and len(events) > 3:
                    break
        assert events[0][0] == "init" and events[0][1]["info"]["model"] == TINY_NAME
        snapshots = [d["snapshot"] for n, d in events[1:] if n == "update" and d["snapshot"]]
        busy = [s for s in snapshots if s["sequences"]]
        assert len(busy) >= 2, "no stream of snapshots while the request ran"
        steps = [s["step"] for s in busy]
        assert steps == sorted(steps) and steps[0] < steps[-1]
    worker.join(60)
    # The charts got the latencies the server measured from those streams.
    history = _state(dash_server)["history"]
    assert any(p["ttft_p50"] is not None for p in history)
    assert any(p["itl_p50"] is not None and p["itl_p99"] >= p["itl_p50"] for p in history)
    # The page is gone: the core builds no more snapshots, except the one asked for.
    time.sleep(0.5)  # the close reaches the core
    before = _state(dash_server)["snapshot"]["num_snapshots"]
    _complete(dash_server, prompt="nobody watches", max_tokens=200)
    after = _state(dash_server)["snapshot"]["num_snapshots"]
    assert after == before + 1


def test_preemption_shows_in_the_rows(dash_server):
    _wait_idle(dash_server)
    prompt = "Preempt me, please, with a long prompt " * 6
    threads = [threading.Thread(target=_complete, args=(dash_server,),
                                kwargs=dict(prompt=prompt + str(i), max_tokens=500), daemon=True)
               for i in range(6)]
    for t in threads:
        t.start()
    seen_preempted = False
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        snap = _state(dash_server)["snapshot"]
        if any(r["state"] == "preempted" and r["preemptions"] >= 1 for r in snap["sequences"]):
            seen_preempted = True
            assert snap["stats"]["num_preemptions"] >= 1
            break
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    assert seen_preempted


def test_disabled_dashboard_is_404(busy_server):
    for path in ("/dashboard", "/dashboard/state", "/dashboard/events"):
        assert httpx.get(f"{busy_server.url}{path}", timeout=30).status_code == 404


# ----- pagedlm top --------------------------------------------------------------------------


def _top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedlm.entrypoints.cli", "top", *args],
                          capture_output=True, text=True, timeout=60,
                          env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"}, cwd=REPO)


def test_top_prints_a_frame(dash_server):
    snap = _wait_idle(dash_server)["snapshot"]
    out = _top(dash_server.url, "--api-key", API_KEY, "--once")
    assert out.returncode == 0, out.stderr
    assert f"{snap['stats']['num_blocks_total']} KV blocks of 16 tokens" in out.stdout
    for name in STATES:
        assert f"{name} " in out.stdout
    assert "TTFT p50/p99" in out.stdout


def test_top_says_what_is_wrong(dash_server):
    out = _top(dash_server.url, "--once")
    assert out.returncode == 1 and "HTTP 401" in out.stdout and "API key" in out.stdout
    out = _top("http://127.0.0.1:9", "--once")
    assert out.returncode == 1 and "cannot reach" in out.stdout


# ----- Grafana ------------------------------------------------------------------------------


def test_grafana_dashboard_queries_metrics_the_server_exports(dash_server):
    board = json.loads((REPO / "docs" / "grafana" / "pagedlm.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    _complete(dash_server, prompt="metrics", max_tokens=4)
    exported = httpx.get(f"{dash_server.url}/metrics", headers=dash_server.headers,
                         timeout=30).text
    names = {line.split("{")[0].split(" ")[0] for line in exported.splitlines()
             if line and not line.startswith("#")}
    for expr in exprs:
        for metric in re.findall(r"pagedlm:[a-z0-9_]+", expr):
            assert metric in names, f"{metric} (in {expr!r}) is not exported"


# ----- a real browser -----------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium and its driver are not installed (Debian: apt-get install "
                    "chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1400",
                "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _js(browser, script: str):
    return browser.execute_script(script)


def test_browser_shows_blocks_and_requests(dash_server, browser, tmp_path):
    _wait_idle(dash_server)
    browser.get(f"{dash_server.url}/dashboard?api_key={API_KEY}")
    deadline = time.monotonic() + 30
    while not _js(browser, "return window.pagedlmDashboard && window.pagedlmDashboard.snapshot"):
        assert time.monotonic() < deadline, "the page got no snapshot"
        time.sleep(0.05)
    prefix = "All of these requests begin with the very same words, " * 3
    bodies = [dict(prompt=prefix + f"number {i}", n=3 if i == 0 else 1, max_tokens=400)
              for i in range(6)]
    threads = [threading.Thread(target=_complete, args=(dash_server,), kwargs=b, daemon=True)
               for b in bodies]
    for t in threads:
        t.start()
    seen = {"group": False, "shared_cell": False, "preempted_row": False, "consistent": 0}
    deadline = time.monotonic() + 90
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        page = _js(browser, """
            const d = window.pagedlmDashboard, snap = d.snapshot;
            const legend = {};
            document.querySelectorAll('#legend [data-state]').forEach(
                (e) => legend[e.dataset.state] = Number(e.querySelector('b').textContent.replace(/\\D/g, '')));
            const rows = [...document.querySelectorAll('#requests tbody tr[data-seq]')].map(
                (tr) => ({seq: tr.dataset.seq, state: tr.dataset.state}));
            const groups = [...document.querySelectorAll('#requests tbody tr.group')].map(
                (tr) => tr.textContent);
            // A shared block's cell, read back from the canvas.
            let sharedPixel = null, sharedInfo = null;
            const states = atob(snap.block_states);
            for (let b = 0; b < states.length; b++) {
                if ((states.charCodeAt(b) & 7) === 3) {
                    const c = d.cellOf(b);
                    sharedPixel = [...document.getElementById('blockmap').getContext('2d')
                        .getImageData(c.x, c.y, 1, 1).data];
                    sharedInfo = d.blockInfo(b);
                    break;
                }
            }
            return {legend, counts: d.counts(), rows, groups, sharedPixel, sharedInfo,
                    seqs: snap.sequences.map((r) => [r.seq_id, r.state])};""")
        if page["legend"] and all(page["legend"][s] == page["counts"][s] for s in STATES):
            seen["consistent"] += 1
        # The table shows exactly the snapshot's sequences with their states.
        assert sorted((r["seq"], r["state"]) for r in page["rows"]) == sorted(
            tuple(x) for x in page["seqs"])
        if any("3 samples" in g for g in page["groups"]):
            seen["group"] = True
        if page["sharedPixel"] is not None:
            r, g, b, a = page["sharedPixel"]
            assert a == 255 and r > 100 and b < 60  # amber: a shared cell
            info = page["sharedInfo"]
            assert info["state"] == "shared" and info["refCount"] >= 2
            assert len(info["owners"]) == info["refCount"] and info["tokensHeld"] > 0
            seen["shared_cell"] = True
        if any(r["state"] == "preempted" for r in page["rows"]):
            seen["preempted_row"] = True
        if all(seen[k] for k in ("group", "shared_cell", "preempted_row")) and seen["consistent"]:
            break
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert seen["group"] and seen["shared_cell"] and seen["preempted_row"], seen
    assert seen["consistent"] >= 1
    # When it is over the page shows an idle engine: no rows, no owned block.
    deadline = time.monotonic() + 30
    while True:
        idle = _js(browser, "return [document.querySelectorAll('#requests tbody tr').length,"
                            " window.pagedlmDashboard.counts().owned]")
        if idle == [0, 0]:
            break
        assert time.monotonic() < deadline, idle
        time.sleep(0.1)
    assert _js(browser, "return window.pagedlmDashboard.historyLength") >= 1
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


@pytest.fixture(scope="module")
def big_server(tmp_path_factory, tiny_model_dir) -> Iterator[ServerProcess]:
    """Over 100k KV blocks: block size 1 (512 bytes a block for the tiny model), 50 MiB."""
    args = list(TINY_ARGS)
    args[args.index("--kv-cache-memory") + 1] = "50M"
    yield from _start(tmp_path_factory, "dashboard-big", [
        tiny_model_dir, *args, "--served-model-name", TINY_NAME, "--block-size", "1"])


def test_browser_draws_a_hundred_thousand_blocks(big_server, browser):
    browser.get(f"{big_server.url}/dashboard")
    deadline = time.monotonic() + 30
    while not _js(browser, "return window.pagedlmDashboard && window.pagedlmDashboard.snapshot"):
        assert time.monotonic() < deadline, "the page got no snapshot"
        time.sleep(0.05)
    n = _js(browser, "return window.pagedlmDashboard.snapshot.stats.num_blocks_total")
    assert n >= 100_000
    assert sum(_js(browser, "return window.pagedlmDashboard.counts()")[s] for s in STATES) == n
    # Every block has a cell inside the canvas; the last one is drawn (free: light grey).
    last = _js(browser, f"""
        const c = window.pagedlmDashboard.cellOf({n - 1}), canvas = document.getElementById('blockmap');
        return [c.x + c.size <= canvas.width, c.y + c.size <= canvas.height,
                [...canvas.getContext('2d').getImageData(c.x, c.y, 1, 1).data]];""")
    assert last[0] and last[1] and last[2] == [229, 231, 235, 255]
    worker = threading.Thread(target=_complete, args=(big_server,),
                              kwargs=dict(prompt="a hundred thousand blocks " * 8,
                                          max_tokens=600), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    owned = None
    while owned is None and time.monotonic() < deadline:
        owned = _js(browser, """  // the first block of a sequence that has computed some
            const d = window.pagedlmDashboard, r = d.snapshot.sequences[0];
            return r && r.computed_tokens > 0 ? d.blockInfo(r.block_ids[0]) : null;""")
        time.sleep(0.05)
    worker.join(120)
    assert owned is not None, "never saw a block owned"
    assert owned["state"] == "owned" and owned["refCount"] == 1
    assert len(owned["owners"]) == 1 and owned["tokensHeld"] == 1
