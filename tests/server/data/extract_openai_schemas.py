"""Extract OpenAI's published response schemas into `openai_schemas.json` (next to this file).

The server tests validate every response body against OpenAI's *official* OpenAPI
description (https://github.com/openai/openai-openapi, file `openapi.yaml`), through
`tests/server/openai_schema.py`. That file is ~3 MB of YAML, so this script keeps only
what the tests need: the transitive `$ref` closure of

    CreateChatCompletionResponse, CreateChatCompletionStreamResponse,
    CreateCompletionResponse, ListModelsResponse, Model, ErrorResponse, Error

written as plain JSON Schema (Draft 2020-12, the dialect of OpenAPI 3.1):

    {"source": {"repository": ..., "commit": ..., "file": ...},
     "schemas": {"<Name>": <schema>, ...}}

with every `#/components/schemas/<Name>` reference rewritten to `#/schemas/<Name>`
(resolved against this JSON document). OpenAPI-isms are converted or dropped:

* `nullable: true` (OpenAPI 3.0, still used in places of the 3.1 spec) becomes an
  explicit `null`: `"type": T` -> `"type": [T, "null"]` (plus `null` in `enum`), and a
  schema without `type` (e.g. a lone `$ref`) -> `{"anyOf": [<schema>, {"type": "null"}]}`;
* `discriminator` and `x-*` extensions are dropped (no meaning in JSON Schema);
* `description`, `example`, `examples` are dropped to keep the file small.

Everything else -- in particular the `required` lists -- is kept exactly as published:
the point is to check the server against OpenAI's contract, not against our own reading
of it. The tests never run this script (nor need PyYAML); they only read its output.

Regenerate (the spec repository has no releases; record the commit it came from):

    git clone https://github.com/openai/openai-openapi /tmp/openai-openapi
    python tests/server/data/extract_openai_schemas.py /tmp/openai-openapi/openapi.yaml

The commit is read with `git rev-parse HEAD` in the YAML file's directory (when the file
is tracked there and unmodified); pass `--commit SHA` otherwise (e.g. it came from
`git --git-dir=... show SHA:openapi.yaml > openapi.yaml`). The output is deterministic
(sorted keys, indent 1), so regenerating from the same commit gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Error",
)
COMPONENT_PREFIX = "#/components/schemas/"
OUTPUT_PREFIX = "#/schemas/"
DEFAULT_OUTPUT = Path(__file__).with_name("openai_schemas.json")
DROPPED_KEYS = {"description", "example", "examples", "discriminator"}
# Keywords whose value is a map from names to subschemas (the names are not keywords).
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
# Keywords whose value is data, not a schema: copied verbatim.
DATA_KEYWORDS = {"enum", "const", "default", "required"}


def iter_refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from iter_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from iter_refs(value)


def ref_name(ref: str) -> str:
    if not ref.startswith(COMPONENT_PREFIX) or "/" in ref[len(COMPONENT_PREFIX):]:
        raise ValueError(f"unsupported $ref {ref!r} (only {COMPONENT_PREFIX}<Name>)")
    return ref[len(COMPONENT_PREFIX):]


def closure(components: dict[str, Any], roots: tuple[str, ...]) -> list[str]:
    """Names of `roots` and every component schema they reach through `$ref`."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in components:
            raise KeyError(f"component schema {name!r} not found in the spec")
        seen.add(name)
        todo.extend(ref_name(ref) for ref in iter_refs(components[name]))
    return sorted(seen)


def convert(node: Any) -> Any:
    """An OpenAPI schema object -> a Draft 2020-12 JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [convert(value) for value in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    nullable = False
    for key, value in node.items():
        if key in DROPPED_KEYS or key.startswith("x-"):
            continue
        if key == "nullable":
            nullable = bool(value)
        elif key == "$ref":
            out[key] = OUTPUT_PREFIX + ref_name(value)
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS:
            out[key] = {name: convert(sub) for name, sub in value.items()}
        else:
            out[key] = convert(value)
    if nullable:
        out = allow_null(out)
    return out


def allow_null(schema: dict[str, Any]) -> dict[str, Any]:
    if "type" not in schema or "const" in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    schema = dict(schema, type=types if "null" in types else [*types, "null"])
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    return schema


def git_commit(path: Path) -> str | None:
    """HEAD of the work tree holding `path`, if the file is tracked there and unmodified."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True,
                              text=True, check=True).stdout.strip()
    try:
        git("ls-files", "--error-unmatch", "--", path.name)
        git("diff", "--quiet", "HEAD", "--", path.name)
        return git("rev-parse", "HEAD") or None
    except (OSError, subprocess.CalledProcessError):
        return None


def extract(spec: dict[str, Any], repository: str, commit: str, file: str) -> dict[str, Any]:
    components = spec["components"]["schemas"]
    names = closure(components, ROOTS)
    schemas = {name: convert(components[name]) for name in names}
    # Every reference must resolve inside the output.
    for ref in iter_refs(schemas):
        assert ref.startswith(OUTPUT_PREFIX) and ref[len(OUTPUT_PREFIX):] in schemas, ref
    return {
        "source": {"repository": repository, "commit": commit, "file": file},
        "schemas": schemas,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="path to openapi.yaml")
    parser.add_argument("--repository", default="openai/openai-openapi")
    parser.add_argument("--commit", help="commit of the spec (default: git rev-parse HEAD)")
    parser.add_argument("--file", help="path of the spec inside the repository "
                        "(default: the file's name)")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    commit = args.commit or git_commit(args.spec)
    if not commit:
        parser.error(f"{args.spec} is not a tracked, unmodified file of a git work tree: "
                     "pass --commit")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(args.spec, encoding="utf-8") as f:
        spec = yaml.load(f, Loader=loader)  # noqa: S506 (a safe loader)
    document = extract(spec, args.repository, commit, args.file or args.spec.name)
    text = json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}: {len(document['schemas'])} schemas, {len(text)} bytes "
          f"(from {args.repository}@{commit}:{document['source']['file']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
