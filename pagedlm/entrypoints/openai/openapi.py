"""/openapi.json as the server really is: FastAPI's schema plus the limits known only at
start-up.

The request models (protocol/) carry every limit that is fixed in code; what depends
on the model being served is added here, once, when the schema is first asked for:

- `model` in request bodies and the `model_id` path parameter: an enum of the served
  names (a null `model` stays allowed where it was);
- token ids (`prompt`'s token-id forms, `stop_token_ids`, /detokenize `tokens`): at most
  vocab_size - 1; `top_k`: at most vocab_size;
- `max_tokens`, `max_completion_tokens`, `min_tokens`: at most max_model_len - 1 (the
  prompt takes at least one token);
- a prompt to generate from needs at least one token: its strings are non-empty;
- fields the schema types but the server supports only empty (`logit_bias`, `suffix`):
  maxProperties / maxLength / maxItems 0;
- integer bounds exactly as pydantic checks them (it writes them as JSON doubles, so the
  seed's 2**63 - 1 came out as 2**63);
- errors as they are answered: a 400 with an ErrorResponse, never FastAPI's 422;
- operation ids unique (GET and HEAD /health shared one).

The schema is walked by field name and JSON Schema keyword, not by position, so it
follows whatever shape pydantic gives a field (`anyOf` with null, nested arrays, ...).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

# Request body fields and path parameters that name a served model.
MODEL_FIELDS = frozenset({"model"})
MODEL_PATH_PARAMETERS = frozenset({"model_id"})
# Request body fields whose integers are token ids.
TOKEN_ID_FIELDS = frozenset({"prompt", "stop_token_ids", "tokens"})
# Request body fields counting generated tokens.
GENERATION_LENGTH_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "min_tokens"})
# Request body fields the server accepts only empty (or null): a non-empty one is a 400.
EMPTY_ONLY_FIELDS = frozenset({"logit_bias", "suffix"})

JsonSchema = dict[str, Any]


def refine_openapi(schema: JsonSchema, *, served_model_names: Sequence[str],
                   max_model_len: int, vocab_size: int) -> JsonSchema:
    """A copy of FastAPI's OpenAPI `schema` stating the server's start-up limits."""
    out = copy.deepcopy(schema)
    names = list(served_model_names)
    for body in _request_body_schemas(out):
        for field, prop in body.get("properties", {}).items():
            _refine_field(field, prop, names, max_model_len, vocab_size)
    for parameter in _parameters(out):
        if parameter.get("in") == "path" and parameter.get("name") in MODEL_PATH_PARAMETERS:
            for leaf in _leaves(parameter.get("schema", {}), "string"):
                leaf["enum"] = list(names)
    for _, operation in _operations(out):
        _declare_400(out, operation)
    _unique_operation_ids(out)
    _drop_unreferenced_components(out)
    return out


def _refine_field(field: str, prop: JsonSchema, names: list[str], max_model_len: int,
                  vocab_size: int) -> None:
    for leaf in _leaves(prop, "integer"):
        _exact_integer_bounds(leaf)
    if field in MODEL_FIELDS:
        for leaf in _leaves(prop, "string"):
            leaf["enum"] = list(names)
    if field in TOKEN_ID_FIELDS:
        token_ids = list(_leaves(prop, "integer"))
        for leaf in token_ids:
            _cap(leaf, vocab_size - 1)
        if field == "prompt" and token_ids:
            # A prompt that can be token ids is one to generate from: the engine needs at
            # least one token, and the empty string tokenizes to none.
            for leaf in _leaves(prop, "string"):
                leaf["minLength"] = max(leaf.get("minLength", 0), 1)
    if field == "top_k":
        for leaf in _leaves(prop, "integer"):
            _cap(leaf, vocab_size)  # -1 and 0 turn it off; more than the vocabulary is a 400
    if field in GENERATION_LENGTH_FIELDS:
        for leaf in _leaves(prop, "integer"):
            _cap(leaf, max_model_len - 1)
    if field in EMPTY_ONLY_FIELDS:
        for kind, keyword in (("object", "maxProperties"), ("array", "maxItems"),
                              ("string", "maxLength")):
            for leaf in _leaves(prop, kind, nested=False):
                leaf[keyword] = 0
                leaf.pop("minItems", None)
                leaf.pop("minLength", None)
                leaf.pop("minProperties", None)


def _leaves(schema: JsonSchema, kind: str, nested: bool = True) -> Iterator[JsonSchema]:
    """The schemas of JSON type `kind` within `schema`: through anyOf/oneOf/allOf and, if
    `nested`, array items (not through $ref: a shared component is not this field's)."""
    if not isinstance(schema, dict):
        return
    if _has_type(schema, kind):
        yield schema
    for keyword in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(keyword, ()):
            yield from _leaves(sub, kind, nested)
    if nested and isinstance(schema.get("items"), dict):
        yield from _leaves(schema["items"], kind, nested)
    if nested:
        for sub in schema.get("prefixItems", ()):
            yield from _leaves(sub, kind, nested)


def _has_type(schema: JsonSchema, kind: str) -> bool:
    declared = schema.get("type")
    return declared == kind or (isinstance(declared, list) and kind in declared)


def _cap(schema: JsonSchema, maximum: int) -> None:
    current = schema.get("maximum")
    schema["maximum"] = maximum if current is None else min(current, maximum)


def _exact_integer_bounds(schema: JsonSchema) -> None:
    """Integer bounds as ints. pydantic writes them as doubles, which round above 2**53:
    the only such bounds in our models are the signed 64-bit limits, so a bound past them
    is read as the limit."""
    for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(keyword)
        if isinstance(value, float) and value.is_integer():
            schema[keyword] = min(max(int(value), INT64_MIN), INT64_MAX)


def _resolve(root: JsonSchema, schema: Any) -> Any:
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            key = part.replace("~1", "/").replace("~0", "~")
            target = target.get(key, {}) if isinstance(target, dict) else {}
        schema, seen = target, seen + 1
    return schema


def _operations(root: JsonSchema) -> Iterator[tuple[str, JsonSchema]]:
    for path_item in root.get("paths", {}).values():
        for method in HTTP_METHODS:
            operation = path_item.get(method)
            if isinstance(operation, dict):
                yield method, operation


def _parameters(root: JsonSchema) -> Iterator[JsonSchema]:
    """Every parameter: of the path items (shared by their operations) and of each operation."""
    for path_item in root.get("paths", {}).values():
        yield from (_resolve(root, p) for p in path_item.get("parameters", ()))
    for _, operation in _operations(root):
        yield from (_resolve(root, p) for p in operation.get("parameters", ()))


def _request_body_schemas(root: JsonSchema) -> list[JsonSchema]:
    """Each distinct JSON request body schema (resolved), once."""
    found: dict[int, JsonSchema] = {}
    for _, operation in _operations(root):
        content = _resolve(root, operation.get("requestBody", {})).get("content", {})
        for media_type, entry in content.items():
            if "json" in media_type and isinstance(entry, dict):
                body = _resolve(root, entry.get("schema"))
                if isinstance(body, dict):
                    found[id(body)] = body
    return list(found.values())


def _declare_400(root: JsonSchema, operation: JsonSchema) -> None:
    """The server answers invalid requests 400 with an ErrorResponse (errors.py), never
    FastAPI's 422 with an HTTPValidationError."""
    responses = operation.get("responses")
    if not isinstance(responses, dict) or "422" not in responses:
        return
    del responses["422"]
    if "400" not in responses:
        responses["400"] = {"description": "Bad Request"}
        if "ErrorResponse" in root.get("components", {}).get("schemas", {}):
            responses["400"]["content"] = {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


def _unique_operation_ids(root: JsonSchema) -> None:
    """FastAPI gives every method of a multi-method route one operationId, named after one
    of the methods ("health_health_head" for GET /health too): name each one's own."""
    operations = [(method, op) for method, op in _operations(root) if "operationId" in op]
    counts: dict[str, int] = {}
    for _, op in operations:
        counts[op["operationId"]] = counts.get(op["operationId"], 0) + 1
    seen: set[str] = set()
    for method, op in operations:
        op_id = op["operationId"]
        if counts[op_id] > 1:
            stem, _, suffix = op_id.rpartition("_")
            op_id = f"{stem if stem and suffix in HTTP_METHODS else op_id}_{method}"
        while op_id in seen:
            op_id += "_"
        op["operationId"] = op_id
        seen.add(op_id)


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            yield ref.rsplit("/", 1)[1]
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def _drop_unreferenced_components(root: JsonSchema) -> None:
    """Component schemas nothing refers to any more (HTTPValidationError, ...)."""
    schemas = root.get("components", {}).get("schemas")
    if not isinstance(schemas, dict):
        return
    components = root["components"]
    reachable: set[str] = set()
    pending = list(_refs({k: v for k, v in root.items() if k != "components"}))
    pending += _refs({k: v for k, v in components.items() if k != "schemas"})
    while pending:
        name = pending.pop()
        if name not in reachable and name in schemas:
            reachable.add(name)
            pending.extend(_refs(schemas[name]))
    for name in list(schemas):
        if name not in reachable:
            del schemas[name]
