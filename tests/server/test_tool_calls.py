"""Tool calling through the server on the tiny random model (SmolLM2's tokenizer and chat
template, which has no tool support: pagedlm describes the tools itself and the model
answers in the Hermes format). The weights are random, so a call with valid arguments
under tool_choice required or a named function is the grammar's doing; under auto the
output is forced into a call's text with a regex, to check the parsing path."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, TINY_NAME, stream_tool_calls

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "pattern": "^[0-9+*/() -]{1,12}$"}},
        "required": ["expression"], "additionalProperties": False}}}
TOOLS = [WEATHER, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}]


def check_calls(tool_calls, allowed=tuple(SCHEMAS)):
    assert tool_calls, "a call was forced"
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in tool_calls}) == len(tool_calls)


def test_required_forces_valid_calls(client):
    r = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        n=4, temperature=1.0, seed=11, max_completion_tokens=300)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)


def test_named_function_and_no_parallel_calls(client):
    r = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, tools=TOOLS, seed=4, temperature=1.0, n=3,
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        max_completion_tokens=200)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, allowed=("calculator",))
    r = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=7,
        temperature=1.0, n=3, parallel_tool_calls=False, max_completion_tokens=200)
    for choice in r.choices:
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_streamed_tool_calls_match_the_whole_response(client):
    kwargs = dict(model=TINY_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  temperature=0, max_completion_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = stream_tool_calls(client.chat.completions.create(**kwargs,
                                                                            stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


# Under tool_choice auto the random model would only babble: a regex makes it write a
# call's text (with a sentence before it), which the Hermes parser must turn into a call.
FORCED_TEXT = ('Checking the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def _regex(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_out_of_the_text(client, stream):
    r = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto", stream=stream,
        max_completion_tokens=100, extra_body={"guided_regex": _regex(FORCED_TEXT)})
    if stream:
        content, calls, finish = stream_tool_calls(r)
    else:
        choice = r.choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [c.model_dump() for c in choice.message.tool_calls]
    assert content == "Checking the weather."  # no markup in the content
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_tool_choice_none_leaves_the_text_alone(client):
    r = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
        max_completion_tokens=100, extra_body={"guided_regex": _regex(FORCED_TEXT)})
    choice = r.choices[0]
    assert choice.message.content == FORCED_TEXT and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_cut_short_call_finishes_with_length(client):
    r = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
        max_completion_tokens=12, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert "<tool_call>" not in (choice.message.content or "")


def test_history_with_calls_and_results_goes_back_in(client):
    """An agent's second turn: the assistant's call and the tool's result are in the
    history; the model answers (here: in the forced call format again, to check it)."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {
                "name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    r = client.chat.completions.create(model=TINY_NAME, messages=history, tools=TOOLS,
                                       max_completion_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools' descriptions and results are in


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [CALC, {"type": "function", "function": {
        "name": "g", "parameters": {"type": "string", "pattern": "(unclosed"}}}]},
     "tools[1].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    body = {"model": TINY_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param), error
    server.assert_alive()
