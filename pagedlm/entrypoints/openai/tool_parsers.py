"""Tool calls in a model's output: the formats models write them in, an incremental parser
that turns the generated text into OpenAI `tool_calls` (whole or as stream deltas), the
grammar that forces a call with valid arguments (`tool_choice` required or a named
function), and, for a chat template that knows nothing of tools, the system prompt and
history text that teach the model the format.

    format        a call as the model writes it
    ------        ----------------------------
    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen;
                  a JSON list of calls inside the tags is read too, as SmolLM2 writes it)
    llama3_json   {"name": "f", "parameters": {...}}; {...}   (the whole output; Llama 3.x)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   (Mistral)

One parser serves streaming and whole responses: a whole response is the stream fed at
once, so the two always agree. The parser re-reads the text it has so far on every delta
and sends only what is new and can no longer change: content up to a possible start of a
call (a held-back `<tool_ca` or trailing whitespace), a call's id and name once its name
is complete, then its arguments as the raw JSON text grows. The arguments string is the
model's own text of the arguments object, byte for byte.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_CALL_FORMATS", "ToolCallFormat", "ToolCallParser", "ParsedToolCall",
           "ToolCallDelta", "choose_tool_call_format", "template_takes_tools"]


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """One piece of a streamed call: the first carries id and name, the rest arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class _Truncated(Exception):
    """The JSON text ends before the value does (more may come)."""


class _Malformed(Exception):
    """Not JSON at this point: the rest of the region is not a call."""


_WS = " \t\r\n"
_SCALAR_CHARS = frozenset("-+.0123456789eEtrufalsn")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """text[i] is '"': the index after the closing quote."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    raise _Truncated


def _value_end(text: str, i: int) -> int:
    """The index after the JSON value that starts at text[i]."""
    if i >= len(text):
        raise _Truncated
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        raise _Truncated
    j = i
    while j < len(text) and text[j] in _SCALAR_CHARS:
        j += 1
    if j == i:
        raise _Malformed
    if j == len(text):
        raise _Truncated  # a number may go on
    return j


@dataclass
class _CallScan:
    """A call object as far as the text goes."""

    name: str | None = None
    arguments: str = ""  # raw text of the arguments value so far
    arguments_done: bool = False
    complete: bool = False


_ARGUMENT_KEYS = ("arguments", "parameters")


def _scan_object(text: str, i: int) -> tuple[_CallScan, int | None]:
    """text[i] is '{': the call it describes and the index after it (None: not finished)."""
    call = _CallScan()
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return call, None
        c = text[i]
        if c == "}":
            call.complete = True
            call.arguments_done = True
            return call, i + 1
        if c == ",":
            i += 1
            continue
        if c != '"':
            raise _Malformed
        try:
            key_end = _string_end(text, i)
        except _Truncated:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            raise _Malformed
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return call, None
        try:
            end = _value_end(text, i)
        except _Truncated:
            if key in _ARGUMENT_KEYS and text[i] in "{[" and not call.arguments:
                call.arguments = text[i:]  # the object so far: streamable
            return call, None
        value = text[i:end]
        if key == "name":
            name = json.loads(value)
            call.name = name if isinstance(name, str) else None
        elif key in _ARGUMENT_KEYS and not call.arguments_done:
            if value.startswith('"'):  # arguments sent as a JSON string
                decoded = json.loads(value)
                value = decoded if isinstance(decoded, str) else value
            call.arguments, call.arguments_done = value, True
        i = end


def _scan_calls(body: str) -> list[_CallScan]:
    """The call objects in a region's text: one object, a JSON list of them, or several
    separated by whitespace, commas or semicolons. Stops at anything else."""
    calls: list[_CallScan] = []
    i = 0
    while True:
        i = _skip_ws(body, i)
        if i >= len(body):
            return calls
        c = body[i]
        if c in ",;[]":
            i += 1
            continue
        if c != "{":
            return calls
        try:
            call, end = _scan_object(body, i)
        except (_Malformed, ValueError):
            return calls
        if call.name is not None or end is None:
            calls.append(call)
        if end is None:
            return calls
        i = end


def _random_id(alphabet: str, length: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(length))


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls.

    start/end: the markers around calls (end None: the calls run to the end of the output);
    start None: the output is the calls if it begins with '{' (Llama 3's JSON).
    arguments_key: the key the family uses for the arguments object."""

    name: str
    start: str | None
    end: str | None
    arguments_key: str = "arguments"
    # The start marker is a special token in the family's tokenizers: the output must be
    # detokenized with special tokens kept, or the marker disappears.
    start_is_special: bool = False

    def new_id(self) -> str:
        if self.name == "mistral":  # Mistral's templates insist on 9 alphanumerics
            return _random_id(string.ascii_letters + string.digits, 9)
        return "call_" + secrets.token_hex(12)

    # ----- teaching a template without tool support -----------------------------------

    def call_text(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Past calls (name, arguments) as this format writes them, for a history."""
        texts = [self.call_text(name, args) for name, args in calls]
        if self.start is None:
            return "; ".join(texts)
        if self.end is None:
            return self.start + "[" + ", ".join(texts) + "]"
        return "\n".join(f"{self.start}\n{t}\n{self.end}" for t in texts)

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """Instructions listing the tools, for a chat template that cannot render them."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.render_calls([("function_name", {"argument": "value"})])
        return ("You can call the functions described below (JSON schemas) inside "
                f"<tools></tools>.\n<tools>\n{listing}\n</tools>\n"
                "To call a function, reply with the call and nothing else, in this form:\n"
                f"{example}\nIf no function is needed, answer in plain text.")

    # ----- forcing a call -------------------------------------------------------------

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool,
                special_start_id: int | None = None) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (or, with
        `parallel`, one or more) of one of `tools` (OpenAI function dicts), in this
        format, with arguments valid against the function's parameter schema. An object
        schema that lists its properties and says nothing of others takes no others here
        (as OpenAI's strict mode requires them to say): a forced call's arguments are the
        ones the function declares, not whatever a small model adds."""
        options = []
        definitions: dict[str, Any] = {}
        for i, tool in enumerate(tools):
            parameters = tool.get("parameters") or {"type": "object", "properties": {}}
            parameters = _hoist_definitions(_closed_objects(parameters), f"tool{i}_",
                                            definitions)
            options.append({
                "type": "object",
                "properties": {"name": {"const": tool["name"]},
                               self.arguments_key: parameters},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        if definitions:
            schema["$defs"] = definitions
        body = f"call_json: %json {json.dumps(schema, ensure_ascii=False)}\n"
        many = '("; " call_json)*' if parallel else ""
        if self.start is None:
            return f"start: call_json {many}\n{body}"
        start = (f"<[{special_start_id}]>" if special_start_id is not None
                 else json.dumps(self.start))
        if self.end is None:
            many = '("," call_json)*' if parallel else ""
            return f'start: {start} "[" call_json {many} "]"\n{body}'
        call = f'call: {start} "\\n" call_json "\\n" {json.dumps(self.end)}\n'
        first = 'start: call ("\\n" call)*\n' if parallel else "start: call\n"
        return first + call + body


_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _closed_objects(schema: Any) -> Any:
    """`schema` with additionalProperties false on every object schema that lists
    properties and sets neither additionalProperties nor patternProperties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed_objects(s) for k, s in out[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _closed_objects(out[key])
    if ("properties" in out and "additionalProperties" not in out
            and "patternProperties" not in out):
        out["additionalProperties"] = False
    return out


def _hoist_definitions(schema: dict[str, Any], prefix: str,
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


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (
        ToolCallFormat("hermes", "<tool_call>", "</tool_call>"),
        ToolCallFormat("llama3_json", None, None, arguments_key="parameters"),
        ToolCallFormat("mistral", "[TOOL_CALLS]", None, start_is_special=True),
    )
}


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a `tools` argument (else pagedlm describes the tools
    in a system prompt itself)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def choose_tool_call_format(chat_template: str | None, requested: str = "auto") -> ToolCallFormat:
    """`requested` (a TOOL_CALL_FORMATS name), or for "auto" the one the chat template
    writes; hermes when the template says nothing (pagedlm then teaches it)."""
    if requested != "auto":
        try:
            return TOOL_CALL_FORMATS[requested]
        except KeyError:
            raise ValueError(f"unknown tool call parser {requested!r}: use auto or one of "
                             f"{', '.join(TOOL_CALL_FORMATS)}") from None
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return TOOL_CALL_FORMATS["mistral"]
    if "<tool_call>" in template:
        return TOOL_CALL_FORMATS["hermes"]
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return TOOL_CALL_FORMATS["llama3_json"]
    return TOOL_CALL_FORMATS["hermes"]


def _find_outside_strings(text: str, marker: str, start: int) -> int:
    """The first `marker` at or after `start` that is not inside a JSON string (an argument
    may well contain the end marker's text); -1 if none."""
    in_string, i = False, start
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif text.startswith(marker, i):
            return i
        i += 1
    return -1


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _held_suffix(segment: str, marker: str) -> int:
    """How many trailing characters of a content segment to hold back: a partial start
    marker and the whitespace before it (a call may follow, and the whitespace before a
    call is not content)."""
    keep = len(segment) - _partial_marker(segment, marker)
    while keep > 0 and segment[keep - 1] in _WS:
        keep -= 1
    return len(segment) - keep


@dataclass
class _Analysis:
    content: str
    calls: list[_CallScan]


@dataclass
class ToolCallParser:
    """Feeds on one choice's generated text; returns what is new for the client."""

    format: ToolCallFormat
    text: str = ""
    finished: bool = False
    _sent_content: int = 0
    _ids: list[str] = field(default_factory=list)
    _sent_arguments: list[int] = field(default_factory=list)
    _calls: list[_CallScan] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """New content text and call deltas after `delta` is appended."""
        self.text += delta
        return self._update(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, once the output is complete (held-back text, a call cut short)."""
        self.finished = True
        return self._update(final=True)

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        """The calls so far (after finish(): all of them)."""
        return [ParsedToolCall(self._ids[i], call.name or "",
                               self._arguments(call, self.finished))
                for i, call in enumerate(self._calls[:len(self._ids)])]

    @staticmethod
    def _arguments(call: _CallScan, final: bool) -> str:
        if final and not call.arguments and call.complete:
            return "{}"
        return call.arguments

    def _update(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        analysis = self._analyse(final)
        content = analysis.content[self._sent_content:]
        self._sent_content = len(analysis.content)
        deltas: list[ToolCallDelta] = []
        self._calls = analysis.calls
        for i, call in enumerate(analysis.calls):
            if call.name is None:
                break  # later calls wait for this one's name: indexes stay in order
            if i == len(self._ids):
                self._ids.append(self.format.new_id())
                self._sent_arguments.append(0)
                deltas.append(ToolCallDelta(i, id=self._ids[i], name=call.name, arguments=""))
            arguments = self._arguments(call, final)
            if not call.arguments_done and not arguments.startswith(("{", "[")):
                continue  # a string or scalar: sent whole once complete
            new = arguments[self._sent_arguments[i]:]
            if new:
                self._sent_arguments[i] = len(arguments)
                if deltas and deltas[-1].index == i and deltas[-1].arguments == "":
                    deltas[-1].arguments = new
                else:
                    deltas.append(ToolCallDelta(i, arguments=new))
        return content, deltas

    def _analyse(self, final: bool) -> _Analysis:
        fmt, text = self.format, self.text
        if fmt.start is None:
            return self._analyse_json_output(final)
        content: list[str] = []
        calls: list[_CallScan] = []
        pos, after_call = 0, False
        while True:
            start = text.find(fmt.start, pos)
            segment = text[pos:] if start < 0 else text[pos:start]
            if after_call:
                segment = segment.lstrip(_WS)
            if start < 0:
                held = 0 if final else _held_suffix(segment, fmt.start)
                content.append(segment[:len(segment) - held])
                return _Analysis("".join(content), calls)
            body_start = start + len(fmt.start)
            end = _find_outside_strings(text, fmt.end, body_start) if fmt.end else -1
            closed = end >= 0 or final
            body = text[body_start:] if end < 0 else text[body_start:end]
            if not closed and fmt.end:
                # an end marker may be arriving: keep its first characters out of the body
                body = body[:len(body) - _partial_marker(body, fmt.end)]
            found = _scan_calls(body)
            named = [c for c in found if c.name is not None]
            if named:
                content.append(segment.rstrip(_WS))  # the whitespace before a call goes
                calls.extend(named if closed else found)
            elif end < 0 and final and body.lstrip(_WS).startswith(("{", "[")):
                content.append(segment.rstrip(_WS))  # a call cut short before its name
            elif closed:  # a region without a call in it was text after all
                content.append(segment)
                content.append(text[start:] if end < 0 else text[start:end + len(fmt.end)])
            else:  # undecided yet: hold the whitespace before it too
                content.append(segment.rstrip(_WS))
                return _Analysis("".join(content), calls)
            if end < 0:
                return _Analysis("".join(content), calls)
            pos, after_call = end + len(fmt.end), bool(named)

    def _analyse_json_output(self, final: bool) -> _Analysis:
        """Llama 3's JSON format: the whole output is calls if it starts with '{'."""
        text = self.text
        body = text.lstrip(_WS)
        tagged = body.startswith("<|python_tag|>")
        if tagged:
            body = body[len("<|python_tag|>"):].lstrip(_WS)
        if not body or (not tagged and "<|python_tag|>".startswith(body)):
            return _Analysis(text if final else "", [])  # undecided yet
        if not body.startswith("{"):
            return _Analysis(text, [])
        found = _scan_calls(body)
        if any(c.name is not None for c in found):
            return _Analysis("", found if not final else [c for c in found if c.name])
        return _Analysis(text if final else "", [])


