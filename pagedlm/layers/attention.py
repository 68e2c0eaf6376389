"""The attention layer a model holds: its slice of the paged KV cache and a backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend,
                 alibi_slopes: torch.Tensor | None = None) -> None:
        super().__init__()
        if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}, expected ({num_heads},)")
        # A plain attribute, not a buffer, so that casting the model to bf16/fp16 keeps the
        # slopes in float32 (non-power-of-two head counts have slopes that are not exact in bf16).
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        # Bound by the model runner once the cache is allocated:
        # each [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim]
        assert self.k_cache is not None, "KV cache not bound to the model"
        if self.alibi_slopes is None:
            return self.backend.forward(query, key, value, self.k_cache, self.v_cache, meta, self.scale)
        return self.backend.forward(query, key, value, self.k_cache, self.v_cache, meta, self.scale,
                                    alibi_slopes=self.alibi_slopes)
