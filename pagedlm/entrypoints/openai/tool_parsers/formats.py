"""How each model family writes tool calls (a ToolCallFormat each: data, not code), the
registry of them, the choice of one for a chat template, and what a format derives: call
ids, the text that teaches a template without tool support, the grammar that forces a call."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedlm.entrypoints.openai.tool_parsers.schema import closed_objects, hoist_definitions


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
            parameters = hoist_definitions(closed_objects(parameters), f"tool{i}_",
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
