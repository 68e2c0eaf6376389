"""The FMA units' peak on this CPU: 12 independent float32 FMA chains in inline assembly
(so the compiler cannot fold them), on 1 and on N threads, with 8-lane (AVX2) registers and,
where the CPU has AVX-512, 16-lane ones. The wider figure is the hardware's float32 ceiling
for kernels built with AVX-512 (the C++ kernels are, where it exists); on a CPU that splits
512-bit operations in two the two figures match. benchmarks/flops_ceiling.py measures
torch's GEMM, which reaches part of it.

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

double fma512_gflops(long iters, int threads) {
#if defined(__AVX512F__)
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    for (long i = 0; i < iters; ++i) {
      __asm__ volatile(
          "vfmadd231ps %%zmm15, %%zmm14, %%zmm0\n vfmadd231ps %%zmm15, %%zmm14, %%zmm1\n"
          "vfmadd231ps %%zmm15, %%zmm14, %%zmm2\n vfmadd231ps %%zmm15, %%zmm14, %%zmm3\n"
          "vfmadd231ps %%zmm15, %%zmm14, %%zmm4\n vfmadd231ps %%zmm15, %%zmm14, %%zmm5\n"
          "vfmadd231ps %%zmm15, %%zmm14, %%zmm6\n vfmadd231ps %%zmm15, %%zmm14, %%zmm7\n"
          "vfmadd231ps %%zmm15, %%zmm14, %%zmm8\n vfmadd231ps %%zmm15, %%zmm14, %%zmm9\n"
          "vfmadd231ps %%zmm15, %%zmm14, %%zmm10\n vfmadd231ps %%zmm15, %%zmm14, %%zmm11\n"
          ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
              "xmm9", "xmm10", "xmm11");
    }
  }
  // 12 FMAs x 16 lanes x 2 FLOP per iteration per thread
  return threads * iters * 12.0 * 32.0 / (omp_get_wtime() - start) / 1e9;
#else
  return 0.0;
#endif
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    mod = load_inline("pagedlm_fma_peak2", cpp_sources=SOURCE,
                      functions=["fma_gflops", "fma512_gflops"],
                      extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    for threads in sorted({1, args.threads}):
        best = max(mod.fma_gflops(100_000_000, threads) for _ in range(3))
        if best == 0.0:
            print("no AVX2/FMA on this CPU")
            return
        wide = max(mod.fma512_gflops(50_000_000, threads) for _ in range(3))
        print(f"{threads} thread(s): {best:.1f} GFLOP/s float32 FMA peak, 8 lanes"
              + (f"; {wide:.1f} with 16 lanes (AVX-512)" if wide else ""), flush=True)


if __name__ == "__main__":
    main()
