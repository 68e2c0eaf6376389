"""torch SDPA for one prompt's causal attention on CPU, 3-D inputs (no batch dimension:
torch takes its math fallback) against 4-D ones (its flash kernel), SmolLM2's 9 query and
3 kv heads of 64 dims, 2 threads. The torch backend's prefill calls the 4-D form.

    python benchmarks/cpu/prefill_sdpa.py
"""

import time

import torch
import torch.nn.functional as F


def best(q, k, v, repeats: int = 5) -> float:
    """Fastest of `repeats` causal GQA SDPA calls on q [.., 9, L, 64], k/v [.., 3, L, 64]."""
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(2)
    for length in (200, 700, 1500):
        q = torch.randn(9, length, 64)
        k, v = torch.randn(3, length, 64), torch.randn(3, length, 64)
        flops = 9 * length * length * 64 * 2  # QK and PV, causal half
        t3, t4 = best(q, k, v), best(q[None], k[None], v[None])
        print(f"{length:5d} tokens: 3-D {t3 * 1e3:7.2f} ms ({flops / t3 / 1e9:5.1f} GF/s)  "
              f"4-D {t4 * 1e3:7.2f} ms ({flops / t4 / 1e9:5.1f} GF/s)", flush=True)


if __name__ == "__main__":
    main()
