// Small vector-math helpers shared by the CPU kernels in this directory (each kernel is
// its own extension; this header is compiled into each).
#pragma once

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedlm_vec {

// exp(x) in plain float arithmetic, so the loops calling it can vectorise (libm's expf is
// a scalar call): x = (n + r) ln2 with n an integer and |r| <= 1/2; 2^r from a degree-6
// polynomial (the classic Cephes exp2f coefficients, relative error ~2e-7); 2^n written
// straight into the exponent bits. Clamped to [-87, 88], which keeps 2^n a normal float:
// below, the result is a tiny normal value instead of 0; above, a huge finite one.
// The polynomial's coefficients, highest degree first: every exp below evaluates them in
// this order, so all give the same bits.
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                                1.0f};

inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;  // x * log2(e)
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const float r = t - n;
  float p = kExp2Poly[0];
  for (int k = 1; k < 7; ++k) p = p * r + kExp2Poly[k];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// exp_approx on every lane of a GCC vector type V of floats (VI: its int32 twin), the same
// steps, for kernels written with vector extensions instead of intrinsics.
template <typename V, typename VI>
inline V exp_approx_lanes(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V t = x * 1.44269504088896341f;
  const V n = (t + 12582912.0f) - 12582912.0f;
  const V r = t - n;
  V p = V{} + kExp2Poly[0];
  for (int k = 1; k < 7; ++k) p = p * r + kExp2Poly[k];
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  return p * reinterpret_cast<const V&>(bits);
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_approx on 8 lanes, the same steps, for loops the compiler does not vectorise.
inline __m256 exp_approx8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int k = 1; k < 7; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExp2Poly[k]));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#if defined(__AVX512F__)
// exp_approx8 on 16 lanes: the same steps, so each lane's result is the same bits.
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int k = 1; k < 7; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2Poly[k]));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// r[i] = row i of a 16 x 16 block of float32  ->  r[j] = its column j.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved, 128 bits at a time
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int m = 0; m < 16; m += 4) {  // u[m + e], 128-bit lane L: column 4 L + e of rows m .. m + 3
    r[m] = _mm512_shuffle_ps(t[m], t[m + 2], 0x44);
    r[m + 1] = _mm512_shuffle_ps(t[m], t[m + 2], 0xEE);
    r[m + 2] = _mm512_shuffle_ps(t[m + 1], t[m + 3], 0x44);
    r[m + 3] = _mm512_shuffle_ps(t[m + 1], t[m + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {  // the 4 x 4 blocks of 128 bits of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512 v0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 v3 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_f32x4(v0, v2, 0x88);       // column e
    t[8 + e] = _mm512_shuffle_f32x4(v0, v2, 0xDD);   // column 8 + e
    t[4 + e] = _mm512_shuffle_f32x4(v1, v3, 0x88);   // column 4 + e
    t[12 + e] = _mm512_shuffle_f32x4(v1, v3, 0xDD);  // column 12 + e
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}
#endif

// The sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

}  // namespace pagedlm_vec
