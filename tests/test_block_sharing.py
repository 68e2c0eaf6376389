"""KV block sharing end to end on a tiny model: prefix caching, n > 1 with copy-on-write,
best_of, and beam search against HF transformers."""

import pytest
import torch

from pagedlm import LLM, BeamSearchParams, SamplingParams
from pagedlm.engine.frontend import derive_seed

SYSTEM = list(range(200, 222))  # 22 tokens: 5 full blocks of 4, then 2 tokens
USERS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24],
         [25, 26, 27, 28, 29], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
PROMPTS = [SYSTEM + u for u in USERS]


def _llm(path, **kw):
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, skip_tokenizer_init=True, block_size=4, **kw)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_prefix_caching_does_not_change_outputs(tiny_llama_dir, params):
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    off = _llm(tiny_llama_dir, enable_prefix_caching=False)
    on = _llm(tiny_llama_dir, enable_prefix_caching=True)
    expected = _tokens(off.generate(reqs, params, use_tqdm=False))
    assert _tokens(on.generate(reqs, params, use_tqdm=False)) == expected
    stats = on.stats()
    # All five are admitted in one step: the first computes the system prompt's five
    # full blocks, the other four find them (same-step hits), 20 tokens each.
    assert stats.prefix_cache_queries == sum(len(p) for p in PROMPTS)
    assert stats.prefix_cache_hits == 4 * 20
    # Run again: now every prompt also finds its own blocks from the first run.
    assert _tokens(on.generate(reqs, params, use_tqdm=False)) == expected
    hits_second = on.stats().prefix_cache_hits - 4 * 20
    assert hits_second == sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert on.stats().num_blocks_free == on.stats().num_blocks_total
    assert off.stats().prefix_cache_queries == 0


def test_prefix_caching_with_preemption_and_chunking(tiny_llama_dir):
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _tokens(_llm(tiny_llama_dir, enable_prefix_caching=False).generate(reqs, params, use_tqdm=False))
    small = _llm(tiny_llama_dir, kv_cache_memory=30 * 2048, max_num_batched_tokens=9, max_model_len=64)
    assert _tokens(small.generate(reqs, params, use_tqdm=False)) == expected
    assert small.stats().num_preemptions > 0 and small.stats().prefix_cache_hits > 0


def test_prompt_logprobs_requests_skip_the_cache(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert all(e is not None for e in b.prompt_logprobs[1:])
    assert [list(e) for e in a.prompt_logprobs[1:]] == [list(e) for e in b.prompt_logprobs[1:]]


def test_parallel_samples_share_the_prompt_and_match_independent_runs(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    prompt = PROMPTS[2]  # 29 tokens: the last prompt block is partly filled
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("x", None, params, prompt_token_ids=prompt)
    first = engine.scheduler.schedule  # observe the first step's work
    seen = []

    def spy():
        out = first()
        seen.append(out)
        return out

    engine.scheduler.schedule = spy
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        if len(seen) == 2:
            stats = engine.get_stats()
            assert stats.num_blocks_shared == len(prompt) // 4  # the full prompt blocks
            assert stats.num_tokens_held < stats.num_tokens_held_unshared
    engine.scheduler.schedule = first
    assert seen[0].total_num_scheduled_tokens == len(prompt)  # the prompt computed once
    assert engine.get_stats().num_block_copies == 3  # the partial block, per extra writer
    final = [o for o in outputs if o.finished][0]
    shared = [c.token_ids for c in final.outputs]
    alone = [
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=1.0, seed=derive_seed(11, i), max_tokens=10,
                                    ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        for i in range(4)
    ]
    assert shared == alone
    assert len({tuple(t) for t in shared}) > 1
    assert engine.get_stats().num_blocks_free == engine.get_stats().num_blocks_total


def test_best_of_returns_the_n_best_by_cumulative_logprob(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    all4 = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6,
                                               ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=6,
                                               ignore_eos=True), use_tqdm=False)[0]
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].logprobs is None  # not asked for
    assert best.outputs[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob, abs=1e-5)


def _hf_beams(model, prompt, width, max_tokens, length_penalty=1.0, eos=None):
    model.generation_config.eos_token_id = eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                             num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                             length_penalty=length_penalty, early_stopping=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = row[len(prompt):]
        if eos is not None and eos in gen:
            gen = gen[: gen.index(eos) + 1]  # HF pads finished beams after their EOS
        seqs.append((prompt + gen, score))
    return seqs


@pytest.mark.parametrize("width,eos,lp", [(3, None, 1.0), (4, "frequent", 1.0), (4, "frequent", 2.0)])
def test_beam_search_equals_hf(tiny_llama_dir, width, eos, lp):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22)
    if eos == "frequent":
        # Pick as EOS a token the model likes, so beams do finish early.
        greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6,
                              ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        eos = greedy[3]
    llm.llm_engine.eos_token_ids = () if eos is None else (eos,)
    llm.llm_engine.beam_search.eos_token_ids = llm.llm_engine.eos_token_ids
    params = BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=eos is None, length_penalty=lp)
    ours = llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
    ref = _hf_beams(hf, prompt, width, 10, lp, eos)
    assert [s.tokens for s in ours] == [r[0] for r in ref]
    for s, (_, score) in zip(ours, ref):
        assert s.score == pytest.approx(score, abs=1e-4)
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total and not llm.llm_engine.has_unfinished_requests()


def test_beam_search_shares_blocks_and_frees_pruned_beams(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    engine.eos_token_ids = ()
    peak_shared = []
    orig = engine.step

    def step():
        out = orig()
        s = engine.get_stats()
        peak_shared.append((s.num_blocks_shared, s.num_tokens_held, s.num_tokens_held_unshared))
        assert s.num_requests_running <= 8  # two groups of four beams
        return out

    engine.step = step
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[3]}],
                          BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
    assert len(out) == 2 and all(len(o.sequences) == 4 for o in out)
    assert max(p[0] for p in peak_shared) > 0
    assert any(p[1] < p[2] for p in peak_shared)
    assert engine.get_stats().num_blocks_free == engine.get_stats().num_blocks_total
