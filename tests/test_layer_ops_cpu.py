"""The fused float32 CPU kernels of the element-wise layers against their torch references."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from pagedlm.csrc import load_extension
from pagedlm.layers.activation import SiluAndMul
from pagedlm.layers.norm import RMSNorm
from pagedlm.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(load_extension("layer_ops_cpu") is None,
                                reason="CPU layer kernels could not be built")


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 3, 64)])
def test_rms_norm_matches_reference(shape):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.data = torch.randn(shape[-1], generator=g)
    x = torch.randn(*shape, generator=g) * 3
    residual = torch.randn(*shape, generator=g)
    _close(norm(x), norm._norm(x))
    out, new_residual = norm(x, residual)
    _close(new_residual, x + residual)
    _close(out, norm._norm(x + residual))
    assert out.shape == x.shape and new_residual.shape == x.shape


def test_silu_and_mul_matches_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2 * 1536, generator=g) * 4
    x[0, :6] = torch.tensor([0.0, -100.0, 100.0, -88.5, 89.0, 1e-30])  # exp clamp edges
    gate, up = x.chunk(2, dim=-1)
    out = SiluAndMul()(x)
    _close(out, F.silu(gate) * up)
    assert torch.isfinite(out).all()
    _close(SiluAndMul()(x.view(3, 3, -1)), (F.silu(gate) * up).view(3, 3, -1))


def test_rotary_on_qkv_views_matches_reference():
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 11
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=10000.0)
    rope = RotaryEmbedding(config, head_dim, max_position=4096, dtype=torch.float32)
    assert rope._fusable
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)  # strided views, as the models pass them
    k = k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)
    q_ref, k_ref = rope._apply_full(q, cos, sin), rope._apply_full(k, cos, sin)
    before = qkv.clone()
    q_out, k_out = rope(positions, q, k)
    _close(q_out, q_ref)
    _close(k_out, k_ref)
    assert torch.equal(qkv, before)  # the inputs are left alone


def test_rotary_rejects_positions_outside_the_cache():
    config = LlamaConfig(hidden_size=64, num_attention_heads=1)
    rope = RotaryEmbedding(config, 64, max_position=16, dtype=torch.float32)
    q, k = torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        rope(torch.tensor([16]), q, k)


def test_other_dtypes_and_layouts_keep_the_torch_path():
    config = LlamaConfig(hidden_size=64, num_attention_heads=1)
    assert not RotaryEmbedding(config, 64, 16, torch.float32, interleaved=True)._fusable
    assert not RotaryEmbedding(config, 64, 16, torch.float32, rotary_dim=32)._fusable
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    norm = RMSNorm(64).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), norm._norm(x))
