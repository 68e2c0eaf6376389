"""The reference attention backend: slow, loop-based, and easy to check by eye.

It is the oracle the fast backends are tested against, so it deliberately does
everything the plain way:

* the cache write is one Python assignment per new token;
* each request's context is read back from the paged cache one token at a time,
  following `block_tables[r][pos // block_size]` and `pos % block_size`;
* each query token is handled on its own, over exactly the keys it may see, with a
  hand-written float32 softmax (soft cap, then ALiBi bias; no mask needed).

Never use it for real inference; every step costs O(tokens * context) Python work
and it syncs with the device (`.tolist()`) freely.
"""

import torch

from pagedlm.attention.base import AttentionBackend, AttentionOptions
from pagedlm.attention.metadata import AttentionMetadata


class ReferenceAttention(AttentionBackend):
    name = "reference"

    def _forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, options: AttentionOptions) -> torch.Tensor:
        alibi_slopes, sliding_window, logits_soft_cap = options
        num_heads = query.shape[1]
        num_kv_heads = key.shape[1]
        group = num_heads // num_kv_heads
        block_size = k_cache.shape[1]

        # 1. Store this step's keys/values, one token at a time.
        slots = meta.slot_mapping.tolist()
        for t in range(meta.num_tokens):
            block, offset = divmod(slots[t], block_size)
            k_cache[block, offset] = key[t]
            v_cache[block, offset] = value[t]

        # Query head h reads kv head h // group.
        kv_head_of = torch.arange(num_heads, device=query.device) // group  # [num_heads]

        out = torch.zeros_like(query)  # [num_tokens, num_heads, head_dim]
        block_tables = meta.block_tables.tolist()
        for r in range(meta.num_seqs):
            q_start, q_end = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
            q_len = q_end - q_start
            ctx_len = meta.seq_lens_cpu[r]

            # 2. Read the context of request r back from the paged cache: every token,
            #    or with a window W only those some query of this step can see (earlier
            #    blocks may have been freed and replaced by the null block).
            first = 0 if sliding_window is None else max(0, ctx_len - q_len - sliding_window + 1)
            ctx_k, ctx_v = [], []
            for pos in range(first, ctx_len):
                block = block_tables[r][pos // block_size]
                offset = pos % block_size
                ctx_k.append(k_cache[block, offset])
                ctx_v.append(v_cache[block, offset])
            keys = torch.stack(ctx_k).float()  # [ctx_len - first, num_kv_heads, head_dim]
            values = torch.stack(ctx_v).float()  # [ctx_len - first, num_kv_heads, head_dim]

            # 3. Each new token sits at absolute position ctx_len - q_len + i and sees the
            #    context tokens j <= pos, or with a window W only those with pos - j < W:
            #    the last W tokens, itself included (HF's convention).
            for i in range(q_len):
                pos = ctx_len - q_len + i
                lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
                q = query[q_start + i].float()  # [num_heads, head_dim]
                k = keys[lo - first : pos + 1 - first, kv_head_of]  # [n, num_heads, head_dim]
                v = values[lo - first : pos + 1 - first, kv_head_of]  # [n, num_heads, head_dim]
                scores = torch.einsum("hd,khd->hk", q, k) * scale  # [num_heads, n = pos + 1 - lo]
                if logits_soft_cap is not None:
                    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
                if alibi_slopes is not None:
                    # ALiBi: key j gets slope_h * (j - pos), i.e. 0 on the diagonal.
                    distance = torch.arange(lo, pos + 1, device=query.device) - pos  # [n]
                    scores = scores + alibi_slopes.float()[:, None] * distance[None, :]
                scores = scores - scores.max(dim=-1, keepdim=True).values
                weights = scores.exp()  # [num_heads, n]
                weights = weights / weights.sum(dim=-1, keepdim=True)
                out[q_start + i] = torch.einsum("hk,khd->hd", weights, v).to(query.dtype)
        return out
