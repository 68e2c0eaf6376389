"""What the two generation endpoints (/v1/completions, /v1/chat/completions) share once
their engine requests are started: logprobs JSON can carry, a choice gathered from engine
outputs, token usage, and the answer itself: an SSE stream (ending in an error event if
need be, then [DONE]) or a whole JSON response, a 499 if the client leaves first."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.responses import Response

from pagedlm.engine.request_stream import RequestStream
from pagedlm.entrypoints.openai.protocol.common import SamplingFields, UsageInfo
from pagedlm.entrypoints.openai.sse import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    run_until_disconnect,
    stream_error_event,
)
from pagedlm.outputs import CompletionOutput, PositionLogprobs

# Logprobs can be -inf (a masked token); JSON has no infinity, so report a floor.
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def usage_info(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens)


@dataclass
class GatheredChoice:
    """One choice of a whole (not streamed) response: its outputs so far, joined."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, output: CompletionOutput) -> None:
        self.text.append(output.text)
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs or ())
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


class GenerationJob(Protocol):
    """One generation call, from its engine outputs to the response."""

    def collect(self, stream: RequestStream) -> Awaitable[BaseModel]:
        """The whole response, once every engine request has finished."""
        ...

    def chunks(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        """The response as SSE events, one per chunk (the usage chunk last if asked)."""
        ...


async def _sse_events(chunks: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """`chunks`, then [DONE]; an error on the way is sent as an event before [DONE]."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except Exception as e:
        yield stream_error_event(e)
    finally:
        stream.close()
    yield SSE_DONE


async def respond(job: GenerationJob, stream: RequestStream, req: SamplingFields,
                  raw_request: Request) -> Response:
    """The response to a started request: streamed if it asks, else whole (or 499 when the
    client disconnects first). Either way the engine requests are aborted when it ends."""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_sse_events(job.chunks(stream, include_usage), stream),
                           on_close=stream.close)
    try:
        response = await run_until_disconnect(job.collect(stream), raw_request.receive)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        stream.close()
    return JSONResponse(response.model_dump())
