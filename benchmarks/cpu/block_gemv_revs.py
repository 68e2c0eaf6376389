"""The GGUF block kernel (pagedlm/csrc/block_gemv_cpu.cpp: float32 maths on Q4_1 / Q8_0
blocks, the default weights' kernel for steps of up to 8 rows) against the same kernel at
another git revision, on a decode step of SmolLM2-135M's linear layers: every layer its own
weights (Q4_1; the LM head Q8_0), so that they stream from memory as in a forward. The two
builds take turns, each keeps its best of several rounds, and their results must be equal
bit for bit.

    python benchmarks/cpu/block_gemv_revs.py --baseline-rev REV [--rows 1 2 4 6 8]
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from q8_gemm_revs import SHAPES  # (out_features, in_features, layers) of the model's matmuls
from revision_build import build_library


def weights() -> list[list[torch.Tensor]]:
    """Per shape, one block tensor [N, K / 32, bytes] per layer (distinct memory)."""
    out = []
    for n, k, layers in SHAPES:
        ggml_type = GGMLQuantizationType.Q8_0 if layers == 1 else GGMLQuantizationType.Q4_1
        raw = quantize(np.random.default_rng(n + k).normal(0, 0.05, (n, k)).astype(np.float32), ggml_type)
        blocks = torch.from_numpy(raw.reshape(n, k // 32, -1).copy())
        out.append([blocks.clone() for _ in range(layers)])
    return out


def step(kernel, blocks: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    outs = []
    for layer in range(SHAPES[0][2]):
        for (_n, k, layers), per_layer in zip(SHAPES, blocks):
            if layers > 1:
                outs.append(kernel.q4_1_gemv(xs[k], per_layer[layer], None))
    for (_n, k, layers), per_layer in zip(SHAPES, blocks):
        if layers == 1:
            outs.append(kernel.q8_0_gemv(xs[k], per_layer[0], None))
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as current_dir, tempfile.TemporaryDirectory() as base_dir:
        kernels = {"current": build_library("llama_decode_cpu", Path(current_dir), "pagedlm_block_current"),
                   args.baseline_rev: build_library("llama_decode_cpu", Path(base_dir),
                                                    "pagedlm_block_base", args.baseline_rev)}
        blocks = weights()
        print(f"ms per step in the linear layers (30 layers of distinct weights + LM head), "
              f"current / {args.baseline_rev}")
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for _, k, _ in SHAPES}
            ref = step(kernels["current"], blocks, xs)
            other = step(kernels[args.baseline_rev], blocks, xs)
            assert all(torch.equal(a, b) for a, b in zip(ref, other)), "results differ"
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(args.rounds):
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    step(kernel, blocks, xs)
                    best[name] = min(best[name], time.perf_counter() - start)
            t_cur, t_base = best["current"], best[args.baseline_rev]
            print(f"{rows:5d} rows  {1e3 * t_cur:.2f} / {1e3 * t_base:.2f}  current / baseline "
                  f"{t_base / t_cur:.2f}x faster", flush=True)


if __name__ == "__main__":
    main()
