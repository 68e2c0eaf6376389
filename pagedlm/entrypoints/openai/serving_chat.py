"""POST /v1/chat/completions: the model's chat template, n samples, streamed or whole."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from pagedlm.engine.async_engine import RequestStream
from pagedlm.entrypoints.openai.errors import bad_request
from pagedlm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from pagedlm.entrypoints.openai.serving import (
    SSE_DONE,
    ClientDisconnected,
    Serving,
    SSEResponse,
    build_sampling_params,
    check_common_fields,
    clamp_logprob,
    compile_structured_outputs,
    run_until_disconnect,
    sse_event,
    stream_error_event,
)
from pagedlm.outputs import PositionLogprobs


def _top_logprob(text: str | None, logprob: float) -> TopLogprob:
    token = text or ""
    return TopLogprob(token=token, logprob=clamp_logprob(logprob), bytes=list(token.encode()))


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
                  num_top: int) -> ChatLogprobs:
    """Per generated token: its text, logprob, UTF-8 bytes and the `num_top` most likely."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = _top_logprob(position[token_id].decoded_token, position[token_id].logprob)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:num_top]
        content.append(ChatLogprobToken(
            token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
            top_logprobs=[_top_logprob(lp.decoded_token, lp.logprob) for _, lp in ranked]))
    return ChatLogprobs(content=content)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        s = self.serving
        model = s.check_model(req.model)
        check_common_fields(req)
        if req.tools:
            raise bad_request("tools are not supported", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        params = build_sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs,
                                       field_names={"max_tokens": max_tokens_param})
        s.check_vocabulary_fields(req)
        await compile_structured_outputs(s, req, params)
        prompt, token_ids = await s.render_chat(req.messages, req.add_generation_prompt)
        s.check_context_length(len(token_ids), max_tokens, "messages", max_tokens_param)
        if max_tokens is None:
            params.max_tokens = s.default_max_tokens(len(token_ids), params.min_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await s.start(request_id, [(prompt, token_ids)], params, arrival_time,
                               prompt_param="messages")
        job = _Job(request_id, model, len(token_ids), params.n, num_logprobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(job.stream(stream, include_usage), on_close=stream.close)
        try:
            response = await run_until_disconnect(job.collect(stream), raw_request.receive)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            stream.close()
        return JSONResponse(response.model_dump())


@dataclass
class _Job:
    """One chat completion call, from engine outputs to the response (whole or streamed)."""

    request_id: str
    model: str
    num_prompt_tokens: int
    n: int
    num_logprobs: int | None
    created: int = field(default_factory=lambda: int(time.time()))

    def _usage(self, num_completion_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.num_prompt_tokens,
                         completion_tokens=num_completion_tokens,
                         total_tokens=self.num_prompt_tokens + num_completion_tokens)

    def _chunk(self, choices: list[ChatChunkChoice],
               usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                    choices=choices, usage=usage)
        return sse_event(chunk.model_dump_json())

    async def collect(self, stream: RequestStream) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(self.n)]
        async for output in stream:
            for c in output.outputs:
                choice = choices[c.index]
                choice.text.append(c.text)
                choice.token_ids.extend(c.token_ids)
                choice.logprobs.extend(c.logprobs or ())
                if c.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        result = []
        for i, choice in enumerate(choices):
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = chat_logprobs(choice.token_ids, choice.logprobs, self.num_logprobs)
            result.append(ChatChoice(
                index=i, message=ChatResponseMessage(content="".join(choice.text)),
                logprobs=logprobs, finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason))
        num_completion_tokens = sum(len(c.token_ids) for c in choices)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=result, usage=self._usage(num_completion_tokens))

    async def stream(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        finished: set[int] = set()
        num_completion_tokens = 0
        try:
            # OpenAI opens every choice with the role, before any content.
            yield self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                           content=""))
                               for i in range(self.n)])
            async for output in stream:
                for c in output.outputs:
                    if c.index in finished:
                        continue
                    num_completion_tokens += len(c.token_ids)
                    logprobs = None
                    if self.num_logprobs is not None and c.token_ids:
                        logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self.num_logprobs)
                    if not c.text and c.finish_reason is None and logprobs is None:
                        continue  # the detokenizer is holding text back (maybe a stop string)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    yield self._chunk([ChatChunkChoice(
                        index=c.index, delta=DeltaMessage(content=c.text or None),
                        logprobs=logprobs, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason)])
            if include_usage:
                yield self._chunk([], self._usage(num_completion_tokens))
        except Exception as e:
            yield stream_error_event(e)
        finally:
            stream.close()
        yield SSE_DONE
