"""The CPU format of a float32 model's linear weights, decided once after loading.

    weight_dtype='q8'      GGUF Q4_1 / Q8_0 weights as stored (others rounded to Q8_0),
                           multiplied in int8 (layers/q8_weights.py)
    otherwise              float32 (or float16) panels for the fbgemm-free matmul kernel
                           (layers/panel_weights.py); weights that are exactly GGUF quant
                           blocks (a Q4_1 / Q8_0 file) also keep that form for small batches
                           (layers/block_weights.py), found before the packing drops the
                           float32 copies
"""

from __future__ import annotations

from torch import nn

from pagedlm.layers.block_weights import attach_block_weights, recover_block_weights
from pagedlm.layers.panel_weights import pack_cpu_weights
from pagedlm.layers.q8_weights import pack_weights_q8


def prepare_cpu_weights(model: nn.Module, weight_dtype: str) -> list[str]:
    """Put every linear weight of a float32 CPU model in its format; returns what was done,
    one line each, for the log."""
    if weight_dtype == "q8":
        return [f"CPU linear weights: {pack_weights_q8(model)}"]
    block_weights = recover_block_weights(model)
    lines = [f"CPU linear weights: {pack_cpu_weights(model, weight_dtype)}"]
    if block_weights:
        lines.append(f"quant-block kernel for small batches on {attach_block_weights(block_weights)} "
                     "layers (GGUF Q4_1/Q8_0 weights)")
    return lines
