"""Triton kernels for paged attention: the KV-cache write, split-K decode, and prefill.

All kernels read the paged cache of one layer, laid out as

    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]

and find position `pos` of request `r` at block `block_tables[r, pos // block_size]`,
offset `pos % block_size`. A key tile of BLOCK_N positions may span several cache
blocks; each row is looked up on its own, so a tile need not align with a block and
the block size can be any value (each row is one contiguous head_dim vector).

GQA: a program owns one kv head and *all* the query heads that read it, stacked as
the rows of its query tile, so every K/V tile is loaded once per group, not once per
query head. Softmax runs online in float32 in base 2 (`exp2`, with log2(e) folded into
the scale), as in FlashAttention.

Masked loads use `other=0`: cache slots past a sequence's end may hold anything (the
tests fill them with NaN), and a masked key's weight of 0 times a NaN value is NaN.

Launch code is device-agnostic: the same calls run CUDA tensors on a GPU and CPU
tensors under the Triton interpreter (`TRITON_INTERPRET=1` set before triton is
imported). Launch grids come only from host integers, so nothing here syncs.
"""

import torch
import triton
import triton.language as tl

_LOG2_E = 1.4426950408889634


# --------------------------------------------------------------------------- KV write


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,  # key
    stride_vt, stride_vh, stride_vd,  # value
    stride_cb, stride_cs, stride_ch, stride_cd,  # both caches
    BLOCK_SIZE: tl.constexpr, BLOCK_KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # One program per token: its [num_kv_heads, head_dim] K and V rows are one small
    # tile each, so a whole token moves in one masked load/store pair.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64; negative = padding, write nothing
    offs_h = tl.arange(0, BLOCK_KVH)
    offs_d = tl.arange(0, HEAD_DIM)
    # (Folding `slot >= 0` into the head count keeps the mask a plain vector compare.)
    mask = offs_h[:, None] < tl.where(slot >= 0, num_kv_heads, 0)
    safe_slot = tl.maximum(slot, 0)
    dst = (
        (safe_slot // BLOCK_SIZE) * stride_cb + (safe_slot % BLOCK_SIZE) * stride_cs
        + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    )
    k_src = t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    v_src = t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    k = tl.load(key_ptr + k_src, mask=mask)
    v = tl.load(value_ptr + v_src, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [n] int64, n <= num_tokens; -1 = padding
) -> None:
    """Store token t's key/value in flat slot `slot_mapping[t]`, in place; skip slots < 0."""
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(),
        BLOCK_SIZE=block_size, BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
    )


# ------------------------------------------------------------------ shared inner loop


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _attend_tiles(
    q,  # [ROWS, HEAD_DIM] in the query dtype
    row_max, row_sum,  # [ROWS] fp32, running max and sum of 2^(score) per row
    acc,  # [ROWS, HEAD_DIM] fp32, unnormalised output
    row_pos,  # [ROWS] absolute position of each query row (only read when CAUSAL)
    k_cache_ptr, v_cache_ptr,
    block_table_ptr,  # this request's row of block_tables
    head_offset,  # kv_head * stride_ch
    lo, hi,  # key positions [lo, hi); lo is a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e)
    stride_cb, stride_cs, stride_cd,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    RANGE_MASK: tl.constexpr,  # some tiles may run past hi
    CAUSAL: tl.constexpr,  # key pos must be <= row_pos
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Fold keys [lo, hi) into the running (row_max, row_sum, acc) of each query row.

    Invariant: the first tile folded into a row has at least one key the row may see,
    so row_max is finite afterwards and exp2(row_max - new_max) is never exp2(-inf + inf).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        if RANGE_MASK:
            in_range = pos < hi
            block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
        else:
            block = tl.load(block_table_ptr + pos // BLOCK_SIZE)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset  # [BLOCK_N]
        kv_offs = rows[:, None] + offs_d[None, :] * stride_cd  # [BLOCK_N, HEAD_DIM]
        if RANGE_MASK:
            k = tl.load(k_cache_ptr + kv_offs, mask=in_range[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offs)
            v = tl.load(v_cache_ptr + kv_offs)
        k = k.to(q.dtype)  # a cache in another dtype is read back at the query's
        v = v.to(q.dtype)

        s = _mma(q, tl.trans(k), UPCAST, DOT_PREC) * qk_scale  # [ROWS, BLOCK_N] fp32
        if CAUSAL:
            s = tl.where(pos[None, :] <= row_pos[:, None], s, float("-inf"))
        if RANGE_MASK:
            s = tl.where(in_range[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))  # [ROWS]
        alpha = tl.exp2(row_max - new_max)  # rescales what was summed under the old max
        p = tl.exp2(s - new_max[:, None])  # [ROWS, BLOCK_N]
        row_sum = row_sum * alpha + tl.sum(p, 1)
        # P is rounded to the value dtype for the tensor-core dot, as FlashAttention does.
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, DOT_PREC)
        row_max = new_max
    return row_max, row_sum, acc


# ------------------------------------------------------------------------- decode
#
# Split-K ("flash decoding"). A decode has one query token, so a batch of short
# requests with few kv heads gives too few programs to fill the GPU, and one long
# context is read by a single program. The context is therefore cut into
# NUM_SPLITS ranges of `split_len` tokens (a multiple of BLOCK_N), one program each:
#
#   context of request r, kv head h: seq_len 300; NUM_SPLITS 4 and split_len 128
#   were set on the host from the batch's longest context (512); BLOCK_N 64:
#
#   pos  0        64       128      192      256   300   384
#        |--tile--|--tile--|--tile--|--tile--|--tile-|.....|
#        |<--- split 0 --->|<--- split 1 --->|<-- split 2->|  split 3: empty
#            program          program          program         program
#               |                |                |               |
#               v                v                v               v
#   part_m / part_l  [num_decodes, num_heads, NUM_SPLITS]           (row max, row sum)
#   part_acc         [num_decodes, num_heads, NUM_SPLITS, head_dim] (unnormalised out)
#               \________________|________________/
#                                v
#            reduce program (r, q head): M = max_s m_s, w_s = 2^(m_s - M)
#            out = sum_s w_s * acc_s / sum_s w_s * l_s     (splits past seq_len masked)
#
# With NUM_SPLITS == 1 the split program normalises and writes `out` itself.
# A row with seq_len 0 (batch padding, e.g. for a CUDA graph) gets an output of 0.
#
# The query tile is BLOCK_H rows: the GROUP query heads of the kv head, padded to
# at least 16 because tl.dot needs M >= 16 on tensor cores. The padding wastes MMA
# throughput, which decode (bandwidth-bound: each K/V byte is used GROUP times)
# does not miss. BLOCK_N = 64 keys x head_dim 128 x 2 bytes = 16 KiB per K or V tile:
# large enough for wide coalesced loads from 4 blocks of 16, small enough to keep
# several pipeline stages in flight in shared memory.


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, split_len, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    req = tl.program_id(0)  # decode r is request r and token r
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)  # hi <= lo: an empty split

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_h  # [BLOCK_H]
    head_ok = offs_h < GROUP
    q = tl.load(
        q_ptr + req * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_ok[:, None], other=0.0,
    )  # [BLOCK_H, HEAD_DIM]
    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    row_max, row_sum, acc = _attend_tiles(
        q, row_max, row_sum, acc,
        row_max,  # row_pos: unused, a decode token sees its whole context
        k_cache_ptr, v_cache_ptr, block_tables_ptr + req * stride_bt, kv_head * stride_ch,
        lo, hi, qk_scale, stride_cb, stride_cs, stride_cd,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, False, UPCAST, DOT_PREC,
    )
    if NUM_SPLITS == 1:
        # row_sum >= 1 once a row saw a key (its max term is 2^0), so max(row_sum, 1)
        # changes nothing but the 0/0 of a padding row (seq_len 0) into 0.
        row_sum = tl.maximum(row_sum, 1.0)
        o_offs = req * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_offs, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None])
    else:
        part = (req * num_heads + head) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_m_ptr + part, row_max, mask=head_ok)
        tl.store(part_l_ptr + part, row_sum, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=head_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, out_ptr,
    split_len, num_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    used = offs_s < tl.cdiv(seq_len, split_len)  # none for a padding row (seq_len 0)
    part = (req * num_heads + head) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
    row_max = tl.load(part_m_ptr + part, mask=used, other=float("-inf"))
    row_sum = tl.load(part_l_ptr + part, mask=used, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=used[:, None], other=0.0)  # [NUM_SPLITS, HEAD_DIM]
    w = tl.where(used, tl.exp2(row_max - tl.max(row_max, 0)), 0.0)  # [NUM_SPLITS]
    # The split holding the max has w = 1 and row_sum >= 1: max(., 1) only turns a
    # padding row's 0/0 into 0.
    o = tl.sum(w[:, None] * acc, 0) / tl.maximum(tl.sum(w * row_sum, 0), 1.0)  # [HEAD_DIM]
    tl.store(out_ptr + req * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty))


def choose_num_splits(
    max_seq_len: int,
    num_decodes: int,
    num_kv_heads: int,
    num_sms: int,
    min_tokens_per_split: int = 256,
    max_splits: int = 16,
) -> int:
    """How many context splits a decode launch uses: a power of two (few recompiles).

    Enough that the longest context is cut into pieces of >= min_tokens_per_split
    (shorter pieces spend more on partials and the reduce than they save), but no
    more than needed to give ~2 programs per SM, and at most max_splits.
    """
    by_length = triton.cdiv(max_seq_len, min_tokens_per_split)
    by_occupancy = triton.cdiv(2 * num_sms, num_decodes * num_kv_heads)
    wanted = max(1, min(by_length, by_occupancy, max_splits))
    return min(triton.next_power_of_2(wanted), max_splits)


def split_length(max_seq_len: int, num_splits: int, block_n: int) -> int:
    """Tokens per split: covers max_seq_len in num_splits pieces, whole tiles each."""
    return triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n


# The interpreter's tl.dot multiplies bfloat16 operands as their raw uint16 bits
# (triton 3.9); under it, bf16 operands are widened to fp32 just before each dot,
# after being rounded to bf16 at the same points as on the GPU (though the
# interpreter's fp32 -> bf16 cast truncates where the GPU rounds to nearest). A kernel is interpreted iff TRITON_INTERPRET=1 was set when
# it was decorated, i.e. when this module was first imported: decided once, here.
_INTERPRETED = not isinstance(_decode_split_kernel, triton.runtime.JITFunction)


def _dot_flags(dtype: torch.dtype) -> dict:
    # fp32 inputs would otherwise be rounded to tf32 by tensor cores (~1e-3 error).
    return dict(
        UPCAST=_INTERPRETED and dtype == torch.bfloat16,
        DOT_PREC="ieee" if dtype == torch.float32 else None,
    )


DECODE_BLOCK_N = 64


def paged_decode_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows 0..num_decodes-1 written
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    num_decodes: int,
    scale: float,
    num_splits: int,
    split_len: int,  # from split_length(); num_splits * split_len >= every decode's seq_len
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # from alloc_partials
) -> None:
    """Attention of the first num_decodes tokens (one per request) over their contexts."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if num_splits > 1:
        part_m, part_l, part_acc = partials
    else:
        part_m = part_l = part_acc = out  # unused by the NUM_SPLITS == 1 variant
    _decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        scale * _LOG2_E, split_len, num_heads,
        *query.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        **_dot_flags(query.dtype), num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_m, part_l, part_acc, seq_lens, out, split_len, num_heads, *out.stride(),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, num_warps=1,
        )


def alloc_partials(
    num_decodes: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (part_m, part_l, part_acc) for one decode launch; reusable across layers."""
    shape = (num_decodes, num_heads, num_splits)
    return (
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
    )


# ------------------------------------------------------------------------- prefill
#
# One program per (query tile, kv head, prefill request). The query tile is BLOCK_M
# consecutive tokens x the GROUP_PAD query heads of the kv head, flattened to
# ROWS = BLOCK_M * GROUP_PAD rows (row = token * GROUP_PAD + head-in-group), so each
# K/V tile read through the block table feeds every head of the group:
#
#   request with a cached prefix of P tokens and q_len new ones (token i at P + i):
#
#   keys   0 ............. P+t0 | P+t0+1 ... P+t0+BLOCK_M-1
#          [ whole tiles: no mask ][ diagonal tiles: causal + range mask ]
#   rows of tile t0..t0+BLOCK_M-1 all see the first part; the mask is only paid on
#   the (at most 1 + BLOCK_M / BLOCK_N) tiles that straddle the diagonal.
#
# ROWS = 64 for head_dim 128 (fp32 acc 64x128 = 32 KiB in registers over 4 warps)
# and 128 for head_dim <= 64; BLOCK_N = 64. Query tiles are launched longest first
# (the last tile of a request sees the most keys), so the stragglers start early.

PREFILL_BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr,
    qk_scale, first_seq, num_q_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = num_q_tiles - 1 - tl.program_id(0)  # longest-running tiles first
    kv_head = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    t0 = tile * BLOCK_M

    offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = t0 + offs_r // GROUP_PAD  # [ROWS] token index within the request
    g = offs_r % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_offs = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)

    # A tile past this request's tokens (requests are shorter than the longest) gets
    # empty key ranges rather than an early return, and stores nothing.
    live = t0 < q_len
    full_hi = tl.where(live, (prefix + t0 + 1) // BLOCK_N * BLOCK_N, 0)
    hi = tl.where(live, tl.minimum(prefix + t0 + BLOCK_M, seq_len), 0)

    row_max = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    row_pos = prefix + tok
    bt_row = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch
    row_max, row_sum, acc = _attend_tiles(
        q, row_max, row_sum, acc, row_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset,
        0, full_hi, qk_scale, stride_cb, stride_cs, stride_cd,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, UPCAST, DOT_PREC,
    )
    row_max, row_sum, acc = _attend_tiles(
        q, row_max, row_sum, acc, row_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset,
        full_hi, hi, qk_scale, stride_cb, stride_cs, stride_cd,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, UPCAST, DOT_PREC,
    )
    # row_sum >= 1 once a row saw a key (its max term is 2^0); rows of a dead tile
    # have row_sum == 0 and are not stored: max(row_sum, 1) keeps them free of 0/0.
    row_sum = tl.maximum(row_sum, 1.0)
    o_offs = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + offs_d[None, :] * stride_od,
             (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tile_shape(head_dim: int, group: int) -> tuple[int, int]:
    """(BLOCK_M tokens, GROUP_PAD heads) of a prefill query tile."""
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
) -> None:
    """Causal attention of prefill (chunk) tokens over their cached prefix and themselves."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    block_m, group_pad = prefill_tile_shape(head_dim, group)
    num_q_tiles = triton.cdiv(max_query_len, block_m)
    _prefill_kernel[(num_q_tiles, num_kv_heads, num_prefills)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2_E, first_seq, num_q_tiles,
        *query.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=PREFILL_BLOCK_N,
        **_dot_flags(query.dtype), num_warps=4 if block_m * group_pad * head_dim <= 8192 else 8,
    )

