"""The Triton kernels behind layers/triton_ops.py (imported only where triton is).

Each rounds where the torch reference rounds: a bf16/float16 `a * b` is computed in
float32 and rounded once to the dtype, as torch's element-wise kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_stride, res_stride,
                     out_stride, res_out_stride, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # torch's x + residual
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * (1.0 / tl.sqrt(mean_sq + eps))).to(x.dtype)  # x32 * rsqrt(...), then .to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)  # weight * normed, rounded once by the store
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of the rows of 2-D `x` (after adding `residual`, when given): (normed, x +
    residual or None). The output's dtype is torch's for weight * x (RMSNorm._norm)."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=torch.result_type(weight, x), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        res = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        _rms_norm_kernel[(rows,)](
            x, res, weight, out, ro, cols, x.stride(0), res.stride(0), out.stride(0), ro.stride(0),
            eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded to the dtype
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for 2-D `x` of 2d columns (unit stride along them)."""
    rows, two_d = x.shape
    d = two_d // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x, out, d, x.stride(0), out.stride(0),
                                                            BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, num_q_heads,
                   head_dim, rotary_dim, q_tok_stride, q_head_stride, k_tok_stride,
                   k_head_stride, q_out_tok_stride, k_out_tok_stride, cache_stride,
                   INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token and head, the query's heads first, then the key's.
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if head < num_q_heads:
        src = q_ptr + tok * q_tok_stride + head * q_head_stride
        dst = q_out_ptr + tok * q_out_tok_stride + head * head_dim
    else:
        src = k_ptr + tok * k_tok_stride + (head - num_q_heads) * k_head_stride
        dst = k_out_ptr + tok * k_out_tok_stride + (head - num_q_heads) * head_dim
    dims = tl.arange(0, BLOCK)
    in_head = dims < head_dim
    rot = dims < rotary_dim
    pos = tl.load(pos_ptr + tok)
    x = tl.load(src + dims, mask=in_head, other=0.0)
    half = rotary_dim // 2
    if INTERLEAVED:  # pairs (2i, 2i + 1): rotated = (-x[2i + 1], x[2i])
        partner = dims ^ 1
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    else:  # rotate-half: pairs (i, i + half): rotated = (-x[i + half], x[i])
        partner = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1.0, 1.0)
    other = tl.load(src + partner, mask=rot, other=0.0)
    cos = tl.load(cos_ptr + pos * cache_stride + dims, mask=rot, other=0.0)
    sin = tl.load(sin_ptr + pos * cache_stride + dims, mask=rot, other=0.0)
    # x * cos + rotate(x) * sin, each product and the sum rounded to the dtype as torch does
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
    b = ((other.to(tl.float32) * sign) * sin.to(tl.float32)).to(x.dtype)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    y = tl.where(rot, y, x)  # the dims past rotary_dim pass through
    tl.store(dst + dims, y, mask=in_head)


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int,
           interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of `query` [num_tokens, num_heads, head_dim] and `key` [num_tokens,
    num_kv_heads, head_dim] (same dtype, unit stride along head_dim) at `positions`, the
    first `rotary_dim` dims of each head rotated, in one launch: new contiguous tensors.
    The caches are [max_position, rotary_dim] in their dtype (RotaryEmbedding's)."""
    tokens, q_heads, head_dim = query.shape
    k_heads = key.shape[1]
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=key.dtype, device=key.device)
    if tokens and q_heads + k_heads:
        _rotary_kernel[(tokens, q_heads + k_heads)](
            query, key, q_out, k_out, positions, cos_cache, sin_cache, q_heads, head_dim,
            rotary_dim, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            q_out.stride(0), k_out.stride(0), cos_cache.stride(0),
            INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(head_dim))
    return q_out, k_out
