"""Paged attention in plain PyTorch: the fast path on CPU, and correct on CUDA.

Cache layout (one layer; the same for `k_cache` and `v_cache`):

    k_cache [num_blocks, block_size, num_kv_heads, head_dim]

      block 0          block 1          block 2
    +----------------+----------------+----------------+
    | s0 s1 ... s15  | s16 ... s31    | s32 ... s47    |   flat slot = block * block_size + offset
    +----------------+----------------+----------------+
      each slot holds [num_kv_heads, head_dim] contiguous values

    k_cache.view(-1, num_kv_heads, head_dim) is therefore a flat table of slots,
    which is how both the write and the read below index it.

Reading a request's context means gathering its slots in order:

    block_tables[r] = [7, 2, 9]     (block_size 4, seq_len 10)
    positions         0 1 2 3 | 4 5 6 7 | 8 9 . .
    slots            28 ...31 | 8 ... 11| 36 37 (38 39 are past the end)

Positions past the end of a sequence (the tail of its last block, and the
padding columns of `block_tables`) are redirected to the slot of the sequence's
last token (written this step) instead of being read from their block. Their
scores are masked anyway, but a masked weight of exactly 0 still gives NaN if it
multiplies a NaN, and unused cache memory may hold anything (e.g. if the cache
was allocated with torch.empty).

Sliding window W: query position i sees keys i - W < j <= i. Only those are
gathered: a decode reads its last min(seq_len, W) slots, a prefill chunk starts
W - 1 positions before its first query. Blocks wholly before that may have been
freed by the KV cache manager (their block-table entry is then the null block),
and are never read. Logit soft-capping (`cap * tanh(s / cap)`, applied before the
ALiBi bias and the mask) has no SDPA equivalent, so it takes a matmul + float32
softmax path.

Nothing in the decode path reads tensors back to the host; the prefill loop uses
only the `*_cpu` lists of the metadata, so the whole forward is sync-free on CUDA.
"""

import torch
import torch.nn.functional as F

from pagedlm.attention.base import AttentionBackend, AttentionOptions
from pagedlm.attention.metadata import AttentionMetadata

# `enable_gqa` appeared in torch 2.5; older versions need K/V expanded per group.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store token t's key/value in flat slot `slot_mapping[t]` of the cache, in place.

    All slots must be valid (no -1 padding) and distinct.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # .view (not .reshape) so that a non-contiguous cache fails loudly instead of
    # silently writing into a copy.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    n = slot_mapping.shape[0]
    key, value = key[:n].to(k_cache.dtype), value[:n].to(v_cache.dtype)
    if k_cache.element_size() == 1:  # float8: index_copy_ has no float8 kernel on CPU
        k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    k_flat.index_copy_(0, slot_mapping, key)
    v_flat.index_copy_(0, slot_mapping, value)


def _context_slots(
    block_tables: torch.Tensor,  # [n, max_num_blocks] int64
    positions: torch.Tensor,  # [n, L] int64, all valid positions of their row
    block_size: int,
) -> torch.Tensor:
    """Flat cache slot of each (row, position): block_tables[row, pos // bs] * bs + pos % bs."""
    blocks = torch.gather(block_tables, 1, positions // block_size)  # [n, L]
    return blocks * block_size + positions % block_size  # [n, L]


def _softcap_attention(
    q: torch.Tensor,  # [..., M, head_dim]
    k: torch.Tensor,  # [..., L, head_dim] (broadcastable against q's leading dims)
    v: torch.Tensor,  # [..., L, head_dim]
    mask: torch.Tensor,  # bool (True = visible) or additive float, broadcastable to [..., M, L]
    scale: float,
    cap: float,
) -> torch.Tensor:  # [..., M, head_dim]
    """Attention with soft-capped scores, softmax in float32 (SDPA has no soft cap)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [..., M, L]
    scores = cap * torch.tanh(scores / cap)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1)  # [..., M, L]
    return torch.matmul(weights, v.float()).to(q.dtype)


def decode_groups(seq_lens: list[int], min_fill: float = 0.8) -> list[tuple[int, int, int]]:
    """Split the decode rows into contiguous groups, each padded to its longest context.

    Padding costs gather bandwidth and attention FLOPs, so a group is closed when adding
    the next row would leave less than `min_fill` of its padded slots holding real
    tokens. The model runner orders decodes longest first, which makes the groups
    length buckets. Returns (start, end, max_len) per group.
    """
    groups = []
    start, longest, total = 0, 0, 0
    for i, n in enumerate(seq_lens):
        new_longest = max(longest, n)
        if i > start and new_longest * (i - start + 1) * min_fill > total + n:
            groups.append((start, i, longest))
            start, new_longest, total = i, n, 0
        longest = new_longest
        total += n
    groups.append((start, len(seq_lens), longest))
    return groups


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def _forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, options: AttentionOptions) -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if meta.num_decodes > 0:
            self._decodes(query, k_cache, v_cache, meta, scale, out, options)
        if meta.num_decodes < meta.num_seqs:
            self._prefills(query, key, value, k_cache, v_cache, meta, scale, out, options)
        return out

    # The tensors below are `forward`'s (shapes in attention/base.py); `_decodes` writes rows
    # :num_decodes of `out` [num_tokens, num_heads, head_dim], `_prefills` the rest.

    def _prefills(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor, options: AttentionOptions) -> None:
        """Every prefill (or prefill chunk) of the step, one request at a time."""
        for r in range(meta.num_decodes, meta.num_seqs):
            start, end = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
            out[start:end] = self._prefill(r, query, key, value, k_cache, v_cache, meta, scale,
                                           options)

    def _decodes(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor,
                 options: AttentionOptions) -> None:
        """All decode rows of the step, in length buckets (see `decode_groups`)."""
        sliding_window = options[1]
        # Layers with different windows (Gemma's local/global mix) share one step.
        cache_key = "decode_groups" if sliding_window is None else ("decode_groups", sliding_window)
        groups = meta.backend_cache.get(cache_key)
        if groups is None:
            lens = meta.seq_lens_cpu[: meta.num_decodes]
            if sliding_window is not None:
                lens = [min(n, sliding_window) for n in lens]
            groups = decode_groups(lens)
            meta.backend_cache[cache_key] = groups
        for start, end, max_len in groups:
            out[start:end] = self._decode(query, k_cache, v_cache, meta, scale, start, end, max_len,
                                          options)

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, start: int, end: int, max_len: int,
                options: AttentionOptions) -> torch.Tensor:  # [end - start, num_heads, head_dim]
        """Decodes start..end at once, padded to max_len: one gather, one SDPA call.

        `max_len` counts the keys each decode reads: its whole context, or with a window
        its last min(seq_len, W) tokens, so a long windowed context costs W, not seq_len.

        GQA without repeating K/V: a decode has a single query token, so the
        `group` query heads that share a kv head can be laid out as `group`
        query *rows* against that kv head:

            q [B, num_heads, d]  ->  [B, num_kv_heads, group, d]   (a free view)
            k [B, num_kv_heads, L, d]
            scores [B, num_kv_heads, group, L], one mask row per sequence.

        This measured faster than a hand-written matmul + softmax (which needs a
        strided-batch copy or a loop over kv heads) and than SDPA's enable_gqa.
        """
        alibi_slopes, sliding_window, logits_soft_cap = options
        num_decodes = end - start
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        device = query.device

        seq_lens = meta.seq_lens[start:end]  # [B]
        # Column t holds key position first + t: the whole context from 0, or the last
        # W tokens (first = seq_len - W) under a window.
        #   seq_len 10, W 4:   first 6   positions 6 7 8 9
        positions = torch.arange(max_len, device=device)[None, :]  # [1, L]
        if sliding_window is not None:
            positions = positions + (seq_lens[:, None] - sliding_window).clamp(min=0)  # [B, L]
        valid = positions < seq_lens[:, None]  # [B, L]
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        if alibi_slopes is not None:
            # The query sits at position seq_len - 1; key j gets slope_h * (j - (seq_len - 1)).
            distance = positions - (seq_lens[:, None] - 1)  # [B, L]
            slopes = alibi_slopes.float().view(num_kv_heads, group)  # [kvh, g], head = kvh * group + g
            bias = slopes[None, :, :, None] * distance[:, None, None, :]  # [B, kvh, g, L]
            mask = bias.masked_fill(~mask, float("-inf")).to(query.dtype)
        # Past-the-end positions re-read the last token, which is always written (finite).
        positions = torch.where(valid, positions, seq_lens[:, None] - 1)  # [B, L]
        slots = _context_slots(meta.block_tables[start:end], positions, block_size)  # [B, L]

        # One index_select over the flat slot table gathers every decode's context
        # (a row memcpy per slot; faster than advanced indexing of blocks on CPU).
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k = k_flat.index_select(0, slots.flatten())  # [B * L, num_kv_heads, head_dim]
        v = v_flat.index_select(0, slots.flatten())  # [B * L, num_kv_heads, head_dim]
        k = k.view(num_decodes, max_len, num_kv_heads, head_dim).transpose(1, 2).to(query.dtype)
        v = v.view(num_decodes, max_len, num_kv_heads, head_dim).transpose(1, 2).to(query.dtype)
        # k, v: [B, num_kv_heads, L, head_dim] (strided views; SDPA accepts them)

        # reshape, not view: query may be a strided slice of a fused qkv projection.
        q = query[start:end].reshape(num_decodes, num_kv_heads, group, head_dim)  # [B,kvh,g,d]
        if logits_soft_cap is not None:
            o = _softcap_attention(q, k, v, mask, scale, logits_soft_cap)  # [B, kvh, g, d]
        else:
            # SDPA accumulates the softmax in float32 for bf16/fp16 inputs.
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale
            )  # [B, num_kv_heads, group, head_dim]
        return o.reshape(num_decodes, num_heads, head_dim)

    def _prefill(self, r: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, options: AttentionOptions) -> torch.Tensor:
        """One prefill (or prefill chunk) request: causal attention over its context.
        Returns [q_len, num_heads, head_dim]."""
        alibi_slopes, sliding_window, logits_soft_cap = options
        start, end = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
        q_len = end - start
        ctx_len = meta.seq_lens_cpu[r]
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        device = query.device
        q_first = ctx_len - q_len  # position of the first query
        # First key any query of this chunk can see.
        k_first = 0 if sliding_window is None else max(0, q_first - sliding_window + 1)

        q = query[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        if k_first >= q_first:
            # No visible prefix: the keys are exactly this step's tokens, so skip the cache
            # read. Round-trip through the cache dtype so the result matches what a cache
            # read would give when the cache is stored in another dtype.
            k_first = q_first
            k = key[start:end].to(k_cache.dtype).to(query.dtype)  # [q_len, kv_heads, head_dim]
            v = value[start:end].to(v_cache.dtype).to(query.dtype)  # [q_len, kv_heads, head_dim]
        else:
            k_pos = torch.arange(k_first, ctx_len, device=device)  # [num_keys]
            slots = _context_slots(meta.block_tables[r : r + 1], k_pos[None, :], block_size)[0]
            # slots: [num_keys]
            k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).to(query.dtype)
            v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).to(query.dtype)
            # k, v: [num_keys, num_kv_heads, head_dim]

        # Query i is at absolute position q_first + i and sees keys j <= it (and, with a
        # window W, j > i - W):
        #
        #            keys ->  0 1 2 3 4 5      (ctx_len 6, q_len 3, prefix 3; W = 3)
        #   query 0 (pos 3)   . x x x . .
        #   query 1 (pos 4)   . . x x x .
        #   query 2 (pos 5)   . . . x x x
        mask = None  # None: plain causal over exactly this step's tokens
        if k_first != q_first or sliding_window is not None or alibi_slopes is not None \
                or logits_soft_cap is not None:
            k_pos = torch.arange(k_first, ctx_len, device=device)  # [num_keys]
            q_pos = torch.arange(q_first, ctx_len, device=device)  # [q_len]
            distance = k_pos[None, :] - q_pos[:, None]  # [q_len, num_keys], j - i
            mask = distance <= 0
            if sliding_window is not None:
                mask &= distance > -sliding_window
            if alibi_slopes is not None:
                bias = alibi_slopes.float()[:, None, None] * distance[None]  # [num_heads, q_len, num_keys]
                mask = bias.masked_fill(~mask[None], float("-inf")).to(query.dtype)

        k = k.transpose(0, 1)  # [num_kv_heads, num_keys, head_dim]
        v = v.transpose(0, 1)  # [num_kv_heads, num_keys, head_dim]
        if logits_soft_cap is not None:
            group = q.shape[0] // num_kv_heads
            if mask.dim() == 3:
                mask = mask.view(num_kv_heads, group, q_len, -1)  # [kvh, g, q_len, num_keys]
            o = _softcap_attention(
                q.reshape(num_kv_heads, group, q_len, head_dim), k[:, None], v[:, None], mask, scale,
                logits_soft_cap,
            )  # [kvh, g, q_len, head_dim]
            return o.reshape(-1, q_len, head_dim).transpose(0, 1)
        if _SDPA_HAS_GQA:
            extra = {"enable_gqa": True}
        else:
            group = q.shape[0] // num_kv_heads
            k = k.repeat_interleave(group, dim=0)  # [num_heads, num_keys, head_dim]
            v = v.repeat_interleave(group, dim=0)  # [num_heads, num_keys, head_dim]
            extra = {}
        # A leading batch dimension matters: torch's CPU flash-attention kernel only takes
        # 4-D inputs, and 3-D ones fall back to the math path, which materialises the
        # scores (measured 5-6x slower at 700 tokens, 9 heads, 2 threads).
        if mask is not None:
            mask = mask[None] if mask.dim() == 3 else mask  # 2-D [q_len, keys] broadcasts
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale, **extra
        )[0]  # [num_heads, q_len, head_dim]
        return o.transpose(0, 1)
