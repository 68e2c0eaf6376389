"""Paged attention for prefill (chunk) tokens, in Triton.

One program per (query tile, kv head, prefill request). The query tile is TILE_M
consecutive tokens x the GROUP_PAD query heads of the kv head, flattened to
ROWS = TILE_M * GROUP_PAD rows (row = token * GROUP_PAD + head-in-group), so each
K/V tile read through the block table feeds every head of the group:

  request with a cached prefix of P tokens and q_len new ones (token i at P + i):

  keys   0 ............. P+t0 | P+t0+1 ... P+t0+TILE_M-1
         [ whole tiles: no mask ][ diagonal tiles: causal + range mask ]
  rows of tile t0..t0+TILE_M-1 all see the first part; the mask is only paid on
  the (at most 1 + TILE_M / TILE_N) tiles that straddle the diagonal.

With a sliding window of W keys the first part starts at the tile holding key_lo =
P+t0-W+1 (the first row's first key; earlier blocks are never read), and its tiles
before P+t0+TILE_M-W, where the last rows' windows begin, pay the window mask:

  keys   key_lo ....... P+t0+TILE_M-W ........ P+t0 | diagonal tiles
         [ window mask ][       no mask            ][ causal + range + window mask ]

ROWS = 64 for head_dim 128 (fp32 acc 64x128 = 32 KiB in registers over 4 warps)
and 128 for head_dim <= 64; TILE_N = 64. Query tiles are launched longest first
(the last tile of a request sees the most keys), so the stragglers start early.
"""

import torch
import triton
import triton.language as tl

from pagedlm.attention.triton_kernels import LOG2_E_JIT, _attend_tiles, dot_flags, score_scales

PREFILL_TILE_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    alibi_slopes_ptr, out_ptr,
    qk_scale, cap_scale, window, first_seq, num_q_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = num_q_tiles - 1 - tl.program_id(0)  # longest-running tiles first
    kv_head = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    t0 = tile * TILE_M

    offs_r = tl.arange(0, TILE_M * GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = t0 + offs_r // GROUP_PAD  # [ROWS] token index within the request
    g = offs_r % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_offs = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    if ALIBI:
        row_slope = tl.load(alibi_slopes_ptr + head, mask=g < GROUP, other=0.0) * LOG2_E_JIT
    else:
        row_slope = tl.zeros([TILE_M * GROUP_PAD], tl.float32)  # unused

    # A tile past this request's tokens (requests are shorter than the longest) gets
    # empty key ranges rather than an early return, and stores nothing.
    live = t0 < q_len
    full_hi = tl.where(live, (prefix + t0 + 1) // TILE_N * TILE_N, 0)
    hi = tl.where(live, tl.minimum(prefix + t0 + TILE_M, seq_len), 0)

    row_max = tl.full([TILE_M * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([TILE_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([TILE_M * GROUP_PAD, HEAD_DIM], tl.float32)
    row_pos = prefix + tok
    bt_row = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch
    if HAS_WINDOW:
        key_lo = tl.maximum(prefix + t0 - window + 1, 0)
        win_lo = tl.where(live, key_lo // TILE_N * TILE_N, 0)  # <= full_hi
        # From here on every row's window has begun (rounded up to a whole tile).
        mid = tl.cdiv(tl.maximum(prefix + t0 + TILE_M - window, 0), TILE_N) * TILE_N
        mid = tl.minimum(tl.maximum(mid, win_lo), full_hi)
        row_max, row_sum, acc = _attend_tiles(
            q, row_max, row_sum, acc, row_pos, row_slope, k_cache_ptr, v_cache_ptr, bt_row,
            head_offset, win_lo, mid, key_lo, window, qk_scale, cap_scale,
            stride_cb, stride_cs, stride_cd,
            BLOCK_SIZE, TILE_N, HEAD_DIM, False, False, True, ALIBI, SOFTCAP, UPCAST, DOT_PREC,
        )
    else:
        key_lo = 0
        mid = 0
    row_max, row_sum, acc = _attend_tiles(
        q, row_max, row_sum, acc, row_pos, row_slope, k_cache_ptr, v_cache_ptr, bt_row,
        head_offset, mid, full_hi, key_lo, window, qk_scale, cap_scale,
        stride_cb, stride_cs, stride_cd,
        BLOCK_SIZE, TILE_N, HEAD_DIM, False, False, False, ALIBI, SOFTCAP, UPCAST, DOT_PREC,
    )
    row_max, row_sum, acc = _attend_tiles(
        q, row_max, row_sum, acc, row_pos, row_slope, k_cache_ptr, v_cache_ptr, bt_row,
        head_offset, full_hi, hi, key_lo, window, qk_scale, cap_scale,
        stride_cb, stride_cs, stride_cd,
        BLOCK_SIZE, TILE_N, HEAD_DIM, True, True, HAS_WINDOW, ALIBI, SOFTCAP, UPCAST, DOT_PREC,
    )
    # row_sum >= 1 once a row saw a key (its max term is 2^0); rows of a dead tile
    # have row_sum == 0 and are not stored: max(row_sum, 1) keeps them free of 0/0.
    row_sum = tl.maximum(row_sum, 1.0)
    o_offs = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + offs_d[None, :] * stride_od,
             (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tile_shape(head_dim: int, group: int) -> tuple[int, int]:
    """(TILE_M tokens, GROUP_PAD heads) of a prefill query tile."""
    group_pad = triton.next_power_of_2(group)
    rows = 128 if head_dim <= 64 else 64
    return max(1, rows // group_pad), group_pad


def paged_prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; prefill rows written
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int64
    first_seq: int,  # requests first_seq.. are prefills (= num_decodes)
    num_prefills: int,
    max_query_len: int,  # >= every prefill's query length (a host value)
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Causal attention of prefill (chunk) tokens over their cached prefix and themselves."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    block_m, group_pad = prefill_tile_shape(head_dim, group)
    num_q_tiles = triton.cdiv(max_query_len, block_m)
    qk_scale, cap_scale = score_scales(scale, logits_soft_cap)
    _prefill_kernel[(num_q_tiles, num_kv_heads, num_prefills)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        query if alibi_slopes is None else alibi_slopes,  # unused without ALIBI
        out,
        qk_scale, cap_scale, sliding_window or 0, first_seq, num_q_tiles,
        *query.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad, TILE_M=block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=PREFILL_TILE_N,
        ALIBI=alibi_slopes is not None, HAS_WINDOW=sliding_window is not None,
        SOFTCAP=logits_soft_cap is not None, **dot_flags(query.dtype),
        num_warps=4 if block_m * group_pad * head_dim <= 8192 else 8,
    )
