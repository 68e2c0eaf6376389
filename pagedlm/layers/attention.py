"""The attention layer a model holds: its slice of the paged KV cache and a backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """One attention layer: writes this step's K/V into its cache slice and attends.

    `sliding_window=W` lets query position i see key positions j with i - W < j <= i
    (W keys including itself, HF's convention); `logits_soft_cap=c` maps each score s
    to c * tanh(s / c) before the ALiBi bias and the mask (Gemma 2).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend,
                 alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}, expected ({num_heads},)")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        # A plain attribute, not a buffer, so that casting the model to bf16/fp16 keeps the
        # slopes in float32 (non-power-of-two head counts have slopes that are not exact in bf16).
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float()
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        # Bound by the model runner once the cache is allocated:
        # each [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    @property
    def _backend_kwargs(self) -> dict:
        # Only the options that are set, so backends without them keep working for plain layers.
        kwargs: dict = {}
        if self.alibi_slopes is not None:
            kwargs["alibi_slopes"] = self.alibi_slopes
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            kwargs["logits_soft_cap"] = self.logits_soft_cap
        return kwargs

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim]
        assert self.k_cache is not None, "KV cache not bound to the model"
        return self.backend.forward(query, key, value, self.k_cache, self.v_cache, meta, self.scale,
                                    **self._backend_kwargs)
