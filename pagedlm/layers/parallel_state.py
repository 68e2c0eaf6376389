"""Tensor-parallel group membership. A single process is rank 0 of a group of 1.

The layers read the rank and size from here when they are built, so that sharding
weights across ranks later changes this module, not the models.
"""

from dataclasses import dataclass

import torch

from pagedlm.csrc import load_extension

# A float32 all-reduce is cut into rounds of at most this many elements (1 MiB per slot).
SHM_CHUNK = 1 << 18
SHM_TIMEOUT_MS = 60_000


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


def shm_segment_bytes(world_size: int, chunk: int = SHM_CHUNK) -> int:
    """Size of the shared segment csrc/shm_allreduce_cpu.cpp lays out (flags, two slot sets)."""
    return world_size * 64 + 2 * world_size * chunk * 4


class ShmAllReduce:
    """Float32 sums over the ranks of one machine through a shared-memory file every rank
    maps (csrc/shm_allreduce_cpu.cpp): a few microseconds where gloo over loopback takes
    hundreds. Every rank must make the same sequence of calls, as collectives do."""

    def __init__(self, path: str, rank: int, world_size: int, chunk: int = SHM_CHUNK,
                 timeout_ms: int = SHM_TIMEOUT_MS) -> None:
        self.kernels = load_extension("shm_allreduce_cpu")
        if self.kernels is None:
            raise RuntimeError("the shared-memory all-reduce kernel is unavailable")
        self.segment = torch.from_file(path, shared=True, size=shm_segment_bytes(world_size, chunk),
                                       dtype=torch.uint8)
        self.rank, self.world_size, self.chunk = rank, world_size, chunk
        self.timeout_ms = timeout_ms
        self.round = 1

    def __call__(self, x: torch.Tensor) -> None:
        """x summed over the ranks, in place."""
        self.round = self.kernels.all_reduce(self.segment, self.rank, self.world_size, self.chunk,
                                             self.round, x, self.timeout_ms)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world_size, *x.shape]: every rank's x, in rank order."""
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype)
        self.round = self.kernels.all_gather(self.segment, self.rank, self.world_size, self.chunk,
                                             self.round, x, out, self.timeout_ms)
        return out


_SHM: ShmAllReduce | None = None


def set_shm_all_reduce(comm: ShmAllReduce | None) -> None:
    """Route float32 CPU all-reduces through `comm` (None: torch.distributed for all)."""
    global _SHM
    _SHM = comm


def shm_all_reduce() -> ShmAllReduce | None:
    """The shared-memory all-reduce this rank's sums go through, if one is set."""
    return _SHM


def all_reduce(x):
    """Sum over the tensor-parallel group (identity for a group of one)."""
    if _TP.size == 1:
        return x
    if _SHM is not None and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous():
        _SHM(x)
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x):
    """Every rank's x side by side along the last dimension, in rank order."""
    if _TP.size == 1:
        return x
    if _SHM is not None and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous():
        parts = _SHM.gather(x)  # [world, ..., d]
        return torch.cat(parts.unbind(0), dim=-1)
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
