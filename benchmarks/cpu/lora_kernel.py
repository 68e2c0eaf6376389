"""The multi-adapter LoRA delta alone, per step of 30 layers of SmolLM2-135M's projections
(qkv, o, gate_up, down; rank 16, 4 adapters in slots), for each CPU kernel of
pagedlm/layers/lora.py: `lora_cpu` (the C++ kernel, with GEMM pairs for chunks of 128+
tokens) and `lora_grouped` (GEMM pairs per adapter). Workloads:

  decode-T       T decode tokens, adapters round-robin (token t uses adapter t % 4)
  prefill-1024   one 1024-token prompt chunk of one adapter
  prefill-32x40  32 prompt chunks of 40 tokens, adapters round-robin by chunk

Each figure is the mean of --repeats calls after one warm-up, times 30 layers.

usage: python benchmarks/cpu/lora_kernel.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedlm.layers.lora import LoRAStep, LoRAWeights, lora_cpu, lora_grouped

LAYERS = 30
RANK, SLOTS = 16, 4
# SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536.
SHAPES = {"qkv": (576, [(0, 576), (576, 768), (768, 960)]), "o": (576, [(0, 576)]),
          "gate_up": (576, [(0, 1536), (1536, 3072)]), "down": (1536, [(0, 576)])}


def workloads() -> dict[str, np.ndarray]:
    return {
        "decode-1": np.zeros(1, dtype=np.int64),
        "decode-32": np.arange(32) % SLOTS,
        "decode-64": np.arange(64) % SLOTS,
        "prefill-1024": np.zeros(1024, dtype=np.int64),
        "prefill-32x40": np.repeat(np.arange(32) % SLOTS, 40),
    }


def step_ms(kernel, slots: np.ndarray, repeats: int) -> float:
    step = LoRAStep(torch.device("cpu"))
    step.set(slots)
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for in_features, slices in SHAPES.values():
        w = LoRAWeights(in_features, slices, SLOTS, RANK, torch.float32, torch.device("cpu"),
                        step, kernel=kernel)
        for slot in range(SLOTS):
            for s, (lo, hi) in enumerate(slices):
                w.set_slice(slot, s, torch.randn(RANK, in_features, generator=gen) * 0.02,
                            torch.randn(hi - lo, RANK, generator=gen) * 0.02)
        x = torch.randn(len(slots), in_features, generator=gen)
        y = torch.zeros(len(slots), slices[-1][1])
        w.add_to(x, y)  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            w.add_to(x, y)
        total += (time.perf_counter() - start) / repeats
    return total * LAYERS * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'workload':16s} {'lora_cpu':>10s} {'lora_grouped':>13s}   ms per step, {LAYERS} layers")
    for name, slots in workloads().items():
        repeats = max(2, args.repeats if len(slots) <= 64 else args.repeats // 5)
        print(f"{name:16s} {step_ms(lora_cpu, slots, repeats):10.2f} "
              f"{step_ms(lora_grouped, slots, repeats):13.2f}")


if __name__ == "__main__":
    main()
