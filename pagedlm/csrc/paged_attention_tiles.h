// The paged decode kernel's pieces (paged_attention_cpu.cpp, the only file that includes
// this): its work item, one K/V row's vector access, the register tiles of one row's
// q . k and p . V, and a partition's softmax numerators. A verification's rows sharing
// their reads: paged_attention_runs.h.
#pragma once
#include "paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>

#include "cpu_vec.h"

namespace {

using namespace pagedlm_vec;

// Context tokens per work item at most; fewer when there is too little work to give
// every thread several items (a short batch of short sequences).
constexpr int64_t kMaxPartition = 256;

// Rows of one sequence's speculative verification at most that share their K/V reads.
constexpr int64_t kMaxRunRows = 16;
// Tokens of a run's partition widened at a time: their K (or V) for the item's kv heads
// stay in L1 while every row of the run uses them.
constexpr int64_t kRunTile = 16;
// Floats per kv head dim of a run's tile space: kRunTile widened tokens, or the keys of a
// 32-key tile transposed (the keys-in-lanes kernels below).
constexpr int64_t kRunTileFloats = 2 * kRunTile;

// An item computes one partition of rows seq .. seq_end - 1: one row, or a run of rows that
// read the same cache blocks from the same first key (a verification's k + 1 rows; see
// run_decode). A run's item covers the tokens [begin, end) of its longest row, whose block
// table it reads, and, for each row, the part of them that row sees.
struct Item {
  int64_t seq;
  int64_t begin;  // first context token of the partition
  int64_t end;    // one past the last
  int64_t slot = 0;  // the partition's index among its sequence's (row's) partitions
  int64_t kv0 = 0, kv1 = 0;  // the kv heads this item computes, [kv0, kv1)
  int64_t seq_end = 0;  // one past the last row
  int64_t longest = 0;  // the row whose block table the item reads
};

// Row access: `dot` and `axpy` over one K/V row of head_dim values in the cache dtype.
// With AVX2 + F16C + FMA (the build uses -march=native) 8 lanes at a time, widening
// float16 with vcvtph2ps and bfloat16 by a 16-bit shift; at::Half's scalar conversion
// operator is a bit-twiddling function the compiler cannot vectorise.
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// float8 caches, widened through float16: an e5m2 byte is the top byte of a float16; an
// e4m3fn byte's sign moved to bit 15 and its exponent and mantissa to bits 7..14 make a
// float16 worth exactly value / 256 (normal and subnormal alike: both biases differ by 8).
inline __m128i e4m3_to_half(__m128i b) {  // 8 x uint16 holding one byte each
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
}
inline __m256 load8(const at::Float8_e5m2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
inline __m256 load8(const at::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_to_half(b)), _mm256_set1_ps(256.f));
}
template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t n) {
  if (n % 8 != 0) {
    float s = 0.f;
    for (int64_t d = 0; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
    return s;
  }
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  return hsum(acc);
}
template <typename cache_t>
inline void axpy(float a, const cache_t* v, float* out, int64_t n) {
  if (n % 8 != 0) {
    for (int64_t d = 0; d < n; ++d) out[d] += a * static_cast<float>(v[d]);
    return;
  }
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t d = 0; d < n; d += 8) {
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(av, load8(v + d), _mm256_loadu_ps(out + d)));
  }
}
#else
template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}
template <typename cache_t>
inline void axpy(float a, const cache_t* v, float* out, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] += a * static_cast<float>(v[d]);
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGEDLM_TILED 1
// Register-tiled inner loops for head_dim % 8 == 0. A K or V row is widened once and
// used by every query head of its group, and each loop keeps 12 independent FMA chains
// in flight: one chain per (head, token) or (head, 8 dims) instead of one latency-bound
// chain per dot product. NG (<= 3) query heads at a time keeps the 12 accumulators and
// their operands inside the 16 ymm registers.

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Tokens ahead of the one being read that are fetched into cache. A sequence's blocks lie
// anywhere in the cache, so the hardware prefetcher loses the stream at every block edge;
// the token pointers are known in advance, so the loops ask for them explicitly.
constexpr int64_t kPrefetchTokens = 16;

// Fetch a whole token (every kv head: `bytes` contiguous bytes) into cache.
inline void prefetch_token(const void* token, int64_t bytes) {
  const char* p = static_cast<const char*>(token);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// The vector operations of the tiles below on 8 lanes (AVX2) or, where the compiler
// targets AVX-512, 16: half the multiply-adds and conversions per value, and a 64-wide
// head's V in one pass of 4 registers per head instead of two. Only the order of the
// float32 sums differs between the two.
struct Lanes8 {
  using V = __m256;
  static constexpr int kW = 8;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256 to8(V v) { return v; }  // for hsum4
};
#if defined(__AVX512F__)
#define PAGEDLM_TILED512 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
inline __m512 load16(const at::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
struct Lanes16 {
  using V = __m512;
  static constexpr int kW = 16;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __m256 to8(V v) {  // lane j + lane j + 8
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
#endif

// dst[t] = the lane sum of x_t for t < count (<= 4): the reduction of every q . k score.
template <typename L>
inline void store_scores(typename L::V x0, typename L::V x1, typename L::V x2, typename L::V x3,
                         int count, float* dst) {
  const __m128 s = hsum4(L::to8(x0), L::to8(x1), L::to8(x2), L::to8(x3));
  if (count == 4) {
    _mm_storeu_ps(dst, s);
  } else {
    alignas(16) float out[4];
    _mm_store_ps(out, s);
    for (int t = 0; t < count; ++t) dst[t] = out[t];
  }
}

// scores[g * n + i + t] = q_g . (toks[t] + off)[0 : head_dim] for t < count (<= 4), g < NG.
template <int NG, typename L, typename cache_t>
inline void qk_tile(const float* q /*[NG, D]*/, const cache_t* const* toks, int64_t off,
                    int count, int64_t head_dim, float* scores, int64_t n, int64_t i) {
  using V = typename L::V;
  const cache_t* r[4];
  for (int t = 0; t < 4; ++t) r[t] = toks[std::min(t, count - 1)] + off;  // pad with the last
  V acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < 4; ++t) acc[g][t] = L::zero();
  for (int64_t d = 0; d < head_dim; d += L::kW) {
    V qv[NG];
    for (int g = 0; g < NG; ++g) qv[g] = L::load(q + g * head_dim + d);
    for (int t = 0; t < 4; ++t) {
      const V kv = L::load(r[t] + d);
      for (int g = 0; g < NG; ++g) acc[g][t] = L::fmadd(qv[g], kv, acc[g][t]);
    }
  }
  for (int g = 0; g < NG; ++g) store_scores<L>(acc[g][0], acc[g][1], acc[g][2], acc[g][3], count, scores + g * n + i);
}

// acc[g, d0 : d0 + W * CB] = sum_i p[g * n + i] * (toks[i] + off)[d0 : d0 + W * CB], g < NG.
// With `token_bytes` > 0 the loop also prefetches that many bytes of the tokens
// kPrefetchTokens ahead, from `off`.
template <int NG, int CB, typename L, typename cache_t>
inline void pv_tile(const float* p, int64_t n, const cache_t* const* toks, int64_t off,
                    int64_t d0, float* acc /*[NG, D]*/, int64_t head_dim, int64_t token_bytes) {
  using V = typename L::V;
  V a[NG][CB];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CB; ++c) a[g][c] = L::zero();
  for (int64_t i = 0; i < n; ++i) {
    if (token_bytes > 0 && i + kPrefetchTokens < n) prefetch_token(toks[i + kPrefetchTokens] + off, token_bytes);
    V pb[NG];
    for (int g = 0; g < NG; ++g) pb[g] = L::set1(p[g * n + i]);
    const cache_t* row = toks[i] + off + d0;
    for (int c = 0; c < CB; ++c) {
      const V v = L::load(row + L::kW * c);
      for (int g = 0; g < NG; ++g) a[g][c] = L::fmadd(pb[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CB; ++c) L::store(acc + g * head_dim + d0 + L::kW * c, a[g][c]);
}

template <int NG, typename L, typename cache_t>
inline void pv_heads(const float* p, int64_t n, const cache_t* const* toks, int64_t off,
                     float* acc, int64_t head_dim, int64_t token_bytes) {
  int64_t d0 = 0;
  for (; d0 + 4 * L::kW <= head_dim; d0 += 4 * L::kW, token_bytes = 0) {
    pv_tile<NG, 4, L>(p, n, toks, off, d0, acc, head_dim, token_bytes);
  }
  switch ((head_dim - d0) / L::kW) {
    case 3: pv_tile<NG, 3, L>(p, n, toks, off, d0, acc, head_dim, token_bytes); break;
    case 2: pv_tile<NG, 2, L>(p, n, toks, off, d0, acc, head_dim, token_bytes); break;
    case 1: pv_tile<NG, 1, L>(p, n, toks, off, d0, acc, head_dim, token_bytes); break;
    default: break;
  }
}

// The 16-lane tiles where they apply, else the 8-lane ones.
template <int NG, typename cache_t>
inline void qk_tile_any(const float* q, const cache_t* const* toks, int64_t off, int count,
                        int64_t head_dim, float* scores, int64_t n, int64_t i) {
#if defined(PAGEDLM_TILED512)
  if (head_dim % 16 == 0) return qk_tile<NG, Lanes16>(q, toks, off, count, head_dim, scores, n, i);
#endif
  qk_tile<NG, Lanes8>(q, toks, off, count, head_dim, scores, n, i);
}
template <int NG, typename cache_t>
inline void pv_heads_any(const float* p, int64_t n, const cache_t* const* toks, int64_t off,
                         float* acc, int64_t head_dim, int64_t token_bytes) {
#if defined(PAGEDLM_TILED512)
  if (head_dim % 16 == 0) return pv_heads<NG, Lanes16>(p, n, toks, off, acc, head_dim, token_bytes);
#endif
  pv_heads<NG, Lanes8>(p, n, toks, off, acc, head_dim, token_bytes);
}

// Keeps `v` in a register: reading float32, the compiler would otherwise fold its load
// into every multiply-add that uses it, and reload the query vectors too.
template <typename V>
inline void in_register(V& v) { asm volatile("" : "+v"(v)); }
#endif  // PAGEDLM_TILED

// offsets[i] = where the partition's token i starts in a layer's K (or V) cache, in
// values (all kv heads of the token follow): one block-table lookup per block.
inline void token_offsets(const Item& it, const int64_t* block_table, int64_t block_size,
                          int64_t token_stride, int64_t* offsets) {
  for (int64_t t = it.begin; t < it.end;) {
    const int64_t first = t % block_size;
    const int64_t rows = std::min(block_size - first, it.end - t);
    const int64_t base = (block_table[t / block_size] * block_size + first) * token_stride;
    for (int64_t r = 0; r < rows; ++r) offsets[t - it.begin + r] = base + r * token_stride;
    t += rows;
  }
}

// s[i] <- exp(s[i] - max_i s[i]) for i < n; *max_out = the maximum, *sum_out = the sum of
// the new s[i]. Eight lanes at a time where AVX2 is there (exp_approx8 takes the same
// steps as exp_approx; only the order of the additions differs).
inline void softmax_numerators(float* s, int64_t n, float* max_out, float* sum_out) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    m = _mm_cvtss_f32(x);
  }
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.f;
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mb = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
#if defined(__AVX512F__)
  // 16 exponentials at a time, added to the 8-lane sums as two groups of 8 in order
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = exp_approx(s[i] - m);
    sum += s[i];
  }
  *max_out = m;
  *sum_out = sum;
}

// Scores [h, 0 : n) of heads h0 .. h1 - 1 after their soft cap and ALiBi bias; token i of
// the row is at distance `first_distance` + i from its query (<= 0).
inline void cap_and_slope(float* scores, int64_t n, int64_t h0, int64_t h1, int64_t first_distance,
                          float soft_cap, const float* slopes) {
  if (soft_cap <= 0.f && slopes == nullptr) return;
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      float s = scores[h * n + i];
      if (soft_cap > 0.f) s = soft_cap * std::tanh(s / soft_cap);
      if (slopes != nullptr) s += slopes[h] * static_cast<float>(first_distance + i);
      scores[h * n + i] = s;
    }
  }
}

}  // namespace
