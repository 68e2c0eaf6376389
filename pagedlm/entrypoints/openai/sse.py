"""Server-sent events and client disconnects: the SSE framing, an error as an SSE event,
the streaming response that stops (and frees the engine's work) when the client hangs up,
and awaiting a whole response unless the client goes away first."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedlm.engine.request_stream import EngineDeadError, RequestFailedError
from pagedlm.entrypoints.openai.errors import APIError, error_body, failed_request_error

logger = logging.getLogger(__name__)
T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


def stream_error_event(exc: BaseException) -> str:
    """An error that happens after the 200 and the first chunks went out, as an SSE event."""
    if isinstance(exc, RequestFailedError):
        exc = failed_request_error(exc)
    if isinstance(exc, APIError):
        body = error_body(exc.status_code, exc.message, exc.param, exc.code)
    elif isinstance(exc, EngineDeadError):
        body = error_body(503, str(exc), code="engine_dead")
    else:
        logger.exception("error while streaming", exc_info=exc)
        body = error_body(500, f"internal server error ({type(exc).__name__})",
                          code="internal_error")
    return sse_event(json.dumps(body))


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(task: asyncio.Future[Any], receive: Receive) -> None:
    """Wait until `task` is done or the client disconnects, whichever comes first; then
    cancel both and wait for them to end (a finished task keeps its result)."""
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def run_until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`, or raise ClientDisconnected as soon as the client goes away (the
    work is cancelled; the caller's `finally` aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    await _race_disconnect(task, receive)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class SSEResponse(Response):
    """A text/event-stream of the events an async iterator yields.

    It watches for the client's disconnect while streaming (rather than trusting the ASGI
    server or Starlette's version to cancel us) and, on any exit, calls `on_close`, which
    aborts the engine requests: a client that hangs up frees its KV blocks at the next
    engine step instead of decoding to max_tokens for nobody.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         media_type=self.media_type)
        # Response sets Content-Length: 0 for its empty body; a stream has none.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        streamer = asyncio.ensure_future(self._stream(send))
        try:
            await _race_disconnect(streamer, receive)
        finally:
            self.on_close()
            if streamer.done() and not streamer.cancelled() and isinstance(
                    streamer.exception(), Exception):
                logger.error("SSE stream failed", exc_info=streamer.exception())
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _stream(self, send: Send) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
        except OSError:  # the connection broke under us; the watcher sees the disconnect
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
