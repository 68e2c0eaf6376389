"""What the completion and chat endpoints share: model check, tokenization off the event
loop, request validation into SamplingParams, starting engine requests, SSE, disconnects."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedlm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from pagedlm.entrypoints.openai import DEFAULT_MAX_TOKENS
from pagedlm.entrypoints.openai.chat_messages import conversation
from pagedlm.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_body,
    failed_request_error,
    queue_full_error,
)
from pagedlm.entrypoints.openai.protocol.chat import ChatMessage
from pagedlm.entrypoints.openai.protocol.common import SamplingFields
from pagedlm.entrypoints.openai.tool_parsers.formats import (
    choose_tool_call_format,
    template_takes_tools,
)
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Logprobs can be -inf (a masked token); JSON has no infinity, so report a floor.
MIN_LOGPROB = -9999.0
# Request fields copied to SamplingParams under the same name when not None.
_PASSTHROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
                "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens", "length_penalty")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Serving:
    """Shared state and helpers of the OpenAI endpoints."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: Sequence[str],
                 max_tokens_default: int = DEFAULT_MAX_TOKENS,
                 tool_call_parser: str = "auto") -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1, got {max_tokens_default}")
        self.max_tokens_default = max_tokens_default
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.max_model_len = engine.max_model_len
        # The server's own copy: the engine thread decodes with the original while this
        # one encodes, and a fast tokenizer must not be mutated by two threads at once.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        template = getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            template = None  # a dict of named templates: the default one is not known here
        self.tool_format = choose_tool_call_format(template, tool_call_parser)
        self.template_takes_tools = template_takes_tools(template)
        # One worker: tokenization is serialised (one tokenizer) but never on the event loop.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedlm-tokenizer")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> str:
        """The name a response reports: the base model's, or the LoRA adapter's that
        `model` names. 404 for any other name."""
        if model is None or model in self.served_model_names:
            return self.model_name
        if model in self.engine.lora_requests:
            return model
        names = [*self.served_model_names, *self.engine.lora_requests]
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                       f"{', '.join(names)}", param="model", code="model_not_found")

    def lora_name(self, model: str) -> str | None:
        """The adapter a checked model name selects (None: the base model)."""
        return model if model in self.engine.lora_requests else None

    def _require_tokenizer(self, param: str = "prompt"):
        if self.tokenizer is None:
            raise bad_request("the server runs without a tokenizer (--skip-tokenizer-init): "
                              "send prompts as token ids", param=param)
        return self.tokenizer

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._require_tokenizer()
        encoding = await self._run(
            lambda: tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        return list(encoding)

    async def detokenize(self, token_ids: Sequence[int], param: str = "prompt") -> str:
        tokenizer = self._require_tokenizer(param)
        return await self._run(lambda: tokenizer.decode(list(token_ids)))

    async def render_chat(self, messages: Sequence[ChatMessage],
                          add_generation_prompt: bool = True,
                          tools: Sequence[dict[str, Any]] | None = None,
                          ) -> tuple[str, list[int]]:
        """The chat template's text for `messages` (and `tools`, OpenAI function dicts)
        and its token ids."""
        tokenizer = self._require_tokenizer("messages")
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("the model's tokenizer has no chat template: use /v1/completions",
                              param="messages")
        native = self.template_takes_tools
        turns = conversation(messages, tools=tools, fmt=self.tool_format,
                             template_takes_tools=native)
        template_tools = ([{"type": "function", "function": t} for t in tools]
                          if tools and native else None)

        def render() -> tuple[str, list[int]]:
            text = tokenizer.apply_chat_template(
                turns, tools=template_tools, tokenize=False,
                add_generation_prompt=add_generation_prompt)
            # The template already holds any BOS token: do not add special tokens again.
            return text, list(tokenizer(text, add_special_tokens=False).input_ids)

        try:
            return await self._run(render)
        except Exception as e:  # jinja's TemplateError (e.g. "roles must alternate") and kin
            raise bad_request(f"the chat template rejected the messages: {e}",
                              param="messages") from e

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Token ids outside the vocabulary are a 400, before anything decodes them."""
        vocab = self.engine.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param} contains token id {bad}, outside the vocabulary "
                              f"[0, {vocab})", param=param)

    def check_vocabulary_fields(self, req: SamplingFields) -> None:
        """The sampling fields whose limit is the model's vocabulary."""
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        vocab = self.engine.vocab_size
        if req.top_k is not None and req.top_k > vocab:
            raise bad_request(f"top_k is {req.top_k}, more than the vocabulary of {vocab} "
                              f"tokens; use -1 or 0 to turn top-k off", param="top_k")

    def default_max_tokens(self, longest_prompt: int, min_tokens: int = 0) -> int:
        """max_tokens for a request that sets none: --max-tokens-default, or what the context
        leaves after the longest prompt if that is less."""
        return max(1, min(max(self.max_tokens_default, min_tokens),
                          self.max_model_len - longest_prompt))

    def check_context_length(self, num_prompt_tokens: int, max_tokens: int | None,
                             prompt_param: str, max_tokens_param: str = "max_tokens") -> None:
        """No silent truncation: a prompt that leaves no room, or prompt + max_tokens over
        the context, is a 400 naming both counts."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for the completion; shorten the "
                f"prompt", param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but the request asks "
                f"for {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt "
                f"+ {max_tokens} for the completion, {max_tokens_param}); shorten the prompt or "
                f"lower {max_tokens_param}", param=max_tokens_param,
                code="context_length_exceeded")

    async def start(self, request_id: str, prompts: Sequence[tuple[str | None, list[int]]],
                    params: SamplingParams, arrival_time: float,
                    prompt_param: str = "prompt", model: str | None = None) -> RequestStream:
        """Add one engine request per prompt ("{request_id}-{i}"); all or nothing. What the
        engine rejects is a 400 on `prompt_param`."""
        limit = self.engine.max_num_queued_requests
        needed = len(prompts) * max(params.n, params.best_of or 1)
        if limit is not None and needed > limit:
            raise bad_request(
                f"this request needs {needed} sequences ({len(prompts)} prompt(s) x "
                f"{max(params.n, params.best_of or 1)} samples) but the server queues at most "
                f"{limit} (--max-num-queued-requests)", param="n")
        stream = self.engine.open_stream()
        try:
            await stream.add_many([(f"{request_id}-{i}", text, token_ids)
                                   for i, (text, token_ids) in enumerate(prompts)],
                                  params, arrival_time,
                                  None if model is None else self.lora_name(model))
        except ValueError as e:
            stream.close()
            raise bad_request(str(e), param=prompt_param) from e
        except QueueFullError as e:
            stream.close()
            raise queue_full_error(e) from e
        except BaseException:
            stream.close()
            raise
        return stream


def check_common_fields(req: SamplingFields) -> None:
    """400s for fields the schema accepts but this server does not implement."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")
    for name, neutral in (("best_of", req.n or 1), ("use_beam_search", False)):
        value = getattr(req, name)
        if value is not None and value != neutral and name not in _SAMPLING_FIELDS:
            raise bad_request(f"{name} is not supported by this engine", param=name)


def build_sampling_params(req: SamplingFields, *, max_tokens: int | None,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          field_names: dict[str, str] | None = None) -> SamplingParams:
    """The request's SamplingParams; a ValueError becomes a 400 naming the field.

    `field_names` maps a SamplingParams field to the request's name for it (chat's
    max_completion_tokens) so that `param` is what the client sent."""
    kwargs: dict[str, Any] = {name: getattr(req, name) for name in _PASSTHROUGH
                              if getattr(req, name) is not None}
    kwargs.update(n=req.n or 1, max_tokens=max_tokens, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs)
    for name in ("best_of", "use_beam_search"):
        if name in _SAMPLING_FIELDS and getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    structured, structured_param = structured_outputs_of(req)
    kwargs["structured_outputs"] = structured
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        if structured is not None and "structured_outputs" in message:
            raise bad_request(message, param=structured_param) from e
        field = message.split(" ", 1)[0]
        param = field if field in _SAMPLING_FIELDS else None
        if param is not None and field_names:
            param = field_names.get(param, param)
        raise bad_request(message, param=param) from e


def structured_outputs_of(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field it came from: OpenAI's
    response_format, vLLM's structured_outputs or guided_* (at most one of them)."""
    sources: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format")
        sources.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True)
        sources.append(("structured_outputs",
                        {("json" if k == "json_" else k): v for k, v in fields.items()}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            sources.append((name, {key: getattr(req, name)}))
    if not sources:
        return None, ""
    if len(sources) > 1:
        raise bad_request(f"send one output constraint, not {len(sources)}: "
                          f"{', '.join(name for name, _ in sources)}", param=sources[1][0])
    param, fields = sources[0]
    try:
        return StructuredOutputsParams(**fields), param
    except ValueError as e:
        raise bad_request(str(e), param=param) from e


async def compile_structured_outputs(serving: Serving, req: SamplingFields,
                                     params: SamplingParams) -> None:
    """Compile (and so validate) the grammar before anything is queued, off the event
    loop: an invalid schema, regex or grammar, or an unsupported schema feature, is a 400
    naming the field and the problem."""
    structured = params.structured_outputs
    if structured is None:
        return
    try:
        await serving._run(structured.grammar_text)
    except ValueError as e:
        raise bad_request(str(e), param=structured_outputs_of(req)[1]) from e


# ----- responses and client disconnects ------------------------------------------------------


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`, or raise ClientDisconnected as soon as the client goes away (the
    work is cancelled; the caller's `finally` aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


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
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                t.cancel()
            results = await asyncio.gather(streamer, watcher, return_exceptions=True)
            self.on_close()
            if isinstance(results[0], Exception):
                logger.error("SSE stream failed", exc_info=results[0])
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
