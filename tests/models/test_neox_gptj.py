"""GPT-NeoX and GPT-J: greedy outputs and logprobs equal HF transformers' on tiny random
checkpoints; the rotary variants equal a direct formula."""

from __future__ import annotations

import pytest
import torch

from pagedlm.layers.rotary import RotaryEmbedding
from tests.helpers import assert_matches_hf

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 23)),
]
MAX_TOKENS = 12


def _save(tmp_dir, config, model_cls, seed: int) -> str:
    torch.manual_seed(seed)
    model_cls(config).eval().save_pretrained(tmp_dir, safe_serialization=True)
    return str(tmp_dir)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    from transformers import GPTJConfig, GPTJForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

    neox = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=256, initializer_range=0.08)
    return {
        "neox-parallel": _save(tmp_path_factory.mktemp("neox-par"), GPTNeoXConfig(
            **neox, use_parallel_residual=True, rotary_pct=0.25), GPTNeoXForCausalLM, 0),
        "neox-serial": _save(tmp_path_factory.mktemp("neox-ser"), GPTNeoXConfig(
            **neox, use_parallel_residual=False, rotary_pct=0.5, hidden_act="gelu_new",
            attention_bias=False), GPTNeoXForCausalLM, 1),
        "gptj": _save(tmp_path_factory.mktemp("gptj"), GPTJConfig(
            vocab_size=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256,
            initializer_range=0.08), GPTJForCausalLM, 2),
    }


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["neox-parallel", "neox-serial", "gptj"])
def test_greedy_and_logprobs_equal_hf(tiny_paths, arch):
    path = tiny_paths[arch]
    hf = _hf(path)
    assert_matches_hf(path, hf, PROMPTS, MAX_TOKENS, context=arch)


def _direct_rope(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """Rotate each pair by angle pos * 10000^(-2i / rotary_dim), pair by pair."""
    out = x.clone()
    for i in range(rotary_dim // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rotary_dim // 2)
        angle = pos.double() * 10000.0 ** (-2 * i / rotary_dim)  # [num_tokens]
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        xa, xb = x[:, :, a].double(), x[:, :, b].double()
        out[:, :, a] = (xa * cos - xb * sin).float()
        out[:, :, b] = (xb * cos + xa * sin).float()
    return out


@pytest.mark.parametrize("rotary_dim", [4, 8, 16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_variants_match_formula(rotary_dim, interleaved):
    from transformers import LlamaConfig

    head_dim = 16
    rope = RotaryEmbedding(LlamaConfig(), head_dim, 64, torch.float32, rotary_dim=rotary_dim,
                           interleaved=interleaved)
    torch.manual_seed(0)
    pos = torch.tensor([0, 1, 5, 63, 17])
    q, k = torch.randn(5, 3, head_dim), torch.randn(5, 1, head_dim)
    q_out, k_out = rope(pos, q, k)
    torch.testing.assert_close(q_out, _direct_rope(q, pos, rotary_dim, interleaved), atol=1e-5, rtol=0)
    torch.testing.assert_close(k_out, _direct_rope(k, pos, rotary_dim, interleaved), atol=1e-5, rtol=0)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


def test_rotary_rejects_bad_rotary_dim():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(LlamaConfig(), 16, 8, torch.float32, rotary_dim=5)
