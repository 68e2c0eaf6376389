"""Triton kernels for the element-wise layers on a GPU: RMSNorm (with the residual add),
SiLU-and-mul and rotary embedding, one kernel each.

The torch references (norm.py, activation.py, rotary.py) take about 36 small kernels per
decoder layer on a GPU; a batch-1 decode step of the Llama-3-8B shape spent about 1.9 of
its 5.95 ms of GPU time in them on an H200, and a CUDA graph of that many nodes cost 1.9
ms of CPU to launch (benchmarks/results/gpu/RUNS.md, fourth loan). These do the same
arithmetic in one kernel per layer call, rounding where torch rounds (each bf16/float16
product and sum is rounded to the tensor's dtype as torch's kernels round it), so their
results differ from the references' only in the order of the RMSNorm's float32 sum and
in the exp/rsqrt instructions; tests/test_triton_layer_ops.py bounds the difference under
Triton's interpreter on CPU.

Off by default until a GPU run has measured them: PAGEDLM_TRITON_LAYER_OPS=1 turns them on
(benchmarks/gpu/run_all.py's decode phase measures both).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

ENV = "PAGEDLM_TRITON_LAYER_OPS"
# CPU tensors take the kernels only in tests/test_triton_layer_ops.py, which sets this under
# Triton's interpreter: a CPU layer call then returns at the first check, reading no
# environment variable (the check runs on every layer call).
INTERPRETED_ON_CPU = False


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        from pagedlm.layers import triton_layer_kernels
    except ImportError:  # no triton
        return None
    return triton_layer_kernels


def triton_ops(x: torch.Tensor) -> ModuleType | None:
    """The kernels' module when `x` is on a CUDA device (or, under Triton's interpreter, a
    test's CPU tensor: INTERPRETED_ON_CPU) and PAGEDLM_TRITON_LAYER_OPS=1; else None: the
    layer runs its torch reference."""
    if not (x.is_cuda or INTERPRETED_ON_CPU) or os.environ.get(ENV) != "1":
        return None
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    return _kernels()
