import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.cpu_ops import fused_ops
from pagedlm.layers.triton_ops import triton_ops


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpu = triton_ops(x)
        if gpu is not None and x.shape[-1] % 2 == 0:
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            out = gpu.silu_and_mul(x2 if x2.stride(-1) == 1 else x2.contiguous())
            return out.view(*shape[:-1], shape[-1] // 2)
        ops = fused_ops(x)
        if ops is not None:
            if x.dim() == 2 and x.is_contiguous():  # no reshape / view to dispatch
                return ops.silu_and_mul(x)
            shape = x.shape
            out = ops.silu_and_mul(x.reshape(-1, shape[-1]).contiguous())
            return out.view(*shape[:-1], shape[-1] // 2)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
