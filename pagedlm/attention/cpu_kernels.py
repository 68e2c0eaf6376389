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
        float(logits_soft_cap or 0.0), int(sliding_window or 0), alibi_slopes,
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)
