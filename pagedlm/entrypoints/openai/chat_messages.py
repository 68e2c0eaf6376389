"""OpenAI chat messages as the model's chat template takes them, tools included.

A template that renders `tools` (Hermes, Qwen, Llama 3.1, Mistral, ...) gets them, the
assistant messages' `tool_calls` (arguments as objects, as transformers' templates expect)
and the `tool` messages as they are. A template that knows nothing of tools (SmolLM2's)
gets the same conversation in words it does know: the tools described in the system
prompt, past calls as the assistant's text in the tool-call format, and the tools' results
as a user message in plain words (a model never taught a tool format answers from them
best so).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagedlm.entrypoints.openai.protocol.chat import ChatMessage
from pagedlm.entrypoints.openai.tool_parsers.formats import ToolCallFormat


def _text(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content or ""


def _role(message: ChatMessage) -> str:
    # Templates know system/user/assistant; OpenAI's newer "developer" is a system prompt.
    return "system" if message.role == "developer" else message.role


def _arguments(text: str) -> Any:
    """A call's arguments string as an object (what templates expect); the string itself
    when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def conversation(messages: Sequence[ChatMessage], *, tools: Sequence[dict[str, Any]] | None,
                 fmt: ToolCallFormat, template_takes_tools: bool) -> list[dict[str, Any]]:
    """`messages` as dicts for `apply_chat_template`. `tools` (OpenAI function dicts) is
    passed to the template separately when it takes them, else described here."""
    names = {call.id: call.function.name for m in messages for call in m.tool_calls or ()}
    if template_takes_tools:
        return [_native(m, names) for m in messages]
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn of the current round of results
    for message in messages:
        if message.role == "tool":
            name = names.get(message.tool_call_id or "", message.name) or "the function"
            block = f"The result of {name}: {_text(message)}"
            if results is not None:
                results["content"] += "\n" + block  # one turn for a round of results
            else:
                results = {"role": "user", "content": block}
                out.append(results)
            continue
        results = None
        entry = {"role": _role(message), "content": _text(message)}
        if message.tool_calls:
            calls = fmt.render_calls([(c.function.name, _arguments(c.function.arguments))
                                      for c in message.tool_calls])
            entry["content"] = (entry["content"] + "\n" if entry["content"] else "") + calls
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    if tools:
        prompt = fmt.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" if out[0]["content"] else "") + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _native(message: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": _role(message), "content": _text(message)}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls]
    if message.role == "tool":
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
            entry.setdefault("name", names.get(message.tool_call_id))
    return entry
