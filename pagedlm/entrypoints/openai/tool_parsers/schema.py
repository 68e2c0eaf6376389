"""The rewrites a function's parameter schema gets before it goes inside a forcing grammar:
object schemas closed to undeclared properties, and local definitions moved to the root."""

from __future__ import annotations

from typing import Any

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """`schema` with additionalProperties false on every object schema that lists
    properties and sets neither additionalProperties nor patternProperties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(s) for k, s in out[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if ("properties" in out and "additionalProperties" not in out
            and "patternProperties" not in out):
        out["additionalProperties"] = False
    return out


def hoist_definitions(schema: dict[str, Any], prefix: str,
                      definitions: dict[str, Any]) -> dict[str, Any]:
    """A parameter schema moved inside a bigger one: its `$defs`/`definitions` go to the
    root (renamed with `prefix`, so tools cannot collide) and its local refs follow them."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for base in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(base):
                        out["$ref"] = "#/$defs/" + prefix + ref[len(base):]
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, definition in local.items():
        definitions[prefix + name] = rewrite(definition)
    return rewrite(schema)
