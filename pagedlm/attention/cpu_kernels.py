"""The C++ CPU kernels in `pagedlm/csrc`, compiled on first use and cached.

The build uses torch's extension builder (a C++ compiler and ninja), once per source
version and CPU; later processes load the cached library in well under a second. Where no
compiler is available `load_cpu_kernels()` returns None and the caller falls back to the
pure-torch path, with a warning that says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention_cpu.cpp"
DISABLE_ENV = "PAGEDLM_DISABLE_CPU_KERNELS"


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the library is built with -march=native,
    so a cache directory shared between different machines must not mix their builds."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@functools.cache
def load_cpu_kernels():
    """The compiled extension module, or None if it is disabled or cannot be built."""
    if os.environ.get(DISABLE_ENV):
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=f"pagedlm_cpu_attention_{_cpu_tag()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a read-only cache, ...
        logger.warning("CPU attention kernels unavailable (%s: %s); using the torch path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


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
    return out.to(query.dtype)
