"""The format of a CPU model's linear weights, decided once after loading, in one place.

    weight_dtype='q8'       GGUF Q4_1 / Q8_0 weights as stored, others rounded to Q8_0,
                            multiplied in int8 (layers/q8_weights.py); a weight whose input
                            size is not a multiple of 32 gets float32 panels
    weight_dtype='float16'  fbgemm's float16 GEMM (layers/fp16_weights.py), or float16
                            panels where torch has no fbgemm (layers/panel_weights.py)
    otherwise               float32 panels (layers/panel_weights.py), or F.linear without
                            the C++ kernels

Outside 'q8', weights that are exactly GGUF quant blocks (a Q4_1 / Q8_0 file) also keep that
form for small batches (layers/quant_block_weights.py), wrapping the kernel above; they are
recovered from the float32 weight before the packing drops it.

Each linear layer and LM head gets its kernel as `weight_kernel` (layers/linear.py); a
linear layer's own float32 `weight` is then dropped (a tied LM head keeps the embedding it
shares). GPU models and float16/bfloat16 CPU models keep F.linear.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedlm.layers.embedding import ParallelLMHead
from pagedlm.layers.fp16_weights import Fp16WeightMatmul, fp16_weights_supported
from pagedlm.layers.linear import DenseWeightKernel, LinearBase, RowParallelLinear, WeightKernel
from pagedlm.layers.panel_weights import PanelWeightMatmul, panel_kernels
from pagedlm.layers.parallel_state import get_tp_group
from pagedlm.layers.q8_weights import BLOCK, Q8WeightMatmul, q8_kernels, quantize_q8_0
from pagedlm.layers.quant_block_weights import (
    MAX_ROWS_OVER_FP32,
    MAX_ROWS_OVER_PACKED,
    QuantBlockMatmul,
    QuantBlockWeight,
    quant_block_kernels,
)


def apply_weight_format(model: nn.Module, weight_dtype: str) -> list[str]:
    """Give every CPU linear layer and LM head of a float32 `model` its weight kernel for
    `weight_dtype` ('auto', 'float32', 'float16' or 'q8'). Returns what was done, one line
    each, for the log. ValueError when the format needs kernels this machine lacks."""
    layers = [m for m in model.modules()
              if isinstance(m, LinearBase | ParallelLMHead) and m.weight.device.type == "cpu"]
    counts: dict[str, int] = {}

    def count(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    choose = _q8_chooser(model, count) if weight_dtype == "q8" else _float_chooser(weight_dtype, count)
    block_kernels = None if weight_dtype == "q8" else quant_block_kernels()
    num_quant_block = 0
    for layer in layers:
        # Recovered first: the packing below drops the float32 copy it is recovered from.
        blocks = QuantBlockWeight.recover(layer.weight) if block_kernels is not None else None
        packed = choose(layer.weight)  # None: the float32 weight itself, through F.linear
        kernel = packed
        if blocks is not None:
            fallback = packed if packed is not None else DenseWeightKernel(layer.weight)
            max_rows = MAX_ROWS_OVER_FP32 if packed is None else MAX_ROWS_OVER_PACKED
            kernel = QuantBlockMatmul(blocks, fallback, max_rows, block_kernels)
            num_quant_block += 1
        layer.weight_kernel = kernel
        if packed is not None and isinstance(layer, LinearBase):
            layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    if weight_dtype == "q8":
        parts = ", ".join(f"{counts[what]} {what}" for what in ("exact", "rounded to Q8_0", "float32")
                          if what in counts)
        done = f"int8 matmuls on {len(layers)} layers ({parts})"
    else:
        done = ", ".join(f"{what} on {n} layers" for what, n in counts.items()) or "float32 (F.linear)"
    lines = [f"CPU linear weights: {done}"]
    if num_quant_block:
        lines.append(f"quant-block kernel for small batches on {num_quant_block} layers "
                     "(GGUF Q4_1/Q8_0 weights)")
    return lines


def _float_chooser(weight_dtype: str, count):
    """Float weights: float32 panels, or float16 (fbgemm or panels); None keeps F.linear."""
    panels = panel_kernels()
    if weight_dtype == "float16":
        if fp16_weights_supported():
            def fp16(weight: torch.Tensor) -> WeightKernel:
                count("float16 (fbgemm)")
                return Fp16WeightMatmul(weight)
            return fp16
        if panels is None:
            raise ValueError("weight_dtype='float16' needs torch's fbgemm backend or the "
                             "C++ panel kernel, and neither is available")
        # Interleaved end to end on the ShareGPT benchmark, float16 panels and fbgemm were
        # level within noise, fbgemm 2% ahead.
        dtype, what = torch.float16, "float16 panels"
    else:
        dtype, what = torch.float32, "float32 panels"

    def panel(weight: torch.Tensor) -> WeightKernel | None:
        if panels is None:
            return None
        count(what)
        return PanelWeightMatmul(weight, dtype, panels)
    return panel


def _q8_chooser(model: nn.Module, count):
    """Integer matmuls: exact GGUF blocks where the weight is one, else rounded to Q8_0."""
    kernels = q8_kernels()
    panels = panel_kernels()
    if kernels is None or panels is None:
        raise ValueError("weight_dtype='q8' needs the C++ CPU kernels (a C++ compiler)")
    _check_tp_alignment(model)

    def q8(weight: torch.Tensor) -> WeightKernel:
        if weight.shape[1] % BLOCK:
            count("float32")
            return PanelWeightMatmul(weight, torch.float32, panels)
        found = QuantBlockWeight.recover(weight)
        if found is not None:
            count("exact")
            return Q8WeightMatmul(found.blocks, found.ggml_type, kernels)
        count("rounded to Q8_0")
        return Q8WeightMatmul(quantize_q8_0(weight), GGMLQuantizationType.Q8_0, kernels)
    return q8


def _check_tp_alignment(model: nn.Module) -> None:
    """Under tensor parallelism a row-parallel layer sees 1/N of the input features; if that
    share is not a multiple of 32 while the whole is, the shard would fall back to float32
    and compute something else than one rank does (activations rounded per 32 values)."""
    tp = get_tp_group().size
    if tp == 1:
        return
    for name, module in model.named_modules():
        if isinstance(module, RowParallelLinear):
            share = module.weight.shape[1]
            if share % BLOCK and (share * tp) % BLOCK == 0:
                raise ValueError(
                    f"weight_dtype='q8' with tensor_parallel_size={tp}: {name} gets {share} of "
                    f"its {share * tp} input features per rank, not a multiple of {BLOCK}; use "
                    "another tensor-parallel size or weight_dtype='auto'")
