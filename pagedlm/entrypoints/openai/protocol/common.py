"""What every endpoint's schema builds on: the per-request limits, strict request and
lenient response base models, field types, the error body, the sampling fields both
generation endpoints take, and token usage."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pagedlm.sampling_params import (
    MAX_LENGTH_PENALTY,
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


# ----- usage --------------------------------------------------------------------------------


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

