"""Storage narrower than the compute: kv_cache_dtype and weight_dtype (CPU)."""

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
        k_cache = llm.llm_engine.model_executor.driver_worker.model_runner.kv_caches[0][0]
        assert str(k_cache.dtype) == f"torch.{kv_dtype}"
        results[backend] = [o.outputs[0].token_ids for o in outs]
    # Every backend reads the same rounded cache, so greedy tokens agree exactly.
    assert all(tokens == results["reference"] for tokens in results.values()), results


def test_float16_cache_close_to_float32_and_twice_the_blocks(tiny_llama_dir):
    llm32, outs32 = _generate(tiny_llama_dir)
    llm16, outs16 = _generate(tiny_llama_dir, kv_cache_dtype="half")
    assert llm16.llm_engine.model_executor.driver_worker.kv_cache_dtype != llm32.llm_engine.model_executor.driver_worker.kv_cache_dtype
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


def test_float16_weights_close_to_float32(tiny_llama_dir):
    """weight_dtype='float16': every linear layer and the LM head holds float16 weights
    (fbgemm's packing, or float16 panels without fbgemm); results within float16 rounding
    of the weights, greedy tokens unchanged here."""
    import torch

    from pagedlm.layers.fp16_weights import Fp16WeightMatmul, fp16_weights_supported
    from pagedlm.layers.panel_weights import PanelWeightMatmul, panel_kernels

    if panel_kernels() is None and not fp16_weights_supported():
        pytest.skip("neither the panel kernel nor fbgemm")
    llm32, outs32 = _generate(tiny_llama_dir)
    llm16, outs16 = _generate(tiny_llama_dir, weight_dtype="float16")
    model = llm16.llm_engine.model_executor.driver_worker.model

    def float16_matmul(m):
        mm = getattr(m, "weight_kernel", None)
        return isinstance(mm, Fp16WeightMatmul) or (
            isinstance(mm, PanelWeightMatmul) and mm.panels.dtype == torch.float16)

    packed = [m for m in model.modules() if float16_matmul(m)]
    num_layers = len(model.model.layers)
    assert len(packed) == 4 * num_layers + 1  # qkv, o, gate_up, down per layer + LM head
    for a, b in zip(outs32, outs16):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos in range(1, len(a.prompt_token_ids)):
            tok = a.prompt_token_ids[pos]
            assert b.prompt_logprobs[pos][tok].logprob == pytest.approx(
                a.prompt_logprobs[pos][tok].logprob, abs=2e-3)


def test_fp16_weight_matmul_matches_rounded_weights():
    import torch

    from pagedlm.layers.fp16_weights import Fp16WeightMatmul, fp16_weights_supported

    if not fp16_weights_supported():
        pytest.skip("no fbgemm")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    bias = torch.randn(40, generator=g)
    mm = Fp16WeightMatmul(w)
    for rows in (1, 3, 17):
        x = torch.randn(2, rows, 24, generator=g)
        ref = torch.nn.functional.linear(x, w.half().float(), bias)
        torch.testing.assert_close(mm(x, bias), ref, atol=1e-4, rtol=1e-4)


def test_float16_weights_rejected_off_cpu_float32(tiny_llama_dir):
    with pytest.raises(ValueError, match="weight_dtype"):
        LLM(tiny_llama_dir, skip_tokenizer_init=True, dtype="bfloat16", weight_dtype="float16")
