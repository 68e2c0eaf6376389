"""Structured outputs in the engine: masks applied exactly, every finished output valid
across temperatures, seeds and n > 1, the same tokens through preemption and prefix hits,
EOS only where the grammar accepts, max_tokens ending a grammar early with "length", and
a matcher error ending only its own request. The tiny model has random weights and
SmolLM2's tokenizer: what it writes is what the grammar allowed."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm import LLM, SamplingParams, StructuredOutputsParams
from pagedlm.structured import apply_bitmask
from tests.server.conftest import tiny_model_dir  # noqa: F401 - the fixture

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "colour": {"enum": ["red", "green", "blue"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "colour", "age"], "additionalProperties": False}
# [0-9], not \d: llguidance's \d (Rust) matches every Unicode digit of a newer Unicode
# than this Python's re knows.
REGEX = r"[a-z]{1,4}(-[0-9]{2}){1,2}"
CHOICES = ["north", "south", "east", "west"]


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def _constraint(kind: str) -> StructuredOutputsParams:
    return {"json": StructuredOutputsParams(json=PERSON),
            "regex": StructuredOutputsParams(regex=REGEX),
            "choice": StructuredOutputsParams(choice=CHOICES)}[kind]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):  # noqa: F811
    return LLM(tiny_model_dir, kv_cache_memory=16 << 20, max_model_len=512, seed=0)


def test_apply_bitmask_matches_a_reference_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    rows = torch.tensor([4, 0, 2])
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(70):
            word, bit = divmod(t, 32)
            if not (int(bitmask[i, word]) >> bit) & 1:
                expected[row, t] = float("-inf")
    apply_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["json", "regex", "choice"]),
       temperature=st.sampled_from([0.0, 0.6, 1.0, 1.8]), seed=st.integers(0, 2**31),
       n=st.sampled_from([1, 3]))
def test_every_finished_output_is_valid(llm, kind, temperature, seed, n):
    params = SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=80,
                            structured_outputs=_constraint(kind))
    out = llm.generate(["Answer:"], params, use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", (kind, c)
        assert _valid(kind, c.text), (kind, c.text)


def _batch(kinds_seeds):
    prompts, params = [], []
    for i, (kind, seed) in enumerate(kinds_seeds):
        prompts.append("A prefix long enough to fill whole KV blocks, shared by every request "
                       "of this batch so that the prefix cache finds its blocks again; "
                       f"number {i % 3}:")
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=60, n=2,
                                     structured_outputs=_constraint(kind)))
    return prompts, params


def test_preemption_and_prefix_hits_keep_the_tokens(tiny_model_dir):  # noqa: F811
    batch = [(k, s) for s in range(4) for k in ("json", "regex", "choice")]
    prompts, params = _batch(batch)
    roomy = LLM(tiny_model_dir, kv_cache_memory=16 << 20, max_model_len=256, seed=0,
                enable_prefix_caching=False)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    # A cache too small for the batch: sequences are preempted and recomputed; prefix
    # caching shares the prompts.
    tight = LLM(tiny_model_dir, kv_cache_memory=24 * 8192, max_model_len=256,  # 24 blocks
                seed=0, block_size=16, enable_prefix_caching=True, max_num_seqs=64)
    got = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    for (kind, _), a, b in zip(batch, expected, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(c.finish_reason == "stop" and _valid(kind, c.text) for c in b.outputs)
    core = tight.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert len(core.structured) == 0


def test_eos_only_where_the_grammar_accepts(llm, monkeypatch):
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    eos = llm.llm_engine.eos_token_ids[0]
    original = runner.model.compute_logits

    def eos_loving(hidden):  # the model wants to stop at once, every step
        logits = original(hidden)
        logits[:, eos] = 1e4
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", eos_loving)
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=40,
                                             structured_outputs=_constraint("json")),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    free = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert free.outputs[0].token_ids == [eos]  # unconstrained, it stops at once


def test_max_tokens_ends_a_grammar_with_length(llm):
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=1, max_tokens=3,
                                             structured_outputs=_constraint("json")),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3 and c.text.startswith("{")


def test_a_matcher_error_ends_only_its_request(llm, monkeypatch):
    manager = llm.llm_engine.core.structured
    original = manager.consume
    first: dict[str, str] = {}

    def consume(seq_id, token_id):  # the first sequence to sample fails
        if first.setdefault("id", seq_id) == seq_id:
            return False, "the structured-output matcher failed: injected"
        return original(seq_id, token_id)

    monkeypatch.setattr(manager, "consume", consume)
    outs = llm.generate(["a", "b"], [
        SamplingParams(temperature=1.0, seed=2, max_tokens=30, structured_outputs=_constraint("regex")),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=_constraint("choice")),
    ], use_tqdm=False)
    failed = [o for o in outs if o.error is not None]
    ok = [o for o in outs if o.error is None]
    assert len(failed) == 1 and "injected" in failed[0].error
    assert len(ok) == 1
    kind = "regex" if ok[0] is outs[0] else "choice"
    assert ok[0].outputs[0].finish_reason == "stop" and _valid(kind, ok[0].outputs[0].text)
    core = llm.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_tensor_parallel_ranks_get_the_same_masks(tiny_model_dir):  # noqa: F811
    """With two ranks the bitmask follows the step to rank 0 once filled: the same
    constrained outputs as one process, also while a long prompt is prefilled in chunks
    beside constrained decodes (steps where some ranks' masks are not sampled from)."""
    prompts, params = _batch([(k, s) for s in range(2) for k in ("json", "regex", "choice")])
    prompts = [*prompts, "a long prompt " * 30]
    params = [*params, params[0]]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(tiny_model_dir, kv_cache_memory=16 << 20, max_model_len=256, seed=0,
                  tensor_parallel_size=tp, max_num_batched_tokens=32)
        try:
            outputs[tp] = [[c.token_ids for c in o.outputs]
                           for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    assert outputs[1] == outputs[2]
