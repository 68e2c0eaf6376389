"""What a call into the CPU kernels costs from Python at decode sizes (batch 1, SmolLM2's
widths), where the call's own overhead, not the arithmetic, is most of the time: the
layer kernels the Python layers call one by one, and the sampler's race over a vocabulary.
Best of five runs of many calls each. To compare two revisions, run it from each
checkout, each with its own kernel folder (TORCH_EXTENSIONS_DIR for a revision built by
torch's builder, before 4909ad2):

    PAGEDLM_KERNEL_DIR=/tmp/k-a PYTHONPATH=. python benchmarks/cpu/kernel_call_overhead.py
"""

import time

import torch

from pagedlm.csrc import load_extension


def best_us(f, calls: int) -> float:
    for _ in range(min(calls, 200)):
        f()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(2)
    layers = load_extension("llama_decode_cpu")
    sampler = load_extension("sampler_cpu")
    x, w, r = torch.randn(1, 576), torch.randn(576), torch.randn(1, 576)
    gate_up = torch.randn(1, 3072)
    logits, seeds, steps = torch.randn(1, 49152), torch.tensor([1]), torch.tensor([3])
    cases = {
        "rms_norm(x, w)": (lambda: layers.rms_norm(x, w, 1e-5, None), 20000),
        "rms_norm(x, w, residual)": (lambda: layers.rms_norm(x, w, 1e-5, r), 20000),
        "silu_and_mul(gate_up)": (lambda: layers.silu_and_mul(gate_up), 20000),
        "exponential_race(1 x 49152)": (lambda: sampler.exponential_race(logits, seeds, steps, None), 2000),
    }
    for name, (f, calls) in cases.items():
        print(f"{name:30s} {best_us(f, calls):8.2f} us")


if __name__ == "__main__":
    main()
