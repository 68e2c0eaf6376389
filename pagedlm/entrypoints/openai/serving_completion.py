"""POST /v1/completions: one engine request per prompt, n samples each.

Choice `index` is prompt_index * n + sample_index, as OpenAI numbers them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from starlette.responses import Response

from pagedlm.engine.request_stream import RequestStream
from pagedlm.entrypoints.openai.errors import bad_request
from pagedlm.entrypoints.openai.generation import (
    GatheredChoice,
    clamp_logprob,
    respond,
    usage_info,
)
from pagedlm.entrypoints.openai.protocol.common import UsageInfo
from pagedlm.entrypoints.openai.protocol.completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedlm.entrypoints.openai.request_params import (
    build_sampling_params,
    check_common_fields,
    compile_structured_outputs,
)
from pagedlm.entrypoints.openai.serving import Serving
from pagedlm.entrypoints.openai.sse import sse_event
from pagedlm.entrypoints.openai.stream_chunks import TextChunkTemplate
from pagedlm.outputs import PositionLogprobs, RequestOutput

Prompt = tuple[str | None, list[int]]


def completion_logprobs(token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        num_top: int, initial_offset: int = 0,
                        first_token_text: str = "") -> CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives (the
    sampled token always among them) and character offset. A position without logprobs
    (the first prompt token) gets None and `first_token_text`."""
    out = CompletionLogprobs()
    offset = initial_offset
    for token_id, position in zip(token_ids, positions):
        if position is None:
            token = first_token_text
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            token = chosen.decoded_token or ""
            out.token_logprobs.append(clamp_logprob(chosen.logprob))
            ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:num_top]
            top = {lp.decoded_token or "": clamp_logprob(lp.logprob) for _, lp in ranked}
            top.setdefault(token, clamp_logprob(chosen.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        s = self.serving
        model = s.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        check_common_fields(req)
        echo = bool(req.echo)
        params = build_sampling_params(
            req, max_tokens=req.max_tokens, logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if echo and req.logprobs is not None else None)
        s.check_vocabulary_fields(req)
        await compile_structured_outputs(s, req, params)
        prompts = await self._prompts(req.prompt)
        for _, token_ids in prompts:
            s.check_token_ids(token_ids, "prompt")
            s.check_context_length(len(token_ids), req.max_tokens, "prompt")
        if req.max_tokens is None:  # an explicit null; OpenAI's default of 16 is in the schema
            params.max_tokens = s.default_max_tokens(max(len(ids) for _, ids in prompts),
                                                     params.min_tokens)
        if echo:
            prompts = [(text if text is not None else await s.detokenize(ids), ids)
                       for text, ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await s.start(request_id, prompts, params, arrival_time, model=model)
        job = _Job(request_id, model, prompts, params.n, echo, req.logprobs, s)
        return await respond(job, stream, req, raw_request)

    async def _prompts(self, prompt: str | list) -> list[Prompt]:
        s = self.serving
        if isinstance(prompt, str):
            return [(prompt, await s.tokenize(prompt))]
        if isinstance(prompt[0], str):
            return [(p, await s.tokenize(p)) for p in prompt]
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        return [(None, list(p)) for p in prompt]


@dataclass
class _Job:
    """One /v1/completions call, from engine outputs to the response (whole or streamed)."""

    request_id: str
    model: str
    prompts: list[Prompt]
    n: int
    echo: bool
    num_logprobs: int | None
    serving: Serving
    created: int = field(default_factory=lambda: int(time.time()))

    def _echo_logprobs(self, prompt_index: int, output: RequestOutput) -> CompletionLogprobs:
        text, token_ids = self.prompts[prompt_index]
        assert self.num_logprobs is not None
        positions = output.prompt_logprobs or [None] * len(token_ids)
        first = self.serving.tokenizer.decode(token_ids[:1]) if self.serving.tokenizer else ""
        return completion_logprobs(token_ids, positions, self.num_logprobs, 0, first)

    def _usage(self, num_completion_tokens: int) -> UsageInfo:
        return usage_info(sum(len(ids) for _, ids in self.prompts), num_completion_tokens)

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        chunk = CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)
        return sse_event(chunk.model_dump_json())

    async def collect(self, stream: RequestStream) -> CompletionResponse:
        choices = [GatheredChoice() for _ in range(len(self.prompts) * self.n)]
        echo_logprobs: dict[int, CompletionLogprobs] = {}
        async for output in stream:
            p = stream.index_of[output.request_id]
            if self.echo and self.num_logprobs is not None and p not in echo_logprobs:
                echo_logprobs[p] = self._echo_logprobs(p, output)
            for c in output.outputs:
                choices[p * self.n + c.index].add(c)
        result = []
        for i, choice in enumerate(choices):
            p = i // self.n
            prefix = (self.prompts[p][0] or "") if self.echo else ""
            text = prefix + "".join(choice.text)
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = completion_logprobs(choice.token_ids, choice.logprobs,
                                               self.num_logprobs, len(prefix))
                if self.echo and p in echo_logprobs:
                    logprobs = _concat(echo_logprobs[p], logprobs)
            result.append(CompletionChoice(index=i, text=text, logprobs=logprobs,
                                           finish_reason=choice.finish_reason,
                                           stop_reason=choice.stop_reason))
        num_completion_tokens = sum(len(c.token_ids) for c in choices)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=result, usage=self._usage(num_completion_tokens))

    async def chunks(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        offsets = [0] * (len(self.prompts) * self.n)  # characters sent per choice
        started: set[int] = set()
        finished: set[int] = set()
        num_completion_tokens = 0
        template = TextChunkTemplate("completion", self.request_id, self.created, self.model)
        async for output in stream:
            p = stream.index_of[output.request_id]
            for c in output.outputs:
                index = p * self.n + c.index
                if index in finished:
                    continue
                num_completion_tokens += len(c.token_ids)
                prefix, prefix_logprobs = "", None
                if index not in started:
                    started.add(index)
                    if self.echo:
                        prefix = self.prompts[p][0] or ""
                        if self.num_logprobs is not None:
                            prefix_logprobs = self._echo_logprobs(p, output)
                text, logprobs = prefix + c.text, None
                if self.num_logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs or [],
                                                   self.num_logprobs,
                                                   offsets[index] + len(prefix))
                    if prefix_logprobs is not None:
                        logprobs = _concat(prefix_logprobs, logprobs)
                if not text and c.finish_reason is None and (logprobs is None
                                                             or not c.token_ids):
                    continue
                offsets[index] += len(text)
                if c.finish_reason is not None:
                    finished.add(index)
                if logprobs is None:
                    yield template.event(index, text, c.finish_reason, c.stop_reason)
                    continue
                yield self._chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=c.finish_reason,
                                                    stop_reason=c.stop_reason)])
        if include_usage:
            yield self._chunk([], self._usage(num_completion_tokens))


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)
