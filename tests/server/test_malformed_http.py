"""Malformed HTTP gets an OpenAI-shaped 400 from a real uvicorn server.

A trivial FastAPI app runs under uvicorn in a background thread, on 127.0.0.1 with a
port the OS picks, with `http=openai_http_protocol(kind)` for each HTTP implementation
installed here; the tests write raw bytes to it over sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from pagedlm.entrypoints.openai.http_protocol import (
    OpenAIH11Protocol,
    OpenAIHttpToolsProtocol,
    malformed_http_message,
    openai_http_protocol,
)

HOST = "127.0.0.1"
KINDS = ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    OpenAIHttpToolsProtocol is None, reason="httptools is not installed"))]


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        try:
            return JSONResponse(await request.json())
        except ClientDisconnect:  # the server hung up on a malformed body
            return Response(status_code=499)

    return app


@pytest.fixture(scope="module", params=KINDS)
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    config = uvicorn.Config(_app(), host=HOST, port=0, http=openai_http_protocol(request.param),
                            lifespan="off", log_level="error", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{request.param}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        assert not thread.is_alive(), "uvicorn did not shut down"


def exchange(port: int, *parts: bytes, pause_s: float = 0.0) -> tuple[int, dict[str, str], bytes]:
    """Send `parts` (pausing between them), read until the server closes; return the
    status, the headers (lower-cased names) and the body."""
    with socket.create_connection((HOST, port), timeout=5) as sock:
        for i, part in enumerate(parts):
            if i and pause_s:
                time.sleep(pause_s)
            sock.sendall(part)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        assert len(body) == int(headers["content-length"])
    return int(status_line.split()[1]), headers, body


def assert_malformed(response: tuple[int, dict[str, str], bytes], *words: str) -> None:
    status, headers, body = response
    assert status == 400, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    payload = json.loads(body)
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    assert error["code"] == "malformed_http"
    assert error["message"].startswith("malformed HTTP request: ")
    for word in words:
        assert word in error["message"], error["message"]


HEAD = b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
CHUNKED_BODY = b"2\r\n{}\r\n0\r\n\r\n"

MALFORMED = {
    "content-length-not-a-number": (HEAD + b"Content-Length: abc\r\n\r\n{}", "Content-Length"),
    "content-length-negative": (HEAD + b"Content-Length: -2\r\n\r\n{}", "Content-Length"),
    "content-length-then-transfer-encoding": (
        HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY,
        "both Content-Length and Transfer-Encoding"),
    "transfer-encoding-then-content-length": (
        HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n" + CHUNKED_BODY,
        "both Content-Length and Transfer-Encoding"),
    "bad-chunk-size": (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                       "chunked"),
    "unsupported-transfer-encoding": (HEAD + b"Transfer-Encoding: gzip\r\n\r\n{}",
                                      "Transfer-Encoding"),
    "garbage-request-line": (b"GARBAGE\r\n\r\n", "request line"),
    "bad-header-name-char": (HEAD + b"X-B\x01d: 1\r\nContent-Length: 2\r\n\r\n{}", "header"),
    "bad-header-value-char": (HEAD + b"X-Bad: a\x01b\r\nContent-Length: 2\r\n\r\n{}",
                              "header value"),
}


@pytest.mark.parametrize("request_bytes,word", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_request_gets_openai_400(port: int, request_bytes: bytes, word: str) -> None:
    assert_malformed(exchange(port, request_bytes), word)


def test_bad_chunk_after_the_app_started(port: int) -> None:
    # The head arrives first, so the app is already waiting for the body when the
    # broken chunk comes: the 400 must still be the only response.
    response = exchange(port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n{}\r\n",
                        pause_s=0.1)
    assert_malformed(response, "chunked")


def test_well_formed_content_length(port: int) -> None:
    body = b'{"a": [1, 2]}'
    status, headers, got = exchange(port, HEAD + b"Connection: close\r\nContent-Length: "
                                    + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(got) == {"a": [1, 2]}


def test_well_formed_chunked(port: int) -> None:
    status, _, got = exchange(port, HEAD + b"Connection: close\r\nTransfer-Encoding: chunked"
                              b"\r\n\r\n5\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\n\r\n")
    assert status == 200
    assert json.loads(got) == {"a": 1}


def test_keep_alive_then_malformed(port: int) -> None:
    # A good request on the connection does not stop a later bad one from being answered.
    good = HEAD + b"Content-Length: 2\r\n\r\n{}"
    with socket.create_connection((HOST, port), timeout=5) as sock:
        sock.sendall(good)
        first = b""
        while not first.endswith(b"\r\n\r\n{}"):  # the whole echo response
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(HEAD + b"Content-Length: abc\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400 ")
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "malformed_http"


def test_protocol_choice() -> None:
    assert openai_http_protocol("h11") is OpenAIH11Protocol
    expected = OpenAIH11Protocol if OpenAIHttpToolsProtocol is None else OpenAIHttpToolsProtocol
    assert openai_http_protocol() is expected  # what uvicorn's "auto" would pick
    with pytest.raises(ValueError):
        openai_http_protocol("zttp")


@pytest.mark.parametrize("parser_message,expected", [
    # llhttp (httptools) wordings, so the mapping is checked without httptools here.
    ("Transfer-Encoding can't be present with Content-Length",
     "both Content-Length and Transfer-Encoding headers are present"),
    ("Invalid character in Content-Length", "invalid Content-Length header"),
    ("Invalid character in chunk size", "invalid chunked transfer encoding"),
    ("Invalid method encountered", "invalid request line"),
    ("Invalid header value char", "invalid character in a header value"),
    ("Invalid header token", "invalid header"),
    # h11 wordings; the offending bytes h11 quotes are not echoed back.
    ("illegal request line: bytearray(b'GARBAGE')", "invalid request line"),
    ("Missing mandatory Host: header", "missing or invalid Host header"),
    ("something new: bytearray(b'x')", "something new"),
    ("", "could not parse the request"),
])
def test_message_mapping(parser_message: str, expected: str) -> None:
    assert malformed_http_message(parser_message) == f"malformed HTTP request: {expected}"
