"""Plain ASGI middlewares for the API key and the request body size.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so that `receive` passes through
untouched after the body: handlers rely on it to notice a client disconnect.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedlm.entrypoints.openai.errors import error_response

# Paths a load balancer or orchestrator must reach without credentials.
PUBLIC_PATHS = frozenset({"/health"})
# A browser cannot put a header on a page it opens or on an EventSource: the dashboard's
# paths also take the key as the query parameter `api_key` (/dashboard?api_key=...).
QUERY_KEY_PREFIX = "/dashboard"
# Bytes of an oversized body read and dropped before the 413 (see _too_large).
DRAIN_LIMIT = 8 << 20


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every path but /health (on the
    dashboard's, `?api_key=<key>` will do)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None and scope["path"].startswith(QUERY_KEY_PREFIX):
            keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            if keys:
                header = b"Bearer " + keys[0].encode()
        if header is None:
            message = "missing API key: send the header 'Authorization: Bearer <api key>'"
        else:
            scheme, _, token = header.partition(b" ")
            # Constant time: the comparison must not reveal how much of the key matched.
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                await self.app(scope, receive, send)
                return
            message = "invalid API key"
        response = error_response(401, message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a body over `max_body_size` bytes, declared or streamed.

    The body is read here (bounded) and replayed to the app, so a chunked upload with no
    Content-Length is capped as well; after the replay, `receive` is the server's own.
    """

    def __init__(self, app: ASGIApp, max_body_size: int) -> None:
        if max_body_size < 1:
            raise ValueError(f"max_body_size must be >= 1, got {max_body_size}")
        self.app = app
        self.max_body_size = max_body_size

    async def _too_large(self, scope: Scope, receive: Receive, send: Send,
                         more_body: bool) -> None:
        # Read (and drop) a bounded rest of the body first: a client still writing when
        # the connection closes may see a reset instead of this answer.
        drained = 0
        while more_body and drained < DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            more_body = message.get("more_body", False)
        response = error_response(
            413, f"the request body is larger than the server's limit of {self.max_body_size} "
            f"bytes (--max-request-body-size)", code="request_too_large",
            headers={"Connection": "close"})
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            try:
                too_large = int(declared) > self.max_body_size
            except ValueError:
                response = error_response(400, "invalid Content-Length header")
                await response(scope, receive, send)
                return
            if too_large:
                await self._too_large(scope, receive, send,
                                      more_body=int(declared) <= DRAIN_LIMIT)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_size:
                await self._too_large(scope, receive, send, message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                  "more_body": False}]

        async def receive_replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_replayed, send)
