// The prefill attention kernel's vectors and register tiles (prefill_attention_cpu.cpp, the
// only file that includes this; the algorithm is described at its top): the lane width and
// tile sizes, a cache row widened to float32, the S = K Q^T tile and the O += P V tiles.
#pragma once

#include "prefill_attention_cpu.h"

#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace {

#if defined(__AVX512F__)
constexpr int kW = 16;  // lanes per vector
constexpr int kKeyTile = 8, kRowVecTile = 3;  // QK tile: keys x row vectors (24 accumulators)
constexpr int kRowTile = 6, kDimVecTile = 4;  // PV tile: rows x head_dim vectors (24)
#else
constexpr int kW = 8;
constexpr int kKeyTile = 4, kRowVecTile = 2;  // 8 of the 16 ymm registers
constexpr int kRowTile = 3, kDimVecTile = 4;  // 12
#endif
constexpr int64_t kChunk = 128;   // keys per online-softmax step
constexpr int64_t kRowsPerItem = 48;  // about this many rows (query heads x queries) per item

typedef float vf __attribute__((vector_size(kW * 4)));
typedef float vfu __attribute__((vector_size(kW * 4), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(kW * 4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
// A broadcast: from memory where x is a load (`vf{} + x` would add 0.0 first, then
// broadcast from a register, a shuffle-port operation that competes with the FMAs).
#if defined(__AVX512F__)
inline vf splat(float x) { return _mm512_set1_ps(x); }
#elif defined(__AVX__)
inline vf splat(float x) { return _mm256_set1_ps(x); }
#else
inline vf splat(float x) { return vf{} + x; }
#endif

inline vf exp_vec(vf x) { return pagedlm_vec::exp_approx_lanes<vf, vi>(x); }

// n values of one cache row as float32.
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {
    _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
  }
#endif
#if defined(__F16C__)
  for (; d + 8 <= n; d += 8) {
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
// float8 through float16 (as paged_attention_cpu.cpp's load8): an e5m2 byte is a float16's
// top byte; an e4m3fn byte's sign to bit 15 and the rest to bits 7..14 is value / 256.
inline void to_float(const at::Float8_e5m2* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
  for (; d + 8 <= n; d += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(b, 8)));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
inline void to_float(const at::Float8_e4m3fn* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const __m256 k256 = _mm256_set1_ps(256.f);
  for (; d + 8 <= n; d += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), k256));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// S[key0 .. key0 + kKeyTile, rv0 * W .. (rv0 + RV) * W) over the whole head_dim.
template <int RV>
inline void qk_tile(const float* k, int64_t key0, const float* qt, int64_t R, int64_t D,
                    float* s, int64_t rv0) {
  vf acc[kKeyTile][RV];
  for (int t = 0; t < kKeyTile; ++t)
    for (int j = 0; j < RV; ++j) acc[t][j] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf q[RV];
    for (int j = 0; j < RV; ++j) q[j] = load(qt + d * R + (rv0 + j) * kW);
#pragma GCC unroll 8
    for (int t = 0; t < kKeyTile; ++t) {
      const vf kb = splat(k[(key0 + t) * D + d]);
      for (int j = 0; j < RV; ++j) acc[t][j] += kb * q[j];
    }
  }
  for (int t = 0; t < kKeyTile; ++t)
    for (int j = 0; j < RV; ++j) store(s + (key0 + t) * R + (rv0 + j) * kW, acc[t][j]);
}

// O[row0 .. row0 + RT, dv0 * W .. (dv0 + DV) * W) = O * corr[row] + sum_key P[key, row] v_key.
template <int RT, int DV>
inline void pv_tile(const float* s, const float* v, int64_t keys, int64_t R, int64_t D,
                    const float* corr, float* o, int64_t row0, int64_t dv0) {
  vf acc[RT][DV];
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < DV; ++j) acc[i][j] = load(o + (row0 + i) * D + (dv0 + j) * kW) * corr[row0 + i];
  for (int64_t key = 0; key < keys; ++key) {
    vf vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = load(v + key * D + (dv0 + j) * kW);
    for (int i = 0; i < RT; ++i) {
      const vf p = splat(s[key * R + row0 + i]);
      for (int j = 0; j < DV; ++j) acc[i][j] += p * vv[j];
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < DV; ++j) store(o + (row0 + i) * D + (dv0 + j) * kW, acc[i][j]);
}

template <int RT>
inline void pv_rows(const float* s, const float* v, int64_t keys, int64_t R, int64_t D,
                    const float* corr, float* o, int64_t row0) {
  const int64_t DVs = D / kW;
  int64_t dv = 0;
  for (; dv + kDimVecTile <= DVs; dv += kDimVecTile) pv_tile<RT, kDimVecTile>(s, v, keys, R, D, corr, o, row0, dv);
  switch (DVs - dv) {
    case 3: pv_tile<RT, 3>(s, v, keys, R, D, corr, o, row0, dv); break;
    case 2: pv_tile<RT, 2>(s, v, keys, R, D, corr, o, row0, dv); break;
    case 1: pv_tile<RT, 1>(s, v, keys, R, D, corr, o, row0, dv); break;
    default: break;
  }
}

}  // namespace
