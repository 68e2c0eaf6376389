"""POST /v1/chat/completions: the model's chat template, n samples, streamed or whole."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from pagedlm.entrypoints.openai.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
)
from pagedlm.entrypoints.openai.protocol.common import UsageInfo
from pagedlm.entrypoints.openai.request_params import (
    build_sampling_params,
    check_common_fields,
    compile_structured_outputs,
    structured_outputs_of,
)
from pagedlm.entrypoints.openai.serving import Serving
from pagedlm.entrypoints.openai.sse import sse_event
from pagedlm.entrypoints.openai.stream_chunks import TextChunkTemplate
from pagedlm.entrypoints.openai.tool_parsers.formats import ToolCallFormat
from pagedlm.entrypoints.openai.tool_parsers.parser import ToolCallParser
from pagedlm.outputs import PositionLogprobs
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured import StructuredOutputsParams


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


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival_time = time.monotonic()
        s = self.serving
        model = s.check_model(req.model)
        check_common_fields(req)
        tools = await self._check_tools(req)
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
        if tools is not None and tools.forced is not None:
            params = await self._force_tool_call(req, tools, params)
        else:
            await compile_structured_outputs(s, req, params)
        # Under tool_choice "none" a template that takes tools still gets them (it knows
        # how to say they are there); one that does not is not taught to call them.
        shown = tools is not None and (tools.parse or s.template_takes_tools)
        prompt, token_ids = await s.render_chat(
            req.messages, req.add_generation_prompt,
            tools=tools.functions if shown else None)
        s.check_context_length(len(token_ids), max_tokens, "messages", max_tokens_param)
        if max_tokens is None:
            params.max_tokens = s.default_max_tokens(len(token_ids), params.min_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await s.start(request_id, [(prompt, token_ids)], params, arrival_time,
                               prompt_param="messages", model=model)
        tool_format = s.tool_format if tools is not None and tools.parse else None
        job = _Job(request_id, model, len(token_ids), params.n, num_logprobs, tool_format)
        return await respond(job, stream, req, raw_request)


    async def _check_tools(self, req: ChatCompletionRequest) -> _Tools | None:
        """The request's tools, validated: every parameter schema compiles (a 400 naming
        tools[i].function.parameters), a named tool_choice is one of them."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise bad_request(f"tool_choice {_choice_name(choice)} needs tools",
                                  param="tool_choice")
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise bad_request(f"two tools are named {duplicate!r}: names must be unique",
                              param="tools")
        for i, function in enumerate(functions):
            if "parameters" not in function:
                continue
            try:
                await self.serving.run_off_loop(
                    StructuredOutputsParams(json=function["parameters"]).grammar_text)
            except ValueError as e:
                problem = str(e).removeprefix("structured_outputs.json: ")
                raise bad_request(f"tools[{i}].function.parameters is not a usable JSON "
                                  f"schema: {problem}",
                                  param=f"tools[{i}].function.parameters") from e
        forced: list[dict[str, Any]] | None = None
        if isinstance(choice, NamedToolChoice):
            forced = [f for f in functions if f["name"] == choice.function.name]
            if not forced:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, "
                                  f"which is not in tools ({', '.join(names)})",
                                  param="tool_choice")
        elif choice == "required":
            forced = functions
        if forced is not None:
            constraint, source = structured_outputs_of(req)
            if constraint is not None:
                raise bad_request(f"tool_choice {_choice_name(choice)} constrains the output "
                                  f"to a tool call: it does not combine with {source}",
                                  param="tool_choice")
        return _Tools(functions, forced=forced, parse=choice != "none",
                      parallel=req.parallel_tool_calls is not False
                      and not isinstance(choice, NamedToolChoice))

    async def _force_tool_call(self, req: ChatCompletionRequest, tools: _Tools,
                               params: SamplingParams) -> SamplingParams:
        """Decoding constrained to calls of the forced functions, in the model's format,
        with arguments valid against their schemas."""
        s = self.serving
        fmt = s.tool_format
        special_id = None
        overrides: dict[str, Any] = {}
        if fmt.start_is_special and fmt.start is not None:
            special_id = special_token_id(s.tokenizer, fmt.start)
            if special_id is not None:
                overrides["skip_special_tokens"] = False  # the parser must see the marker
        grammar = fmt.grammar(tools.forced or [], tools.parallel, special_id)
        structured = StructuredOutputsParams(grammar=grammar)
        try:
            await s.run_off_loop(structured.grammar_text)
            return dataclasses.replace(params, structured_outputs=structured, **overrides)
        except ValueError as e:
            raise bad_request(f"the tools cannot be forced: {e}", param="tools") from e


def _choice_name(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming {choice.function.name!r}"
    return repr(choice)


def special_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one special (added) token of the tokenizer."""
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    return added.get(text)


@dataclass
class _Tools:
    functions: list[dict[str, Any]]  # OpenAI function dicts: name, description, parameters
    forced: list[dict[str, Any]] | None  # tool_choice required or named: one of these
    parse: bool  # tool_choice is not "none": calls in the output become tool_calls
    parallel: bool  # more than one call allowed


@dataclass
class _Job:
    """One chat completion call, from engine outputs to the response (whole or streamed)."""

    request_id: str
    model: str
    num_prompt_tokens: int
    n: int
    num_logprobs: int | None
    tool_format: ToolCallFormat | None = None  # parse tool calls out of the text
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[ChatChunkChoice],
               usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                    choices=choices, usage=usage)
        return sse_event(chunk.model_dump_json())

    async def collect(self, stream: RequestStream) -> ChatCompletionResponse:
        choices = [GatheredChoice() for _ in range(self.n)]
        async for output in stream:
            for c in output.outputs:
                choices[c.index].add(c)
        result = []
        for i, choice in enumerate(choices):
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = chat_logprobs(choice.token_ids, choice.logprobs, self.num_logprobs)
            message = ChatResponseMessage(content="".join(choice.text))
            finish_reason = choice.finish_reason
            if self.tool_format is not None:
                parser = ToolCallParser(self.tool_format)
                content = parser.feed(message.content or "")[0] + parser.finish()[0]
                calls = parser.tool_calls
                if calls:
                    message = ChatResponseMessage(
                        content=content or None,
                        tool_calls=[ToolCall(id=c.id, function=ToolCallFunction(
                            name=c.name, arguments=c.arguments)) for c in calls])
                    finish_reason = _tool_finish_reason(finish_reason)
                else:
                    message = ChatResponseMessage(content=content)
            result.append(ChatChoice(
                index=i, message=message, logprobs=logprobs, finish_reason=finish_reason,
                stop_reason=choice.stop_reason))
        usage = usage_info(self.num_prompt_tokens, sum(len(c.token_ids) for c in choices))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=result, usage=usage)

    async def chunks(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        finished: set[int] = set()
        num_completion_tokens = 0
        parsers = ([ToolCallParser(self.tool_format) for _ in range(self.n)]
                   if self.tool_format is not None else None)
        template = TextChunkTemplate("chat", self.request_id, self.created, self.model)
        # OpenAI opens every choice with the role, before any content.
        yield self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                           for i in range(self.n)])
        async for output in stream:
            for c in output.outputs:
                if c.index in finished:
                    continue
                num_completion_tokens += len(c.token_ids)
                logprobs = None
                if self.num_logprobs is not None and c.token_ids:
                    logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self.num_logprobs)
                text, calls, finish_reason = c.text, None, c.finish_reason
                if parsers is not None:
                    text, calls, finish_reason = _parse_delta(parsers[c.index], c.text,
                                                              c.finish_reason)
                if not text and not calls and finish_reason is None and logprobs is None:
                    continue  # text held back (maybe a stop string or a tool call)
                if finish_reason is not None:
                    finished.add(c.index)
                if calls is None and logprobs is None:
                    yield template.event(c.index, text or None, finish_reason, c.stop_reason)
                    continue
                yield self._chunk([ChatChunkChoice(
                    index=c.index, delta=DeltaMessage(content=text or None, tool_calls=calls),
                    logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=c.stop_reason)])
        if include_usage:
            yield self._chunk([], usage_info(self.num_prompt_tokens, num_completion_tokens))


def _tool_finish_reason(reason: str | None) -> str | None:
    """A choice that ends in tool calls finished for them (not for a cut: length stays)."""
    return "tool_calls" if reason == "stop" else reason


def _parse_delta(parser: ToolCallParser, text: str, finish_reason: str | None,
                 ) -> tuple[str, list[DeltaToolCall] | None, str | None]:
    """One streamed output through the choice's tool-call parser: its content, its
    tool-call deltas (OpenAI's shape: index, id, type and name first, then arguments)."""
    content, deltas = parser.feed(text)
    if finish_reason is not None:
        rest, more = parser.finish()
        content, deltas = content + rest, deltas + more
        if parser.tool_calls:
            finish_reason = _tool_finish_reason(finish_reason)
    calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                           function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
             for d in deltas]
    return content, calls or None, finish_reason
