// The CPU's peak for the two instructions the CPU kernels are built on, one core: int8
// multiply-adds (vpdpbusd, AVX-512 VNNI: 64 per instruction) and float32 FMAs (vfmadd,
// 16 per instruction), each in 12 independent chains so that only throughput counts.
// The kernels' own rates are read against these (README, Speculative decoding).
//
//     g++ -O2 -march=native benchmarks/cpu/vector_peak.cpp -o /tmp/vector_peak && /tmp/vector_peak
//
// Run two at once (`/tmp/vector_peak & /tmp/vector_peak; wait`) to see both cores together.

#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int kChains = 12;
constexpr long kRounds = 20000000;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main() {
#if defined(__AVX512VNNI__)
  __m512i acc[kChains];
  const __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8(2);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  auto start = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
  }
  double dt = seconds_since(start);
  long check = 0;
  for (int i = 0; i < kChains; ++i) check += _mm512_reduce_add_epi32(acc[i]);
  std::printf("vpdpbusd zmm: %.2f G/s, %.0f G int8 ops/s (multiply and add) per core [%ld]\n",
              kRounds * kChains / dt / 1e9, kRounds * kChains * 64.0 * 2 / dt / 1e9, check);
#else
  std::printf("no AVX-512 VNNI on this CPU (or not enabled by -march)\n");
#endif
#if defined(__AVX512F__)
  __m512 f[kChains];
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.001f);
  for (int i = 0; i < kChains; ++i) f[i] = _mm512_set1_ps(static_cast<float>(i));
  auto start_f = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) f[i] = _mm512_fmadd_ps(f[i], x, y);
  }
  double dt_f = seconds_since(start_f);
  float check_f = 0;
  for (int i = 0; i < kChains; ++i) check_f += _mm512_reduce_add_ps(f[i]);
  std::printf("vfmadd zmm: %.2f G/s, %.0f GFLOP/s per core [%g]\n", kRounds * kChains / dt_f / 1e9,
              kRounds * kChains * 32.0 / dt_f / 1e9, check_f);
#endif
  return 0;
}
