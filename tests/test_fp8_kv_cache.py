"""A float8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2): per-layer scales, every backend.

The attention layer quantises the step's K and V (K / k_scale, clamped, rounded by torch)
and folds the scales into the softmax scale and the output, so backends only read float8
rows back. Each backend is checked against the reference on a float8 cache, the layer
against dense attention over the dequantised values, and the engine end to end.
"""

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention.backends import get_attention_backend
from pagedlm.attention.cpu_paged import cpu_kernels_available
from pagedlm.attention.reference import ReferenceAttention
from pagedlm.attention.testing import make_attention_case
from pagedlm.layers.attention import FP8_HEADROOM, FP8_MAX, Attention

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
BACKENDS = ["torch"] + (["cpu"] if cpu_kernels_available() else [])


def _layout(bs: int) -> list[tuple[int, int]]:
    # (num_computed, num_new): decodes first, then prefills and chunks across blocks.
    return [(0, 1), (bs - 1, 1), (3 * bs - 1, 1), (2 * bs + 5, 1),
            (0, bs), (0, 7), (bs, bs), (5, 2 * bs + 3), (0, 1)]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_read_float8_caches_as_the_reference_does(cache_dtype, backend):
    case = make_attention_case(_layout(8), num_heads=8, num_kv_heads=2, head_dim=64,
                               block_size=8, cache_dtype=cache_dtype)
    key, value = case.key.to(cache_dtype), case.value.to(cache_dtype)  # as the layer passes them
    k_ref, v_ref = case.clone_caches()
    k_got, v_got = case.clone_caches()
    ref = ReferenceAttention().forward(case.query, key, value, k_ref, v_ref, case.meta, case.scale)
    got = get_attention_backend(backend).forward(case.query, key, value, k_got, v_got,
                                                 case.meta, case.scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(k_got.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8))


def _dense(q, k, v, scale):  # one prefill of n tokens, causal; k/v [n, kvh, d]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1)  # [h, n, d]
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [h, n, n]
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return (s.softmax(-1) @ v).transpose(0, 1)  # [n, h, d]


@pytest.mark.parametrize("cache_dtype", FP8)
def test_layer_scales_fold_into_softmax_and_output(cache_dtype):
    """Attention over a float8 cache with scales equals dense attention over the values
    the cache stands for (k8 * k_scale, v8 * v_scale), and values beyond the range clamp."""
    g = torch.Generator().manual_seed(0)
    n, h, kvh, d, bs = 13, 4, 2, 32, 4
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(n, kvh, d, generator=g) * 3
    v = torch.randn(n, kvh, d, generator=g) * 0.01
    layer = Attention(h, d, d**-0.5, kvh, get_attention_backend("torch"))
    case = make_attention_case([(0, n)], num_heads=h, num_kv_heads=kvh, head_dim=d,
                               block_size=bs, cache_dtype=cache_dtype)
    layer.k_cache, layer.v_cache = case.clone_caches()
    layer.kv_amax = [0.0, 0.0]
    layer.forward(q, k, v, case.meta)  # calibration: records, then sets the scales
    layer.calibrate_fp8_scales()
    fmax = FP8_MAX[cache_dtype]
    assert layer.k_scale == pytest.approx(k.abs().max().item() * FP8_HEADROOM / fmax)
    assert layer.v_scale == pytest.approx(v.abs().max().item() * FP8_HEADROOM / fmax)

    def quantised(x, scale):
        return (x * (1.0 / scale)).clamp(-fmax, fmax).to(cache_dtype).float() * scale

    for outlier in (False, True):  # past the calibrated range: clamped, not inf or NaN
        if outlier:
            k[0, 0, 0] = 10 * k.abs().max()
        layer.k_cache, layer.v_cache = case.clone_caches()
        out = layer.forward(q, k, v, case.meta)
        want = _dense(q, quantised(k, layer.k_scale), quantised(v, layer.v_scale), d**-0.5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        if not outlier:  # and near the unquantised attention (a sanity bound)
            assert (out - _dense(q, k, v, d**-0.5)).abs().max() < 0.25 * v.abs().max()


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_engine_float8_cache_same_tokens_on_every_backend(tiny_llama_dir, kv):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)]}
               for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs, scales = {}, {}
    for backend in [*BACKENDS, "reference"]:
        llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, kv_cache_dtype=kv,
                  attention_backend=backend, kv_cache_memory=1 << 22, max_model_len=256)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)]
        worker = llm.llm_engine.core.model_executor.driver_worker
        assert worker.kv_cache_dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float8_e5m2)
        scales[backend] = [s for a in worker.model.attention_layers() for s in (a.k_scale, a.v_scale)]
    assert outs["torch"] == outs["reference"] and all(o == outs["torch"] for o in outs.values())
    # calibrated per layer, alike on every backend (their float sums differ a little), and
    # not left at 1.0
    for got in scales.values():
        assert got == pytest.approx(scales["torch"], rel=1e-4)
    assert all(0 < s != 1.0 for s in scales["torch"])


def test_kv_cache_dtype_names():
    from pagedlm.config import EngineArgs

    assert EngineArgs(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model="m", kv_cache_dtype="fp4")
