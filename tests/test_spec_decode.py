"""Speculative decoding (n-gram proposals, verified in one step): outputs identical to
decoding without it, greedy and seeded sampling alike, under batching, chunked prefill,
preemption, prefix hits and sliding windows; the sampled distribution is the target's
(chi-square); blocks exact after every step; back-off; metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.config import EngineArgs, SpeculativeConfig
from pagedlm.core.request import Request
from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_io import CoreRequest
from pagedlm.engine.spec_decode import NGRAM_REST_STEPS, NgramProposer
from pagedlm.engine.stats import EngineStats
from pagedlm.loader.model_loader import resolve_model_source
from tests.conftest import _save_tiny, requires_smollm2, smollm2_path

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    """A tiny Llama over 32 tokens with peaked distributions: its outputs repeat, so
    n-gram drafts are often right (and often wrong)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-peaked"), LlamaConfig, LlamaForCausalLM,
                      seed=3, vocab_size=32, initializer_range=0.6)


@pytest.fixture(scope="module")
def draft_dir(peaked_dir, tmp_path_factory):
    """The peaked model with noise on its weights: a draft that agrees with it often,
    not always."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(peaked_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.25 * p.std())
    path = tmp_path_factory.mktemp("tiny-draft")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _spec_config(method: str, draft: str | None = None) -> dict:
    if method == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-sliding"), MistralConfig,
                      MistralForCausalLM, seed=4, vocab_size=64, initializer_range=0.5,
                      sliding_window=24)


def _prompts(vocab: int, n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (a pattern of 3-7 tokens), so lookups find them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pattern = rng.integers(1, vocab, size=int(rng.integers(3, 8))).tolist()
        out.append((pattern * (length // len(pattern) + 1))[:length])
    return out


def _generate(model: str, prompts, params, **kw) -> tuple[list[list[int]], list, EngineStats]:
    llm = LLM(model, skip_tokenizer_init=True, seed=0, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            llm.stats())


# ----- the proposer ------------------------------------------------------------------------


def _request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=100), seed=0)


def test_ngram_proposes_what_followed_the_most_recent_occurrence():
    proposer = NgramProposer(SpeculativeConfig(**{**NGRAM, "prompt_lookup_min": 2}), 8)
    proposer.match_slack = None  # as many drafts as k, however short the match
    r = _request([1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    proposer.propose([r])
    assert r.spec_token_ids == [4, 5, 6, 7]  # after "1 2 3" at 4..6, not at 0..2
    r2 = _request([1, 2, 3, 4, 5], "r2")  # nothing repeats
    proposer.propose([r2])
    assert r2.spec_token_ids == []
    r3 = _request([7, 8, 7, 8, 7, 8], "r3")
    proposer.propose([r3])
    assert r3.spec_token_ids == [7, 8]  # the continuation ends where the sequence does


def test_drafts_follow_the_length_of_the_match():
    config = SpeculativeConfig(**{**NGRAM, "num_speculative_tokens": 6, "prompt_lookup_min": 2})
    proposer = NgramProposer(config, 8)
    # "1 2 3" matches at 4..6, and the token before agrees too (8 and 8): a match of 4
    # tokens, so at most 3 drafts.
    r = _request([8, 1, 2, 3, 5, 6, 9, 8, 1, 2, 3, 4, 5, 6, 7, 0, 0, 8, 1, 2, 3])
    proposer.propose([r])
    assert r.spec_token_ids == [4, 5, 6]
    # Only the 2-gram itself agrees: one draft.
    r2 = _request([4, 1, 2, 7, 7, 7, 5, 1, 2], "r2")
    proposer.propose([r2])
    assert r2.spec_token_ids == [7]
    # A long copy: the match reaches the start, far more than k + 1 tokens: all k drafts.
    passage = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    r3 = _request(passage + [0] + passage[:9], "r3")
    proposer.propose([r3])
    assert r3.spec_token_ids == passage[9:] + [0] + passage[:2]  # 6 drafts
    # The match ends at the start of the sequence: 4 tokens (the 3-gram and the 3), 3 drafts.
    r4 = _request([3, 4, 5, 6, 9, 3, 4, 5, 6], "r4")
    proposer.propose([r4])
    assert r4.spec_token_ids == [9, 3, 4]
    # match_slack 2: at most m - 2, at least one.
    proposer.match_slack = 2
    r5 = _request([8, 1, 2, 3, 5, 6, 9, 8, 1, 2, 3], "r5")
    proposer.propose([r5])
    assert r5.spec_token_ids == [5, 6]
    r6 = _request([4, 1, 2, 7, 7, 7, 5, 1, 2], "r6")
    proposer.propose([r6])
    assert r6.spec_token_ids == [7]


def test_index_grows_with_the_sequence():
    proposer = NgramProposer(SpeculativeConfig(**{**NGRAM, "prompt_lookup_min": 2}), 8)
    proposer.match_slack = None
    r = _request([5, 6, 1, 2])
    proposer.propose([r])
    assert r.spec_token_ids == []
    r.spec_token_ids = []
    for t in [9, 9, 5, 6]:
        r.append_output_token(t)
    proposer.propose([r])
    assert r.spec_token_ids == [1, 2, 9, 9]


def test_back_off_per_request_and_per_batch():
    proposer = NgramProposer(SpeculativeConfig(**NGRAM), 8)
    proposer.match_slack = None  # the count alone decides
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    r = _request(tokens)
    proposer.propose([r])
    assert len(r.spec_token_ids) == 3  # [3, 1, 2]: what is left after the match
    for expected in (4, 3, 2, 1):  # each verification with nothing accepted: one fewer
        drafts = [1] * expected
        proposer.record({"r": drafts}, {})
    r.spec_token_ids = []
    for _ in range(NGRAM_REST_STEPS):  # resting
        proposer.propose([r])
        assert r.spec_token_ids == []
    proposer.propose([r])
    assert len(r.spec_token_ids) == 1  # then one draft again
    proposer.record({"r": [3]}, {"r": [3]})  # all accepted: one more
    r.spec_token_ids = []
    proposer.propose([r])
    assert len(r.spec_token_ids) == 2
    stats = proposer.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 11, 1)
    assert stats.accepted_per_pos[0] == 1
    # Some of more accepted: as many next time (n-gram drafts cost nothing to propose)...
    long = _request([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], "long")
    proposer.propose([long])
    assert long.spec_token_ids == [3, 4, 5, 6]  # all 4 (NGRAM's k) to start with
    proposer.record({"long": [3, 4, 5, 6]}, {"long": [3]})
    long.spec_token_ids = []
    proposer.propose([long])
    assert long.spec_token_ids == [3, 4, 5, 6]
    # ... or, with the draft model's rule, at most those and one.
    proposer.partial_extra = 1
    proposer.record({"long": [3, 4, 5, 6]}, {"long": [3]})
    long.spec_token_ids = []
    proposer.propose([long])
    assert long.spec_token_ids == [3, 4]
    proposer.record({"long": [3, 4]}, {"long": [3, 4]})  # all accepted: one more again
    long.spec_token_ids = []
    proposer.propose([long])
    assert long.spec_token_ids == [3, 4, 5]
    # More decoding sequences than disable_by_batch_size: no drafts for anyone.
    small = NgramProposer(SpeculativeConfig(**{**NGRAM, "disable_by_batch_size": 1}), 8)
    a, b = _request(tokens, "a"), _request(tokens, "b")
    small.propose([a, b])
    assert a.spec_token_ids == b.spec_token_ids == []


def test_draft_model_must_share_the_vocabulary(peaked_dir, tiny_llama_dir):
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the model 32"):
        LLM(peaked_dir, skip_tokenizer_init=True, kv_cache_memory=4 << 20,
            speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                "num_speculative_tokens": 2})


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        EngineArgs(speculative_config={**NGRAM, "typo": 1})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineArgs(speculative_config={**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="method"):
        EngineArgs(speculative_config='{"method": "eagle", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineArgs(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


# ----- exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("case", ["batch", "chunked_prefill", "preemption", "prefix_hits"])
def test_greedy_outputs_identical(peaked_dir, draft_dir, case, method):
    prompts = _prompts(32, 6)
    kw: dict = dict(kv_cache_memory=4 << 20, max_model_len=256)
    if case == "chunked_prefill":
        kw["max_num_batched_tokens"] = 24
    if case == "preemption":
        kw["kv_cache_memory"] = 160 << 10  # 20 blocks of 16: six sequences do not fit
    if case == "prefix_hits":
        prompts = prompts[:3] + [p[:32] + [9, 9] for p in prompts[:3]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain, _, plain_stats = _generate(peaked_dir, prompts, params, **kw)
    spec, _, stats = _generate(peaked_dir, prompts, params,
                               speculative_config=_spec_config(method, draft_dir), **kw)
    assert spec == plain
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # rejections too
    assert stats.num_generation_tokens == plain_stats.num_generation_tokens
    if case == "preemption":
        assert stats.num_preemptions > 0
    if case == "prefix_hits":
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "sliding"])
def test_greedy_identical_across_architectures(tiny_models, sliding_dir, arch):
    path = sliding_dir if arch == "sliding" else tiny_models[arch]
    vocab = 64 if arch == "sliding" else 512
    prompts = _prompts(vocab, 4, length=60, seed=1)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    kw = dict(kv_cache_memory=4 << 20, max_model_len=256)
    plain, _, _ = _generate(path, prompts, params, **kw)
    spec, _, stats = _generate(path, prompts, params, speculative_config=NGRAM, **kw)
    assert spec == plain
    assert stats.spec_num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_penalties_and_logprobs_identical(peaked_dir, draft_dir, method):
    """Each position samples with the noise step, penalties and min_tokens it would have
    had without speculation: the same tokens and the same logprobs."""
    prompts = _prompts(32, 5, seed=2)
    params = [SamplingParams(temperature=0.8, top_k=8, top_p=0.95, seed=i, max_tokens=50,
                             ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.2,
                             frequency_penalty=0.1, min_tokens=10, logprobs=3)
              for i in range(len(prompts))]
    kw = dict(kv_cache_memory=4 << 20, max_model_len=256)
    plain, plain_lps, _ = _generate(peaked_dir, prompts, params, **kw)
    spec, spec_lps, stats = _generate(peaked_dir, prompts, params,
                                      speculative_config=_spec_config(method, draft_dir), **kw)
    assert spec == plain
    assert stats.spec_num_draft_tokens > 0
    if method == "ngram":  # a greedy draft model rarely guesses these samples right
        assert stats.spec_num_accepted_tokens > 0
    for a, b in zip(plain_lps, spec_lps):
        assert len(a) == len(b)
        for pa, pb in zip(a, b):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)


def test_stops_max_tokens_and_n(peaked_dir):
    prompts = _prompts(32, 4, seed=3)
    stop_ids = [prompts[0][5], prompts[1][3]]
    params = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=stop_ids)
              for m in (7, 13, 30, 1)]
    params.append(SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=25, ignore_eos=True))
    prompts.append(prompts[0])
    kw = dict(kv_cache_memory=4 << 20, max_model_len=256)
    llm_plain = LLM(peaked_dir, skip_tokenizer_init=True, **kw)
    llm_spec = LLM(peaked_dir, skip_tokenizer_init=True, speculative_config=NGRAM, **kw)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    a = llm_plain.generate(reqs, params, use_tqdm=False)
    b = llm_spec.generate(reqs, params, use_tqdm=False)
    for x, y, p in zip(a, b, params):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        assert [o.finish_reason for o in x.outputs] == [o.finish_reason for o in y.outputs]
        assert all(len(o.token_ids) <= p.max_tokens for o in y.outputs)
    assert llm_spec.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_blocks_exact_after_every_step(peaked_dir, draft_dir, method):
    """Rejected drafts give their blocks back: the pool's counts are exact after every
    step, under preemption, and every block is free at the end (the draft model's pool
    too: it holds no block beyond its mirrors' tokens)."""
    args = EngineArgs(model=peaked_dir, skip_tokenizer_init=True, kv_cache_memory=160 << 10,
                      max_model_len=256, speculative_config=_spec_config(method, draft_dir))
    core = EngineCore(args, resolve_model_source(peaked_dir), eos_token_ids=())
    try:
        for i, p in enumerate(_prompts(32, 6, seed=4)):
            params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
            core.add_request(CoreRequest(f"r{i}", p, params, seeds=[i], max_tokens=70,
                                         arrival_time=0.0))
        kv, sched = core.kv_cache_manager, core.scheduler
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
            live = list(sched.running) + list(sched.waiting)
            kv.check_invariants(live)
            sched.check_invariants()
            for r in sched.running:  # no block beyond the request's tokens is held
                held = len(kv.req_to_blocks.get(r.request_id, ()))
                assert held <= kv.num_blocks_needed(r.num_tokens + 1 + 4), (r, held)
            if method == "draft_model":
                draft = core.proposer
                draft.kv.check_invariants([m.request for m in draft._mirrors.values()])
                assert set(draft._mirrors) <= {r.request_id for r in live}
        assert kv.num_free_blocks == kv.num_blocks
        if method == "draft_model":
            assert core.proposer.kv.num_free_blocks == core.proposer.kv.num_blocks
        stats = core.get_stats()
        assert stats.spec_num_accepted_tokens > 0 and stats.num_preemptions > 0
        assert stats.num_generation_tokens == 6 * 70 and steps < 6 * 70
    finally:
        core.shutdown()


# ----- the distribution --------------------------------------------------------------------


def _chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (Wilson-Hilferty)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_distribution_is_the_targets(peaked_dir):
    """Chi-square: the 24th token of 3000 seeded samples with speculation (drafts verified
    all along, some accepted, most rejected) against the model's own distribution there,
    from 3000 samples without speculation under other seeds (a homogeneity test; fixed
    seeds, so the outcome is fixed too)."""
    prompt = _prompts(32, 1, length=30, seed=5)[0]
    n = 3000
    kw = dict(kv_cache_memory=32 << 20, max_model_len=128, max_num_seqs=256)

    def last_tokens(seed0: int, spec: bool) -> tuple[list[int], EngineStats]:
        params = [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=24,
                                 ignore_eos=True) for i in range(n)]
        extra = dict(speculative_config={**NGRAM, "disable_by_batch_size": 4096}) if spec else {}
        tokens, _, stats = _generate(peaked_dir, [prompt] * n, params, **kw, **extra)
        return [t[-1] for t in tokens], stats

    plain, _ = last_tokens(0, spec=False)
    spec, stats = last_tokens(100_000, spec=True)
    assert stats.spec_num_draft_tokens > 10_000  # speculation was at work
    assert 500 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    a, b = np.bincount(plain, minlength=32), np.bincount(spec, minlength=32)
    keep = (a + b) >= 20  # pool the rare tokens into one cell
    cells_a = np.append(a[keep], a[~keep].sum())
    cells_b = np.append(b[keep], b[~keep].sum())
    if cells_a[-1] + cells_b[-1] == 0:
        cells_a, cells_b = cells_a[:-1], cells_b[:-1]
    total = cells_a + cells_b
    expected = total / 2
    stat = float((((cells_a - expected) ** 2 + (cells_b - expected) ** 2) / expected).sum())
    dof = len(total) - 1
    assert dof >= 3
    assert _chi2_sf(stat, dof) > 1e-3, (stat, dof, cells_a.tolist(), cells_b.tolist())


# ----- SmolLM2 and metrics -----------------------------------------------------------------


@requires_smollm2
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_smollm2_greedy_identical(method):
    text = ("Copy this list exactly, twice:\n- apples, pears, plums\n- bread, butter, jam\n"
            "- tea, coffee, milk\n")
    params = SamplingParams(temperature=0, max_tokens=48)
    kw = dict(kv_cache_memory=64 << 20, max_model_len=512)
    llm = LLM(smollm2_path(), **kw)
    prompts = [text, "The capital of France is"]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    # The draft: SmolLM2 itself (no smaller model with its tokenizer is at hand), run by
    # the draft's own worker and KV cache.
    config = _spec_config(method, smollm2_path())
    llm = LLM(smollm2_path(), speculative_config=config, **kw)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    assert llm.stats().spec_num_accepted_tokens > 0


def test_prometheus_names():
    from prometheus_client import generate_latest

    from pagedlm.entrypoints.openai.metrics import _EngineCollector

    class Engine:
        stats = EngineStats(num_blocks_total=10, num_blocks_free=10, block_size=16,
                            num_tokens_held=0, num_preemptions=0, num_requests_running=0,
                            num_requests_waiting=0, spec_num_drafts=5, spec_num_draft_tokens=20,
                            spec_num_accepted_tokens=7, spec_accepted_per_pos=(4, 2, 1, 0))

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(_EngineCollector(Engine(), "m"))
    text = generate_latest(registry).decode()
    assert 'pagedlm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'pagedlm:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'pagedlm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert ('pagedlm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'
            ' 2.0') in text
    assert Engine.stats.spec_acceptance_rate == 7 / 20
    assert Engine.stats.spec_mean_acceptance_length == 1 + 7 / 5


# ----- the benchmark -----------------------------------------------------------------------


def test_repeating_workload_selection():
    from pagedlm.benchmarks.spec_decode import repeat_share, sample_repeating

    text = " ".join(f"word{i}" for i in range(80))
    assert repeat_share(text, text) == 1.0
    assert repeat_share(text, "something else entirely, in other words and terms, here") == 0.0

    class Tok:
        def __call__(self, s):
            return type("E", (), {"input_ids": s.split()})()

    records = [{"conversations": [{"value": text}, {"value": "Fixed: " + text}]},
               {"conversations": [{"value": text}, {"value": " ".join(["other"] * 60)}]}]
    picked = sample_repeating(Tok(), 1, 0, 50, records)
    assert len(picked) == 1 and picked[0].output_len == 50  # capped
    with pytest.raises(ValueError, match="only 1 repeating"):
        sample_repeating(Tok(), 2, 0, 50, records)


@requires_smollm2
def test_bench_spec_decode_runs(tmp_path):
    import json

    from pagedlm.entrypoints.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "spec-decode", "--num-prompts", "1", "--throughput-prompts", "2",
                 "--throughput-pairs", "2", "--max-output-len", "8", "--kv-cache-memory", "64M",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    for workload in ("repeat", "sharegpt"):
        result = report["batch1"][workload]
        assert result["off"]["output_tokens"] == result["on"]["output_tokens"] > 0
        assert result["latency_ratio_off_over_on"] > 0
        (row,) = result["requests"]
        assert row["same_output"] and row["off"]["output_tokens"] == result["off"]["output_tokens"]
        for name in ("off", "on"):
            m = result[name]
            assert 0 < m["ttft_ms"] <= m["seconds"] * 1e3  # one request: its first token
            assert 0 < m["first_token_share"] <= 1
            assert 0 < m["mean_tpot_ms"] <= m["seconds"] * 1e3  # 8 tokens: 7 after the first
    throughput = report["throughput"]
    assert len(throughput["pairs"]) == 2
    ratios = sorted(p["on"]["output_tokens_per_s"] / p["off"]["output_tokens_per_s"]
                    for p in throughput["pairs"])
    assert throughput["ratio_min"] == ratios[0] and throughput["ratio_max"] == ratios[1]
    assert ratios[0] <= throughput["ratio_on_over_off"] <= ratios[1]
    assert report["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 15}


def test_draft_proposer_goes_dormant_when_drafts_fail_and_probes():
    """A proposer with min_recent_acceptance: after enough failed verifications, new
    sequences do not speculate, except one in PROBE_EVERY; good results wake it up."""
    from pagedlm.engine.spec_decode import PROBE_EVERY, RECENT

    proposer = NgramProposer(SpeculativeConfig(**NGRAM), 8)
    proposer.min_recent_acceptance = 0.15
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    for i in range(RECENT):
        proposer.record({f"old{i}": [1, 2]}, {})  # nothing accepted
    assert proposer.dormant()
    speculating = 0
    for i in range(PROBE_EVERY):
        r = _request(tokens, f"new{i}")
        proposer.propose([r])
        speculating += bool(r.spec_token_ids)
    assert speculating == 1  # the probe
    for i in range(RECENT):
        proposer.record({f"good{i}": [1, 2]}, {f"good{i}": [1, 2]})
    assert not proposer.dormant()
    r = _request(tokens, "after")
    proposer.propose([r])
    assert r.spec_token_ids


def test_bench_batch1_stops_on_differing_outputs_unless_allowed_to_count_them():
    """`bench spec-decode` checks greedy equality per request; --allow-divergence (q8
    weights) counts the requests that part instead."""
    from types import SimpleNamespace

    from pagedlm.benchmarks.datasets import SampleRequest
    from pagedlm.benchmarks.spec_decode import batch1
    from pagedlm.outputs import RequestMetrics

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return [1, 2, 3]

    class Engine:
        def __init__(self, replies):
            self.replies = iter(replies)
            self.llm_engine = SimpleNamespace(reset_prefix_cache=lambda: None)

        def get_tokenizer(self):
            return Tok()

        def generate(self, prompt, params, use_tqdm):
            tokens = next(self.replies)
            metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.0005, finished_time=0.001)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], metrics=metrics)]

    requests = [SampleRequest("a", 3, 2), SampleRequest("b", 3, 2), SampleRequest("c", 3, 2)]
    off = [[5, 6], [7, 8], [9, 9]]
    on = [[5, 6], [7, 1], [9, 9]]  # the second request parts
    with pytest.raises(RuntimeError, match="request 1: greedy outputs differ"):
        batch1({"off": Engine(off), "on": Engine(on)}, requests)
    result = batch1({"off": Engine(off), "on": Engine(on)}, requests, allow_divergence=True)
    assert result["num_differing"] == 1 and result["num_requests"] == 3
    assert result["off"]["output_tokens"] == result["on"]["output_tokens"] == 6
    assert result["off"]["ttft_ms"] == result["on"]["ttft_ms"] == pytest.approx(0.5)  # from the metrics
    assert result["off"]["tpot_ms"] == result["off"]["mean_tpot_ms"] == pytest.approx(0.5)
    # Each request's tokens after its first take 0.5 ms: the last one's four here. TPOT
    # pooled is 1.5 ms / 6 tokens; vLLM's mean TPOT, the mean of 0.5, 0.5 and 0.125 ms.
    on = [[5, 6], [7, 1], [9, 9, 9, 9, 9]]
    result = batch1({"off": Engine(off), "on": Engine(on)}, requests, allow_divergence=True)
    assert result["on"]["tpot_ms"] == pytest.approx(0.25)
    assert result["on"]["mean_tpot_ms"] == pytest.approx(0.375)
    assert result["mean_tpot_ratio_off_over_on"] == pytest.approx(0.5 / 0.375)
    rows = result["requests"]
    assert [r["same_output"] for r in rows] == [True, False, False]
    assert [r["on"]["output_tokens"] for r in rows] == [2, 2, 5]
    assert [r["on"]["tpot_ms"] for r in rows] == pytest.approx([0.5, 0.5, 0.125])
    assert all(r["prompt_tokens"] == 3 and r["max_tokens"] == 2 and r["off"]["ttft_ms"] == pytest.approx(0.5)
               for r in rows)
