"""The HTTP side of `pagedlm bench serving`: streamed /v1/completions requests over aiohttp.

The client shares the machine with the server it measures, so it is kept cheap: aiohttp
parses HTTP in C (httpx's pure-Python parser took 1.3 of the client's 1.7-2.0 CPU seconds
in a run of 64 ShareGPT requests, CPU the server then lacked), as vLLM's benchmark client
does.

It lives in `entrypoints` because only this layer speaks HTTP; everything it records is
handed to the pure metric code in `pagedlm.benchmarks.metrics`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from pagedlm.benchmarks.datasets import SampleRequest
from pagedlm.benchmarks.metrics import RequestRecord

DONE = object()  # the "[DONE]" sentinel of an OpenAI event stream


def parse_sse_line(line: str) -> dict[str, Any] | object | None:
    """One line of a server-sent event stream: its JSON ``data`` payload, :data:`DONE`, or
    None for anything else (blank lines, comments, other fields)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return DONE
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return {"error": {"message": f"undecodable event: {payload[:120]!r}"}}
    return data if isinstance(data, dict) else None


def _read_lines(lines: list[bytes], now: float, chunk_times: list[float],
                usage: dict[str, Any]) -> tuple[str | None, bool]:
    """Record the events of `lines` that arrived at `now`: a chunk carrying text adds `now`
    to `chunk_times`, a usage chunk fills `usage`. Returns an error event's text and
    whether the stream ended ([DONE] or an error)."""
    for raw in lines:
        data = parse_sse_line(raw.decode("utf-8", "replace"))
        if data is DONE:
            return None, True
        if not isinstance(data, dict):
            continue
        if "error" in data:
            return _error_text(data), True
        choices = data.get("choices") or []
        if choices and choices[0].get("text"):
            chunk_times.append(now)
        if data.get("usage"):
            usage.update(data["usage"])
    return None, False


def _error_text(data: dict[str, Any]) -> str:
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


class CompletionsClient:
    """Streams OpenAI-compatible completions from ``base_url`` (which may end in /v1).

    Use as ``async with CompletionsClient(...) as client: record = await client.send(req)``.
    Requests carrying token ids send them as the prompt (the server skips tokenizing);
    others send their text.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 ignore_eos: bool = True, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int | None = None,
                 min_p: float | None = None,
                 timeout_s: float = 3600.0, max_connections: int | None = None) -> None:
        base = base_url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
        self.url = base + ("/completions" if base.endswith("/v1") else "/v1/completions")
        self.model = model
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        # Sent only when set: a server's own defaults differ (llama-server: top-k 40,
        # top-p 0.95, min-p 0.05), so a like-for-like run pins them.
        self.sampling = {k: v for k, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p))
                         if v is not None}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No pool limit by default: a connection pool that queues requests would add its
        # own wait to the measured time to first token.
        self._session_args = dict(headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=timeout_s))
        self._max_connections = max_connections or 0  # 0: no limit
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> CompletionsClient:
        # Made here: a session belongs to the event loop that runs it.
        self._session = aiohttp.ClientSession(
            **self._session_args, connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def payload(self, request: SampleRequest) -> dict[str, Any]:
        prompt: str | list[int] = (list(request.prompt_token_ids)
                                   if request.prompt_token_ids is not None else request.prompt)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension, understood by pagedlm and llama-server
        return body

    async def send(self, request: SampleRequest) -> RequestRecord:
        """Send one request and record when each token-carrying chunk arrived."""
        chunk_times: list[float] = []
        usage: dict[str, Any] = {}
        error: str | None = None
        assert self._session is not None, "use the client in `async with`"
        start = time.perf_counter()
        try:
            async with self._session.post(self.url, json=self.payload(request)) as resp:
                if resp.status != 200:
                    body = (await resp.read()).decode("utf-8", "replace")
                    error = f"HTTP {resp.status}: {body[:200]}"
                else:
                    # Whatever the socket has, then its complete lines: one await per read
                    # rather than one per line (two per event), and the lines of one read
                    # share the time they arrived.
                    partial = b""
                    async for received in resp.content.iter_any():
                        lines = (partial + received).split(b"\n")
                        partial = lines.pop()
                        error, stop = _read_lines(lines, time.perf_counter(), chunk_times, usage)
                        if stop:
                            break
                    else:  # a last line without its newline
                        error, _ = _read_lines([partial], time.perf_counter(), chunk_times, usage)
        except (TimeoutError, aiohttp.ClientError) as e:
            error = f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        # Without a usage chunk (a server ignoring stream_options), count one token a chunk;
        # a chunk may carry several tokens (llama-server holds back partial UTF-8), so the
        # usage count is the one to trust.
        output_tokens = int(usage.get("completion_tokens") or len(chunk_times))
        prompt_len = int(usage.get("prompt_tokens") or request.prompt_len)
        return RequestRecord(start, tuple(chunk_times), end, prompt_len, output_tokens,
                             success=error is None, error=error)


async def list_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0
                      ) -> list[str]:
    """The model ids a server lists at /v1/models, with a clear error if it cannot."""
    base = base_url.rstrip("/")
    url = base + ("/models" if base.endswith("/v1") else "/v1/models")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url) as resp:
                status, text = resp.status, await resp.text()
    except (TimeoutError, aiohttp.ClientError) as e:
        raise ValueError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if status != 200:
        raise ValueError(f"{url} answered HTTP {status}: {text[:200]}")
    try:
        listed = json.loads(text).get("data", [])
    except (ValueError, AttributeError):
        listed = []
    ids = [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not ids:
        raise ValueError(f"{url} lists no models; pass --model")
    return ids
