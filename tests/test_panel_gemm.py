"""The panel GEMM (csrc/panel_gemm_cpu.cpp, layers/panel_weights.py) against a float64
reference: every tile height, ragged last panels, both panel dtypes, bias, thread counts,
bad inputs, and packing a model's layers."""

import pytest
import torch
import torch.nn.functional as F

from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from pagedlm.layers.panel_weights import (
    PanelWeightMatmul,
    pack_panels,
    panel_kernels,
)
from pagedlm.layers.weight_format import apply_weight_format

pytestmark = pytest.mark.skipif(panel_kernels() is None, reason="panel kernel could not be built")


def _reference(x, weight, bias):
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).float()


def _check(x, weight, bias, dtype):
    kernels = panel_kernels()
    stored = weight.to(dtype).float()  # the values the panels hold
    y = kernels.panel_gemm(x, pack_panels(weight, dtype), weight.shape[0], bias)
    assert y.shape == (x.shape[0], weight.shape[0]) and y.dtype == torch.float32
    # float32 sums of K products against float64 ones: K * 2^-24 relative, with headroom.
    tol = 4e-7 * max(x.shape[1], 16)
    torch.testing.assert_close(y, _reference(x, stored, bias), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 64])
def test_every_tile_height_matches_reference(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g)
    weight = torch.randn(40, 72, generator=g)  # 40 = two full panels and a ragged one
    bias = torch.randn(40, generator=g)
    _check(x, weight, bias, dtype)
    _check(x, weight, None, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (16, 7), (17, 64), (100, 130), (33, 1536)])
def test_odd_shapes_match_reference(n, k, dtype):
    g = torch.Generator().manual_seed(n * 1000 + k)
    for rows in (1, 9):
        _check(torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g),
               torch.randn(n, generator=g), dtype)


def test_many_panel_groups_match_reference():
    # K = 4096: one panel per widened group, so every thread runs several groups.
    g = torch.Generator().manual_seed(3)
    _check(torch.randn(20, 4096, generator=g), torch.randn(70, 4096, generator=g), None,
           torch.float16)


def test_empty_input():
    y = panel_kernels().panel_gemm(torch.empty(0, 8), pack_panels(torch.randn(5, 8), torch.float32), 5, None)
    assert y.shape == (0, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_thread_count_does_not_change_a_bit(dtype):
    # Each output is summed by one thread in the order of k, whatever the split.
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(19, 96, generator=g), torch.randn(200, 96, generator=g)
    packed = pack_panels(weight, dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(panel_kernels().panel_gemm(x, packed, 200, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_inputs_raise_clear_errors():
    kernels = panel_kernels()
    packed = pack_panels(torch.randn(20, 8), torch.float32)
    with pytest.raises(RuntimeError, match="x has 9 features but the panels hold 8"):
        kernels.panel_gemm(torch.randn(2, 9), packed, 20, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.panel_gemm(torch.randn(2, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.panel_gemm(torch.randn(2, 8).double(), packed, 20, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.panel_gemm(torch.randn(2, 8), packed, 20, torch.randn(19))


def test_matmul_keeps_leading_dims_and_input_dtype():
    weight = torch.randn(24, 32)
    mm = PanelWeightMatmul(weight, torch.float32)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(mm(x, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert mm(x.bfloat16(), None).dtype == torch.bfloat16


def test_weight_format_packs_every_linear_and_keeps_a_tied_embedding():
    torch.manual_seed(0)
    embed = VocabParallelEmbedding(50, 32)
    embed.weight.data.normal_()
    head = ParallelLMHead(50, 32)
    head.tie_to(embed)
    merged = MergedColumnParallelLinear(32, [24, 24], bias=False)
    proj = ReplicatedLinear(48, 32, bias=True)
    for p in (merged.weight, proj.weight, proj.bias):
        p.data.normal_()
    model = torch.nn.ModuleList([embed, merged, proj, head])
    weights = {id(m): m.weight.detach().clone() for m in (merged, proj, head)}
    x = torch.randn(5, 32)
    expected_merged, expected_head = F.linear(x, weights[id(merged)]), F.linear(x, weights[id(head)])
    assert apply_weight_format(model, "auto") == ["CPU linear weights: float32 panels on 3 layers"]
    assert merged.weight.numel() == 0 and proj.weight.numel() == 0
    assert head.weight is embed.weight and embed.weight.shape == (50, 32)  # still tied
    torch.testing.assert_close(merged(x), expected_merged, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head(x), expected_head, rtol=1e-5, atol=1e-5)
    h = torch.randn(4, 48)
    torch.testing.assert_close(proj(h), F.linear(h, weights[id(proj)], proj.bias), rtol=1e-5, atol=1e-5)


def test_weight_format_picks_the_path_per_weight_dtype(monkeypatch):
    from pagedlm.layers import weight_format

    def model():
        layer = ReplicatedLinear(32, 20, bias=False)
        layer.weight.data.normal_()
        return torch.nn.ModuleList([layer])

    m = model()
    assert apply_weight_format(m, "auto") == ["CPU linear weights: float32 panels on 1 layers"]
    assert m[0].weight_kernel.panels.dtype == torch.float32
    monkeypatch.setattr(weight_format, "fp16_weights_supported", lambda: False)
    m = model()
    assert apply_weight_format(m, "float16") == ["CPU linear weights: float16 panels on 1 layers"]  # no fbgemm
    assert m[0].weight_kernel.panels.dtype == torch.float16
