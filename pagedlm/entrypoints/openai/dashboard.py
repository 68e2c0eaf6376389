"""The live dashboard: `/dashboard` (one page, its script and styles inlined from the
package: nothing from a CDN), `/dashboard/events` (server-sent events) and
`/dashboard/state` (the same as JSON, for scripts and `pagedlm top`).

    engine core --(snapshot, 4/s while a page is open)--> DashboardHub --SSE--> pages
               --(stats, 0.2 s while busy)-----------------> history (charts)
    outputs -> ServerMetrics (metrics.py) ---------------> TTFT / inter-token latency

The hub opens the core's snapshot stream while at least one page is connected and closes
it after the last one leaves, so an unwatched server builds no snapshot at all. Each
snapshot is encoded once, whatever the number of pages.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from starlette.responses import Response

from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.dashboard import DashboardSnapshot
from pagedlm.engine.stats import EngineStats
from pagedlm.entrypoints.openai.errors import error_response
from pagedlm.entrypoints.openai.metrics import ServerMetrics

SAMPLE_PERIOD_S = 0.5  # one point of the charts
HISTORY_S = 300.0  # what the charts show: the last five minutes
IDLE_EVENT_S = 1.0  # an open page hears from the server at least this often
SNAPSHOT_WAIT_S = 5.0  # /dashboard/state waits this long for the core's snapshot


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class DashboardHub:
    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = metrics.model_name
        self.started = time.time()
        self.history: deque[dict] = deque(maxlen=int(HISTORY_S / SAMPLE_PERIOD_S))
        self._ttft: list[float] = []  # since the last sample
        self._itl: list[float] = []
        self._prev: tuple[float, EngineStats] | None = None
        self._snapshot_json: str | None = None
        self._snapshot_id = 0
        self._changed = asyncio.Event()
        # The latencies the server's metrics measure from the outputs, as they come.
        metrics.first_token_listeners.append(lambda ttft: self._ttft.append(ttft))
        metrics.token_gap_listeners.append(lambda gap: self._itl.append(gap))
        engine.add_stats_listener(self.sample)
        engine.add_dashboard_listener(self._on_snapshot)

    # ----- what the engine tells it ------------------------------------------------------

    def _on_snapshot(self, snapshot: DashboardSnapshot) -> None:
        self._snapshot_json = json.dumps(snapshot.to_json(), separators=(",", ":"))
        self._snapshot_id += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def sample(self, stats: EngineStats | None = None, force: bool = False) -> None:
        """A point of the charts, if SAMPLE_PERIOD_S has passed since the last."""
        now = time.monotonic()
        stats = stats or self.engine.stats
        if self._prev is None:
            self._prev = (now, stats)
            return
        then, prev = self._prev
        dt = now - then
        if dt < SAMPLE_PERIOD_S and not force:
            return
        queries = stats.prefix_cache_queries - prev.prefix_cache_queries
        self.history.append({
            "t": time.time(),
            "output_tokens_per_s": (stats.num_generation_tokens - prev.num_generation_tokens) / dt,
            "prompt_tokens_per_s": (stats.num_prompt_tokens - prev.num_prompt_tokens) / dt,
            "running": stats.num_requests_running,
            "waiting": stats.num_requests_waiting,
            "kv_usage": stats.kv_cache_usage,
            "prefix_hit_rate": ((stats.prefix_cache_hits - prev.prefix_cache_hits) / queries
                                if queries else None),
            "preemptions": stats.num_preemptions - prev.num_preemptions,
            "ttft_p50": _percentile(self._ttft, 0.5), "ttft_p99": _percentile(self._ttft, 0.99),
            "itl_p50": _percentile(self._itl, 0.5), "itl_p99": _percentile(self._itl, 0.99),
        })
        self._ttft, self._itl = [], []
        self._prev = (now, stats)

    # ----- what pages ask for ------------------------------------------------------------

    def info(self) -> dict:
        engine = self.engine
        return {"model": self.model_name, "model_path": engine.model_path,
                "device": engine.device, "max_model_len": engine.max_model_len,
                "started": self.started, "sample_period_s": SAMPLE_PERIOD_S,
                "history_s": HISTORY_S}

    def open(self) -> None:
        self.engine.watch_dashboard(+1)

    def close(self) -> None:
        self.engine.watch_dashboard(-1)

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    async def state(self) -> str | None:
        """The latest snapshot as JSON text, fresh from the core (None: none came)."""
        seen = self._snapshot_id
        self.engine.watch_dashboard(0)
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        while self._snapshot_id == seen and time.monotonic() < deadline:
            await self.wait_change(deadline - time.monotonic())
        return self._snapshot_json if self._snapshot_id != seen else None

    async def events(self, request: Request) -> AsyncIterator[str]:
        """The event stream of one page: first the model and the charts' history, then a
        message per snapshot (4 per second while busy), or at least every IDLE_EVENT_S."""
        self.open()
        try:
            yield _event("init", json.dumps({"info": self.info(), "history": list(self.history)}))
            sent_id = -1
            sent_t = self.history[-1]["t"] if self.history else 0.0
            while not self.engine.dead_error:
                if self._snapshot_id == sent_id:
                    await self.wait_change(IDLE_EVENT_S)
                if await request.is_disconnected():
                    return
                idle = self._snapshot_id == sent_id
                self.sample(force=idle)  # while idle the charts go on, at zero
                points = [p for p in self.history if p["t"] > sent_t]
                if points:
                    sent_t = points[-1]["t"]
                snapshot = "null" if idle or self._snapshot_json is None else self._snapshot_json
                sent_id = self._snapshot_id
                yield _event("update", _join(snapshot=snapshot, points=json.dumps(points)))
            yield _event("dead", json.dumps({"error": str(self.engine.dead_error)}))
        finally:
            self.close()


def _join(**encoded: str) -> str:
    """A JSON object from members already encoded (a snapshot is encoded once per hub)."""
    return "{" + ",".join(f'"{k}":{v}' for k, v in encoded.items()) + "}"


def _event(name: str, data: str) -> str:
    return f"event: {name}\ndata: {data}\n\n"


def page_html() -> str:
    """The page, its script and its styles in one document (no other request, no CDN)."""
    folder = resources.files("pagedlm.entrypoints.openai") / "dashboard_static"
    html = (folder / "index.html").read_text()
    return (html.replace("/*STYLE*/", (folder / "dashboard.css").read_text())
                .replace("/*SCRIPT*/", (folder / "dashboard.js").read_text()))


def add_dashboard_routes(app: FastAPI, hub: DashboardHub) -> None:
    page = page_html()

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state() -> Response:
        if hub.engine.dead_error is not None:
            return error_response(503, "the engine is not running", code="engine_dead")
        snapshot = await hub.state()
        if snapshot is None:
            return error_response(503, "the engine core sent no snapshot in "
                                  f"{SNAPSHOT_WAIT_S:.0f} s", code="engine_busy")
        hub.sample()
        body = _join(info=json.dumps(hub.info()), snapshot=snapshot,
                     history=json.dumps(list(hub.history)))
        return Response(body, media_type="application/json")

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> Response:
        if hub.engine.dead_error is not None:
            return error_response(503, "the engine is not running", code="engine_dead")
        return StreamingResponse(hub.events(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})
