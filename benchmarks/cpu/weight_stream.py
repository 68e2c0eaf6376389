"""Model matmul time per decode step, float32 vs float16 weights (fbgemm), on SmolLM2-135M's
shapes with 30 distinct layers so the weights stream from memory as in a real forward; then
the same for few rows with the GGUF block kernel (Q4_1 linear layers, Q8_0 LM head, as the
embedded model holds them; layers/quant_block_weights.py).

    python benchmarks/cpu/weight_stream.py
"""

import time
import warnings

import numpy as np
import torch

LAYERS = 30
SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]  # gate_up, down, qkv, o: [out, in]
VOCAB, HIDDEN = 49152, 576


def best_of(fn, rows: int, repeats: int = 3) -> float:
    fn(rows)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(rows)
        best = min(best, time.perf_counter() - start)
    return best


def random_blocks(n: int, k: int, block_bytes: int, rng: np.random.Generator) -> torch.Tensor:
    """[n, k / 32, block_bytes] blocks with random values and small finite float16 scales
    (d, and m for Q4_1) in the leading bytes."""
    blocks = rng.integers(0, 256, size=(n, k // 32, block_bytes), dtype=np.uint8)
    num_scales = 2 if block_bytes == 20 else 1
    scales = (rng.standard_normal((n, k // 32, num_scales)) * 0.01).astype(np.float16)
    blocks[..., : 2 * num_scales] = scales.view(np.uint8)
    return torch.from_numpy(blocks)


def dense_steps(weights, packed, head, head16):
    """One model step of matmuls at float32 (F.linear) and at float16 weights (fbgemm)."""

    def step32(rows: int) -> None:
        for ws in weights:
            for w in ws:
                torch.nn.functional.linear(torch.randn(rows, w.shape[1]), w)
        torch.nn.functional.linear(torch.randn(rows, HIDDEN), head)

    def step16(rows: int) -> None:
        for ps, ws in zip(packed, weights):
            for p, w in zip(ps, ws):
                torch.ops.quantized.linear_dynamic_fp16(torch.randn(rows, w.shape[1]), p)
        torch.ops.quantized.linear_dynamic_fp16(torch.randn(rows, HIDDEN), head16)

    return step32, step16


def block_section(weights, packed, head, head16, repeats: int) -> None:
    """fp32 / fp16 / block-kernel model matmul time per step for few rows."""
    from pagedlm.layers.quant_block_weights import quant_block_kernels

    ops = quant_block_kernels()
    if ops is None:
        print("block kernel unavailable (no compiler, or PAGEDLM_DISABLE_CPU_KERNELS)")
        return
    rng = np.random.default_rng(0)
    blocks = [[random_blocks(n, k, 20, rng) for n, k in SHAPES] for _ in range(LAYERS)]
    head_blocks = random_blocks(VOCAB, HIDDEN, 34, rng)
    nbytes = sum(b.numel() for bs in blocks for b in bs) + head_blocks.numel()

    step32, step16 = dense_steps(weights, packed, head, head16)

    def step_blocks(rows: int) -> None:
        for bs in blocks:
            for b in bs:
                ops.q4_1_gemv(torch.randn(rows, b.shape[1] * 32), b, None)
        ops.q8_0_gemv(torch.randn(rows, HIDDEN), head_blocks, None)

    print(f"block kernel: Q4_1 linear layers + Q8_0 LM head, {nbytes / 1e6:.0f} MB per step")
    for rows in [1, 2, 4, 8, 16]:
        t32, t16, tb = (best_of(f, rows, repeats) for f in (step32, step16, step_blocks))
        print(f"M={rows:4d}: fp32 {t32 * 1e3:7.1f} ms  fp16-weights {t16 * 1e3:7.1f} ms  "
              f"blocks {tb * 1e3:7.1f} ms ({nbytes / tb / 1e9:5.1f} GB/s)", flush=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.quantized.linear_prepack_fp16(w, None) for w in ws] for ws in weights]
    head = torch.randn(VOCAB, HIDDEN)
    head16 = torch.ops.quantized.linear_prepack_fp16(head, None)

    step32, step16 = dense_steps(weights, packed, head, head16)

    for rows in [1, 4, 16, 64, 256]:
        t32, t16 = best_of(step32, rows), best_of(step16, rows)
        flops = 2 * rows * (sum(n * k for n, k in SHAPES) * LAYERS + VOCAB * HIDDEN)
        print(f"M={rows:4d}: fp32 {t32 * 1e3:7.1f} ms ({flops / t32 / 1e9:5.1f} GF/s)  "
              f"fp16-weights {t16 * 1e3:7.1f} ms ({flops / t16 / 1e9:5.1f} GF/s)", flush=True)
    block_section(weights, packed, head, head16, repeats=5)


if __name__ == "__main__":
    main()
