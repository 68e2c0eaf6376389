"""The state the OpenAI endpoints share (the Serving object): the served model names and
LoRA adapters, the server's own tokenizer and the thread it runs on (off the event loop),
chat template rendering, the checks against the vocabulary and the context length, and
starting a request's engine requests."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.request_stream import QueueFullError, RequestStream
from pagedlm.entrypoints.openai import DEFAULT_MAX_TOKENS
from pagedlm.entrypoints.openai.chat_messages import conversation
from pagedlm.entrypoints.openai.errors import APIError, bad_request, queue_full_error
from pagedlm.entrypoints.openai.protocol.chat import ChatMessage
from pagedlm.entrypoints.openai.protocol.common import SamplingFields
from pagedlm.entrypoints.openai.tool_parsers.formats import (
    choose_tool_call_format,
    template_takes_tools,
)
from pagedlm.sampling_params import SamplingParams

T = TypeVar("T")


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

    async def run_off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer's thread, awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._require_tokenizer()
        encoding = await self.run_off_loop(
            lambda: tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        return list(encoding)

    async def detokenize(self, token_ids: Sequence[int], param: str = "prompt") -> str:
        tokenizer = self._require_tokenizer(param)
        return await self.run_off_loop(lambda: tokenizer.decode(list(token_ids)))

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
            return await self.run_off_loop(render)
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
