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


def _peak_function(name: str, guard: str, reg: str, lanes: int) -> str:
    """C++ for `name`(iters, threads): GFLOP/s of 12 independent `lanes`-lane FMA chains in
    registers `reg`0..11 on each thread, 0.0 where `guard` is not defined."""
    fmas = "".join(f'"vfmadd231ps %%{reg}15, %%{reg}14, %%{reg}{i}\\n"\n' for i in range(12))
    clobbers = ", ".join(f'"xmm{i}"' for i in range(12))
    return f"""
double {name}(long iters, int threads) {{
#if {guard}
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {{
    for (long i = 0; i < iters; ++i) {{
      __asm__ volatile({fmas} ::: {clobbers});
    }}
  }}
  // 12 FMAs x {lanes} lanes x 2 FLOP per iteration per thread
  return threads * iters * 12.0 * {2 * lanes}.0 / (omp_get_wtime() - start) / 1e9;
#else
  return 0.0;
#endif
}}
"""


SOURCE = ("#include <omp.h>\n"
          + _peak_function("fma_gflops", "defined(__AVX2__) && defined(__FMA__)", "ymm", 8)
          + _peak_function("fma512_gflops", "defined(__AVX512F__)", "zmm", 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    mod = load_inline("pagedlm_fma_peak3", cpp_sources=SOURCE,
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
