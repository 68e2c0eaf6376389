"""Linear layers shaped for tensor parallelism.

Column-parallel layers split the output features across ranks (each rank computes a slice
of the output); row-parallel layers split the input features and sum partial outputs.
Each parameter carries a `weight_loader` that copies this rank's slice of a checkpoint
tensor, so models load HF checkpoints unchanged whatever the tensor-parallel size.

    QKV projection, one rank of tp:   [ q (heads/tp) | k (kv_heads/tp) | v (kv_heads/tp) ]
    gate/up projection:               [ gate (I/tp)  | up (I/tp) ]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.parallel_state import all_gather_last_dim, all_reduce, get_tp_group

if TYPE_CHECKING:
    from pagedlm.layers.lora import LoRAWeights


class WeightKernel(Protocol):
    """Multiplies by a weight held in another format than a float [out, in] tensor
    (layers/weight_format.py picks one per layer, once, after loading)."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] -> x @ W.T (+ bias) [..., out_features]."""
        ...


class DenseWeightKernel:
    """F.linear over a float [out, in] weight: what a layer without a kernel does, as a
    kernel object for wrappers that fall back to it (layers/quant_block_weights.py)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """For parameters that are never sharded (norm weights, ...)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class LinearBase(nn.Module):
    # Adapter slots (layers/lora.py), where LoRA is enabled: their delta is added to the
    # output of `matmul`, whatever format the weight is in.
    lora: LoRAWeights | None = None
    # The weight in another format (float16, panels, quant blocks), set once after loading
    # by layers/weight_format.py, which then drops `weight`; None: F.linear over `weight`.
    weight_kernel: WeightKernel | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        # This rank's sizes (the weight itself may be repacked into another format).
        self.in_features, self.out_features = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), in whatever format the weight is held."""
        if self.weight_kernel is None:
            return F.linear(x, self.weight, bias)
        return self.weight_kernel(x, bias)

    @staticmethod
    def _copy(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if param.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch{' for ' + name if name else ''}: parameter {tuple(param.shape)}, "
                f"checkpoint {tuple(loaded.shape)}"
            )
        param.data.copy_(loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._copy(param, loaded)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), plus each token's LoRA delta where adapters are on."""
        y = self.matmul(x, bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Splits output features; `gather_output` concatenates the slices again."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.gather_output = gather_output
        super().__init__(input_size, _divide(output_size, tp.size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        self._copy(param, loaded.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x, self.bias)
        return all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        for size in output_sizes:  # each part is split, not only their sum
            _divide(size, get_tp_group().size, "output size")
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert isinstance(shard_id, int), shard_id
        shard_size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if loaded.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(
                f"shape mismatch for shard {shard_id}: expected {self.output_sizes[shard_id]} rows, "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        self._copy(param.data.narrow(0, offset, shard_size),
                   loaded.narrow(0, self.tp_rank * shard_size, shard_size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shards are "q", "k", "v". KV heads are replicated when
    there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_tp_group().size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) and the tensor-parallel size ({tp_size}) "
                "must divide one another (KV heads are split, or replicated when fewer)")
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        full = size * (self.tp_size if shard_id == "q" else self.tp_size // self.num_kv_head_replicas)
        if loaded.shape[0] != full:
            raise ValueError(
                f"shape mismatch for {shard_id}_proj: expected {full} rows, checkpoint has {tuple(loaded.shape)}"
            )
        self._copy(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Splits input features; partial outputs are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(_divide(input_size, tp.size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2 and self.tp_size > 1:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        self._copy(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction; each rank's part of the LoRA delta
        # before it (the parts sum to the whole, as the matmul's do).
        y = all_reduce(self.project(x, None))
        return y + self.bias if self.bias is not None else y
