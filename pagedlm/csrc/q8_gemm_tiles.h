// The int8 block GEMM's micro-kernels (q8_gemm_cpu.cpp, the only file that includes this;
// the format and layout are described at its top): the constants of the format, the AVX2
// tile over one or two panels, and the portable path that computes the same sums one value
// at a time. The AVX-512 VNNI tiles: q8_gemm_tiles512.h.
#pragma once

#include "lite_bind.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLM_Q8_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDLM_Q8_VNNI512 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;   // values per quantisation block
constexpr int64_t kCols = 8;     // output features per panel
constexpr int64_t kGroups = 8;   // groups of 4 values per block

#ifdef PAGEDLM_Q8_AVX2
// Eight float16 scales as float32 (exact: GGUF stores them as float16). Kept as float16
// in memory they are a sixth of a Q4_1 panel's bytes instead of a third, and a decode
// step of a few rows spends its time streaming the weights.
inline __m256 load_scales(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One row of the micro-kernel below, `kPan` panels (1 or 2) by accumulator name: a<i>_<j>.
#define PAGEDLM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// Rows i0 .. i0 + kRows of y over kPan adjacent panels (kPan 2 needs kRows <= 4). `w` is
// the first panel's groups as bytes [B, 8, 32] (Q4_1: 0..15 unsigned; Q8_0: signed), the
// second's at w + wstride; `sc` the first panel's scales, the second's at sc + sstride.
// out: [kRows, kPan, 8].
//
// Two panels share each row's broadcast of 4 activations: on Zen 3 a broadcast costs about
// as much as the multiply it feeds, and sharing it measured 1.5x the multiply-adds per
// cycle of one panel with all data in L1 (4 rows x 2 panels against 6 x 1).
template <int kRows, int kPan, bool kQ4, bool kPacked>
inline void tile(const int8_t* r, const float* e, const float* s, int64_t K, const uint8_t* w,
                 int64_t wstride, const at::Half* sc, int64_t sstride, float* out) {
  static_assert(kPan == 1 || kPan == 2, "one or two panels");
  static_assert(kRows <= (kPan == 1 ? 6 : 4), "the accumulators must fit the 16 registers");
  const int64_t B = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  // Named accumulators, not arrays: gcc keeps these in registers, arrays it spills.
#define PAGEDLM_DECL(i)                                                  \
  __m256 f##i##_0 = _mm256_setzero_ps(), f##i##_1 = _mm256_setzero_ps(); \
  const int8_t* r##i = r + i * K;
  PAGEDLM_ROWS(PAGEDLM_DECL)
#undef PAGEDLM_DECL
  for (int64_t b = 0; b < B; ++b) {
#define PAGEDLM_DECL(i) __m256i a##i##_0 = _mm256_setzero_si256(), a##i##_1 = a##i##_0;
    PAGEDLM_ROWS(PAGEDLM_DECL)
#undef PAGEDLM_DECL
    const uint8_t* wb = w + b * (kPacked ? kGroups / 2 : kGroups) * 32;
    const int64_t k0 = b * kBlock;
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      __m256i w0, w1;
      if constexpr (kPacked) {
        // Q4_1 nibbles unpacked in registers: pair g / 2 holds group g in its low (g even)
        // or high (g odd) nibbles.
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (g / 2) * 32));
        const __m256i p1 = kPan > 1
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + wstride + (g / 2) * 32)) : p0;
        w0 = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(p0, 4) : p0, low4);
        w1 = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(p1, 4) : p1, low4);
      } else {
        w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 32));
        w1 = kPan > 1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + wstride + g * 32)) : w0;
      }
      int32_t bits;
      if constexpr (kQ4) {
        // Unsigned 0..15 weights times signed activations; int16 sums over the block.
#define PAGEDLM_ROW(i)                                                                  \
  if constexpr (kRows > i) {                                                            \
    std::memcpy(&bits, r##i + k0 + 4 * g, 4);                                           \
    const __m256i xb = _mm256_set1_epi32(bits);                                         \
    a##i##_0 = _mm256_add_epi16(a##i##_0, _mm256_maddubs_epi16(w0, xb));                \
    if constexpr (kPan > 1) a##i##_1 = _mm256_add_epi16(a##i##_1, _mm256_maddubs_epi16(w1, xb)); \
  }
        PAGEDLM_ROWS(PAGEDLM_ROW)
#undef PAGEDLM_ROW
      } else {
        // Signed weights: |w| times the activation carrying w's sign (-128 -> 128 as a byte,
        // 2 * 128 * 127 < 2^15), widened to int32 every group.
        const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
#define PAGEDLM_ROW(i)                                                                        \
  if constexpr (kRows > i) {                                                                  \
    std::memcpy(&bits, r##i + k0 + 4 * g, 4);                                                 \
    const __m256i xb = _mm256_set1_epi32(bits);                                               \
    a##i##_0 = _mm256_add_epi32(a##i##_0, _mm256_madd_epi16(                                  \
        _mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xb, w0)), ones));                          \
    if constexpr (kPan > 1)                                                                   \
      a##i##_1 = _mm256_add_epi32(a##i##_1, _mm256_madd_epi16(                                \
          _mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xb, w1)), ones));                        \
  }
        PAGEDLM_ROWS(PAGEDLM_ROW)
#undef PAGEDLM_ROW
      }
    }
    // Per panel: d (and m) of its 8 features; per row: e (and s) of this block.
    const at::Half* sb0 = sc + b * (kQ4 ? 16 : 8);
    const at::Half* sb1 = sb0 + sstride;
    const __m256 d0 = load_scales(sb0), d1 = kPan > 1 ? load_scales(sb1) : d0;
    if constexpr (kQ4) {
      const __m256 m0 = load_scales(sb0 + 8), m1 = kPan > 1 ? load_scales(sb1 + 8) : m0;
#define PAGEDLM_PANEL(i, j)                                                                 \
  f##i##_##j = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a##i##_##j, ones)),      \
                               _mm256_mul_ps(d##j, ev), f##i##_##j);                         \
  f##i##_##j = _mm256_fmadd_ps(m##j, sv, f##i##_##j);
#define PAGEDLM_ROW(i)                                                                      \
  if constexpr (kRows > i) {                                                                \
    const __m256 ev = _mm256_set1_ps(e[i * B + b]), sv = _mm256_set1_ps(s[i * B + b]);      \
    PAGEDLM_PANEL(i, 0)                                                                     \
    if constexpr (kPan > 1) { PAGEDLM_PANEL(i, 1) }                                         \
  }
      PAGEDLM_ROWS(PAGEDLM_ROW)
#undef PAGEDLM_ROW
#undef PAGEDLM_PANEL
    } else {
#define PAGEDLM_PANEL(i, j)                                                                 \
  f##i##_##j = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##i##_##j), _mm256_mul_ps(d##j, ev), f##i##_##j);
#define PAGEDLM_ROW(i)                                                                      \
  if constexpr (kRows > i) {                                                                \
    const __m256 ev = _mm256_set1_ps(e[i * B + b]);                                         \
    PAGEDLM_PANEL(i, 0)                                                                     \
    if constexpr (kPan > 1) { PAGEDLM_PANEL(i, 1) }                                         \
  }
      PAGEDLM_ROWS(PAGEDLM_ROW)
#undef PAGEDLM_ROW
#undef PAGEDLM_PANEL
    }
  }
#define PAGEDLM_ROW(i)                                                     \
  if constexpr (kRows > i) {                                               \
    _mm256_storeu_ps(out + (i * kPan) * kCols, f##i##_0);                  \
    if constexpr (kPan > 1) _mm256_storeu_ps(out + (i * kPan + 1) * kCols, f##i##_1); \
  }
  PAGEDLM_ROWS(PAGEDLM_ROW)
#undef PAGEDLM_ROW
}
#undef PAGEDLM_ROWS

template <int kPan, bool kQ4, bool kPacked>
void run_tile(int rows, const int8_t* r, const float* e, const float* s, int64_t K,
              const uint8_t* w, int64_t wstride, const at::Half* sc, int64_t sstride, float* out) {
#define PAGEDLM_TILE(n) tile<n, kPan, kQ4, kPacked>(r, e, s, K, w, wstride, sc, sstride, out)
  switch (rows) {
    case 1: PAGEDLM_TILE(1); break;
    case 2: PAGEDLM_TILE(2); break;
    case 3: PAGEDLM_TILE(3); break;
    case 4: PAGEDLM_TILE(4); break;
    case 5: if constexpr (kPan == 1) PAGEDLM_TILE(5); break;
    default: if constexpr (kPan == 1) PAGEDLM_TILE(6); break;
  }
#undef PAGEDLM_TILE
}
#else
// Portable path: the same integer sums and scalings, one value at a time.
template <int kPan, bool kQ4, bool kPacked>
void run_tile(int rows, const int8_t* r, const float* e, const float* s, int64_t K,
              const uint8_t* w, int64_t wstride, const at::Half* sc, int64_t sstride, float* out) {
  const int64_t B = K / kBlock;
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < kPan; ++j) {
      const uint8_t* wj = w + j * wstride;
      const at::Half* scj = sc + j * sstride;
      for (int64_t c = 0; c < kCols; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < B; ++b) {
          int32_t dot = 0;
          for (int g = 0; g < kGroups; ++g) {
            for (int u = 0; u < 4; ++u) {
              // Packed Q4_1: pair g / 2 of the block, low nibbles for even g, high for odd.
              const uint8_t byte = kPacked
                  ? (wj[(b * kGroups / 2 + g / 2) * 32 + 4 * c + u] >> (4 * (g % 2))) & 0x0F
                  : wj[(b * kGroups + g) * 32 + 4 * c + u];
              const int32_t q = kQ4 ? static_cast<int32_t>(byte) : static_cast<int8_t>(byte);
              dot += q * r[i * K + b * kBlock + 4 * g + u];
            }
          }
          if constexpr (kQ4) {
            acc = std::fma(static_cast<float>(dot), static_cast<float>(scj[b * 16 + c]) * e[i * B + b], acc);
            acc = std::fma(static_cast<float>(scj[b * 16 + 8 + c]), s[i * B + b], acc);
          } else {
            acc = std::fma(static_cast<float>(dot), static_cast<float>(scj[b * 8 + c]) * e[i * B + b], acc);
          }
        }
        out[(i * kPan + j) * kCols + c] = acc;
      }
    }
  }
}
#endif

}  // namespace
