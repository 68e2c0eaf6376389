"""Linear weights kept in the GGUF quant-block format they were dequantised from, for small batches.

Decode steps with a few sequences are bound by the bytes of weights streamed per step. A
model loaded from a Q4_1 GGUF holds float32 weights that are exactly ``d * q + m`` for
per-32-block float16 ``d, m`` and 4-bit ``q``; this module recovers those blocks from the
float32 tensor (on whatever shard this rank holds), checks that our loader's own
dequantisation gives back every value bit for bit, and multiplies inputs of up to
`max_rows` rows with csrc/block_gemv_cpu.cpp, which widens each block once in registers.
No weight value changes; results differ from F.linear only in the order of float32 sums.
Larger inputs (prefill) keep the layer's existing path (fbgemm float16 or F.linear).

    Q4_1 block (20 B): d f16 | m f16 | qs[16]   w[j] = d * (qs[j] & 15) + m,
                                                w[j + 16] = d * (qs[j] >> 4) + m
    Q8_0 block (34 B): d f16 | q[32] int8       w[j] = d * q[j]
    blocks tensor:     [out_features, in_features / 32, block bytes] uint8

Measured on the 2-core dev box (benchmarks/cpu/weight_stream.py: SmolLM2-135M's shapes,
30 layers + LM head, weights streamed from memory, 2 threads, medians of noisy runs), model
matmul time per step, float32 / float16 (fbgemm) / blocks (96 MB):
1 row 42 / 17 / 8.5 ms, 2 rows 73 / 17 / 9.9 ms, 4 rows 80 / 21 / 13 ms,
8 rows 88 / 28 / 23 ms, 12 rows - / 33 / 35 ms, 16 rows 92 / 45 / 53 ms.
Hence the row limits: up to 8 rows over float16 weights, up to 16 over float32 (F.linear).
Panel-packed weights (layers/panel_weights.py) keep the limit of 8: at 8 rows the panel
kernel takes 29 ms over float32 and 35 ms over float16 panels (benchmarks/cpu/panel_gemm.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedlm.csrc import load_extension
from pagedlm.layers.linear import WeightKernel
from pagedlm.layers.quant_blocks import dequantize_raw

BLOCK = 32
BLOCK_BYTES = {GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}
# Inputs with more rows go to the layer's existing path: the crossovers measured against
# float16 (fbgemm) and float32 (F.linear) weights, in the module docstring.
MAX_ROWS_OVER_PACKED = 8  # over float16 (fbgemm) or panel-packed weights
MAX_ROWS_OVER_FP32 = 16  # over F.linear
# Blocks recovered per numpy pass: ~1 MB of float32, so every pass over a chunk stays in cache.
_CHUNK_BLOCKS = 8192
# float16 steps tried around the first estimate of a block's scale, in order.
_SCALE_STEPS = (1, -1, 2, -2)


def quant_block_kernels():
    """The compiled kernel module, or None (no compiler, or PAGEDLM_DISABLE_CPU_KERNELS)."""
    return load_extension("block_gemv_cpu")


# --------------------------------------------------------------------------------------------
# Recovery: float32 weights -> blocks, exact or not at all
# --------------------------------------------------------------------------------------------


def _block_min_max(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's min and max of w [n, 32]; torch's reductions over a short last axis are
    several times faster than numpy's."""
    t = torch.from_numpy(w)
    return t.amin(dim=1).numpy(), t.amax(dim=1).numpy()


def _exact(deq: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Which blocks of deq equal w bit for bit, [n] bool."""
    diff = deq.view(np.int32) != w.view(np.int32)
    if not diff.any():
        return np.ones(w.shape[0], dtype=bool)
    return ~diff.any(axis=1)


def _fit_q4_1(w: np.ndarray, d16: np.ndarray, m16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q for blocks w [n, 32] given scales, and which blocks then dequantise exactly
    (the loader's arithmetic: float32 q * d, then + m)."""
    d = d16.astype(np.float32)[:, None]
    m = m16.astype(np.float32)[:, None]
    q = np.subtract(w, m)
    q /= np.where(d == 0, np.float32(1), d)
    np.rint(q, out=q)
    np.clip(q, 0, 15, out=q)
    deq = q * d
    deq += m
    return q, _exact(deq, w)


def _fit_q8_0(w: np.ndarray, d16: np.ndarray, _unused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q for blocks w [n, 32] given scales, and which blocks then dequantise exactly
    (the loader's arithmetic: float32 q * d)."""
    d = d16.astype(np.float32)[:, None]
    q = w / np.where(d == 0, np.float32(1), d)
    np.rint(q, out=q)
    np.clip(q, -128, 127, out=q)
    # A block whose scale underflowed to 0 in float16 holds -0.0 where q < 0: keep the sign.
    q -= (q == 0) & np.signbit(w)
    return q, _exact(q * d, w)


def _fit_with_retries(fit: Callable, w: np.ndarray, d16: np.ndarray,
                      m16: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Fit every block, retrying the failures with neighbouring float16 scales (the first
    estimate can be an ulp off when the block's offset dwarfs its range). Updates d16."""
    q, ok = fit(w, d16, m16)
    for step in _SCALE_STEPS:
        bad = np.flatnonzero(~ok)
        if bad.size == 0:
            return q, d16
        bits = d16[bad].view(np.uint16).astype(np.int32) + step
        usable = (bits >= 0) & (bits < 0x7C00)  # finite, non-negative float16 scales
        bad, bits = bad[usable], bits[usable]
        cand = bits.astype(np.uint16).view(np.float16)
        q_c, ok_c = fit(w[bad], cand, m16[bad])
        fixed = bad[ok_c]
        d16[fixed] = cand[ok_c]
        q[fixed] = q_c[ok_c]
        ok[fixed] = True
    return (q, d16) if ok.all() else None


def _q4_1_chunk(w: np.ndarray) -> np.ndarray | None:  # [n, 32] float32 -> [n, 20] uint8
    lo, hi = _block_min_max(w)
    # The element with q = 0 is exactly m (d * 0 = 0), and is the block's minimum.
    m16 = lo.astype(np.float16)
    if not np.array_equal(m16.astype(np.float32), lo):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        d16 = ((hi - lo) / np.float32(15)).astype(np.float16)
        fitted = _fit_with_retries(_fit_q4_1, w, d16, m16)
    if fitted is None:
        return None
    q, d16 = fitted
    q8 = q.astype(np.uint8)
    out = np.empty((w.shape[0], 20), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = m16.view(np.uint8).reshape(-1, 2)
    np.bitwise_or(q8[:, :16], q8[:, 16:] << 4, out=out[:, 4:])
    return out


def _q8_0_chunk(w: np.ndarray) -> np.ndarray | None:  # [n, 32] float32 -> [n, 34] uint8
    # The element of largest magnitude has |q| = 127, so d = max|w| / 127 exactly.
    with np.errstate(over="ignore", invalid="ignore"):
        d16 = (_block_min_max(np.abs(w))[1] / np.float32(127)).astype(np.float16)
        fitted = _fit_with_retries(_fit_q8_0, w, d16, d16)
    if fitted is None:
        return None
    q, d16 = fitted
    out = np.empty((w.shape[0], 34), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out


_CHUNK_FNS = {GGMLQuantizationType.Q4_1: _q4_1_chunk, GGMLQuantizationType.Q8_0: _q8_0_chunk}


def recover_blocks(weight: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor | None:
    """The blocks [N, K / 32, bytes] uint8 whose dequantisation by our GGUF loader is `weight`
    [N, K] (float32) bit for bit, or None if there are none."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK:
        return None
    n, k = weight.shape
    flat = weight.detach().cpu().contiguous().numpy().reshape(-1, BLOCK)  # [N * K / 32, 32]
    blocks = np.empty((flat.shape[0], BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    chunk_fn = _CHUNK_FNS[ggml_type]
    for start in range(0, flat.shape[0], _CHUNK_BLOCKS):
        chunk = flat[start : start + _CHUNK_BLOCKS]
        part = chunk_fn(chunk)
        if part is None:
            return None
        # The final word belongs to the loader itself: every value, bit for bit.
        again = dequantize_raw(part.reshape(-1), ggml_type, chunk.shape)
        if not np.array_equal(again.view(np.int32), chunk.view(np.int32)):
            return None
        blocks[start : start + part.shape[0]] = part
    return torch.from_numpy(blocks.reshape(n, k // BLOCK, -1))


@dataclass
class QuantBlockWeight:
    """One weight in a block format: `blocks` [out_features, in_features / 32, bytes]."""

    ggml_type: GGMLQuantizationType
    blocks: torch.Tensor

    @staticmethod
    def recover(weight: torch.Tensor) -> QuantBlockWeight | None:
        """The smallest block format that holds `weight` exactly, if any."""
        for ggml_type in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            blocks = recover_blocks(weight, ggml_type)
            if blocks is not None:
                return QuantBlockWeight(ggml_type, blocks)
        return None


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------


class QuantBlockMatmul:
    """`x @ W.T (+ bias)`: the block kernel for inputs of up to `max_rows` rows, `fallback`
    (the kernel of the layer's other format) for larger ones and for dtypes other than
    float32."""

    def __init__(self, weight: QuantBlockWeight, fallback: WeightKernel, max_rows: int,
                 kernels=None) -> None:
        kernels = kernels or quant_block_kernels()
        assert kernels is not None, "the block kernel is not built"
        self.ggml_type = weight.ggml_type
        self.blocks = weight.blocks
        self.out_features = weight.blocks.shape[0]
        self.in_features = weight.blocks.shape[1] * BLOCK
        self.fallback = fallback
        self.max_rows = max_rows
        self.gemv = (kernels.q4_1_gemv if weight.ggml_type == GGMLQuantizationType.Q4_1
                     else kernels.q8_0_gemv)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype != torch.float32:
            return self.fallback(x, bias)
        if x.dim() == 2 and x.is_contiguous():  # the common case: no reshape / view to dispatch
            return self.gemv(x, self.blocks, bias)
        lead = x.shape[:-1]
        y = self.gemv(x.reshape(rows, self.in_features).contiguous(), self.blocks, bias)
        return y.view(*lead, self.out_features)  # [..., out_features]
