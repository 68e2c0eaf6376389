"""The schema of POST /v1/completions: the request, the legacy logprobs, the response (and
its stream chunks, which have the same shape)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field, model_serializer

from pagedlm.entrypoints.openai.protocol.common import (
    MAX_PROMPTS,
    WHOLE,
    ResponseModel,
    SamplingFields,
    TokenId,
    UsageInfo,
)
from pagedlm.sampling_params import MAX_LOGPROBS


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


# ----- responses ----------------------------------------------------------------------------


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
