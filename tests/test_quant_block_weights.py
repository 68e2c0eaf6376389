"""GGUF quant-block weights (layers/quant_block_weights.py, csrc/block_gemv_cpu.cpp): exact recovery of
Q4_1 / Q8_0 blocks from dequantised float32 weights, the kernel against a float64
reference, dispatch by rows, and greedy decoding with and without it."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedlm.layers.quant_block_weights import (
    MAX_ROWS_OVER_FP32,
    MAX_ROWS_OVER_PACKED,
    QuantBlockMatmul,
    QuantBlockWeight,
    quant_block_kernels,
    recover_blocks,
)
from pagedlm.layers.quant_blocks import dequantize_raw
from tests.conftest import requires_smollm2, smollm2_path

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0

requires_kernel = pytest.mark.skipif(quant_block_kernels() is None,
                                     reason="block_gemv_cpu kernel cannot be built here")


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.int32)


def _assert_exact(weight: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    blocks = recover_blocks(weight, ggml_type)
    assert blocks is not None, f"{ggml_type.name} blocks not recovered"
    n, k = weight.shape
    assert blocks.shape == (n, k // 32, {Q4_1: 20, Q8_0: 34}[ggml_type])
    again = dequantize_raw(blocks.numpy().reshape(-1), ggml_type, (n, k))
    np.testing.assert_array_equal(again.view(np.int32), _bits(weight))
    return blocks


def _synthetic(ggml_type: GGMLQuantizationType, values: np.ndarray) -> torch.Tensor:
    """gguf's own quantiser, then our loader's dequantisation."""
    raw = quantize(values.astype(np.float32), ggml_type)
    return torch.from_numpy(dequantize_raw(raw.reshape(-1), ggml_type, values.shape))


# --------------------------------------------------------------------------------------------
# Recovery
# --------------------------------------------------------------------------------------------


@requires_smollm2
def test_recovery_exact_on_smollm2_tensors():
    from pagedlm.loader.gguf_loader import GGUFCheckpoint

    with GGUFCheckpoint(smollm2_path()) as ckpt:
        for name, ggml_type in [("blk.0.attn_q.weight", Q4_1), ("blk.7.ffn_down.weight", Q4_1),
                                ("blk.29.ffn_up.weight", Q4_1), ("token_embd.weight", Q8_0)]:
            assert ckpt.tensor_infos[name].ggml_type == ggml_type
            weight = torch.from_numpy(ckpt.read_array(name))
            blocks = _assert_exact(weight, ggml_type)
            found = QuantBlockWeight.recover(weight)
            assert found is not None and found.ggml_type == ggml_type
            torch.testing.assert_close(found.blocks, blocks, rtol=0, atol=0)


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_recovery_exact_on_synthetic_blocks(ggml_type):
    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal((4, 576)),
        rng.standard_normal((4, 576)) * 1e-4 + 3.0,   # offset far above the range (retries)
        rng.standard_normal((4, 576)) * 1e-3 - 40.0,
        rng.uniform(-1e-6, 1e-6, (2, 576)),           # float16 subnormal scales
        np.zeros((2, 576)),
        np.full((2, 576), 0.3),                        # constant blocks: d = 0
        rng.integers(-3, 4, (2, 576)).astype(np.float64),
    ]
    weight = _synthetic(ggml_type, np.concatenate(rows))
    _assert_exact(weight, ggml_type)


def test_random_float32_is_not_representable():
    torch.manual_seed(0)
    for weight in (torch.randn(64, 576), torch.rand(37, 32) * 1e-3):
        assert recover_blocks(weight, Q4_1) is None
        assert recover_blocks(weight, Q8_0) is None
        assert QuantBlockWeight.recover(weight) is None
    # One changed bit anywhere makes the whole weight not representable.
    weight = _synthetic(Q4_1, np.random.default_rng(1).standard_normal((8, 64)))
    assert recover_blocks(weight, Q4_1) is not None
    weight.view(torch.int32)[5, 40] += 1
    assert recover_blocks(weight, Q4_1) is None
    assert recover_blocks(torch.randn(8, 48), Q4_1) is None  # not whole blocks


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


def _gemv(ggml_type):
    ops = quant_block_kernels()
    return ops.q4_1_gemv if ggml_type == Q4_1 else ops.q8_0_gemv


@requires_kernel
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_kernel_matches_float64_reference(ggml_type, k):
    rng = np.random.default_rng(k)
    n = 37
    weight = _synthetic(ggml_type, rng.standard_normal((n, k)) * 0.05)
    blocks = recover_blocks(weight, ggml_type)
    gemv = _gemv(ggml_type)
    w64 = weight.double()
    worst = 0.0
    for m in range(1, 18):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        for bias in (None, torch.randn(n)):
            y = gemv(x, blocks, bias)
            ref = x.double() @ w64.T + (0 if bias is None else bias.double())
            # float32 sums of k terms, in any order: |error| <= k * eps * sum |x w|.
            bound = (x.double().abs() @ w64.abs().T) * k * 2.0**-24 + 1e-6
            err = (y.double() - ref).abs()
            worst = max(worst, err.max().item())
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert (err <= bound).all(), f"M={m} K={k}: max |diff| {err.max().item():.3g}"
    print(f"{ggml_type.name} K={k}: max |kernel - float64| = {worst:.3g}")


@requires_kernel
def test_kernel_checks_its_inputs():
    blocks = recover_blocks(_synthetic(Q4_1, np.ones((4, 64))), Q4_1)
    with pytest.raises(RuntimeError, match="features"):
        quant_block_kernels().q4_1_gemv(torch.randn(1, 32), blocks, None)
    with pytest.raises(RuntimeError, match="Q8_0|uint8"):
        quant_block_kernels().q8_0_gemv(torch.randn(1, 64), blocks, None)


@requires_kernel
def test_kernel_threads_give_identical_results():
    rng = np.random.default_rng(3)
    weight = _synthetic(Q4_1, rng.standard_normal((1000, 576)))
    blocks = recover_blocks(weight, Q4_1)
    x = torch.randn(5, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_block_kernels().q4_1_gemv(x, blocks, None)
        torch.set_num_threads(2)
        two = quant_block_kernels().q4_1_gemv(x, blocks, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, rtol=0, atol=0)  # a row's sum never splits


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return " avx512f" in next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False


@requires_kernel
@pytest.mark.skipif(not _has_avx512(), reason="the 16-lane path needs AVX-512 (8-lane tiles "
                    "split a row's sums by the tile's height)")
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ggml_type):
    """A speculative verification runs a request's k + 1 rows where plain decoding runs
    one, and a batch puts other requests' rows beside it: each row must come out the same
    bits whatever the tile's height, so that speculation changes no token."""
    rng = np.random.default_rng(7)
    blocks = recover_blocks(_synthetic(ggml_type, rng.standard_normal((300, 576)) * 0.05),
                            ggml_type)
    gemv = _gemv(ggml_type)
    x = torch.from_numpy(rng.standard_normal((17, 576)).astype(np.float32))
    alone = torch.cat([gemv(x[i:i + 1].contiguous(), blocks, None) for i in range(17)])
    for m in range(2, 18):
        torch.testing.assert_close(gemv(x[:m].contiguous(), blocks, None), alone[:m],
                                   rtol=0, atol=0)


@requires_kernel
def test_matmul_dispatches_by_rows():
    rng = np.random.default_rng(4)
    weight = _synthetic(Q4_1, rng.standard_normal((37, 96)))
    calls = []

    def fallback(x, bias):
        calls.append(x.shape)
        return torch.nn.functional.linear(x, weight, bias)

    matmul = QuantBlockMatmul(QuantBlockWeight.recover(weight), fallback, max_rows=6)
    bias = torch.randn(37)
    small = torch.randn(2, 3, 96)  # 6 rows in all
    y = matmul(small, bias)
    assert calls == [] and y.shape == (2, 3, 37)
    torch.testing.assert_close(y, torch.nn.functional.linear(small, weight, bias))
    large = torch.randn(7, 96)
    y = matmul(large, None)
    assert calls == [large.shape]
    torch.testing.assert_close(y, torch.nn.functional.linear(large, weight))


@requires_kernel
@pytest.mark.parametrize("fmt", ["F.linear", "panels", "float16"])
def test_weight_format_wraps_the_layers_other_format(fmt, monkeypatch):
    from pagedlm.layers import weight_format
    from pagedlm.layers.fp16_weights import Fp16WeightMatmul, fp16_weights_supported
    from pagedlm.layers.linear import DenseWeightKernel, ReplicatedLinear
    from pagedlm.layers.panel_weights import PanelWeightMatmul

    if fmt == "float16" and not fp16_weights_supported():
        pytest.skip("no fbgemm")
    if fmt == "F.linear":  # as without the panel kernel
        monkeypatch.setattr(weight_format, "panel_kernels", lambda: None)
    model = torch.nn.Sequential(ReplicatedLinear(64, 37, bias=True), ReplicatedLinear(64, 5, bias=False))
    weight = _synthetic(Q4_1, np.random.default_rng(5).standard_normal((37, 64)))
    model[0].weight.data.copy_(weight)
    model[0].bias.data.normal_()
    model[1].weight.data.normal_()  # not representable: keeps its path
    lines = weight_format.apply_weight_format(model, "float16" if fmt == "float16" else "auto")
    assert lines[-1] == "quant-block kernel for small batches on 1 layers (GGUF Q4_1/Q8_0 weights)"
    wrapper = model[0].weight_kernel
    assert isinstance(wrapper, QuantBlockMatmul)
    assert not isinstance(model[1].weight_kernel, QuantBlockMatmul)
    expected_fallback = {"F.linear": DenseWeightKernel, "panels": PanelWeightMatmul,
                         "float16": Fp16WeightMatmul}[fmt]
    assert type(wrapper.fallback) is expected_fallback
    if fmt == "F.linear":
        assert model[1].weight_kernel is None
    else:
        assert type(model[1].weight_kernel) is expected_fallback
    assert wrapper.max_rows == (MAX_ROWS_OVER_FP32 if fmt == "F.linear" else MAX_ROWS_OVER_PACKED)
    # The float32 copy is dropped where another format holds the weight, kept where F.linear
    # still reads it.
    assert (model[0].weight.numel() == 0) == (fmt != "F.linear")
    x = torch.randn(3, 64)  # the block path: the exact weights, not their float16 rounding
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, weight, model[0].bias))


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from pagedlm import LLM

    return LLM(kv_cache_memory=64 << 20)


def _block_layers(model):
    return [m for m in model.modules() if isinstance(getattr(m, "weight_kernel", None), QuantBlockMatmul)]


@requires_smollm2
@requires_kernel
@pytest.mark.slow
def test_greedy_same_tokens_with_and_without_kernel(llm):
    from pagedlm import SamplingParams

    model = llm.llm_engine.model_executor.driver_worker.model
    layers = _block_layers(model)
    assert len(layers) == 4 * 30 + 1  # qkv, o, gate_up, down per layer + the (tied) LM head
    assert {m.weight_kernel.ggml_type for m in layers} == {Q4_1, Q8_0}
    # float32 weights, packed in panels (layers/panel_weights.py) for larger inputs
    assert {m.weight_kernel.max_rows for m in layers} == {MAX_ROWS_OVER_PACKED}
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a haiku about the sea.",
                "List three primary colours.")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def greedy():  # one prompt at a time: every decode step is one row
        return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    with_kernel = greedy()
    wrappers = [(m, m.weight_kernel) for m in layers]
    try:
        for m, wrapper in wrappers:
            m.weight_kernel = wrapper.fallback
        without = greedy()
    finally:
        for m, wrapper in wrappers:
            m.weight_kernel = wrapper
    assert with_kernel == without
