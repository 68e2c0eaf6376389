"""uvicorn HTTP protocols that answer malformed HTTP in the OpenAI error shape.

A request that fails to parse never reaches the ASGI app, so the app's exception
handlers (see `errors.py`) cannot answer it: uvicorn writes a plain-text
"Invalid HTTP request received." itself, from `send_400_response` in
`uvicorn/protocols/http/{h11_impl,httptools_impl}.py`. Both implementations call
that method from inside their `except <parser error>:` block, so the subclasses here
override it, read the parser's exception from `sys.exc_info()` to say what was wrong,
and write a 400 with `error_body(400, ..., code="malformed_http")` instead.

Request smuggling: a request with both Content-Length and Transfer-Encoding must be
rejected (RFC 9112 6.1 lets a server either reject it or drop Content-Length, and
rejecting is the safe choice behind a proxy that may have framed it by the other
header). httptools (llhttp) rejects it itself; h11 silently lets Transfer-Encoding win,
so the h11 protocol runs its own check on every parsed request head before uvicorn
starts the app. The same check rejects control characters in header values, which
h11 accepts but llhttp does not, so both implementations refuse the same requests.

Wire it in with `uvicorn.Config(app, ..., http=openai_http_protocol())`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedlm.entrypoints.openai.errors import error_body

__all__ = ["OpenAIH11Protocol", "OpenAIHttpToolsProtocol", "malformed_http_message",
           "openai_http_protocol"]

# What the parsers say (h11 and llhttp wordings, lower-cased) -> what we tell the
# client. First match wins, so the specific entries come before the general ones.
_DESCRIPTIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("can't be present with", "both content-length and transfer-encoding"),
     "both Content-Length and Transfer-Encoding headers are present"),
    (("content-length",), "invalid Content-Length header"),
    (("transfer-encoding",),
     "invalid or unsupported Transfer-Encoding header (only 'chunked' is accepted)"),
    (("chunk",), "invalid chunked transfer encoding"),
    (("request line", "method", "version", "http/", "url"), "invalid request line"),
    (("host",), "missing or invalid Host header"),
    (("header value", "value char"), "invalid character in a header value"),
    (("header",), "invalid header"),
    (("buffer too long",), "request head too large"),
)
# h11 appends the offending bytes (": bytearray(b'...')"); the client sent them, so
# they add nothing but noise to the message.
_REPR_TAIL = re.compile(r":\s*(bytearray\()?b['\"].*\Z", re.S)
# Control characters other than HTAB: invalid in a field value (RFC 9110 5.5).
_BAD_VALUE_CHARS = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def malformed_http_message(parser_message: str | None) -> str:
    """The client-facing message for a parser's complaint (h11 or llhttp wording)."""
    text = (parser_message or "").strip()
    lowered = text.lower()
    for needles, description in _DESCRIPTIONS:
        if any(n in lowered for n in needles):
            return f"malformed HTTP request: {description}"
    detail = _REPR_TAIL.sub("", text)[:200] or "could not parse the request"
    return f"malformed HTTP request: {detail}"


def _error_response_bytes(message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 400 response with the OpenAI JSON error body."""
    body = json.dumps(error_body(400, message, code="malformed_http")).encode()
    head = [b"HTTP/1.1 400 Bad Request\r\n"]
    # uvicorn's Server and Date headers, as on every other response.
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n",
             b"content-length: " + str(len(body)).encode() + b"\r\n",
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


def _send_error(protocol: Any, default_message: str) -> None:
    """Shared body of both `send_400_response` overrides (`protocol` is an
    H11Protocol or HttpToolsProtocol: both have transport, cycle and server_state)."""
    transport: asyncio.Transport = protocol.transport
    cycle = protocol.cycle
    if cycle is not None and cycle.response_started and not cycle.response_complete:
        # The app is half-way through its response (a body that turned out malformed
        # after the app answered): a 400 now would corrupt the stream. Just hang up.
        transport.close()
        return
    exc = sys.exc_info()[1]  # the parser error uvicorn is handling; see the docstring
    message = malformed_http_message(str(exc) if exc is not None else default_message)
    transport.write(_error_response_bytes(message, protocol.server_state.default_headers))
    transport.close()  # writes after this one (a late app response) are dropped


class _GuardedConnection(h11.Connection):
    """h11.Connection that also rejects what h11 itself lets through."""

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # h11 lower-cases names
            if b"content-length" in names and b"transfer-encoding" in names:
                # h11 would frame the body by Transfer-Encoding; a proxy in front may
                # have used Content-Length. Raised here, uvicorn's handler sends the 400
                # before the app sees the request.
                raise h11.RemoteProtocolError(
                    "both Content-Length and Transfer-Encoding headers are present")
            if any(_BAD_VALUE_CHARS.search(value) for _, value in event.headers):
                raise h11.RemoteProtocolError("invalid character in a header value")
        return event


class OpenAIH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with OpenAI-shaped 400s and a Content-Length +
    Transfer-Encoding guard."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Same limit as the parent's connection; h11's default when not configured.
        size = self.config.h11_max_incomplete_event_size
        limit = {} if size is None else {"max_incomplete_event_size": size}
        self.conn = _GuardedConnection(h11.SERVER, **limit)

    def send_400_response(self, msg: str) -> None:
        _send_error(self, msg)


try:  # httptools is optional, as for uvicorn's own "auto"
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    OpenAIHttpToolsProtocol: type[asyncio.Protocol] | None = None
else:
    class OpenAIHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[no-redef]
        """uvicorn's httptools protocol with OpenAI-shaped 400s (llhttp already
        rejects Content-Length together with Transfer-Encoding, and control
        characters in header values)."""

        def send_400_response(self, msg: str) -> None:
            _send_error(self, msg)


def openai_http_protocol(kind: str = "auto") -> type[asyncio.Protocol]:
    """The protocol class for `uvicorn.Config(app, http=...)`.

    `kind` is uvicorn's `--http` choice: "auto" (httptools when it is installed, else
    h11, as uvicorn picks), "h11" or "httptools".
    """
    if kind == "auto":
        kind = "h11" if OpenAIHttpToolsProtocol is None else "httptools"
    if kind == "h11":
        return OpenAIH11Protocol
    if kind == "httptools":
        if OpenAIHttpToolsProtocol is None:
            raise ImportError("http='httptools' needs the httptools package installed")
        return OpenAIHttpToolsProtocol
    raise ValueError(f"unsupported HTTP implementation {kind!r}: use auto, h11 or httptools")
