"""Triton kernels for the multi-adapter LoRA delta of `pagedlm.layers.lora`, for CUDA.

Layout (see `lora.py`): S slices, rank padded to R, `max_loras` slots,

    x      [T, in]                   the layer's input, one row per token
    y      [T, out]                  its output, the delta added in place
    a      [max_loras, S, R, in]     rows r >= ranks[l] of slot l are zeros
    b      [max_loras, R, out]       B transposed: columns lo_s:hi_s hold slice s's B^T
                                     (passed with strides as the view [max_loras, out, R])
    ranks  [max_loras] int32         0: an empty slot
    bounds [S, 2] int64              slice s covers output rows lo_s:hi_s
    slots  [T] int32                 each token's slot, -1: no adapter

Two launches, a token at a time through its own slot's weights (any mix of adapters in
one step, no grouping by adapter on the host):

    shrink  grid (T, S):             h[t, s, :r] = a[l, s, :r] @ x[t]    (TILE_K tiles of in)
    expand  grid (T, S, row blocks): y[t, lo_s + n] += b[l, lo_s + n, :r] @ h[t, s, :r]

with l = slots[t], r = ranks[l], h a float32 scratch [T, S, R] and the row blocks of
TILE_N rows covering the widest slice (the blocks past a narrower slice's end return).
Tokens without an adapter (or on an empty slot) return at once, so they neither read
weights nor write y. A token is one vector, too short for `tl.dot`: products are
broadcast multiplies summed in float32 (loads are widened first, so the interpreter's
bfloat16 dot is never used). Every output element is written by one program: no
atomics. Launch grids come only from host integers, so nothing here syncs; the same
calls run CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pagedlm.layers.lora import LoRAStep, LoRAWeights

TILE_K = 128  # shrink: input features per tile
TILE_N = 64  # expand: output rows per program


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, slots_ptr, ranks_ptr,
    in_features,
    stride_xt, stride_xk,  # x
    stride_al, stride_as, stride_ar, stride_ak,  # a
    stride_ht, stride_hs,  # h (rank stride 1)
    TILE_R: tl.constexpr, TILE_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    offs_r = tl.arange(0, TILE_R)
    offs_k = tl.arange(0, TILE_K)
    r_mask = offs_r < rank
    a_rows = a_ptr + slot * stride_al + s * stride_as + offs_r[:, None] * stride_ar  # [TILE_R, 1]
    acc = tl.zeros([TILE_R], dtype=tl.float32)
    for k0 in range(0, in_features, TILE_K):
        k = k0 + offs_k  # [TILE_K]
        k_mask = k < in_features
        xk = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k_mask, other=0.0)
        ak = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0)  # [TILE_R, TILE_K]
        acc += tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + s * stride_hs + offs_r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, h_ptr, slots_ptr, ranks_ptr, bounds_ptr,
    stride_yt, stride_yn,  # y
    stride_bl, stride_bn, stride_br,  # b
    stride_ht, stride_hs,  # h (rank stride 1)
    TILE_R: tl.constexpr, TILE_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    start = tl.load(bounds_ptr + 2 * s) + tl.program_id(2) * TILE_N
    hi = tl.load(bounds_ptr + 2 * s + 1)
    if start >= hi:  # past this slice's end (the grid covers the widest slice)
        return
    offs_r = tl.arange(0, TILE_R)
    r_mask = offs_r < rank
    n = start + tl.arange(0, TILE_N)  # [TILE_N] output rows
    n_mask = n < hi
    h = tl.load(h_ptr + t * stride_ht + s * stride_hs + offs_r, mask=r_mask, other=0.0)
    b = tl.load(b_ptr + slot * stride_bl + n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [TILE_N, TILE_R]
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)  # [TILE_N]
    y_ptrs = y_ptr + t * stride_yt + n * stride_yn
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def lora_triton(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, step: LoRAStep) -> None:
    """y [T, out] += each token's adapter delta of x [T, in] (see the module docstring)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    _, num_slices, max_rank, in_features = w.a.shape
    block_r = triton.next_power_of_2(max_rank)
    slots = step.token_slots
    h = torch.empty(num_tokens, num_slices, max_rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens, num_slices)](
        x, w.a, h, slots, w.ranks,
        in_features,
        x.stride(0), x.stride(1),
        *w.a.stride(),
        h.stride(0), h.stride(1),
        TILE_R=block_r, TILE_K=min(TILE_K, triton.next_power_of_2(in_features)),
    )
    widest = max(hi - lo for lo, hi in w.slices)
    block_n = min(TILE_N, triton.next_power_of_2(widest))
    _expand_kernel[(num_tokens, num_slices, triton.cdiv(widest, block_n))](
        y, w.b, h, slots, w.ranks, w.bounds,
        y.stride(0), y.stride(1),
        *w.b.transpose(1, 2).stride(),
        h.stride(0), h.stride(1),
        TILE_R=block_r, TILE_N=block_n,
    )
