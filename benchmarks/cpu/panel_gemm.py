"""The panel GEMM (pagedlm/csrc/panel_gemm_cpu.cpp) against torch's matmuls at SmolLM2-135M's
shapes: every linear layer of its 30 decoder layers plus the LM head, per row count, 2
threads. Columns: F.linear on float32 weights, fbgemm's float16-weight GEMM, the panel
kernel over float32 and float16 panels, and the int8 kernel of weight_dtype='q8'
(pagedlm/csrc/q8_gemm_cpu.cpp) over Q4_1 blocks (Q8_0 for the LM head, as in the embedded
GGUF file). The five are timed in turns, layer by layer, so a slow spell of the machine hits
them alike.

    python benchmarks/cpu/panel_gemm.py [--rows 8 16 32 64 128 512 2048]
"""

import argparse
import functools
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedlm.layers.panel_weights import pack_panels, panel_kernels
from pagedlm.layers.q8_weights import Q8WeightMatmul
from pagedlm.layers.quant_block_weights import QuantBlockWeight
from pagedlm.layers.quant_blocks import dequantize_raw

# (out_features, in_features, layers): qkv, o, gate_up, down, LM head
SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = panel_kernels()
    assert kernels is not None, "the panel kernel did not build"
    names = ["F.linear fp32", "fbgemm fp16", "panel fp32", "panel fp16", "q8"]
    print(f"{'rows':>5}  " + "  ".join(f"{n:>22}" for n in names))
    for rows in args.rows:
        totals, flops = [0.0] * len(names), 0
        for n, k, layers in SHAPES:
            if rows * n > 2048 * 3072:  # skip the LM head at prefill sizes (it sees last tokens)
                continue
            ggml_type = GGMLQuantizationType.Q8_0 if layers == 1 else GGMLQuantizationType.Q4_1
            raw = quantize(np.random.default_rng(n + k).normal(0, 0.05, (n, k)).astype(np.float32), ggml_type)
            w = torch.from_numpy(dequantize_raw(raw.reshape(-1), ggml_type, (n, k)))  # as loaded
            q8 = Q8WeightMatmul(QuantBlockWeight.recover(w).blocks, ggml_type)
            x = torch.randn(rows, k)
            fp16 = torch.ops.quantized.linear_prepack_fp16(w, None)
            p32, p16 = pack_panels(w, torch.float32), pack_panels(w, torch.float16)
            fns = [functools.partial(F.linear, x, w),
                   functools.partial(torch.ops.quantized.linear_dynamic_fp16, x, fp16),
                   functools.partial(kernels.panel_gemm, x, p32, n, None),
                   functools.partial(kernels.panel_gemm, x, p16, n, None),
                   functools.partial(q8, x, None)]
            repeats = max(2, int(3e7 / (rows * n * k)))
            for i, fn in enumerate(fns):
                totals[i] += layers * per_call(fn, repeats)
            flops += layers * 2 * rows * n * k
        print(f"{rows:5d}  " + "  ".join(f"{t * 1e3:8.1f} ms {flops / t / 1e9:5.0f} GF/s"
                                          for t in totals), flush=True)


if __name__ == "__main__":
    main()
