"""Validate response bodies against OpenAI's published OpenAPI schemas.

The schemas come from OpenAI's official spec (https://github.com/openai/openai-openapi),
extracted into `data/openai_schemas.json` by `data/extract_openai_schemas.py` -- see that
script for the commit and how OpenAPI-isms were converted. `required` lists are kept as
published: a body that a real OpenAI client could not rely on fails here.

    from tests.server.openai_schema import validate_error, validate_openai

    validate_openai("CreateChatCompletionResponse", r.json())
    validate_openai("CreateChatCompletionStreamResponse", chunk)  # each SSE `data:` chunk
    validate_openai("CreateCompletionResponse", r.json())
    validate_openai("ListModelsResponse", r.json())
    validate_error(r.json(), r.status_code)                       # 4xx / 5xx bodies

Both raise AssertionError listing every violation: where in the body (`$.choices[0]...`),
the failing JSON Schema keyword, and where in the schema. Extra fields the schemas do not
name (e.g. vLLM's `stop_reason`) are allowed: OpenAI's schemas do not close their objects.
Needs only `jsonschema` (no PyYAML, no server).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMA_FILE = Path(__file__).with_name("data") / "openai_schemas.json"
_BASE_URI = "urn:pagedlm:test:openai-schemas"
_MAX_MESSAGE = 240


@functools.cache
def _document() -> dict[str, Any]:
    with open(SCHEMA_FILE, encoding="utf-8") as f:
        return json.load(f)


def schema_names() -> list[str]:
    return sorted(_document()["schemas"])


def schema_source() -> dict[str, str]:
    """Where the schemas came from: {"repository", "commit", "file"}."""
    return dict(_document()["source"])


@functools.cache
def _validator(schema_name: str) -> Draft202012Validator:
    if schema_name not in _document()["schemas"]:
        raise KeyError(f"no OpenAI schema {schema_name!r}; known: {', '.join(schema_names())}")
    resource = Resource.from_contents(_document(), default_specification=DRAFT202012)
    registry = Registry().with_resource(_BASE_URI, resource)
    return Draft202012Validator(
        {"$ref": f"{_BASE_URI}#/schemas/{schema_name}"},
        registry=registry,
        format_checker=Draft202012Validator.FORMAT_CHECKER,
    )


def _json_path(path: Iterable[Any]) -> str:
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _short(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _sorted(errors: Iterable[ValidationError]) -> list[ValidationError]:
    return sorted(errors, key=lambda e: ([str(p) for p in e.absolute_path], str(e.validator)))


def _closest(errors: list[ValidationError]) -> list[ValidationError]:
    """The failures of the anyOf / oneOf alternative that came closest to matching.

    An alternative whose `type` does not even match the value (typically `{"type": "null"}`
    of a nullable field) says nothing useful, so it is skipped when another failed deeper.
    """
    branches: dict[Any, list[ValidationError]] = {}
    for error in errors:
        branches.setdefault(error.relative_schema_path[0], []).append(error)
    telling = [e for e in errors
               if not (e.validator == "type" and not e.relative_path
                       and len(branches[e.relative_schema_path[0]]) == 1)]
    best = best_match(telling or errors)
    return _sorted(branches[best.relative_schema_path[0]])


def _describe(error: ValidationError, prefix: str = "  - ") -> list[str]:
    schema_path = "/".join(str(p) for p in error.absolute_schema_path)
    lines = [f"{prefix}{_json_path(error.absolute_path)}: {_short(error.message)} "
             f"[keyword {error.validator!r} at schema {schema_path}]"]
    if error.context:  # anyOf / oneOf: say which alternative came closest and why it failed
        for sub in _closest(error.context):
            lines += _describe(sub, " " * len(prefix) + "  closest: ")
    return lines


def validate_openai(schema_name: str, body: Any) -> None:
    """Assert `body` (a decoded JSON response) is valid under OpenAI's `schema_name`."""
    validator = _validator(schema_name)
    errors = _sorted(validator.iter_errors(body))
    if not errors:
        return
    source = schema_source()
    header = (f"response body violates OpenAI's {schema_name} "
              f"({source['repository']}@{source['commit'][:12]}:{source['file']}): "
              f"{len(errors)} error(s)")
    body_text = _short(json.dumps(body, default=str))
    lines = [line for error in errors for line in _describe(error)]
    raise AssertionError("\n".join([header, *lines, f"  body: {body_text}"]))


def validate_error(body: Any, status: int | None = None) -> None:
    """Assert `body` is an OpenAI error response (`{"error": {...}}`, `ErrorResponse`).

    When `status` (the HTTP status code) is given, also assert it is a 4xx or 5xx.
    """
    if status is not None:
        assert 400 <= status < 600, f"error body returned with HTTP status {status}"
    validate_openai("ErrorResponse", body)


# ----- every response of the server tests --------------------------------------------------
#
# tests/server/conftest.py patches httpx's transports (which the `openai` client uses too)
# so that each response from a test server is checked against the schema of its endpoint
# once its body has been read. A test that stops reading a stream early is not checked.

_JSON_SCHEMAS = {
    "/v1/chat/completions": "CreateChatCompletionResponse",
    "/v1/completions": "CreateCompletionResponse",
    "/v1/models": "ListModelsResponse",
}
_STREAM_SCHEMAS = {
    "/v1/chat/completions": "CreateChatCompletionStreamResponse",
    "/v1/completions": "CreateCompletionResponse",
}


def _completion_exemptions(body: dict, streamed: bool) -> dict:
    """Two places where OpenAI's own legacy completions API answers outside its published
    schema, and so do we (as vLLM does):
    - a streamed completion chunk is published as CreateCompletionResponse, whose
      `finish_reason` has no null, yet every chunk before the last has null there;
    - with echo and logprobs, the prompt's first token has no logprob: null in
      `token_logprobs` and `top_logprobs`.
    The copy returned fills exactly those nulls; everything else is checked as published.
    """
    body = json.loads(json.dumps(body))
    for choice in body.get("choices") or ():
        if isinstance(choice, dict):
            if streamed and choice.get("finish_reason", "absent") is None:
                choice["finish_reason"] = "length"
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                for key, filler in (("token_logprobs", 0.0), ("top_logprobs", {})):
                    values = logprobs.get(key)
                    if isinstance(values, list) and values and values[0] is None:
                        values[0] = filler
    return body


def check_server_response(path: str, status: int, content_type: str, body: bytes) -> None:
    """Assert one response of the OpenAI endpoints matches OpenAI's published schema."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    if status >= 400:
        if media_type == "application/json" and path not in ("/health",):
            validate_error(json.loads(body), status)
        return
    if status != 200:
        return
    if media_type == "text/event-stream" and path in _STREAM_SCHEMAS:
        for line in body.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                validate_error(event)
            elif path == "/v1/completions":
                validate_openai(_STREAM_SCHEMAS[path], _completion_exemptions(event, True))
            else:
                validate_openai(_STREAM_SCHEMAS[path], event)
        return
    if media_type != "application/json":
        return
    if path in _JSON_SCHEMAS:
        data = json.loads(body)
        if path == "/v1/completions":
            data = _completion_exemptions(data, False)
        validate_openai(_JSON_SCHEMAS[path], data)
    elif path.startswith("/v1/models/"):
        validate_openai("Model", json.loads(body))
