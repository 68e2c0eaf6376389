"""What every attention backend offers: `AttentionBackend.forward`, declared once here.

    backend.forward(query, key, value, k_cache, v_cache, meta, scale, *, alibi_slopes=None,
                    sliding_window=None, logits_soft_cap=None) -> output
    # query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim],
    # caches [num_blocks, block_size, num_kv_heads, head_dim]; output like query.

It writes this step's key/value into the cache at `meta.slot_mapping` first, then
attends causally over each request's context read from the paged cache.

`alibi_slopes` ([num_heads] float32) adds the ALiBi bias `slope_h * (j - i)` to the
score of query position i against key position j (0 on the diagonal, negative
behind it). Softmax is shift-invariant per row, so this equals HF BLOOM's
`slope_h * j`; the relative form keeps the bias small on long contexts.

The score of query position i against key position j is, in this order:

    s = (q_i . k_j) * scale
    s = cap * tanh(s / cap)              if logits_soft_cap   (Gemma 2; before the bias)
    s = s + slope_h * (j - i)            if alibi_slopes
    s = -inf unless j <= i and (sliding_window is None or i - j < sliding_window)

so a window W shows each query W keys, itself included. That is HF transformers'
convention (checked against transformers 5.23 masking_utils.sliding_window_overlay:
`kv_idx > q_idx - sliding_window`, used by Mistral, Qwen2, Gemma 2/3). Key blocks
that lie wholly before i - W + 1 are never read through the mask, which is what lets
the KV cache manager free them.
"""

import torch

from pagedlm.attention.metadata import AttentionMetadata

# (alibi_slopes, sliding_window, logits_soft_cap): the per-layer options of `forward`, passed
# on to a backend's `_forward` as one plain tuple (cheaper on the hot path than an object).
AttentionOptions = tuple[torch.Tensor | None, int | None, float | None]


class AttentionBackend:
    """A backend implements `_forward`; callers call `forward`, which checks the head counts
    every backend relies on (query head h reads kv head h // (num_heads // num_kv_heads))."""

    name: str
    # Whether `forward` may be captured in a CUDA graph and replayed with new tensor values
    # (launches must depend only on host values the graph runner keeps fixed per size).
    supports_cuda_graphs: bool = False

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        *,
        alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's key/value into the cache at `meta.slot_mapping`, then return the
        attention of every query token over its request's context (see the module docstring
        for the scores)."""
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        options = (alibi_slopes, sliding_window, logits_soft_cap)
        return self._forward(query, key, value, k_cache, v_cache, meta, scale, options)

    def _forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, options: AttentionOptions) -> torch.Tensor:
        """`forward` once the head counts are checked; shapes as there."""
        raise NotImplementedError
