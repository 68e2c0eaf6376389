"""The offline API on a tiny model: prompt forms, validation, n > 1, abort, stats."""

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.engine.output_processor import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
               max_model_len=256)


def _free(llm):
    s = llm.stats()
    return s.num_blocks_free == s.num_blocks_total and s.num_requests_running == 0


def test_prompt_forms_and_order(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [9] * 30}], params,
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [9] * 30]
    single = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time
    assert _free(llm)


def test_per_prompt_sampling_params(llm):
    ps = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}], ps, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([{"prompt_token_ids": [1]}], ps, use_tqdm=False)


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 10_000]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 256}, "maximum context length"),
    ("text prompt", "skip_tokenizer_init"),
    (42, "must be a string"),
])
def test_bad_prompts_are_clear_errors(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert _free(llm)


def test_max_tokens_over_context_names_both_counts(llm):
    with pytest.raises(ValueError, match=r"prompt has 200 tokens and max_tokens is 100"):
        llm.generate({"prompt_token_ids": [1] * 200}, SamplingParams(max_tokens=100), use_tqdm=False)


def test_bad_batch_adds_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    assert _free(llm) and not llm.llm_engine.has_unfinished_requests()


def test_max_tokens_none_fills_context(llm):
    out = llm.generate({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6


def test_request_longer_than_whole_cache_is_rejected(tiny_llama_dir):
    # 8 blocks of 4 tokens = 32 tokens of cache, model context 512.
    small = LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=8 * 2048)
    assert small.llm_engine.max_model_len == 32
    with pytest.raises(ValueError, match="maximum context length"):
        small.generate({"prompt_token_ids": [1] * 40}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="larger than the KV cache"):
        LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=8 * 2048,
            max_model_len=64)


def test_n_samples_seeded_and_distinct(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert _free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=10,
                          ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = greedy[3]
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    first = greedy.index(stop_at)
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_engine_streaming_and_abort(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("stream", None, params, prompt_token_ids=[1, 2, 3],
                       output_kind=RequestOutputKind.DELTA)
    engine.add_request("other", None, params, prompt_token_ids=[4, 5, 6])
    deltas = []
    for _ in range(5):
        for out in engine.step():
            if out.request_id == "stream":
                deltas.append(out.outputs[0].token_ids)
    assert all(len(d) == 1 for d in deltas) and len(deltas) == 5
    assert engine.get_stats().num_blocks_free < engine.get_stats().num_blocks_total
    aborted = engine.abort_request("stream")
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    engine.abort_request(["other", "unknown-id"])
    assert _free(llm) and not engine.has_unfinished_requests()


def test_kv_usage_recording(tiny_llama_dir):
    for caching in (False, True):
        rec = LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
                  record_kv_usage=True, enable_prefix_caching=caching)
        rec.generate([{"prompt_token_ids": [1] * 10}] * 3, SamplingParams(max_tokens=5, ignore_eos=True),
                     use_tqdm=False)
        samples = rec.llm_engine.kv_usage
        assert samples and all(s.allocated_slots >= s.tokens_held for s in samples)
        first = samples[0]
        assert first.tokens_held_unshared == 30
        if not caching:
            # Three requests of 10 prompt tokens after the first step: 3 blocks each.
            assert first.allocated_slots == 3 * 3 * 4 and first.tokens_held == 30
        else:
            # The second and third find the first's two full blocks: 3 + 1 + 1 blocks,
            # 8 shared tokens + 3 x 2 private ones.
            assert first.allocated_slots == 5 * 4 and first.tokens_held == 14


def test_unknown_engine_option():
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(max_num_sequences=3)


def test_offline_prompts_are_not_spread_next_to_decodes(tiny_llama_dir):
    """The offline LLM computes a new prompt whole while another request decodes (nobody
    reads its tokens before the end, and every extra step runs the model again); an engine
    built for serving bounds it (CPU default 64 tokens), and an explicit bound holds."""
    from pagedlm.config import EngineArgs
    from pagedlm.engine.core_sizing import DEFAULT_CPU_PREFILL_WITH_DECODES
    from pagedlm.engine.llm_engine import LLMEngine

    opts = dict(skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
                max_model_len=256, max_num_batched_tokens=128)

    def computed_in_one_step(engine) -> int:
        engine.add_request("decoding", None, SamplingParams(max_tokens=20, ignore_eos=True),
                           prompt_token_ids=[3, 4, 5])
        engine.step()  # its prompt; it decodes from now on
        engine.add_request("long", None, SamplingParams(max_tokens=2, ignore_eos=True),
                           prompt_token_ids=list(range(1, 101)))
        engine.step()
        computed = engine.scheduler.requests["long"].num_computed_tokens
        while engine.has_unfinished_requests():
            engine.step()
        return computed

    offline = LLM(tiny_llama_dir, **opts).llm_engine
    assert offline.scheduler.config.max_prefill_tokens_with_decodes == 128  # the step budget
    assert computed_in_one_step(offline) == 100
    bounded = LLM(tiny_llama_dir, max_prefill_tokens_with_decodes=8, **opts).llm_engine
    assert computed_in_one_step(bounded) == 8
    served = LLMEngine(EngineArgs(model=tiny_llama_dir, **opts))
    assert served.scheduler.config.max_prefill_tokens_with_decodes == DEFAULT_CPU_PREFILL_WITH_DECODES
    assert computed_in_one_step(served) == DEFAULT_CPU_PREFILL_WITH_DECODES



def test_step_token_budget_defaults(tiny_llama_dir):
    """On CPU a step batches 512 tokens unless told otherwise, and a longer prompt is
    prefilled in chunks of that size; with chunked prefill off the budget grows to the
    context (a whole prompt must fit one step) instead of refusing to start."""
    from pagedlm.config import EngineArgs
    from pagedlm.engine.core_sizing import DEFAULT_CPU_BATCHED_TOKENS, max_num_batched_tokens

    assert DEFAULT_CPU_BATCHED_TOKENS == 512
    assert max_num_batched_tokens(EngineArgs(), "cpu", 8192) == 512
    assert max_num_batched_tokens(EngineArgs(), "cuda", 8192) == 8192
    assert max_num_batched_tokens(EngineArgs(max_num_batched_tokens=64), "cpu", 8192) == 64
    off = EngineArgs(enable_chunked_prefill=False)
    assert max_num_batched_tokens(off, "cpu", 8192) == 8192
    assert max_num_batched_tokens(EngineArgs(enable_chunked_prefill=False, max_model_len=3000),
                                  "cpu", 8192) == 3000
    assert max_num_batched_tokens(off, "cpu", 100) == 512
    assert max_num_batched_tokens(EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=64),
                                  "cpu", 8192) == 64  # the user's, refused later if too small

    # An engine: a prompt longer than the budget takes several steps.
    opts = dict(skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 23, max_model_len=512)
    engine = LLM(tiny_llama_dir, max_num_batched_tokens=128, **opts).llm_engine
    engine.add_request("long", None, SamplingParams(max_tokens=1, ignore_eos=True),
                       prompt_token_ids=list(range(1, 301)))
    engine.step()
    assert engine.scheduler.requests["long"].num_computed_tokens == 128
    assert LLM(tiny_llama_dir, **opts).llm_engine.scheduler.config.max_num_batched_tokens == 512
