"""GGUF Q4_1 / Q8_0 weights multiplied in integer arithmetic (csrc/q8_gemm_cpu.cpp), the
`weight_dtype='q8'` CPU path: every row of x is rounded to int8 per block of 32 values (one
float32 scale per block), as llama.cpp does for these formats; the weights keep the file's
exact values. See the C++ source for the maths and the packed layout:

    Q4_1  packed [ceil(N / 8), K / 32, 4, 32] uint8 (two 4-bit values a byte)
          scales [ceil(N / 8), K / 32, 2, 8] float16 (d, m)
    Q8_0  packed [ceil(N / 8), K / 32, 8, 32] uint8 (int8 bits)
          scales [ceil(N / 8), K / 32, 8] float16 (d)
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from pagedlm.csrc import load_extension

BLOCK = 32
COLS = 8  # output features per panel


def q8_kernels():
    """The compiled kernel module, or None (no compiler, or PAGEDLM_DISABLE_CPU_KERNELS)."""
    return load_extension("q8_gemm_cpu")


def _panels(values: torch.Tensor) -> torch.Tensor:
    """[N, B, 32] per-feature block values -> [P, B, 8 groups, 8 features, 4] (0 past N)."""
    n, b, _ = values.shape
    padded = values.new_zeros(-(-n // COLS) * COLS, b, BLOCK)
    padded[:n] = values
    # [P, 8 features, B, 8 groups, 4 values] -> [P, B, groups, features, values]
    return padded.view(-1, COLS, b, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


def _pad_scales(scale: torch.Tensor) -> torch.Tensor:
    """[N, B] float16 -> [P, B, 8] float16 (0 past N)."""
    n, b = scale.shape
    padded = torch.zeros(-(-n // COLS) * COLS, b, dtype=torch.float16)
    padded[:n] = scale
    return padded.view(-1, COLS, b).transpose(1, 2).contiguous()


def pack_blocks(blocks: torch.Tensor, ggml_type: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks [N, K / 32, bytes] uint8 (layers/quant_block_weights.py's form) -> the kernel's
    (packed, scales)."""
    if ggml_type == GGMLQuantizationType.Q4_1:
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, B]
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]  # [N, B]
        qs = blocks[..., 4:20]  # [N, B, 16]: value j low nibble of qs[j], j + 16 high nibble
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, B, 32] in 0..15
        groups = _panels(q)  # [P, B, 8, 8, 4]
        packed = groups[:, :, 0::2] | (groups[:, :, 1::2] << 4)  # [P, B, 4, 8, 4]
        scales = torch.stack([_pad_scales(d), _pad_scales(m)], dim=2)  # [P, B, 2, 8]
        return packed.reshape(*packed.shape[:3], 32).contiguous(), scales.contiguous()
    if ggml_type == GGMLQuantizationType.Q8_0:
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, B]
        q = blocks[..., 2:34]  # [N, B, 32] int8 bits
        packed = _panels(q)  # [P, B, 8, 8, 4]
        return packed.reshape(*packed.shape[:3], 32).contiguous(), _pad_scales(d)
    raise ValueError(f"no integer kernel for {ggml_type.name} blocks")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference rounding of x [M, K] float32: (r [M, K] in -127..127 as float, e [M, K/32])."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)  # [M, B]
    # 127 / amax correctly rounded, as the kernel's scalar division is: torch's `127.0 / amax`
    # (a Python number over a tensor) is not, and one ulp off turns a product of exactly
    # k + 0.5 into a different integer.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    r = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return r.view_as(x), amax / 127.0


def reference_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded per block as the kernel rounds it,
    times the float32 weight [N, K] the blocks dequantise to."""
    r, e = quantize_activations(x)
    xq = (r.double().view(x.shape[0], -1, BLOCK) * e.double()[..., None]).view(x.shape)
    return xq @ weight.double().T


class Q8WeightMatmul:
    """`x @ W.T (+ bias)` with W in Q4_1 or Q8_0 blocks and x rounded to int8 per 32 values."""

    def __init__(self, blocks: torch.Tensor, ggml_type: GGMLQuantizationType, kernels=None) -> None:
        kernels = kernels or q8_kernels()
        assert kernels is not None, "the int8 block kernel is not built"
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] * BLOCK
        self.q4_1 = ggml_type == GGMLQuantizationType.Q4_1
        self.packed, self.scales = pack_blocks(blocks, ggml_type)
        self.gemm = kernels.q8_gemm

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            # [rows, in_features] float32, the common case: no reshape / view to dispatch.
            return self.gemm(x, self.packed, self.scales, self.out_features, self.q4_1, None)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # [rows, in_features]
        y = self.gemm(x2, self.packed, self.scales, self.out_features, self.q4_1,
                      None if bias is None else bias.float().contiguous())
        return y.to(x.dtype).view(*lead, self.out_features)  # [..., out_features]


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] (K a multiple of 32) rounded to Q8_0 blocks [N, K / 32, 34] as
    ggml rounds it: d = max |w| / 127 stored as float16, q = round(w / d)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // BLOCK, BLOCK)
    d16 = (w.abs().amax(dim=-1) / 127.0).half()  # [N, B]
    d = d16.float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)  # [N, B, 32]
    blocks = torch.empty(n, k // BLOCK, 34, dtype=torch.uint8)
    blocks[..., 0:2] = d16.view(torch.uint8).view(n, k // BLOCK, 2)
    blocks[..., 2:] = q.view(torch.uint8)
    return blocks
