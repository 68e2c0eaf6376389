"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama uses).

cos/sin are precomputed for every position up to max_position and looked up by
`positions`, so a step with tokens at arbitrary positions (chunked prefill, decodes of
different lengths) costs one gather.
"""

from __future__ import annotations

import torch
from torch import nn

# RoPE types whose frequencies do not depend on the sequence length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def rope_parameters(config) -> dict:
    """The RoPE dict of an HF config, across transformers versions (rope_parameters in 5.x,
    rope_theta + rope_scaling before)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def compute_inv_freq(config, head_dim: int, partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return inv_freq, 1.0
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(config, head_dim)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # query [num_tokens, num_heads, head_dim], key [num_tokens, num_kv_heads, head_dim]
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin_cache[positions].unsqueeze(1)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        return query, key
