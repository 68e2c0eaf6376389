"""Tensor parallelism on CPU: ranks in worker processes, gloo on 127.0.0.1.

Two ranks must give what one gives, token for token (and prompt logprobs within 1e-4),
through chunked prefill, prefix-cache hits and preemption; seeded sampling the same. A
rank that dies is reported at once and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.executor import WorkerError

PROMPTS = [list(range(200, 222)) + [7, 8, 9, 10, 11], list(range(200, 222)) + [12, 13, 14],
           [5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41]]


def _llm(path, tp, **kw):
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, skip_tokenizer_init=True, block_size=4, tensor_parallel_size=tp,
               num_threads=1, **kw)


def _run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_two_ranks_equal_one_greedy_and_prompt_logprobs(tiny_models, arch):
    path = tiny_models[arch]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2,
                            logprobs=2)
    one_tokens, one = _run(_llm(path, 1), params)
    llm = _llm(path, 2)
    two_tokens, two = _run(llm, params)
    assert two_tokens == one_tokens
    for a, b in zip(one, two):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    llm.llm_engine.shutdown()


def test_two_ranks_sampling_chunking_prefix_hits_and_preemption(tiny_llama_dir):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    small = dict(kv_cache_memory=26 * 2048, max_num_batched_tokens=9, max_model_len=64)
    expected, _ = _run(_llm(tiny_llama_dir, 1, **small), params)
    llm = _llm(tiny_llama_dir, 2, **small)
    got, _ = _run(llm, params)
    assert got == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_blocks_free == stats.num_blocks_total
    llm.llm_engine.shutdown()


def test_heads_that_do_not_divide_are_refused_at_start(tiny_llama_dir):
    before = _children()
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by the "
                                         "tensor-parallel size \\(3\\)"):
        _llm(tiny_llama_dir, 3)
    assert _children() <= before


def test_a_killed_rank_fails_the_step_fast_and_leaves_no_process(tiny_llama_dir):
    before = _children()
    llm = _llm(tiny_llama_dir, 2)
    engine = llm.llm_engine
    procs = engine.model_executor.procs
    engine.add_request("a", None, SamplingParams(max_tokens=200, ignore_eos=True),
                       prompt_token_ids=PROMPTS[0])
    engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 .* died"):
        for _ in range(200):
            engine.step()
    assert time.monotonic() - start < 5
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(WorkerError):
        engine.step()
    assert _children() <= before
