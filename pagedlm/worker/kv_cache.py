"""Sizing and allocating the paged KV cache.

Per layer, two tensors (K and V), each

    [num_blocks, block_size, num_kv_heads, head_dim]
      block 0: | tok 0 | tok 1 | ... | tok block_size-1 |   each tok: [num_kv_heads, head_dim]
      block 1: | ...                                    |

One block holds `block_size` tokens of every layer, so its cost in bytes is
2 (K and V) * num_layers * block_size * num_kv_heads * head_dim * element size.
"""

from __future__ import annotations

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeroed, not empty: attention reads whole blocks and masks the unused slots, and an
    # uninitialised NaN times a zero weight would still be NaN.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


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
