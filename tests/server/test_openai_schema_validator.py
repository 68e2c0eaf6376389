"""The OpenAI response-schema validator itself (no server, no model): it accepts bodies
shaped like OpenAI's documented responses and rejects specific contract violations."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from tests.server.openai_schema import (
    SCHEMA_FILE,
    schema_names,
    schema_source,
    validate_error,
    validate_openai,
)

CHAT_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-123",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "tiny",
    "choices": [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hello!", "refusal": None},
        "logprobs": None,
        "finish_reason": "stop",
    }],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}

CHAT_LOGPROBS = {
    "content": [{
        "token": "Hello",
        "logprob": -0.25,
        "bytes": [72, 101, 108, 108, 111],
        "top_logprobs": [{"token": "Hello", "logprob": -0.25, "bytes": None}],
    }],
    "refusal": None,
}

CHAT_CHUNKS: list[dict[str, Any]] = [
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1700000000,
     "model": "tiny", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]},
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1700000000,
     "model": "tiny", "choices": [{"index": 0, "delta": {"content": "Hello"},
                                   "finish_reason": None}]},
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1700000000,
     "model": "tiny", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    # stream_options.include_usage: the last chunk has no choices.
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1700000000,
     "model": "tiny", "choices": [],
     "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
]

COMPLETION: dict[str, Any] = {
    "id": "cmpl-123",
    "object": "text_completion",
    "created": 1700000000,
    "model": "tiny",
    "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}

MODEL_LIST: dict[str, Any] = {
    "object": "list",
    "data": [{"id": "tiny", "object": "model", "created": 1700000000, "owned_by": "pagedlm"}],
}

ERROR: dict[str, Any] = {
    "error": {"message": "model 'x' not found", "type": "invalid_request_error",
              "param": "model", "code": None},
}


def mutated(body: dict[str, Any], path: str, value: Any = ..., delete: bool = False) -> dict:
    """A deep copy of `body` with the dotted `path` (ints index lists) set or deleted."""
    body = copy.deepcopy(body)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = body
    for part in parents:
        node = node[part]
    if delete:
        del node[last]
    else:
        node[last] = value
    return body


# --- the schema file ---------------------------------------------------------------------


def test_schema_file_records_its_source_and_is_valid_json_schema() -> None:
    source = schema_source()
    assert source["repository"] == "openai/openai-openapi"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert source["file"] == "openapi.yaml"

    document = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    for name in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                 "CreateCompletionResponse", "ListModelsResponse", "Model",
                 "ErrorResponse", "Error"):
        assert name in schema_names()
    text = json.dumps(document)
    assert '"nullable"' not in text and '"x-oaiMeta"' not in text  # converted / dropped
    for ref in re.findall(r'"\$ref": "([^"]*)"', text):
        assert ref.startswith("#/schemas/") and ref.removeprefix("#/schemas/") in schema_names()
    for schema in document["schemas"].values():
        Draft202012Validator.check_schema(schema)


def test_required_lists_are_kept_as_published() -> None:
    schemas = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))["schemas"]
    message = schemas["ChatCompletionResponseMessage"]
    assert set(message["required"]) == {"role", "content", "refusal"}
    choice = schemas["CreateChatCompletionResponse"]["properties"]["choices"]["items"]
    assert set(choice["required"]) == {"finish_reason", "index", "message", "logprobs"}
    assert set(choice["properties"]["logprobs"]["anyOf"][0]["required"]) == {"content", "refusal"}
    assert set(schemas["Error"]["required"]) == {"type", "message", "param", "code"}


def test_unknown_schema_name_is_an_error() -> None:
    with pytest.raises(KeyError, match="CreateChatCompletionResponse"):
        validate_openai("ChatCompletion", CHAT_COMPLETION)


# --- valid bodies ------------------------------------------------------------------------


def test_accepts_chat_completion() -> None:
    validate_openai("CreateChatCompletionResponse", CHAT_COMPLETION)
    # With logprobs, and with fields the spec does not name (vLLM's `stop_reason`).
    body = mutated(CHAT_COMPLETION, "choices.0.logprobs", CHAT_LOGPROBS)
    body["choices"][0]["stop_reason"] = None
    body["system_fingerprint"] = "fp_pagedlm"
    validate_openai("CreateChatCompletionResponse", body)
    # A tool call.
    body = mutated(CHAT_COMPLETION, "choices.0.message.tool_calls", [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    body["choices"][0]["finish_reason"] = "tool_calls"
    validate_openai("CreateChatCompletionResponse", body)


@pytest.mark.parametrize("index", range(len(CHAT_CHUNKS)))
def test_accepts_chat_completion_chunk(index: int) -> None:
    validate_openai("CreateChatCompletionStreamResponse", CHAT_CHUNKS[index])


def test_accepts_completion() -> None:
    validate_openai("CreateCompletionResponse", COMPLETION)
    validate_openai("CreateCompletionResponse", mutated(COMPLETION, "choices.0.logprobs", {
        "tokens": [" world"], "token_logprobs": [-0.5], "text_offset": [5],
        "top_logprobs": [{" world": -0.5}]}))


def test_accepts_model_list_and_model() -> None:
    validate_openai("ListModelsResponse", MODEL_LIST)
    validate_openai("Model", MODEL_LIST["data"][0])
    validate_openai("ListModelsResponse", {"object": "list", "data": []})


def test_accepts_error() -> None:
    validate_error(ERROR)
    validate_error(ERROR, 404)
    validate_error({"error": {"message": "boom", "type": "internal_error",
                              "param": None, "code": "500"}}, 500)


# --- invalid bodies ----------------------------------------------------------------------

INVALID = [
    # (schema, body, path in the message, failing keyword)
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "choices", delete=True),
                 "$", "'choices' is a required property", id="chat-missing-choices"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "object", "chat.completion.chunk"),
                 "$.object", "keyword 'enum'", id="chat-wrong-object"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "created", "1700000000"),
                 "$.created", "is not of type 'integer'", id="chat-created-string"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "choices.0.message.refusal", delete=True),
                 "$.choices[0].message", "'refusal' is a required property",
                 id="chat-message-missing-refusal"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "choices.0.logprobs", delete=True),
                 "$.choices[0]", "'logprobs' is a required property",
                 id="chat-choice-missing-logprobs"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "choices.0.logprobs", {"content": []}),
                 "$.choices[0].logprobs", "'refusal' is a required property",
                 id="chat-logprobs-missing-refusal"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "choices.0.finish_reason", "abort"),
                 "$.choices[0].finish_reason", "keyword 'enum'", id="chat-bad-finish-reason"),
    pytest.param("CreateChatCompletionResponse",
                 mutated(CHAT_COMPLETION, "usage.total_tokens", delete=True),
                 "$.usage", "'total_tokens' is a required property", id="chat-usage-incomplete"),
    pytest.param("CreateChatCompletionStreamResponse",
                 mutated(CHAT_CHUNKS[1], "object", "chat.completion"),
                 "$.object", "keyword 'enum'", id="chunk-wrong-object"),
    pytest.param("CreateChatCompletionStreamResponse",
                 mutated(CHAT_CHUNKS[1], "choices.0.finish_reason", delete=True),
                 "$.choices[0]", "'finish_reason' is a required property",
                 id="chunk-missing-finish-reason"),
    pytest.param("CreateChatCompletionStreamResponse",
                 mutated(CHAT_CHUNKS[1], "choices.0.delta.content", 5),
                 "$.choices[0].delta.content", "keyword 'anyOf'", id="chunk-content-int"),
    pytest.param("CreateCompletionResponse",
                 mutated(COMPLETION, "choices", delete=True),
                 "$", "'choices' is a required property", id="completion-missing-choices"),
    pytest.param("CreateCompletionResponse",
                 mutated(COMPLETION, "object", "completion"),
                 "$.object", "keyword 'enum'", id="completion-wrong-object"),
    pytest.param("CreateCompletionResponse",
                 mutated(COMPLETION, "created", "1700000000"),
                 "$.created", "is not of type 'integer'", id="completion-created-string"),
    pytest.param("CreateCompletionResponse",
                 mutated(COMPLETION, "choices.0.text", delete=True),
                 "$.choices[0]", "'text' is a required property", id="completion-missing-text"),
    pytest.param("ListModelsResponse",
                 mutated(MODEL_LIST, "object", "models"),
                 "$.object", "keyword 'enum'", id="models-wrong-object"),
    pytest.param("ListModelsResponse",
                 mutated(MODEL_LIST, "data.0.owned_by", delete=True),
                 "$.data[0]", "'owned_by' is a required property", id="model-missing-owned-by"),
    pytest.param("ListModelsResponse",
                 mutated(MODEL_LIST, "data.0.created", "1700000000"),
                 "$.data[0].created", "is not of type 'integer'", id="model-created-string"),
    pytest.param("ErrorResponse",
                 mutated(ERROR, "error.message", delete=True),
                 "$.error", "'message' is a required property", id="error-missing-message"),
    pytest.param("ErrorResponse",
                 {"detail": "Not Found"},  # FastAPI's default error body
                 "$", "'error' is a required property", id="error-fastapi-detail"),
    pytest.param("ErrorResponse",
                 mutated(ERROR, "error.code", 404),
                 "$.error.code", "keyword 'anyOf'", id="error-code-int"),
]


@pytest.mark.parametrize(("schema_name", "body", "path", "detail"), INVALID)
def test_rejects(schema_name: str, body: dict, path: str, detail: str) -> None:
    with pytest.raises(AssertionError) as info:
        if schema_name == "ErrorResponse":
            validate_error(body)
        else:
            validate_openai(schema_name, body)
    message = str(info.value)
    assert f"OpenAI's {schema_name}" in message
    # The offending location and the reason are named on the same line (for an anyOf, the
    # line may be the alternative that came closest).
    lines = [re.sub(r"^\s*(- |closest: )", "", line) for line in message.splitlines()]
    assert any(line.startswith(f"{path}: ") and detail in line for line in lines), message


def test_reports_every_violation() -> None:
    body = mutated(CHAT_COMPLETION, "created", "x")
    del body["choices"][0]["message"]["refusal"]
    with pytest.raises(AssertionError, match=r"2 error\(s\)") as info:
        validate_openai("CreateChatCompletionResponse", body)
    assert "$.created" in str(info.value) and "$.choices[0].message" in str(info.value)


def test_error_status_must_be_4xx_or_5xx() -> None:
    with pytest.raises(AssertionError, match="status 200"):
        validate_error(ERROR, 200)
