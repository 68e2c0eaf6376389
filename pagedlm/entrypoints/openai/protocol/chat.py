"""The schema of POST /v1/chat/completions: history messages, tools and tool_choice, the
request, the response and its stream chunks (deltas)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from pagedlm.entrypoints.openai.protocol.common import (
    MAX_TOOLS,
    WHOLE,
    OpenAIModel,
    ResponseModel,
    SamplingFields,
    UsageInfo,
)
from pagedlm.sampling_params import MAX_LOGPROBS


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


# ----- responses ----------------------------------------------------------------------------


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


class _Delta(ResponseModel):
    """A part of a stream chunk's delta: only its non-null fields are sent (OpenAI's deltas
    carry only the fields that changed)."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Delta):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Delta):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
