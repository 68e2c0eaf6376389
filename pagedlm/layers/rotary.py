"""Rotary position embedding.

cos/sin are precomputed for every position up to max_position and looked up by
`positions`, so a step with tokens at arbitrary positions (chunked prefill, decodes of
different lengths) costs one gather.

Two layouts of the rotated pairs within the first `rotary_dim` dims of a head
(the remaining head_dim - rotary_dim dims pass through unchanged, "partial rotary"):

    rotate-half (Llama, NeoX):  pairs (x[i], x[i + rotary_dim/2])   cos/sin = [f0..fn, f0..fn]
    interleaved (GPT-J):        pairs (x[2i], x[2i + 1])            cos/sin = [f0,f0, f1,f1, ..]
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.layers.cpu_ops import fused_ops
from pagedlm.layers.triton_ops import triton_ops

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


def compute_inv_freq(config, head_dim: int, partial_rotary_factor: float = 1.0,
                     rotary_dim: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention scaling); `rotary_dim`, when given, overrides
    head_dim * partial_rotary_factor (avoids float rounding of the product)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rotary_dim is None:
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


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    # [..., d] -> pairs (x[2i], x[2i+1]) become (-x[2i+1], x[2i])
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key.

    `rotary_dim` (default: all of head_dim) is how many leading dims of each head rotate;
    `interleaved` picks the GPT-J pair layout instead of rotate-half.
    """

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype, *,
                 rotary_dim: int | None = None, interleaved: bool = False) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and in (0, head_dim={head_dim}]")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq, scaling = compute_inv_freq(config, head_dim, rotary_dim=rotary_dim)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        if interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # [max_position, rotary_dim]
            self._rotate = rotate_every_two
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
            self._rotate = rotate_half
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype), persistent=False)
        self._apply_rope = self._apply_full if rotary_dim == head_dim else self._apply_partial
        # The fused CPU kernel rotates rotate-half pairs over the whole head.
        self._fusable = not interleaved and rotary_dim == head_dim and dtype == torch.float32
        self.interleaved = interleaved

    def _apply_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + self._rotate(x) * sin

    def _apply_partial(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + self._rotate(rot) * sin, rest), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # query [num_tokens, num_heads, head_dim], key [num_tokens, num_kv_heads, head_dim]
        gpu = triton_ops(query)
        if gpu is not None and query.dim() == 3 and key.dim() == 3 \
                and query.stride(-1) == 1 and key.stride(-1) == 1 \
                and query.dtype == key.dtype == self.cos_cache.dtype:
            return gpu.rotary(positions.contiguous(), query, key, self.cos_cache,
                              self.sin_cache, self.rotary_dim, self.interleaved)
        ops = fused_ops(query) if self._fusable else None
        if ops is not None and query.stride(-1) == 1 and key.stride(-1) == 1 \
                and key.dtype == torch.float32:
            q, k = ops.rotary(positions.contiguous(), query, key, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._apply_rope(query, cos, sin), self._apply_rope(key, cos, sin)
