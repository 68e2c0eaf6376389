"""The integer GEMM over GGUF blocks (csrc/q8_gemm_cpu.cpp, layers/q8_weights.py) against a
float64 reference of the same maths (x rounded to int8 per 32 values, the blocks' exact
weights): every tile height, ragged panels, both formats, bias, thread counts, bad inputs;
Q8_0 rounding of float weights; weight_dtype='q8' end to end."""

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagedlm.layers.q8_weights import (
    Q8WeightMatmul,
    pack_blocks,
    q8_kernels,
    quantize_activations,
    quantize_q8_0,
    reference_matmul,
)
from pagedlm.layers.quant_blocks import dequantize_raw

pytestmark = pytest.mark.skipif(q8_kernels() is None, reason="the int8 kernel could not be built")


def random_q4_1(n, k, g):
    """Random Q4_1 blocks [n, k / 32, 20] and the float32 weight they hold."""
    b = k // 32
    blocks = torch.randint(0, 256, (n, b, 20), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, b, generator=g) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, b, generator=g) * 0.1).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(n, b, 2)
    blocks[..., 2:4] = m.view(torch.uint8).view(n, b, 2)
    qs = blocks[..., 4:20]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # value j: low nibble j, then high
    return blocks, (d.float()[..., None] * q + m.float()[..., None]).view(n, k)


def random_q8_0(n, k, g):
    """Random Q8_0 blocks [n, k / 32, 34] (q over the whole int8 range, -128 included)."""
    b = k // 32
    blocks = torch.randint(0, 256, (n, b, 34), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, b, generator=g) * 0.01 + 1e-4).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(n, b, 2)
    q = blocks[..., 2:34].contiguous().view(torch.int8).float()
    return blocks, (d.float()[..., None] * q).view(n, k)


FORMATS = {T.Q4_1: random_q4_1, T.Q8_0: random_q8_0}


def _check(x, blocks, weight, ggml_type, bias=None):
    y = Q8WeightMatmul(blocks, ggml_type)(x, bias)
    assert y.shape == (x.shape[0], weight.shape[0]) and y.dtype == torch.float32
    ref = reference_matmul(x, weight)
    if bias is not None:
        ref = ref + bias.double()
    # Exact integer sums; float32 only in the per-block scaling: K / 32 roundings.
    scale = ref.abs().max().item() + 1e-30
    assert (y.double() - ref).abs().max().item() <= 2e-6 * scale * max(1, x.shape[1] // 256)


@pytest.mark.parametrize("ggml_type", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 64])
def test_every_tile_height_matches_reference(rows, ggml_type):
    g = torch.Generator().manual_seed(rows)
    # 52 features = 7 panels of 8, the last ragged: with AVX-512 VNNI a four, a pair and
    # one alone (tile512x4, tile512, the narrow tile); elsewhere pairs and one alone
    blocks, weight = FORMATS[ggml_type](52, 96, g)
    x = torch.randn(rows, 96, generator=g)
    _check(x, blocks, weight, ggml_type, torch.randn(52, generator=g))
    _check(x, blocks, weight, ggml_type)


@pytest.mark.parametrize("ggml_type", list(FORMATS))
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (8, 576), (33, 1536), (9, 4096)])
def test_shapes_match_reference(n, k, ggml_type):
    g = torch.Generator().manual_seed(n * 1000 + k)
    blocks, weight = FORMATS[ggml_type](n, k, g)
    for rows in (1, 9):
        _check(torch.randn(rows, k, generator=g), blocks, weight, ggml_type)


def test_extreme_values_do_not_overflow():
    """Every weight at its largest magnitude against activations at +-127: the int16 sums of a
    Q4_1 block (8 groups of 2 * 15 * 127) and the Q8_0 products (2 * 128 * 127) stay in range."""
    n, k = 8, 64
    q4 = torch.zeros(n, k // 32, 20, dtype=torch.uint8)
    q4[..., 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # d = 1, m = 0
    q4[..., 4:] = 0xFF  # q = 15 everywhere
    q8 = torch.zeros(n, k // 32, 34, dtype=torch.uint8)
    q8[..., 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    q8[..., 2:] = 0x80  # q = -128 everywhere
    x = torch.full((3, k), 5.0)
    x[1] = -5.0
    x[2, ::2] = -5.0
    y4 = Q8WeightMatmul(q4, T.Q4_1)(x, None)
    y8 = Q8WeightMatmul(q8, T.Q8_0)(x, None)
    torch.testing.assert_close(y4, x.sum(1, keepdim=True).expand(3, n) * 15)
    torch.testing.assert_close(y8, x.sum(1, keepdim=True).expand(3, n) * -128)


def test_zero_rows_and_empty_input():
    g = torch.Generator().manual_seed(0)
    blocks, weight = random_q4_1(16, 64, g)
    mm = Q8WeightMatmul(blocks, T.Q4_1)
    x = torch.zeros(2, 64)  # block maximum 0: scale 0, no division by zero
    assert torch.equal(mm(x, None), torch.zeros(2, 16))
    assert mm(torch.empty(0, 64), None).shape == (0, 16)


def test_thread_counts_give_identical_results():
    g = torch.Generator().manual_seed(5)
    blocks, _ = random_q4_1(72, 576, g)
    mm = Q8WeightMatmul(blocks, T.Q4_1)
    x = torch.randn(23, 576, generator=g)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(mm(x, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("ggml_type", list(FORMATS))
def test_each_row_is_computed_as_if_alone(ggml_type):
    """Bit for bit, a row's result does not depend on the rows beside it: not on its place in
    a micro-kernel tile, nor on the chunk of rows it falls in (250 rows of 1536 features run
    in three chunks), nor on how many panels share its tile (52 features: 7 panels, a four,
    a pair and a ragged one alone where the CPU has AVX-512 VNNI)."""
    g = torch.Generator().manual_seed(11)
    blocks, weight = FORMATS[ggml_type](52, 1536, g)
    mm = Q8WeightMatmul(blocks, ggml_type)
    x = torch.randn(250, 1536, generator=g)
    together = mm(x, None)
    for i in range(x.shape[0]):
        assert torch.equal(together[i], mm(x[i : i + 1], None)[0]), f"row {i}"
    _check(x, blocks, weight, ggml_type)


def test_leading_dims_and_dtype_are_kept():
    g = torch.Generator().manual_seed(1)
    blocks, weight = random_q8_0(16, 64, g)
    x = torch.randn(2, 3, 64, generator=g)
    y = Q8WeightMatmul(blocks, T.Q8_0)(x, None)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y.view(6, 16), reference_matmul(x.view(6, 64), weight).float())


def test_bad_inputs_raise_clear_errors():
    kernels = q8_kernels()
    g = torch.Generator().manual_seed(0)
    packed, scales = pack_blocks(random_q4_1(8, 64, g)[0], T.Q4_1)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        kernels.q8_gemm(torch.randn(2, 40), packed, scales, 8, True, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        kernels.q8_gemm(torch.randn(2, 96), packed, scales, 8, True, None)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q8_gemm(torch.randn(2, 64).double(), packed, scales, 8, True, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.q8_gemm(torch.randn(2, 64), packed, scales, 8, True, torch.randn(3))
    with pytest.raises(ValueError, match="no integer kernel for Q6_K"):
        pack_blocks(torch.zeros(1, 1, 210, dtype=torch.uint8), T.Q6_K)


def test_activation_rounding():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    r, e = quantize_activations(x)
    assert e[0, 0] == 0 and torch.all(r[0, :32] == 0)
    assert e[0, 1] == pytest.approx(2 / 127)
    assert r[0, 32:35].tolist() == [64.0, -127.0, 32.0]  # 63.5 rounds half to even


def test_quantize_q8_0_rounds_each_block_to_its_own_scale():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 96, generator=g) * torch.logspace(-3, 1, 96)  # blocks of unlike sizes
    blocks = quantize_q8_0(w)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [5, 3, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    back = (d * q).view(5, 96)
    assert q.abs().max() <= 127
    # Each value within half a step of its block (plus the float16 rounding of the step).
    step = d.expand(5, 3, 32).reshape(5, 96)
    assert torch.all((back - w).abs() <= 0.5 * step + 127 * step * 2**-11)


def test_pack_weights_q8_keeps_exact_blocks_and_rounds_the_rest():
    from pagedlm.layers.linear import ReplicatedLinear
    from pagedlm.layers.panel_weights import PanelWeightMatmul
    from pagedlm.layers.quant_block_weights import QuantBlockWeight
    from pagedlm.layers.weight_format import apply_weight_format

    g = torch.Generator().manual_seed(4)
    exact = ReplicatedLinear(64, 16, bias=False)
    # A weight as a Q4_1 file holds it: ggml's own rounding, dequantised.
    raw = quantize(torch.randn(16, 64, generator=g).numpy(), T.Q4_1)
    weight = torch.from_numpy(dequantize_raw(raw.reshape(-1), T.Q4_1, (16, 64)))
    exact.weight.data.copy_(weight)
    assert QuantBlockWeight.recover(weight) is not None
    rounded = ReplicatedLinear(64, 8, bias=True)
    rounded.weight.data.normal_(generator=g)
    rounded.bias.data.normal_(generator=g)
    odd = ReplicatedLinear(40, 8, bias=False)  # 40 inputs: no blocks of 32
    odd.weight.data.normal_(generator=g)
    float_weights = [m.weight.detach().clone() for m in (exact, rounded, odd)]
    model = torch.nn.ModuleList([exact, rounded, odd])
    assert apply_weight_format(model, "q8") == [
        "CPU linear weights: int8 matmuls on 3 layers (1 exact, 1 rounded to Q8_0, 1 float32)"]
    assert isinstance(exact.weight_kernel, Q8WeightMatmul) and exact.weight_kernel.q4_1
    assert isinstance(rounded.weight_kernel, Q8WeightMatmul) and not rounded.weight_kernel.q4_1
    assert isinstance(odd.weight_kernel, PanelWeightMatmul)
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(exact(x), reference_matmul(x, float_weights[0]).float())
    requantized = quantize_q8_0(float_weights[1])
    d = requantized[..., 0:2].contiguous().view(torch.float16).float()
    w8 = (d * requantized[..., 2:].contiguous().view(torch.int8).float()).view(8, 64)
    torch.testing.assert_close(rounded(x), (reference_matmul(x, w8) + rounded.bias.double()).float())
    h = torch.randn(3, 40, generator=g)
    torch.testing.assert_close(odd(h), h @ float_weights[2].T, rtol=1e-5, atol=1e-5)


def test_q8_engine_computes_what_the_reference_matmuls_compute(tiny_llama_dir):
    """weight_dtype='q8' end to end: the engine's logprobs equal those of the same model with
    every int8 matmul replaced by its float64 reference; its KV blocks all come back."""
    from pagedlm import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", num_threads=2)
    model = llm.llm_engine.model_executor.driver_worker.model
    layers = [m for m in model.modules() if isinstance(getattr(m, "weight_kernel", None), Q8WeightMatmul)]
    assert len(layers) == 4 * len(model.model.layers) + 1  # qkv, o, gate_up, down + LM head
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 33, 7, 99, 4, 18]},
               {"prompt_token_ids": [3, 3, 48, 120]}]
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.llm_engine.scheduler.kv
    kv.block_pool.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks

    def reference(mm):
        w = _dequantise(mm)
        return lambda x, bias: (reference_matmul(x.reshape(-1, mm.in_features), w)
                                + (0 if bias is None else bias.double())).float().view(
                                    *x.shape[:-1], mm.out_features)

    for m in layers:
        m.weight_kernel = reference(m.weight_kernel)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    assert runner.cpu_decoder is not None  # it holds the packed weights: the reference runs the layers
    runner._forward = runner._forward_eager
    ref_outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, ref_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos in range(1, len(a.prompt_token_ids)):
            tok = a.prompt_token_ids[pos]
            assert a.prompt_logprobs[pos][tok].logprob == pytest.approx(
                b.prompt_logprobs[pos][tok].logprob, abs=1e-4)


def _dequantise(mm: Q8WeightMatmul) -> torch.Tensor:
    """The float32 weight [N, K] a Q8WeightMatmul's packed panels hold."""
    p, b = mm.packed.shape[:2]
    if mm.q4_1:
        pairs = mm.packed.view(p, b, 4, 8, 4)
        q = torch.stack([pairs & 0x0F, pairs >> 4], dim=3).reshape(p, b, 8, 8, 4).float()
        d, m = mm.scales[:, :, 0].float(), mm.scales[:, :, 1].float()  # [P, B, 8]
    else:
        q = mm.packed.view(torch.int8).view(p, b, 8, 8, 4).float()
        d = mm.scales.float()
        m = torch.zeros_like(d)
    # q [P, B, group, feature, value] -> w [P, feature, B, group * value]
    w = q * d[:, :, None, :, None] + m[:, :, None, :, None]
    w = w.permute(0, 3, 1, 2, 4).reshape(p * 8, b * 32)
    return w[: mm.out_features]


def test_q8_rejected_off_cpu_float32(tiny_llama_dir):
    from pagedlm import LLM

    with pytest.raises(ValueError, match="weight_dtype='q8' is for float32 models on CPU"):
        LLM(tiny_llama_dir, skip_tokenizer_init=True, dtype="bfloat16", weight_dtype="q8")
    with pytest.raises(ValueError, match=r"weight_dtype must be one of \('auto', 'float16', 'q8'\)"):
        LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="int4")
