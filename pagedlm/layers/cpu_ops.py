"""Fused float32 CPU kernels for the element-wise layers (pagedlm/csrc/layer_ops_cpu.cpp).

The layers call `fused_ops(x)`: the compiled module when `x` is a float32 CPU tensor and
the kernels built, else None and the layer runs its torch reference. The kernels change
only float32 rounding (a polynomial exp in SiLU, fused multiply-adds), which
tests/test_layer_ops_cpu.py bounds against those references.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedlm.csrc import load_extension


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return load_extension("layer_ops_cpu")
