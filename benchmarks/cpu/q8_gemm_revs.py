"""The int8 block GEMM (pagedlm/csrc/q8_gemm_cpu.cpp) at SmolLM2-135M's shapes, against the
same kernel as it was at another git revision: the layer shapes of the embedded model (Q4_1
blocks; Q8_0 for the LM head, as the GGUF file holds them), a row count at a time. The two
builds run interleaved, call by call, and each keeps its best of several rounds: on a shared
VM whose speed drifts by more than the difference between two kernels, only such a
side-by-side comparison means anything. Both must give bit-identical results.

    python benchmarks/cpu/q8_gemm_revs.py --baseline-rev c06dd1a [--rows 1 2 4 8 16 32 64 2048]

With --stream, each shape gets as many distinct weights as the model has layers (the LM head
one), and a call runs every layer in turn, as a forward does: the weights (85 MB) no longer
fit the caches and stream from memory, which is what bounds a decode step of a few rows.
The figure is then a step's time in the linear layers, in ms.
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from revision_build import build_revision

from pagedlm.layers.q8_weights import pack_blocks, q8_kernels
from pagedlm.layers.quant_block_weights import QuantBlockWeight
from pagedlm.layers.quant_blocks import dequantize_raw

SOURCE = "pagedlm/csrc/q8_gemm_cpu.cpp"
# (out_features, in_features, layers): qkv, o, gate_up, down, LM head
SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def weights(copies: int = 1):
    """Per shape: (packed, scales, q4_1) of random blocks of the embedded model's formats;
    with copies > 1, lists of as many distinct weights as the model has such layers."""
    out = []
    for n, k, layers in SHAPES:
        ggml_type = GGMLQuantizationType.Q8_0 if layers == 1 else GGMLQuantizationType.Q4_1
        raw = quantize(np.random.default_rng(n + k).normal(0, 0.05, (n, k)).astype(np.float32), ggml_type)
        w = torch.from_numpy(dequantize_raw(raw.reshape(-1), ggml_type, (n, k)))
        packed, scales = pack_blocks(QuantBlockWeight.recover(w).blocks, ggml_type)
        if copies > 1:  # distinct memory, the same values: the bytes streamed are what count
            packed, scales = [packed.clone() for _ in range(layers)], [scales.clone() for _ in range(layers)]
        out.append((packed, scales, ggml_type == GGMLQuantizationType.Q4_1))
    return out


def compare_stream(kernels: dict, rows_list: list[int], rounds: int) -> None:
    """A decode step's linear layers, every layer's own weights in turn (they stream from
    memory), interleaved build by build; ms per step, best of `rounds`."""
    names = list(kernels)
    packed_weights = weights(copies=2)
    print(f"ms per step in the linear layers (30 layers of distinct weights + LM head), "
          f"{' / '.join(names)}")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for _, k, _ in SHAPES}

        def step(kernel, xs=xs) -> torch.Tensor:
            outs = []
            for layer in range(SHAPES[0][2]):
                for (n, k, layers), (packed, scales, q4_1) in zip(SHAPES, packed_weights):
                    if layers > 1:
                        outs.append(kernel.q8_gemm(xs[k], packed[layer], scales[layer], n, q4_1, None))
            for (n, k, layers), (packed, scales, q4_1) in zip(SHAPES, packed_weights):
                if layers == 1:
                    outs.append(kernel.q8_gemm(xs[k], packed[0], scales[0], n, q4_1, None))
            return torch.cat([o.flatten() for o in outs])

        ref = step(kernels[names[0]])
        assert all(torch.equal(ref, step(kernels[name])) for name in names[1:]), "results differ"
        times = [float("inf")] * len(names)
        for _ in range(rounds):
            for i, name in enumerate(names):
                start = time.perf_counter()
                step(kernels[name])
                times[i] = min(times[i], time.perf_counter() - start)
        ratio = f"  current / baseline {times[1] / times[0]:.2f}x faster" if len(names) == 2 else ""
        print(f"{rows:5d} rows  " + " / ".join(f"{1e3 * t:.2f}" for t in times) + ratio, flush=True)


def compare(kernels: dict, rows_list: list[int], rounds: int) -> None:
    names = list(kernels)
    packed_weights = weights()
    print(f"GFLOP/s per shape, {' / '.join(names)}; 'model' weights every layer by its count")
    for rows in rows_list:
        best: dict[tuple, list[float]] = {}
        for (n, k, layers), (packed, scales, q4_1) in zip(SHAPES, packed_weights):
            if rows * n > 2048 * 3072:  # the LM head only ever sees the sampled rows
                continue
            x = torch.randn(rows, k)
            outs = [kernels[name].q8_gemm(x, packed, scales, n, q4_1, None) for name in names]
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"results differ at {n}x{k}"
            calls = max(1, int(2e7 / (rows * n * k)))
            times = [float("inf")] * len(names)
            for _ in range(rounds):
                for i, name in enumerate(names):
                    start = time.perf_counter()
                    for _ in range(calls):
                        kernels[name].q8_gemm(x, packed, scales, n, q4_1, None)
                    times[i] = min(times[i], (time.perf_counter() - start) / calls)
            best[(n, k, layers)] = times
        flops = {key: 2 * rows * key[0] * key[1] for key in best}
        model = [sum(key[2] * flops[key] for key in best) / sum(key[2] * t[i] for key, t in best.items())
                 for i in range(len(names))]
        cells = [f"{key[0]}x{key[1]} " + "/".join(f"{flops[key] / t / 1e9:.0f}" for t in times)
                 for key, times in best.items()]
        ratio = f"  current / baseline {model[0] / model[1]:.2f}x" if len(names) == 2 else ""
        print(f"{rows:5d} rows  model " + "/".join(f"{m / 1e9:.0f}" for m in model) + ratio
              + "  |  " + "  ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", help="also time the kernel of this git revision, interleaved")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each keeps its best")
    p.add_argument("--stream", action="store_true",
                   help="distinct weights per layer, streamed from memory as in a forward")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"current": q8_kernels()}
    if kernels["current"] is None:
        raise SystemExit("the int8 kernel is not available")
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_rev:
            kernels[args.baseline_rev] = build_revision(args.baseline_rev, [SOURCE], Path(tmp))
        (compare_stream if args.stream else compare)(kernels, args.rows, args.rounds)


if __name__ == "__main__":
    main()
