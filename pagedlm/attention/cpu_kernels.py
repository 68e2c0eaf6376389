"""Python entry points of the C++ CPU attention kernels (pagedlm/csrc/paged_attention_cpu.cpp)."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedlm.csrc import load_extension


def load_cpu_kernels() -> ModuleType | None:
    """The compiled attention kernels, or None if disabled or they cannot be built."""
    return load_extension("paged_attention_cpu")


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: list[int],  # context length of each sequence, incl. its query token
    scale: float,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads]
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], query's dtype
    """One query token per sequence against its paged context (see the C++ source for the
    maths). Requires `load_cpu_kernels()` to have succeeded."""
    kernels = load_cpu_kernels()
    if kernels is None:
        raise RuntimeError("the CPU attention kernels are not available")
    q = (query.float() * scale).contiguous()  # [num_seqs, num_heads, head_dim]
    out = kernels.paged_decode(
        q, k_cache, v_cache, block_tables.contiguous(), seq_lens,
        float(logits_soft_cap or 0.0), int(sliding_window or 0),
        None if alibi_slopes is None else alibi_slopes.float().contiguous(),
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def load_prefill_kernels() -> ModuleType | None:
    """The compiled prefill attention kernel (pagedlm/csrc/prefill_attention_cpu.cpp), or None."""
    return load_extension("prefill_attention_cpu")


def prefill_kernel_supports(head_dim: int) -> bool:
    """Whether the prefill kernel is built and takes this head size (a multiple of its
    vector width: 16 with AVX-512, else 8)."""
    kernels = load_prefill_kernels()
    return kernels is not None and head_dim % kernels.lanes == 0


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the prefill rows, seq after seq
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    query_start: list[int],  # [num_seqs + 1] offsets of each sequence's rows in `query`
    seq_lens: list[int],  # context length of each sequence, its new tokens included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Causal attention of every sequence's new tokens against its whole paged context (the
    new tokens' K/V already written to the cache), in one call for all of them. Requires
    `prefill_kernel_supports(head_dim)`."""
    kernels = load_prefill_kernels()
    if kernels is None:
        raise RuntimeError("the CPU prefill attention kernel is not available")
    out = kernels.paged_prefill(
        query.float().contiguous(), k_cache, v_cache, block_tables.contiguous(), query_start,
        seq_lens, float(scale), int(sliding_window or 0),
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)
