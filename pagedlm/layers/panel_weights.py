"""Linear weights packed in 16-column panels for the CPU panel GEMM (csrc/panel_gemm_cpu.cpp).

At the row counts of decode steps (8-64 rows) torch's float32 GEMM on our 2-core dev box
reaches 22-80 GFLOP/s and the panel kernel 60-122, of the FMA units' 200
(benchmarks/cpu/panel_gemm.py, benchmarks/cpu/fma_peak.py). Float32 panels keep float32 models' maths exact up to the
order of the sums; float16 panels hold `weight_dtype='float16'` weights where torch has no
fbgemm (each weight rounded to float16 once, widened back to float32 in the kernel).

    packed [ceil(N / 16), K, 16]    packed[p, k, j] = W[16 p + j, k]   (0 past N)
"""

from __future__ import annotations

import torch

from pagedlm.csrc import load_extension

PANEL = 16


def panel_kernels():
    """The compiled kernel module, or None (no compiler, or PAGEDLM_DISABLE_CPU_KERNELS)."""
    return load_extension("panel_gemm_cpu")


def pack_panels(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N / 16), K, 16] of `dtype` (float32 or float16)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous().to(dtype)  # [P, K, 16]


class PanelWeightMatmul:
    """`x @ W.T (+ bias)` with W packed in panels; x float32 (other dtypes are cast)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, kernels=None) -> None:
        if weight.device.type != "cpu":
            raise ValueError("panel packing is for CPU weights")
        kernels = kernels or panel_kernels()
        assert kernels is not None, "the panel kernel is not built"
        self.out_features, self.in_features = weight.shape
        self.panels = pack_panels(weight, dtype)
        self.gemm = kernels.panel_gemm

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            # [rows, in_features] float32, the common case: no reshape / view to dispatch.
            return self.gemm(x, self.panels, self.out_features, None)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # [rows, in_features]
        y = self.gemm(x2, self.panels, self.out_features, None if bias is None else bias.float())
        return y.to(x.dtype).view(*lead, self.out_features)  # [..., out_features]
