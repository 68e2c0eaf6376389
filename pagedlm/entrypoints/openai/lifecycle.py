"""An orderly shutdown: on SIGTERM or SIGINT the server drains instead of cutting requests.

    signal -> draining: new requests get 503 + Retry-After, /health 503 (a load balancer
              stops sending work); requests already running go on
           -> all finished (or --shutdown-timeout passed: each one left is ended with an
              OpenAI error, a stream with an error event and [DONE], and its KV blocks freed)
           -> uvicorn closes the sockets, the lifespan stops the engine, exit status 0

A second signal during the drain stops at once (uvicorn's forced exit).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.request_stream import RequestFailedError
from pagedlm.entrypoints.openai import DEFAULT_SHUTDOWN_TIMEOUT_S
from pagedlm.entrypoints.openai.errors import SHUTDOWN_RETRY_AFTER_S, error_response

logger = logging.getLogger(__name__)

# After the deadline ended the requests left, how long their handlers get to answer.
_ANSWER_GRACE_S = 5.0
# Paths served during the drain: scrapes see the drain happen.
_SERVED_WHILE_DRAINING = frozenset({"/metrics"})
# Paths that are not work: they neither count as in flight nor hold the drain up.
_NOT_WORK = frozenset({"/health", "/metrics", "/version"})


class DrainMiddleware:
    """Counts the requests in flight and, once draining, turns new ones away with 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.draining and path not in _SERVED_WHILE_DRAINING:
            response = error_response(
                503, "the server is shutting down; retry on another instance or later",
                code="server_shutting_down",
                headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S), "Connection": "close"})
            await response(scope, receive, send)
            return
        if path in _NOT_WORK:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight, False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def _quiet_cancelled_lifespan(record: logging.LogRecord) -> bool:
    """On a forced exit the loop's end cancels what still runs: each request handler
    (uvicorn logs "Exception in ASGI application" with the CancelledError's traceback)
    and the lifespan task, whose shutdown was skipped (Starlette reports the cancellation
    as a failed shutdown, which uvicorn logs with the traceback as its message). Tracebacks
    of a stop the user asked for, and said in one line already; the engine is stopped by
    run_server's `finally`. Installed on uvicorn's logger once forced."""
    if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
        return False
    return not record.getMessage().rstrip().endswith("CancelledError")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: DrainMiddleware, engine: AsyncLLMEngine,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.drain = drain
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.forced = False  # a second signal cut the drain short
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: only hand the work to the loop.
        if not self._drain_requested and self._loop is not None:
            self._drain_requested = True
            self._loop.call_soon_threadsafe(self._start_drain, sig)
            return
        logger.warning("%s during the drain: stopping now (%d running request(s) cut off)",
                       signal.Signals(sig).name, self.drain.in_flight)
        if not self.forced:
            logging.getLogger("uvicorn.error").addFilter(_quiet_cancelled_lifespan)
        self.forced = True
        self.should_exit = True
        self.force_exit = True

    def _start_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(signal.Signals(sig).name))

    async def _drain(self, signal_name: str) -> None:
        drain = self.drain
        drain.draining = True
        timeout = self.shutdown_timeout
        logger.info("%s: shutting down; new requests get 503; waiting up to %.0f s for %d "
                    "running request(s) (--shutdown-timeout)", signal_name, timeout,
                    drain.in_flight)
        if not await drain.wait_idle(timeout):
            ended = self.engine.fail_requests(RequestFailedError(
                f"the server is shutting down and this request did not finish within the "
                f"shutdown timeout ({timeout:g} s)", code="server_shutting_down"))
            logger.warning("shutdown timeout: ended %d engine request(s) of %d HTTP request(s) "
                           "still running", ended, drain.in_flight)
            if not await drain.wait_idle(_ANSWER_GRACE_S):
                logger.error("%d request(s) still had no answer %.0f s later", drain.in_flight,
                             _ANSWER_GRACE_S)
        else:
            logger.info("drained: every request finished")
        self.should_exit = True
