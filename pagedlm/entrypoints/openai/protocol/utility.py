"""The schemas of the endpoints around generation: /v1/models, /tokenize, /detokenize,
/health, /version and LoRA adapter loading."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.protocol.chat import ChatMessage
from pagedlm.entrypoints.openai.protocol.common import (
    OpenAIModel,
    ResponseModel,
    TokenId,
)


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


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
