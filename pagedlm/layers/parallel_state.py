"""Tensor-parallel group membership. A single process is rank 0 of a group of 1.

The layers read the rank and size from here when they are built, so that sharding
weights across ranks later changes this module, not the models.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1


_TP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP


def set_tp_group(rank: int, size: int) -> None:
    global _TP
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} outside a group of size {size}")
    _TP = TensorParallelGroup(rank, size)


def all_reduce(x):
    """Sum over the tensor-parallel group (identity for a group of one)."""
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x):
    if _TP.size == 1:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
