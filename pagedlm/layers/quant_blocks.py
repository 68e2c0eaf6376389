"""GGUF quant blocks: vectorised dequantisation of ggml's block formats (Q4_0 ... Q6_K).

A quant block is ggml's unit of quantisation (32 or 256 weights sharing a scale), not a
KV-cache block. Both the GGUF loader (dense weights) and the block-weight layers (weights
kept quantised, dequantised a panel at a time) read these formats, so they live here, below
both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# The dequantisers below use numpy, not torch: they run on one thread by design. On a small,
# shared CPU box torch's intra-op thread pool made these element-wise passes ~10x slower
# (threads waiting on descheduled peers), while the numpy versions are memory-bound and steady.


def _half_scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 scalar at byte `start` of every block, as a float32 column [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _unpack_nibbles(qs: np.ndarray, out: np.ndarray) -> None:
    # ggml packs element j of a 32-block in the low nibble of byte j and element j+16 in the high
    # nibble of the same byte, so the two halves are written side by side, not interleaved.
    half = qs.shape[1]
    np.bitwise_and(qs, 0x0F, out=out[:, :half], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, half:], casting="unsafe")


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:  # 34 B: f16 d, i8 q[32]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    np.multiply(blocks[:, 2:].view(np.int8), _half_scale(blocks, 0), out=out)
    return out


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:  # 18 B: f16 d, u8 qs[16]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    _unpack_nibbles(blocks[:, 2:], out)
    out -= 8.0
    out *= _half_scale(blocks, 0)
    return out


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:  # 20 B: f16 d, f16 m, u8 qs[16]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    _unpack_nibbles(blocks[:, 4:], out)
    out *= _half_scale(blocks, 0)
    out += _half_scale(blocks, 2)
    return out


def _high_bits_q5(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 fifth bits of a Q5_0/Q5_1 block (u32 at byte `start`, bit j for element j),
    already shifted to 16: [n_blocks, 32]."""
    qh = np.ascontiguousarray(blocks[:, start : start + 4]).view("<u4")  # [n_blocks, 1]
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.float32)


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:  # 22 B: f16 d, u32 qh, u8 qs[16]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    _unpack_nibbles(blocks[:, 6:], out)
    out += _high_bits_q5(blocks, 2)
    out -= 16.0
    out *= _half_scale(blocks, 0)
    return out


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:  # 24 B: f16 d, f16 m, u32 qh, u8 qs[16]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    _unpack_nibbles(blocks[:, 8:], out)
    out += _high_bits_q5(blocks, 4)
    out *= _half_scale(blocks, 0)
    out += _half_scale(blocks, 2)
    return out


# K-quants: super-blocks of 256 values in 8 or 16 sub-blocks, each with its own small integer
# scale (and min) multiplied by the super-block's fp16 d (and dmin).
#
#   Q2_K  84 B: scales[16] (lo 4 bits scale, hi 4 min) | qs[64] 2-bit | d | dmin
#   Q3_K 110 B: hmask[32] 3rd bits | qs[64] 2-bit | scales 16 x 6 bits in 12 B | d
#   Q4_K 144 B: d | dmin | scales + mins 8 x (6 + 6) bits in 12 B | qs[128] 4-bit
#   Q5_K 176 B: d | dmin | scales + mins as Q4_K | qh[32] 5th bits | qs[128] 4-bit
#   Q6_K 210 B: ql[128] low 4 bits | qh[64] high 2 bits | scales[16] int8 | d
#
# 2-bit values: the 256 outputs are two halves of 128; within a half, byte l of 32 holds four
# values, bits 2k..2k+1 giving output 32k + l. 4-bit values: 4 chunks of 64; byte l of a
# chunk's 32 gives output l (low nibble) and 32 + l (high nibble).

_TWO_BIT_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    """[n, 64] bytes -> [n, 2, 4, 32] values 0..3 (half, shift k, byte l)."""
    halves = qs.reshape(-1, 2, 1, 32)
    return (halves >> _TWO_BIT_SHIFTS[None, None, :, None]) & 3


def _unpack_4bit(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 8, 32] values 0..15, one row per 32-value sub-block."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate((chunks & 0x0F, chunks >> 4), axis=2).reshape(-1, 8, 32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> (scales, mins), each [n, 8] float32.
    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7
    take their low 4 bits from bytes 8-11 and their top 2 bits from the spare top bits."""
    s = s.astype(np.uint8)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), axis=1)
    mins = np.concatenate((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    sc = blocks[:, 0:16].reshape(-1, 2, 4, 2, 1)  # [n, half, k, 16-group, 1]
    d = _half_scale(blocks, 80)[:, :, None, None, None]
    dmin = _half_scale(blocks, 82)[:, :, None, None, None]
    q = _unpack_2bit(blocks[:, 16:80]).reshape(-1, 2, 4, 2, 16)
    out = d * (sc & 0x0F).astype(np.float32) * q - dmin * (sc >> 4).astype(np.float32)
    return out.reshape(-1, 256)


def _dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    s = blocks[:, 96:108]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate((
        (lo & 0x0F) | ((hi & 3) << 4),
        (mid & 0x0F) | (((hi >> 2) & 3) << 4),
        (lo >> 4) | (((hi >> 4) & 3) << 4),
        (mid >> 4) | (((hi >> 6) & 3) << 4),
    ), axis=1).astype(np.float32) - 32.0  # [n, 16]
    d = _half_scale(blocks, 108)
    q = _unpack_2bit(blocks[:, 32:96]).astype(np.float32)  # [n, 2, 4, 32]
    # The third bit of output (half h, shift k, byte l) is bit 4h + k of hmask[l]; a clear
    # bit subtracts 4.
    hmask = blocks[:, None, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)
    q -= 4.0 * (1 - (hmask & 1)).astype(np.float32)
    out = q.reshape(-1, 16, 16) * (d * scales)[:, :, None]
    return out.reshape(-1, 256)


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    d, dmin = _half_scale(blocks, 0), _half_scale(blocks, 2)
    q = _unpack_4bit(blocks[:, 16:144]).astype(np.float32)  # [n, 8, 32]
    out = q * (d * scales)[:, :, None] - (dmin * mins)[:, :, None]
    return out.reshape(-1, 256)


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    d, dmin = _half_scale(blocks, 0), _half_scale(blocks, 2)
    q = _unpack_4bit(blocks[:, 48:176]).astype(np.float32)  # [n, 8, 32]
    # Bit j of qh[l] is the fifth bit of value l of sub-block j.
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q += 16.0 * high
    out = q * (d * scales)[:, :, None] - (dmin * mins)[:, :, None]
    return out.reshape(-1, 256)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 2, 32)  # [n, half, 1, part, l]
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=2).reshape(-1, 2, 4, 32)  # group 2 * nibble + part
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> _TWO_BIT_SHIFTS[None, None, :, None]) & 3  # [n, half, group, l]
    q = (low | (high << 4)).astype(np.float32) - 32.0
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]: (half, group, l // 16)
    d = _half_scale(blocks, 208)
    out = q.reshape(-1, 16, 16) * (d * scales)[:, :, None]
    return out.reshape(-1, 256)


_PLAIN_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
_FAST_DEQUANT: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q8_0: _dequant_q8_0,
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: _dequant_q4_1,
    GGMLQuantizationType.Q5_0: _dequant_q5_0,
    GGMLQuantizationType.Q5_1: _dequant_q5_1,
    GGMLQuantizationType.Q2_K: _dequant_q2_k,
    GGMLQuantizationType.Q3_K: _dequant_q3_k,
    GGMLQuantizationType.Q4_K: _dequant_q4_k,
    GGMLQuantizationType.Q5_K: _dequant_q5_k,
    GGMLQuantizationType.Q6_K: _dequant_q6_k,
}


@functools.cache
def can_dequantize(ggml_type: GGMLQuantizationType) -> bool:
    """Whether `dequantize_raw` handles the type: ours, or one block through the gguf
    package's reference code (which raises NotImplementedError for the rest)."""
    if ggml_type in _PLAIN_TYPES or ggml_type in _FAST_DEQUANT:
        return True
    if ggml_type not in GGML_QUANT_SIZES:
        return False
    try:
        gguf_dequantize(np.zeros((1, GGML_QUANT_SIZES[ggml_type][1]), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def supported_type_names() -> list[str]:
    return [t.name for t in GGMLQuantizationType if can_dequantize(t)]


def dequantize_raw(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray:
    """Dequantise one tensor's raw bytes (uint8) into a new float32 array of `shape`.

    The result never aliases `raw`, so the file mapping can be closed while it is alive.
    """
    if ggml_type == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if ggml_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if ggml_type == GGMLQuantizationType.BF16:
        # bf16 is the top half of an f32: widen the bits instead of going through torch.
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    fast = _FAST_DEQUANT.get(ggml_type)
    if fast is not None:
        return fast(raw.reshape(-1, type_size)).reshape(shape)
    # Everything else (i-quants, ...) via the reference numpy implementation.
    rows = raw.reshape(-1, shape[-1] // block_size * type_size) if shape else raw
    out = np.asarray(gguf_dequantize(rows, ggml_type), dtype=np.float32).reshape(shape)
    return out if out.base is None else out.copy()
