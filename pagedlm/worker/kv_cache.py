"""Sizing and allocating the paged KV cache.

Per layer, two tensors (K and V), each

    [num_blocks, block_size, num_kv_heads, head_dim]
      block 0: | tok 0 | tok 1 | ... | tok block_size-1 |   each tok: [num_kv_heads, head_dim]
      block 1: | ...                                    |

One block holds `block_size` tokens of every layer, so its cost in bytes is
2 (K and V) * num_layers * block_size * num_kv_heads * head_dim * element size.
"""

from __future__ import annotations

import math
import mmap

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device,
                      huge_pages: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache, zeroed; on CPU in 2 MB pages where the kernel grants
    them (`huge_pages=False`: torch's own memory, for comparison)."""
    # Zeroed, not empty: attention reads whole blocks and masks the unused slots, and an
    # uninitialised NaN times a zero weight would still be NaN.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    zeros = _huge_page_zeros if huge_pages and torch.device(device).type == "cpu" else (
        lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
    return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(num_layers)]


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory the kernel backs with 2 MB pages where it can
    (transparent huge pages, asked for with madvise: most systems grant them only then).
    Attention reads a sequence's blocks from anywhere in the cache; with 4 KB pages nearly
    every block costs TLB misses and the hardware prefetcher stops at each page edge.
    Plain torch.zeros where the platform has no such advice."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: small pages, as torch's
        pass
    # The tensor keeps the mapping alive; zeroing now faults every page in up front (anonymous
    # memory reads as zeros anyway), as torch.zeros does, instead of during the first steps.
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape).zero_()


def num_blocks_for_cuda(profile_peak_bytes: int, block_bytes: int, gpu_memory_utilization: float,
                        device: torch.device) -> int:
    """Blocks that fit in `gpu_memory_utilization` of the card next to what this process
    held at the peak of a profiling forward pass (`profile_peak_bytes`: weights and
    activations, as torch.cuda.max_memory_allocated reads it) and what other processes use."""
    free, total = torch.cuda.mem_get_info(device)
    return kv_blocks_in_budget(total, free, torch.cuda.memory_reserved(device),
                               profile_peak_bytes, block_bytes, gpu_memory_utilization)


def kv_blocks_in_budget(total: int, free: int, reserved: int, peak: int, block_bytes: int,
                        gpu_memory_utilization: float) -> int:
    """The KV blocks of `block_bytes` that fit in `gpu_memory_utilization * total` bytes
    once `peak` (this process's peak allocation, weights included) and the memory of other
    processes (`total - free` minus what this process has `reserved`) are taken out."""
    used_by_others = max(0, total - free - reserved)
    budget = total * gpu_memory_utilization - used_by_others - peak
    return max(0, int(budget // block_bytes))
