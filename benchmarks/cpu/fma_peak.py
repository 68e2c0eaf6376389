"""The FMA units' peak on this CPU: 12 independent 8-lane float32 FMA chains in inline
assembly (so the compiler cannot fold them), on 1 and on N threads. This is the hardware's
float32 ceiling; benchmarks/flops_ceiling.py measures torch's GEMM, which reaches part of it.

    python benchmarks/cpu/fma_peak.py [--threads 2]
"""

import argparse

from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <omp.h>
double fma_gflops(long iters, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    for (long i = 0; i < iters; ++i) {
      __asm__ volatile(
          "vfmadd231ps %%ymm15, %%ymm14, %%ymm0\n vfmadd231ps %%ymm15, %%ymm14, %%ymm1\n"
          "vfmadd231ps %%ymm15, %%ymm14, %%ymm2\n vfmadd231ps %%ymm15, %%ymm14, %%ymm3\n"
          "vfmadd231ps %%ymm15, %%ymm14, %%ymm4\n vfmadd231ps %%ymm15, %%ymm14, %%ymm5\n"
          "vfmadd231ps %%ymm15, %%ymm14, %%ymm6\n vfmadd231ps %%ymm15, %%ymm14, %%ymm7\n"
          "vfmadd231ps %%ymm15, %%ymm14, %%ymm8\n vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n"
          "vfmadd231ps %%ymm15, %%ymm14, %%ymm10\n vfmadd231ps %%ymm15, %%ymm14, %%ymm11\n"
          ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
              "xmm9", "xmm10", "xmm11");
    }
  }
  // 12 FMAs x 8 lanes x 2 FLOP per iteration per thread
  return threads * iters * 12.0 * 16.0 / (omp_get_wtime() - start) / 1e9;
#else
  return 0.0;
#endif
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    mod = load_inline("pagedlm_fma_peak", cpp_sources=SOURCE, functions=["fma_gflops"],
                      extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    for threads in sorted({1, args.threads}):
        best = max(mod.fma_gflops(100_000_000, threads) for _ in range(3))
        if best == 0.0:
            print("no AVX2/FMA on this CPU")
            return
        print(f"{threads} thread(s): {best:.1f} GFLOP/s float32 FMA peak", flush=True)


if __name__ == "__main__":
    main()
