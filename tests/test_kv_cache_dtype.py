"""A KV cache stored narrower than the model computes (kv_cache_dtype)."""

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.attention.cpu_paged import cpu_kernels_available

PROMPTS = [[1, 5, 9, 200, 31, 7, 7, 90], [1, *range(40, 75)], [3]]


def _generate(path, **kw):
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22, **kw)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_narrow_cache_same_tokens_on_every_backend(tiny_llama_dir, kv_dtype):
    backends = ["reference", "torch"] + (["cpu"] if cpu_kernels_available() else [])
    results = {}
    for backend in backends:
        llm, outs = _generate(tiny_llama_dir, kv_cache_dtype=kv_dtype, attention_backend=backend)
        k_cache = llm.llm_engine.runner.kv_caches[0][0]
        assert str(k_cache.dtype) == f"torch.{kv_dtype}"
        results[backend] = [o.outputs[0].token_ids for o in outs]
    # Every backend reads the same rounded cache, so greedy tokens agree exactly.
    assert all(tokens == results["reference"] for tokens in results.values()), results


def test_float16_cache_close_to_float32_and_twice_the_blocks(tiny_llama_dir):
    llm32, outs32 = _generate(tiny_llama_dir)
    llm16, outs16 = _generate(tiny_llama_dir, kv_cache_dtype="half")
    assert llm16.llm_engine.kv_cache_dtype != llm32.llm_engine.kv_cache_dtype
    # Same memory budget, half the bytes per block.
    assert llm16.stats().num_blocks_total >= 2 * llm32.stats().num_blocks_total - 2
    for a, b in zip(outs32, outs16):
        for pos in range(1, len(a.prompt_token_ids)):
            tok = a.prompt_token_ids[pos]
            assert b.prompt_logprobs[pos][tok].logprob == pytest.approx(
                a.prompt_logprobs[pos][tok].logprob, abs=2e-2)


def test_rejects_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(load_format="dummy", kv_cache_dtype="int4")
