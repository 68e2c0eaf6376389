"""Split-K ("flash decoding") paged attention for decode tokens, in Triton.

A decode has one query token, so a batch of short requests with few kv heads gives
too few programs to fill the GPU, and one long context is read by a single program.
The keys a decode reads are therefore cut into NUM_SPLITS ranges of `split_len`
tokens (a multiple of TILE_N), one program each:

  context of request r, kv head h: seq_len 300; NUM_SPLITS 4 and split_len 128
  were set on the host from the batch's longest context (512); TILE_N 64:

  pos  0        64       128      192      256   300   384
       |--tile--|--tile--|--tile--|--tile--|--tile-|.....|
       |<--- split 0 --->|<--- split 1 --->|<-- split 2->|  split 3: empty
           program          program          program         program
              |                |                |               |
              v                v                v               v
  part_m / part_l  [num_decodes, num_heads, NUM_SPLITS]           (row max, row sum)
  part_acc         [num_decodes, num_heads, NUM_SPLITS, head_dim] (unnormalised out)
              \\________________|________________/
                               v
           reduce program (r, q head): M = max_s m_s, w_s = 2^(m_s - M)
           out = sum_s w_s * acc_s / sum_s w_s * l_s     (splits past seq_len masked)

With a sliding window of W keys the splits start at `base`, the window's first key
rounded down to a tile (seq_len 300, W 100: base 192, key_lo 200), so blocks wholly
before the window are skipped and the split plan only has to cover W + TILE_N - 1
keys (`decode_span`):

  pos  0 ... 192    200                300
             |base  |key_lo            |seq_len
             |<-- split 0 -->|<-- split 1 -->|
             keys 192..199 are masked at the load, never read

With NUM_SPLITS == 1 the split program normalises and writes `out` itself.
A row with seq_len 0 (batch padding, e.g. for a CUDA graph) gets an output of 0.

The query tile is TILE_H rows: the GROUP query heads of the kv head, padded to
at least 16 because tl.dot needs M >= 16 on tensor cores. The padding wastes MMA
throughput, which decode (bandwidth-bound: each K/V byte is used GROUP times)
does not miss. TILE_N = 64 keys x head_dim 128 x 2 bytes = 16 KiB per K or V tile:
large enough for wide coalesced loads from 4 blocks of 16, small enough to keep
several pipeline stages in flight in shared memory.
"""

import torch
import triton
import triton.language as tl

from pagedlm.attention.triton_kernels import LOG2_E_JIT, _attend_tiles, dot_flags, score_scales

DECODE_TILE_N = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_slopes_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, cap_scale, split_len, window, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, TILE_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    req = tl.program_id(0)  # decode r is request r and token r
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    if HAS_WINDOW:
        key_lo = tl.maximum(seq_len - window, 0)  # the window's first key
        base = key_lo // TILE_N * TILE_N
    else:
        key_lo = 0
        base = 0
    lo = base + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)  # hi <= lo: an empty split

    offs_h = tl.arange(0, TILE_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_h  # [TILE_H]
    head_ok = offs_h < GROUP
    q = tl.load(
        q_ptr + req * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_ok[:, None], other=0.0,
    )  # [TILE_H, HEAD_DIM]
    if ALIBI:
        row_slope = tl.load(alibi_slopes_ptr + head, mask=head_ok, other=0.0) * LOG2_E_JIT
    else:
        row_slope = tl.zeros([TILE_H], tl.float32)  # unused
    row_pos = tl.zeros([TILE_H], tl.int64) + (seq_len - 1)  # the decode token's position
    row_max = tl.full([TILE_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([TILE_H], tl.float32)
    acc = tl.zeros([TILE_H, HEAD_DIM], tl.float32)
    row_max, row_sum, acc = _attend_tiles(
        q, row_max, row_sum, acc, row_pos, row_slope,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + req * stride_bt, kv_head * stride_ch,
        lo, hi, key_lo, window, qk_scale, cap_scale, stride_cb, stride_cs, stride_cd,
        BLOCK_SIZE, TILE_N, HEAD_DIM, True, False, HAS_WINDOW, ALIBI, SOFTCAP,
        UPCAST, DOT_PREC,
    )
    if NUM_SPLITS == 1:
        # row_sum >= 1 once a row saw a key (its max term is 2^0), so max(row_sum, 1)
        # changes nothing but the 0/0 of a padding row (seq_len 0) into 0.
        row_sum = tl.maximum(row_sum, 1.0)
        o_offs = req * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_offs, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None])
    else:
        part = (req * num_heads + head) * NUM_SPLITS + split  # [TILE_H]
        tl.store(part_m_ptr + part, row_max, mask=head_ok)
        tl.store(part_l_ptr + part, row_sum, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=head_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr, out_ptr,
    split_len, window, num_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    if HAS_WINDOW:
        base = tl.maximum(seq_len - window, 0) // TILE_N * TILE_N  # as in the split kernel
    else:
        base = 0
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    # Every used split holds a key the row sees: split 0 the window's first, the others
    # lie wholly inside the window. None is used by a padding row (seq_len 0).
    used = offs_s < tl.cdiv(seq_len - base, split_len)
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


def decode_span(max_seq_len: int, sliding_window: int | None) -> int:
    """The most keys (from `base`, whole tiles before the window skipped) a decode of
    context <= max_seq_len reads: what the split plan has to cover."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + DECODE_TILE_N - 1)


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
    split_len: int,  # num_splits * split_len >= decode_span(every decode's seq_len, window)
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # from alloc_partials
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Attention of the first num_decodes tokens (one per request) over their contexts."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if num_splits > 1:
        part_m, part_l, part_acc = partials
    else:
        part_m = part_l = part_acc = out  # unused by the NUM_SPLITS == 1 variant
    qk_scale, cap_scale = score_scales(scale, logits_soft_cap)
    window = sliding_window or 0
    _decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        query if alibi_slopes is None else alibi_slopes,  # unused without ALIBI
        out, part_m, part_l, part_acc,
        qk_scale, cap_scale, split_len, window, num_heads,
        *query.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, TILE_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=DECODE_TILE_N, NUM_SPLITS=num_splits,
        ALIBI=alibi_slopes is not None, HAS_WINDOW=sliding_window is not None,
        SOFTCAP=logits_soft_cap is not None, **dot_flags(query.dtype), num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_m, part_l, part_acc, seq_lens, out, split_len, window, num_heads,
            *out.stride(), HEAD_DIM=head_dim, NUM_SPLITS=num_splits, TILE_N=DECODE_TILE_N,
            HAS_WINDOW=sliding_window is not None, num_warps=1,
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
