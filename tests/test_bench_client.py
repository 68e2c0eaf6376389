"""`pagedlm bench serving`'s HTTP client reads an event stream however the socket cuts it:
events split in the middle of a line, several in one read, CRLF line ends, a last line
without its newline, an error event. A small aiohttp server plays the OpenAI server and
writes the stream in exactly such pieces, flushing and pausing between them."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from pagedlm.benchmarks.datasets import SampleRequest
from pagedlm.entrypoints.bench_client import CompletionsClient


def _event(text: str | None = None, usage: dict | None = None) -> bytes:
    data: dict = {"id": "cmpl-1", "object": "text_completion", "choices": []}
    if text is not None:
        data["choices"] = [{"index": 0, "text": text, "finish_reason": None}]
    if usage is not None:
        data["usage"] = usage
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _serve(pieces: list[bytes]) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.02)  # each piece its own read on the client's side
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _record(pieces: list[bytes]):
    async def main():
        runner, url = await _serve(pieces)
        try:
            async with CompletionsClient(url, "m") as client:
                return await client.send(SampleRequest("hi", 1, 4))
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_events_cut_anywhere_are_all_read():
    stream = (_event("a") + _event("") + _event("b") + _event("c") + _event("d")
              + _event(usage={"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11})
              + b"data: [DONE]\n\n")
    cuts = [5, 40, 41, len(_event("a")) + len(_event("")) + 3, 260, 261]
    pieces = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)])]
    record = _record(pieces)
    assert record.success, record.error
    # Four chunks carried text (the empty one does not count).
    assert len(record.chunk_times) == 4
    assert record.output_tokens == 4 and record.prompt_len == 7


def test_several_events_in_one_read_share_its_time_and_crlf_is_accepted():
    crlf = _event("x").replace(b"\n", b"\r\n")
    record = _record([_event("a") + _event("b") + crlf, _event("c") + b"data: [DONE]\n\n"])
    assert record.success, record.error
    times = record.chunk_times
    assert len(times) == 4 and times[0] == times[1] == times[2] < times[3]


def test_a_last_line_without_newline_and_an_error_event():
    no_newline = _record([_event("a"), b"data: [DONE]"])
    assert no_newline.success and len(no_newline.chunk_times) == 1
    error = _record([_event("a"), b'data: {"error": {"message": "boom", "code": 500}}\n\n',
                     _event("never read")])
    assert not error.success and error.error == "boom"
    assert len(error.chunk_times) == 1
