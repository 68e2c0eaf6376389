"""Triton kernels for paged attention: the KV-cache write and the shared attention loop.

The decode (split-K) and prefill kernels that use the loop are in `triton_decode.py` and
`triton_prefill.py`.

All kernels read the paged cache of one layer, laid out as

    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]

and find position `pos` of request `r` at block `block_tables[r, pos // block_size]`,
offset `pos % block_size`. A key tile of TILE_N positions may span several cache
blocks; each row is looked up on its own, so a tile need not align with a block and
the block size can be any value (each row is one contiguous head_dim vector).

GQA: a program owns one kv head and *all* the query heads that read it, stacked as
the rows of its query tile, so every K/V tile is loaded once per group, not once per
query head. Softmax runs online in float32 in base 2 (`exp2`, with log2(e) folded into
the scale), as in FlashAttention.

Masked loads use `other=0`: cache slots past a sequence's end may hold anything (the
tests fill them with NaN), and a masked key's weight of 0 times a NaN value is NaN.

Scores, per query position i and key position j (all optional parts are constexpr
switches, so a kernel without them is the plain causal one):

    s = (q . k) * scale
    s = cap * tanh(s / cap)                    SOFTCAP  (logits soft-capping, Gemma 2)
    s = s + slope[head] * (j - i)              ALIBI
    key j is seen iff j <= i and i - j < W     WINDOW   (sliding window of W keys)

With a window, keys before the window of a tile's earliest query are never loaded, nor
are their block-table entries followed: the engine may have freed those blocks.

Launch code is device-agnostic: the same calls run CUDA tensors on a GPU and CPU
tensors under the Triton interpreter (`TRITON_INTERPRET=1` set before triton is
imported). Launch grids come only from host integers, so nothing here syncs.

Names: TILE_* are a kernel's tile sizes (rows or keys a program holds at once);
BLOCK_SIZE is the KV cache's block size (tokens per block, reached through the block table).
"""

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
LOG2_E_JIT: tl.constexpr = tl.constexpr(LOG2_E)  # the same, readable inside kernels


# --------------------------------------------------------------------------- KV write


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,  # key
    stride_vt, stride_vh, stride_vd,  # value
    stride_cb, stride_cs, stride_ch, stride_cd,  # both caches
    BLOCK_SIZE: tl.constexpr, TILE_KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # One program per token: its [num_kv_heads, head_dim] K and V rows are one small
    # tile each, so a whole token moves in one masked load/store pair.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64; negative = padding, write nothing
    offs_h = tl.arange(0, TILE_KVH)
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
        BLOCK_SIZE=block_size, TILE_KVH=triton.next_power_of_2(num_kv_heads),
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
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 without inf / inf (e^2x = inf gives 1).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2_E_JIT)) + 1.0)


@triton.jit
def _attend_tiles(
    q,  # [ROWS, HEAD_DIM] in the query dtype
    row_max, row_sum,  # [ROWS] fp32, running max and sum of 2^(score) per row
    acc,  # [ROWS, HEAD_DIM] fp32, unnormalised output
    row_pos,  # [ROWS] absolute position of each query row (read for CAUSAL, ALIBI, WINDOW)
    row_slope,  # [ROWS] fp32 ALiBi slope * log2(e) of each row's head (read for ALIBI)
    k_cache_ptr, v_cache_ptr,
    block_table_ptr,  # this request's row of block_tables
    head_offset,  # kv_head * stride_ch
    lo, hi,  # key positions [lo, hi); lo is a multiple of TILE_N
    key_lo,  # WINDOW: keys before this are in no row's window and are never loaded
    window,  # WINDOW: row i sees keys j with i - j < window
    qk_scale,  # log2(e) * softmax scale; with SOFTCAP: softmax scale / cap
    cap_scale,  # SOFTCAP: cap * log2(e)
    stride_cb, stride_cs, stride_cd,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    RANGE_MASK: tl.constexpr,  # some tiles may run past hi
    CAUSAL: tl.constexpr,  # key pos must be <= row_pos
    WINDOW: tl.constexpr,  # key pos must be > row_pos - window and >= key_lo
    ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Fold keys [lo, hi) into the running (row_max, row_sum, acc) of each query row.

    Invariant without WINDOW: the first tile folded into a row has at least one key the
    row may see, so row_max is finite afterwards and exp2(row_max - new_max) is never
    exp2(-inf + inf). With WINDOW a tile may hide every key from some rows, so the max
    they subtract is taken as 0 while it is still -inf.
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, TILE_N):
        pos = start + offs_n  # [TILE_N]
        if WINDOW:
            if RANGE_MASK:
                load_ok = (pos >= key_lo) & (pos < hi)
            else:
                load_ok = pos >= key_lo
        elif RANGE_MASK:
            load_ok = pos < hi
        if RANGE_MASK or WINDOW:
            block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=load_ok, other=0)
        else:
            block = tl.load(block_table_ptr + pos // BLOCK_SIZE)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset  # [TILE_N]
        kv_offs = rows[:, None] + offs_d[None, :] * stride_cd  # [TILE_N, HEAD_DIM]
        if RANGE_MASK or WINDOW:
            k = tl.load(k_cache_ptr + kv_offs, mask=load_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=load_ok[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offs)
            v = tl.load(v_cache_ptr + kv_offs)
        k = k.to(q.dtype)  # a cache in another dtype is read back at the query's
        v = v.to(q.dtype)

        s = _mma(q, tl.trans(k), UPCAST, DOT_PREC)  # [ROWS, TILE_N] fp32
        if SOFTCAP:
            s = _tanh(s * qk_scale) * cap_scale
        else:
            s = s * qk_scale
        if ALIBI:
            s += row_slope[:, None] * (pos[None, :] - row_pos[:, None]).to(tl.float32)
        if CAUSAL:
            s = tl.where(pos[None, :] <= row_pos[:, None], s, float("-inf"))
        if WINDOW:
            s = tl.where(row_pos[:, None] - pos[None, :] < window, s, float("-inf"))
        if RANGE_MASK:
            s = tl.where(load_ok[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))  # [ROWS]
        if WINDOW:
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        else:
            shift = new_max
        alpha = tl.exp2(row_max - shift)  # rescales what was summed under the old max
        p = tl.exp2(s - shift[:, None])  # [ROWS, TILE_N]
        row_sum = row_sum * alpha + tl.sum(p, 1)
        # P is rounded to the value dtype for the tensor-core dot, as FlashAttention does.
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, DOT_PREC)
        row_max = new_max
    return row_max, row_sum, acc


# The interpreter's tl.dot multiplies bfloat16 operands as their raw uint16 bits
# (triton 3.9); under it, bf16 operands are widened to fp32 just before each dot,
# after being rounded to bf16 at the same points as on the GPU (though the
# interpreter's fp32 -> bf16 cast truncates where the GPU rounds to nearest). A kernel
# is interpreted iff TRITON_INTERPRET=1 was set when it was decorated, i.e. when this
# module was first imported: decided once, here.
_INTERPRETED = not isinstance(_write_kv_kernel, triton.runtime.JITFunction)


def dot_flags(dtype: torch.dtype) -> dict:
    """UPCAST / DOT_PREC constexprs of the attention kernels for a query dtype."""
    # fp32 inputs would otherwise be rounded to tf32 by tensor cores (~1e-3 error).
    return dict(
        UPCAST=_INTERPRETED and dtype == torch.bfloat16,
        DOT_PREC="ieee" if dtype == torch.float32 else None,
    )


def score_scales(scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_scale) for `_attend_tiles`: scores in log2 units are
    qk * qk_scale, or with a soft cap c, tanh(qk * scale / c) * c * log2(e)."""
    if logits_soft_cap is None:
        return scale * LOG2_E, 0.0
    return scale / logits_soft_cap, logits_soft_cap * LOG2_E
