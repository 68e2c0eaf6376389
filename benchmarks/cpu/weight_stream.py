"""Model matmul time per decode step, float32 vs float16 weights (fbgemm), on SmolLM2-135M's
shapes with 30 distinct layers so the weights stream from memory as in a real forward.

    python benchmarks/cpu/weight_stream.py
"""

import time
import warnings

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


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.quantized.linear_prepack_fp16(w, None) for w in ws] for ws in weights]
    head = torch.randn(VOCAB, HIDDEN)
    head16 = torch.ops.quantized.linear_prepack_fp16(head, None)

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

    for rows in [1, 4, 16, 64, 256]:
        t32, t16 = best_of(step32, rows), best_of(step16, rows)
        flops = 2 * rows * (sum(n * k for n, k in SHAPES) * LAYERS + VOCAB * HIDDEN)
        print(f"M={rows:4d}: fp32 {t32 * 1e3:7.1f} ms ({flops / t32 / 1e9:5.1f} GF/s)  "
              f"fp16-weights {t16 * 1e3:7.1f} ms ({flops / t16 / 1e9:5.1f} GF/s)", flush=True)


if __name__ == "__main__":
    main()
