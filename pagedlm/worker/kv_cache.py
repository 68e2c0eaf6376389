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
    """Blocks that fit in `gpu_memory_utilization` of the card once weights and the peak
    activation memory of a profiling forward pass are accounted for."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = total * gpu_memory_utilization - used_by_others - profile_peak_bytes
    return max(0, int(budget // block_bytes))
