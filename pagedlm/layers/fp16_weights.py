"""Linear weights stored in float16 on CPU, multiplied in float32 (fbgemm's fp16 GEMM).

Small-batch decode on a CPU is bound by the bytes of weights streamed from memory per
step; float16 storage halves them while activations, accumulation and outputs stay
float32 (the weights are widened to float32 inside the GEMM's packed panels). The only
change to the maths is each weight rounded to the nearest float16 (relative error
<= 2^-11). Measured on the 2-core dev box (SmolLM2-135M's 30 layers + LM head, weights
streamed from memory), model matmul time per step, float32 -> float16 weights:
1 row 38.6 -> 14.1 ms, 4 rows 75.9 -> 17.9 ms, 16 rows 99.5 -> 43.1 ms, 64 rows
217 -> 152 ms, 256 rows 644 -> 565 ms.
"""

from __future__ import annotations

import torch


def fp16_weights_supported() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Fp16WeightMatmul:
    """`x @ W.T (+ bias)` with W pre-packed as float16; x and the result float32."""

    def __init__(self, weight: torch.Tensor) -> None:  # [out_features, in_features]
        if weight.device.type != "cpu":
            raise ValueError("float16 weight packing is for CPUs (on a GPU use dtype=float16)")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and x.dim() == 2 and x.dtype == torch.float32:
            # [rows, in_features] float32, the common case: no reshape / view to dispatch.
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features).float(), self.packed)
        if bias is not None:
            y.add_(bias)
        return y.to(x.dtype).view(*lead, self.out_features)  # [..., out_features]
