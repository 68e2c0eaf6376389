from __future__ import annotations

import torch
from torch import nn

from pagedlm.layers.cpu_ops import fused_ops
from pagedlm.layers.triton_ops import triton_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; optionally adds the residual first and returns it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        gpu = triton_ops(x)
        if gpu is not None and (residual is None or residual.dtype == x.dtype):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            res2 = None if residual is None else residual.reshape(-1, shape[-1])
            out, res_out = gpu.rms_norm(x2 if x2.stride(-1) == 1 else x2.contiguous(),
                                        self.weight, self.eps,
                                        res2 if res2 is None or res2.stride(-1) == 1
                                        else res2.contiguous())
            if res_out is None:
                return out.view(shape)
            return out.view(shape), res_out.view(shape)
        ops = fused_ops(x)
        if ops is not None and self.weight.dtype == torch.float32:
            # The common case, [num_tokens, hidden] contiguous, skips reshape and view: at
            # decode sizes their dispatch costs several times the kernel.
            if x.dim() == 2 and x.is_contiguous() and (residual is None or (
                    residual.dim() == 2 and residual.is_contiguous())):
                outs = ops.rms_norm(x, self.weight, self.eps, residual)
                return outs[0] if residual is None else (outs[0], outs[1])
            shape = x.shape
            res = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
            outs = ops.rms_norm(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps, res)
            if residual is None:
                return outs[0].view(shape)
            return outs[0].view(shape), outs[1].view(shape)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
