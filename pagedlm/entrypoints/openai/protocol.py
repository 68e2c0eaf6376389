"""Pydantic models of the OpenAI API (the subset pagedlm serves) plus vLLM's extra fields.

Request models forbid unknown fields: a parameter we do not implement (`audio`, ...) is a
clear 400, not silently ignored output.
Fields that do not change generation (`user`, `store`, `metadata`, ...) are accepted.
Types are strict, as OpenAI checks them: `"max_tokens": "4"`, `"stream": "yes"` or `true`
as a token id are 400s, never coerced (an integer is accepted where a number is).
Limits that protect the server (n, logprobs, stop strings, prompt counts) and the ranges
SamplingParams enforces are part of the schema, so they also show up in /openapi.json.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

from pagedlm.sampling_params import (
    MAX_LENGTH_PENALTY,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
)

# Per-request caps. Generous for real use, small enough that one request cannot
# monopolise the engine or the tokenizer.
MAX_N = 16
MAX_PROMPTS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 256
MAX_TOOLS = 128  # OpenAI's limit on functions per request

def _whole_number(value: Any) -> Any:
    """JSON Schema's integer includes 2.0: a whole float is that int. Strings and booleans
    stay errors (strict mode), as do fractions."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# On an integer field of a request, after its Field (so that /openapi.json keeps the
# bounds): strict, but 2.0 counts (it is an integer in JSON Schema).
WHOLE = BeforeValidator(_whole_number)
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LENGTH)]
TokenId = Annotated[int, Field(ge=0), WHOLE]
# OpenAI's seed is a signed 64-bit integer.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), WHOLE]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Stop = StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)] | None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----- errors -----------------------------------------------------------------------------


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ----- shared request fields ----------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: stored as json_schema, sent as "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIModel):
    """vLLM's `structured_outputs` body field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                      Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class SamplingFields(OpenAIModel):
    """Sampling fields common to /v1/completions and /v1/chat/completions.

    None means "the default" for every field, as OpenAI allows explicit nulls.
    """

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), WHOLE] | None = 1
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = None  # -1, 0: off; <= the vocabulary
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0],
                                               le=REPETITION_PENALTY_RANGE[1])] | None = None
    min_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Handled by the engine only if it supports them (checked at request time).
    best_of: Annotated[int, Field(ge=1, le=MAX_N), WHOLE] | None = None
    use_beam_search: bool | None = None
    length_penalty: Annotated[float, Field(ge=-MAX_LENGTH_PENALTY,
                                           le=MAX_LENGTH_PENALTY)] | None = None
    # Structured outputs (at most one source): OpenAI's response_format, vLLM's
    # structured_outputs, or vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                             Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                    Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE] | None = None
    suffix: str | None = None


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history, as OpenAI returned it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Fields a client replays from a response (refusal, annotations, ...) are ignored:
    # they do not affect the template's text.
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIModel):
    # OpenAI's rule for function names.
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None  # deprecated by OpenAI
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# ----- responses ----------------------------------------------------------------------------


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _drop_null_usage(self, handler):
        # OpenAI's schema has usage as an object or absent, never null (stream chunks).
        data = handler(self)
        if data.get("usage", 0) is None:
            del data["usage"]
        return data


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None  # the model refuses nothing: always null


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None  # OpenAI's field for a safety refusal; never set here
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_null_tool_calls(self, handler):
        # OpenAI's schema has tool_calls as an array or absent, never null.
        data = handler(self)
        if data.get("tool_calls", 0) is None:
            del data["tool_calls"]
        return data


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        # OpenAI's deltas carry only the fields that changed.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedlm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class HealthResponse(ResponseModel):
    status: Literal["ok"] = "ok"


class VersionResponse(ResponseModel):
    version: str
