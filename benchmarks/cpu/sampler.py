"""The Sampler's random rows on CPU: the torch exponential race vs the fused C++ kernel
(pagedlm/csrc/sampler_cpu.cpp), as in the benchmark workload (temperature 1, top-p 1).

    python benchmarks/cpu/sampler.py                      # [64, 49152] and [1, 49152], 2 threads
    python benchmarks/cpu/sampler.py --rows 8 --threads 1 --logits randn

--logits lm (default) draws logits shaped like SmolLM2-135M's (standard deviation ~3, the
top tokens 12-18 above the mean), where the kernel's exact prefilter skips most of the vocabulary;
--logits randn (standard deviation 3, no outlier) is its worst case: nothing is skipped.
Times the whole Sampler call (median of --repeats), batch tensors built beforehand.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedlm.sample.sampler import Sampler
from pagedlm.sample.sampling_batch import SamplingRequestState, make_sampling_batch
from pagedlm.sampling_params import SamplingParams


def make_logits(kind: str, num_rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    x = 3.0 * torch.randn(num_rows, vocab, generator=generator)  # [num_rows, vocab]
    if kind == "lm":
        # A handful of likely tokens well above the bulk, as a language model's logits have.
        # Matches SmolLM2's share of tokens within 16.6 of the top logit (~40%).
        top = torch.randint(0, vocab, (num_rows, 8), generator=generator)  # [num_rows, 8]
        x.scatter_(1, top, 12.0 + 6.0 * torch.rand(num_rows, 8, generator=generator))
    return x


def time_sampler(sampler: Sampler, logits: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(median, min) seconds of one Sampler call."""
    states = [
        SamplingRequestState(SamplingParams(temperature=1.0, top_p=1.0), seed=r, prompt_token_ids=[],
                             output_token_ids=[], eos_token_ids=[])
        for r in range(logits.shape[0])
    ]
    batch = make_sampling_batch(states, logits.shape[1], torch.device("cpu"))
    sampler(logits, batch)  # warm-up (and the kernel's build on the first call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--logits", choices=["lm", "randn"], nargs="+", default=["lm", "randn"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    torch_path, fused = Sampler(use_cpu_kernels=False), Sampler()
    print(f"threads={args.threads} vocab={args.vocab}: median (min) of {args.repeats} calls, ms")
    print(f"{'logits':>6} {'rows':>5} {'torch':>18} {'kernel':>16} {'speed-up':>9}")
    for kind in args.logits:
        for num_rows in args.rows:
            logits = make_logits(kind, num_rows, args.vocab, generator)
            torch_med, torch_min = time_sampler(torch_path, logits, args.repeats)
            fused_med, fused_min = time_sampler(fused, logits, args.repeats)
            print(f"{kind:>6} {num_rows:>5} {torch_med * 1e3:>9.3f} ({torch_min * 1e3:>7.3f}) "
                  f"{fused_med * 1e3:>7.3f} ({fused_min * 1e3:>6.3f}) {torch_med / fused_med:>8.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
