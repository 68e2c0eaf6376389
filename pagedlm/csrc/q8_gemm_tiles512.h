// The int8 block GEMM's AVX-512 VNNI micro-kernels (q8_gemm_cpu.cpp, the only file that
// includes this): two panels in one 512-bit register (tile512), four in two (tile512x4), and
// their dispatch by row count. The same integer sums and float32 operations per output as
// the AVX2 tile in q8_gemm_tiles.h, so the same bits.
#pragma once

#include "q8_gemm_tiles.h"

namespace {

#ifdef PAGEDLM_Q8_VNNI512
// Two adjacent panels' 32 bytes of a group (or a Q4_1 pair of groups) side by side; the
// second panel at p + wstride.
inline __m512i pair_bytes(const uint8_t* p, int64_t wstride) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + wstride)), 1);
}

// Two adjacent panels' 8 float16 scales as 16 float32 lanes; the second's at p + sstride.
inline __m512 pair_scales(const at::Half* p, int64_t sstride) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + sstride)), 1));
}

// Group g of block `wb` for two adjacent panels as unsigned bytes for vpdpbusd: packed
// Q4_1 nibbles unpacked, widened Q4_1 as stored, Q8_0 plus 128 (see tile512).
template <bool kQ4, bool kPacked>
inline __m512i pair_group(const uint8_t* wb, int g, int64_t wstride) {
  if constexpr (kPacked) {
    const __m512i p = pair_bytes(wb + (g / 2) * 32, wstride);
    return _mm512_and_si512(g % 2 ? _mm512_srli_epi16(p, 4) : p, _mm512_set1_epi8(0x0F));
  } else if constexpr (kQ4) {
    return pair_bytes(wb + g * 32, wstride);
  } else {
    return _mm512_xor_si512(pair_bytes(wb + g * 32, wstride), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

// Two panels in one 512-bit register (features 0-7 of the first, then of the second) and
// vpdpbusd, which multiplies 4 unsigned by 4 signed bytes and adds them to an int32 lane in
// one operation (AVX2 takes vpmaddubsw, vpaddw and, per block, vpmaddwd). The same exact
// integer sums and the same float32 operations as `tile`, so the same bits. Q4_1: nibbles
// (unsigned) times activations (signed). Q8_0 has signed weights: w + 128 (unsigned)
// times r, its block sum started at c = -128 sum r instead of 0.
template <int kRows, bool kQ4, bool kPacked>
inline void tile512(const int8_t* r, const float* e, const float* s, const int32_t* c, int64_t K,
                    const uint8_t* w, int64_t wstride, const at::Half* sc, int64_t sstride,
                    float* out, const uint8_t* pf_w, const at::Half* pf_sc) {
  static_assert(kRows >= 1 && kRows <= 8, "up to 8 rows");
  const int64_t B = K / kBlock;
#define PAGEDLM_ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define PAGEDLM_DECL(i) __m512 f##i = _mm512_setzero_ps(); const int8_t* r##i = r + i * K;
  PAGEDLM_ROWS8(PAGEDLM_DECL)
#undef PAGEDLM_DECL
  constexpr int64_t kBlockBytes = (kPacked ? kGroups / 2 : kGroups) * 32;  // per panel
  for (int64_t b = 0; b < B; ++b) {
    if (pf_w != nullptr) {  // the same block of the next pair of panels (see the top)
      for (int64_t off = 0; off < kBlockBytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(pf_w + b * kBlockBytes + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(pf_w + wstride + b * kBlockBytes + off), _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(pf_sc + b * (kQ4 ? 16 : 8)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf_sc + sstride + b * (kQ4 ? 16 : 8)), _MM_HINT_T0);
    }
#define PAGEDLM_DECL(i) \
  __m512i a##i = kQ4 ? _mm512_setzero_si512() : _mm512_set1_epi32(kRows > i ? c[i * B + b] : 0);
    PAGEDLM_ROWS8(PAGEDLM_DECL)
#undef PAGEDLM_DECL
    const uint8_t* wb = w + b * (kPacked ? kGroups / 2 : kGroups) * 32;
    const int64_t k0 = b * kBlock;
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      const __m512i wg = pair_group<kQ4, kPacked>(wb, g, wstride);
      int32_t bits;
#define PAGEDLM_ROW(i)                                                   \
  if constexpr (kRows > i) {                                             \
    std::memcpy(&bits, r##i + k0 + 4 * g, 4);                            \
    a##i = _mm512_dpbusd_epi32(a##i, wg, _mm512_set1_epi32(bits));       \
  }
      PAGEDLM_ROWS8(PAGEDLM_ROW)
#undef PAGEDLM_ROW
    }
    const at::Half* sb = sc + b * (kQ4 ? 16 : 8);
    const __m512 d = pair_scales(sb, sstride);
    if constexpr (kQ4) {
      const __m512 m = pair_scales(sb + 8, sstride);
#define PAGEDLM_ROW(i)                                                                     \
  if constexpr (kRows > i) {                                                               \
    f##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##i), _mm512_mul_ps(d, _mm512_set1_ps(e[i * B + b])), f##i); \
    f##i = _mm512_fmadd_ps(m, _mm512_set1_ps(s[i * B + b]), f##i);                        \
  }
      PAGEDLM_ROWS8(PAGEDLM_ROW)
#undef PAGEDLM_ROW
    } else {
#define PAGEDLM_ROW(i)                                                                     \
  if constexpr (kRows > i)                                                                 \
    f##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##i), _mm512_mul_ps(d, _mm512_set1_ps(e[i * B + b])), f##i);
      PAGEDLM_ROWS8(PAGEDLM_ROW)
#undef PAGEDLM_ROW
    }
  }
#define PAGEDLM_ROW(i) if constexpr (kRows > i) _mm512_storeu_ps(out + i * 2 * kCols, f##i);
  PAGEDLM_ROWS8(PAGEDLM_ROW)
#undef PAGEDLM_ROW
#undef PAGEDLM_ROWS8
}

// tile512 over four adjacent panels (two 512-bit weight registers) and up to 6 rows: each
// row's broadcast of 4 activations feeds two vpdpbusd instead of one. With all data in L1
// tile512 issues about three operations per vpdpbusd, and those, not the multiplies, bound
// it (the same tile with one broadcast shared by all its rows, wrong but timed, ran 2.1x
// the multiply-adds at 512 rows); sharing the broadcasts measured 1.07-1.10x at 4-512 rows
// and the same at 1-16 rows with the weights streaming from memory
// (benchmarks/cpu/q8_gemm_revs.py [--stream] --baseline-rev). The same integer sums and
// float32 operations per output as tile512, so the same bits. out: [kRows, 4, 8].
template <int kRows, bool kQ4, bool kPacked>
inline void tile512x4(const int8_t* r, const float* e, const float* s, const int32_t* c, int64_t K,
                      const uint8_t* w, int64_t wstride, const at::Half* sc, int64_t sstride,
                      float* out, const uint8_t* pf_w, const at::Half* pf_sc) {
  static_assert(kRows >= 1 && kRows <= 6, "up to 6 rows");
  const int64_t B = K / kBlock;
#define PAGEDLM_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define PAGEDLM_DECL(i) __m512 f##i = _mm512_setzero_ps(), g##i = _mm512_setzero_ps(); \
  const int8_t* r##i = r + i * K;
  PAGEDLM_ROWS6(PAGEDLM_DECL)
#undef PAGEDLM_DECL
  constexpr int64_t kBlockBytes = (kPacked ? kGroups / 2 : kGroups) * 32;  // per panel
  for (int64_t b = 0; b < B; ++b) {
    if (pf_w != nullptr) {  // the same block of the next four panels
      for (int j = 0; j < 4; ++j) {
        for (int64_t off = 0; off < kBlockBytes; off += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(pf_w + j * wstride + b * kBlockBytes + off), _MM_HINT_T0);
        }
        _mm_prefetch(reinterpret_cast<const char*>(pf_sc + j * sstride + b * (kQ4 ? 16 : 8)), _MM_HINT_T0);
      }
    }
#define PAGEDLM_DECL(i) \
  const int32_t c##i = kQ4 || kRows <= i ? 0 : c[i * B + b]; \
  __m512i a##i = _mm512_set1_epi32(c##i), h##i = a##i;
    PAGEDLM_ROWS6(PAGEDLM_DECL)
#undef PAGEDLM_DECL
    const uint8_t* wb = w + b * kBlockBytes;
    const uint8_t* wb2 = wb + 2 * wstride;
    const int64_t k0 = b * kBlock;
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      const __m512i w0 = pair_group<kQ4, kPacked>(wb, g, wstride);
      const __m512i w1 = pair_group<kQ4, kPacked>(wb2, g, wstride);
      int32_t bits;
#define PAGEDLM_ROW(i)                                                   \
  if constexpr (kRows > i) {                                             \
    std::memcpy(&bits, r##i + k0 + 4 * g, 4);                            \
    const __m512i xb = _mm512_set1_epi32(bits);                          \
    a##i = _mm512_dpbusd_epi32(a##i, w0, xb);                            \
    h##i = _mm512_dpbusd_epi32(h##i, w1, xb);                            \
  }
      PAGEDLM_ROWS6(PAGEDLM_ROW)
#undef PAGEDLM_ROW
    }
    const at::Half* sb = sc + b * (kQ4 ? 16 : 8);
    const at::Half* sb2 = sb + 2 * sstride;
    const __m512 d0 = pair_scales(sb, sstride), d1 = pair_scales(sb2, sstride);
    if constexpr (kQ4) {
      const __m512 m0 = pair_scales(sb + 8, sstride), m1 = pair_scales(sb2 + 8, sstride);
#define PAGEDLM_ROW(i)                                                                     \
  if constexpr (kRows > i) {                                                               \
    const __m512 ei = _mm512_set1_ps(e[i * B + b]), si = _mm512_set1_ps(s[i * B + b]);   \
    f##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##i), _mm512_mul_ps(d0, ei), f##i);        \
    f##i = _mm512_fmadd_ps(m0, si, f##i);                                                  \
    g##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h##i), _mm512_mul_ps(d1, ei), g##i);        \
    g##i = _mm512_fmadd_ps(m1, si, g##i);                                                  \
  }
      PAGEDLM_ROWS6(PAGEDLM_ROW)
#undef PAGEDLM_ROW
    } else {
#define PAGEDLM_ROW(i)                                                                     \
  if constexpr (kRows > i) {                                                               \
    const __m512 ei = _mm512_set1_ps(e[i * B + b]);                                        \
    f##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##i), _mm512_mul_ps(d0, ei), f##i);        \
    g##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h##i), _mm512_mul_ps(d1, ei), g##i);        \
  }
      PAGEDLM_ROWS6(PAGEDLM_ROW)
#undef PAGEDLM_ROW
    }
  }
#define PAGEDLM_ROW(i)                                        \
  if constexpr (kRows > i) {                                  \
    _mm512_storeu_ps(out + i * 4 * kCols, f##i);              \
    _mm512_storeu_ps(out + i * 4 * kCols + 2 * kCols, g##i);  \
  }
  PAGEDLM_ROWS6(PAGEDLM_ROW)
#undef PAGEDLM_ROW
#undef PAGEDLM_ROWS6
}

template <bool kQ4, bool kPacked>
void run_tile512x4(int rows, const int8_t* r, const float* e, const float* s, const int32_t* c,
                   int64_t K, const uint8_t* w, int64_t wstride, const at::Half* sc,
                   int64_t sstride, float* out, const uint8_t* pf_w, const at::Half* pf_sc) {
#define PAGEDLM_TILE(n) tile512x4<n, kQ4, kPacked>(r, e, s, c, K, w, wstride, sc, sstride, out, pf_w, pf_sc)
  switch (rows) {
    case 1: PAGEDLM_TILE(1); break;
    case 2: PAGEDLM_TILE(2); break;
    case 3: PAGEDLM_TILE(3); break;
    case 4: PAGEDLM_TILE(4); break;
    case 5: PAGEDLM_TILE(5); break;
    default: PAGEDLM_TILE(6); break;
  }
#undef PAGEDLM_TILE
}

template <bool kQ4, bool kPacked>
void run_tile512(int rows, const int8_t* r, const float* e, const float* s, const int32_t* c,
                 int64_t K, const uint8_t* w, int64_t wstride, const at::Half* sc,
                 int64_t sstride, float* out, const uint8_t* pf_w, const at::Half* pf_sc) {
#define PAGEDLM_TILE(n) tile512<n, kQ4, kPacked>(r, e, s, c, K, w, wstride, sc, sstride, out, pf_w, pf_sc)
  switch (rows) {
    case 1: PAGEDLM_TILE(1); break;
    case 2: PAGEDLM_TILE(2); break;
    case 3: PAGEDLM_TILE(3); break;
    case 4: PAGEDLM_TILE(4); break;
    case 5: PAGEDLM_TILE(5); break;
    case 6: PAGEDLM_TILE(6); break;
    case 7: PAGEDLM_TILE(7); break;
    default: PAGEDLM_TILE(8); break;
  }
#undef PAGEDLM_TILE
}
#endif

}  // namespace
