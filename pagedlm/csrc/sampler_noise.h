// The sampler's hash and noise (sampler_cpu.cpp, the only file that includes this; the maths
// is described at its top): splitmix64's counter-based hash, and the uniform u and the
// log(-log u) of the race from it, 8 lanes at a time with AVX2 + FMA or one at a time.
#pragma once

#include <cmath>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

inline uint64_t row_key(int64_t seed, int64_t step) {
  return mix64(mix64(static_cast<uint64_t>(seed) + kGolden) ^ static_cast<uint64_t>(step));
}

inline uint32_t uniform_bits(uint64_t key, int64_t j) {
  return static_cast<uint32_t>(mix64(key + static_cast<uint64_t>(j + 1) * kGolden) >> 41);
}

// Cephes logf: log(1 + f) = f - f^2/2 + f^3 P(f) for f in [sqrt(1/2) - 1, sqrt(2) - 1].
constexpr float kLogP[9] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f,
                            -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                            2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f};
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;

#if defined(__AVX2__) && defined(__FMA__)

// ---- 8 lanes at a time (AVX2 + FMA; the build uses -march=native) -------------------------

// The high dword of each 64-bit lane of a * c, plus (a * c) mod 2^64 itself: AVX2 has no 64-bit
// multiply. lo(a) lo(c) is a 32x32 -> 64 product (vpmuludq); the two cross terms only matter
// mod 2^32, so one 32-bit multiply (vpmulld) of a by c with its halves swapped gives both.
inline __m256i mul64_high_dword(__m256i a, __m256i c, __m256i c_swapped) {
  const __m256i lo = _mm256_mul_epu32(a, c);
  const __m256i cross = _mm256_mullo_epi32(a, c_swapped);  // dwords: lo(a) hi(c), hi(a) lo(c)
  // dword-wise add: the high dword becomes hi(lo) + both cross terms, the low one is garbage.
  return _mm256_add_epi32(lo, _mm256_add_epi32(cross, _mm256_slli_epi64(cross, 32)));
}

inline __m256i mul64(__m256i a, __m256i c, __m256i c_swapped) {
  const __m256i lo = _mm256_mul_epu32(a, c);
  return _mm256_blend_epi32(lo, mul64_high_dword(a, c, c_swapped), 0xAA);
}

inline __m256i swap_halves(uint64_t c) {
  return _mm256_set1_epi64x(static_cast<int64_t>((c >> 32) | (c << 32)));
}

// mix64(z) >> 41, in the high dword of each lane. splitmix64's last step, z ^ (z >> 31), leaves
// the top 33 bits alone, and only the high dword of the last product is needed.
inline __m256i mix64_top_bits(__m256i z) {
  const __m256i m1 = _mm256_set1_epi64x(static_cast<int64_t>(kMix1)), m1_sw = swap_halves(kMix1);
  const __m256i m2 = _mm256_set1_epi64x(static_cast<int64_t>(kMix2)), m2_sw = swap_halves(kMix2);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1, m1_sw);
  return mul64_high_dword(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2, m2_sw);
}

// b_j .. b_{j+7} as 8 int32 lanes in order. The even indices hash in one vector, the odd in
// another, so that one blend puts the 23 bits of each straight into dword order: (even >> 41)
// fills the even dwords, (odd >> 9) has b in its odd (high) dwords.
inline __m256i uniform_bits8(uint64_t key, int64_t j) {
  constexpr uint64_t g = kGolden;
  const __m256i base = _mm256_set1_epi64x(static_cast<int64_t>(key + static_cast<uint64_t>(j + 1) * g));
  const __m256i even_off = _mm256_set_epi64x(static_cast<int64_t>(6 * g), static_cast<int64_t>(4 * g),
                                             static_cast<int64_t>(2 * g), 0);
  const __m256i odd_off = _mm256_set_epi64x(static_cast<int64_t>(7 * g), static_cast<int64_t>(5 * g),
                                            static_cast<int64_t>(3 * g), static_cast<int64_t>(g));
  const __m256i even = mix64_top_bits(_mm256_add_epi64(base, even_off));
  const __m256i odd = mix64_top_bits(_mm256_add_epi64(base, odd_off));
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 41), _mm256_srli_epi64(odd, 9), 0xAA);
}

inline __m256 uniform8(__m256i bits) {  // (b + 1/2) / 2^23, exact
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(0x1p-23f), _mm256_set1_ps(0x1p-24f));
}

// Natural log of n vectors of positive normal floats (no zero, inf or NaN reaches it), written
// lane-parallel so that the polynomials' dependency chains interleave: x = 2^e m with m in
// (sqrt(1/2), sqrt(2)], log x = e ln2 + log(1 + f), f = m - 1 (exact).
template <int n>
inline void log8(const __m256* x, __m256* out) {
  __m256 e[n], f[n], z[n], p[n];
  for (int k = 0; k < n; ++k) {
    const __m256i bits = _mm256_castps_si256(x[k]);
    e[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                                   _mm256_set1_epi32(0x3F800000)));  // [1, 2)
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e[k] = _mm256_add_ps(e[k], _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
    f[k] = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
    z[k] = _mm256_mul_ps(f[k], f[k]);
    p[k] = _mm256_set1_ps(kLogP[0]);
  }
  for (int i = 1; i < 9; ++i) {
    for (int k = 0; k < n; ++k) p[k] = _mm256_fmadd_ps(p[k], f[k], _mm256_set1_ps(kLogP[i]));
  }
  for (int k = 0; k < n; ++k) {
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p[k], f[k]), z[k]);
    y = _mm256_fmadd_ps(e[k], _mm256_set1_ps(kLn2Lo), y);
    y = _mm256_fmadd_ps(z[k], _mm256_set1_ps(-0.5f), y);
    out[k] = _mm256_fmadd_ps(e[k], _mm256_set1_ps(kLn2Hi), _mm256_add_ps(f[k], y));
  }
}

// log(-log u) of n vectors of hash values: the race value is y minus this.
template <int n>
inline void log_exponential8(const __m256i* bits, __m256* out) {
  __m256 t[n];
  for (int k = 0; k < n; ++k) t[k] = uniform8(bits[k]);
  log8<n>(t, t);
  for (int k = 0; k < n; ++k) t[k] = _mm256_xor_ps(t[k], _mm256_set1_ps(-0.0f));  // -log u
  log8<n>(t, out);
}

// An upper bound of the noise -log(-log u) from b alone, for the second prefilter. With
// c = 2^23 - 1 - b, w = 1 - u = (c + 1/2) / 2^23: -log u >= w, so the noise is at most
// -log w <= (23 - floor(log2(c + 1/2))) ln2, read off the float exponent of c + 1/2; 1e-3 more
// covers the polynomial logs' error (5.4e-7).
inline __m256 noise_bound8(__m256i bits) {
  const __m256i c = _mm256_xor_si256(bits, _mm256_set1_epi32(0x007FFFFF));
  const __m256 k = _mm256_add_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(0.5f));
  const __m256i biased = _mm256_srli_epi32(_mm256_castps_si256(k), 23);  // floor(log2 k) + 127
  constexpr float ln2 = 0.693147181f;
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(biased), _mm256_set1_ps(-ln2), _mm256_set1_ps(150 * ln2 + 1e-3f));
}

inline __m256 hmax8(__m256 v) {  // every lane = the largest (v must hold no NaN)
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0b01001110));
  return _mm256_max_ps(v, _mm256_permute_ps(v, 0b10110001));
}

// Whether any lane of any of the n vectors has a + b >= threshold, or is NaN.
template <int n>
inline bool any_reaches(const __m256* a, const __m256* b, __m256 threshold) {
  __m256 hit = _mm256_setzero_ps();
  for (int k = 0; k < n; ++k) {
    hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_add_ps(a[k], b[k]), threshold, _CMP_NLT_UQ));
  }
  return _mm256_movemask_ps(hit) != 0;
}

#else

// ---- Portable scalar path (no AVX2 + FMA): the same maths one element at a time ----------

inline float uniform1(uint32_t bits) {
  return (static_cast<float>(bits) + 0.5f) * 0x1p-23f;
}

inline float log_scalar(float x) {
  int e;
  float m = std::frexp(x, &e) * 2.0f;  // [1, 2)
  float fe = static_cast<float>(e - 1);
  if (m > 1.41421356f) {
    m *= 0.5f;
    fe += 1.0f;
  }
  const float f = m - 1.0f;
  const float z = f * f;
  float p = kLogP[0];
  for (int i = 1; i < 9; ++i) p = p * f + kLogP[i];
  float y = p * f * z;
  y += fe * kLn2Lo;
  y += -0.5f * z;
  return (f + y) + fe * kLn2Hi;
}

inline float log_exponential1(uint32_t bits) { return log_scalar(-log_scalar(uniform1(bits))); }

#endif

}  // namespace
