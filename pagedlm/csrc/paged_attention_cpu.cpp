// Paged decode attention for CPU: one query token per sequence, K/V read straight from
// the cache blocks (no gathered copy of the context), split over the context so that a
// batch of one long sequence still keeps every core busy.
//
// Cache layout (one layer):  [num_blocks, block_size, num_kv_heads, head_dim]
// Token t of sequence b lives in block block_tables[b, t / block_size], row t % block_size.
//
// Work item = (sequence, partition of <= 256 context tokens), every head at once: a
// token's K (or V) values for all kv heads are one contiguous run, so an item reads its
// blocks front to back. Each item computes, for every query head, the partition's softmax
// maximum, sum of exponentials and un-normalised weighted sum of V; a second pass merges
// the partitions of each (sequence, head). A step with fewer partitions than four per
// thread (one short sequence) splits each partition's kv heads over several items instead.
// The partitions (256 tokens from the first visible key) fix the order of a head's float
// sums and follow from its sequence alone, and heads are computed apart either way: a
// row's result is the same whatever else the step holds, bit for bit, so a speculative
// verification's k + 1 rows give what decoding one token at a time gives
// (tests/test_cpu_attention.py).
//
//   out = sum_p exp(m_p - m) * acc_p / sum_p exp(m_p - m) * s_p,   m = max_p m_p
//
// Score of query head h (kv head h / group) against key t, query at position
// q = seq_len - 1 (the same maths as attention/reference.py):
//   s = (q_h . k_t) * scale;  s = cap * tanh(s / cap) if cap > 0;  s += slope_h * (t - q);
//   visible iff t <= q and (window <= 0 or q - t < window).

#include "paged_attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagedlm_vec;

// Context tokens per work item at most; fewer when there is too little work to give
// every thread several items (a short batch of short sequences).
constexpr int64_t kMaxPartition = 256;

// Item i's partial results are slot i.
struct Item {
  int64_t seq;
  int64_t begin;  // first context token of the partition
  int64_t end;    // one past the last
  int64_t slot = 0;  // where the partition's partial results go
  int64_t kv0 = 0, kv1 = 0;  // the kv heads this item computes, [kv0, kv1)
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
  for (int g = 0; g < NG; ++g) {
    const __m128 s = hsum4(L::to8(acc[g][0]), L::to8(acc[g][1]), L::to8(acc[g][2]), L::to8(acc[g][3]));
    if (count == 4) {
      _mm_storeu_ps(scores + g * n + i, s);
    } else {
      alignas(16) float out[4];
      _mm_store_ps(out, s);
      for (int t = 0; t < count; ++t) scores[g * n + i + t] = out[t];
    }
  }
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

// scores[h, i] = q_h . k_i for the query heads h of kv heads kv0 .. kv1 - 1 (scores [H, n],
// q [H, D]): token tiles front to back, each tile's K values for those kv heads (one
// contiguous run per token) before the next tile, NG <= 3 query heads of a group at a
// time. The loop also fetches the V rows of the tokens ahead: the passes over V that
// follow then find them in cache instead of waiting on DRAM at the start of each token
// (measured 1.2x for the whole kernel on cold caches, benchmarks/cpu/decode_attention_cold.py).
template <typename cache_t>
void qk_all(const float* q, const cache_t* const* k_toks, const cache_t* const* v_toks, int64_t n,
            int64_t kv0, int64_t kv1, int64_t head_dim, int64_t group, float* scores) {
  // The item's kv heads of a token: one contiguous run.
  const int64_t first = kv0 * head_dim;
  const int64_t token_bytes = (kv1 - kv0) * head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t i = 0; i < n; i += 4) {
    for (int64_t j = i + kPrefetchTokens; j < std::min(n, i + kPrefetchTokens + 4); ++j) {
      prefetch_token(k_toks[j] + first, token_bytes);
      prefetch_token(v_toks[j] + first, token_bytes);
    }
    const int count = static_cast<int>(std::min<int64_t>(4, n - i));
    for (int64_t h = kv0; h < kv1; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const int64_t head = h * group + g0;
        const float* qh = q + head * head_dim;
        float* s = scores + head * n;
        switch (std::min<int64_t>(3, group - g0)) {
          case 3: qk_tile_any<3>(qh, k_toks + i, h * head_dim, count, head_dim, s, n, i); break;
          case 2: qk_tile_any<2>(qh, k_toks + i, h * head_dim, count, head_dim, s, n, i); break;
          default: qk_tile_any<1>(qh, k_toks + i, h * head_dim, count, head_dim, s, n, i); break;
        }
      }
    }
  }
}

// acc[h] = sum_i p[h, i] v_i for the query heads h of kv heads kv0 .. kv1 - 1: one pass
// over the partition per (kv head, NG query heads, 32 dims); the first pass prefetches
// those kv heads of each token, the others find them in cache (a partition's V is at most
// 256 tokens).
template <typename cache_t>
void pv_all(const float* p, const cache_t* const* v_toks, int64_t n, int64_t kv0, int64_t kv1,
            int64_t head_dim, int64_t group, float* acc) {
  // The first pass prefetches the item's kv heads of each token (from kv head kv0 on).
  int64_t token_bytes = (kv1 - kv0) * head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t h = kv0; h < kv1; ++h) {
    for (int64_t g0 = 0; g0 < group; g0 += 3, token_bytes = 0) {
      const int64_t head = h * group + g0;
      const float* ph = p + head * n;
      float* a = acc + head * head_dim;
      switch (std::min<int64_t>(3, group - g0)) {
        case 3: pv_heads_any<3>(ph, n, v_toks, h * head_dim, a, head_dim, token_bytes); break;
        case 2: pv_heads_any<2>(ph, n, v_toks, h * head_dim, a, head_dim, token_bytes); break;
        default: pv_heads_any<1>(ph, n, v_toks, h * head_dim, a, head_dim, token_bytes); break;
      }
    }
  }
}
#endif

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

template <typename cache_t>
void decode_item(const Item& it, const float* q /*[H, D] of this seq, pre-scaled*/,
                 const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_table,
                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t group,
                 int64_t q_pos, float soft_cap, const float* slopes, float* scores /*[H, P]*/,
                 float* acc /*[H, D]*/, float* m_out /*[H]*/, float* s_out /*[H]*/) {
  // Query heads h0 .. h1 - 1 (those of kv heads kv0 .. kv1 - 1); the others' rows of
  // scores, acc, m_out and s_out are left alone.
  const int64_t n = it.end - it.begin;
  const int64_t h0 = it.kv0 * group, h1 = it.kv1 * group;
  const int64_t token_stride = num_kv_heads * head_dim;
#if defined(PAGEDLM_TILED)
  const bool tiled = head_dim % 8 == 0;
#else
  const bool tiled = false;
#endif
  int64_t offsets[kMaxPartition];
  token_offsets(it, block_table, block_size, token_stride, offsets);
  const cache_t* k_toks[kMaxPartition];
  const cache_t* v_toks[kMaxPartition];
  for (int64_t i = 0; i < n; ++i) {
    k_toks[i] = k_cache + offsets[i];
    v_toks[i] = v_cache + offsets[i];
  }
  if (tiled) {
#if defined(PAGEDLM_TILED)
    qk_all(q, k_toks, v_toks, n, it.kv0, it.kv1, head_dim, group, scores);
#endif
  } else {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = h0; h < h1; ++h) {
        scores[h * n + i] = dot(q + h * head_dim, k_toks[i] + (h / group) * head_dim, head_dim);
      }
    }
  }
  if (soft_cap > 0.f || slopes != nullptr) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        float s = scores[h * n + i];
        if (soft_cap > 0.f) s = soft_cap * std::tanh(s / soft_cap);
        if (slopes != nullptr) s += slopes[h] * static_cast<float>(it.begin + i - q_pos);
        scores[h * n + i] = s;
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) softmax_numerators(scores + h * n, n, m_out + h, s_out + h);
  if (tiled) {
#if defined(PAGEDLM_TILED)
    pv_all(scores, v_toks, n, it.kv0, it.kv1, head_dim, group, acc);
#endif
    return;
  }
  std::fill(acc + h0 * head_dim, acc + h1 * head_dim, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = h0; h < h1; ++h) {
      axpy(scores[h * n + i], v_toks[i] + (h / group) * head_dim, acc + h * head_dim, head_dim);
    }
  }
}

template <typename cache_t>
void run_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const std::vector<int64_t>& seq_lens, float soft_cap,
         int64_t window, const float* slopes, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  std::vector<int64_t> starts(num_seqs), spans(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) {
    starts[b] = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
    spans[b] = seq_lens[b] - starts[b];
  }
  // Partitions of kMaxPartition tokens from each sequence's first visible key (never a
  // size chosen by the batch: see the header). With fewer than four per thread, each
  // partition's kv heads are split over up to that many items.
  const int64_t part = kMaxPartition;
  int64_t num_parts = 0;
  for (int64_t b = 0; b < num_seqs; ++b) num_parts += (spans[b] + part - 1) / part;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t splits = num_parts >= want ? 1
      : std::min<int64_t>(num_kv_heads, (want + num_parts - 1) / std::max<int64_t>(1, num_parts));
  const int64_t kv_per_item = (num_kv_heads + splits - 1) / splits;
  // Items run sequence by sequence, partition by partition; the partial results of one
  // sequence are consecutive slots for the merge below.
  std::vector<Item> items;
  std::vector<int64_t> first_slot(num_seqs + 1, 0);
  int64_t slots = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    first_slot[b] = slots;
    for (int64_t p = starts[b]; p < seq_lens[b]; p += part, ++slots) {
      for (int64_t kv = 0; kv < num_kv_heads; kv += kv_per_item) {
        items.push_back({b, p, std::min(p + part, seq_lens[b]), slots, kv,
                         std::min(num_kv_heads, kv + kv_per_item)});
      }
    }
  }
  first_slot[num_seqs] = slots;
  const int64_t num_items = static_cast<int64_t>(items.size());

  // The items' partial results [slots, heads, head_dim] and per-head maxima and sums
  // [slots, heads], in memory the calling thread keeps between calls (still in cache).
  static thread_local std::vector<float> partials;
  partials.resize(slots * num_heads * (head_dim + 2));
  float* acc_p = partials.data();
  float* max_p = acc_p + slots * num_heads * head_dim;
  float* sum_p = max_p + slots * num_heads;
  const float* q_p = q.data_ptr<float>();
  const cache_t* k_p = k_cache.data_ptr<cache_t>();
  const cache_t* v_p = v_cache.data_ptr<cache_t>();
  const int64_t* bt_p = block_tables.data_ptr<int64_t>();

  // Threads take items from a shared counter, not an even split of the item list: the
  // items differ in size (a batch's long sequences come first, in full partitions; its
  // short ones last, in one small item each), so halves of the list can differ in work
  // several-fold.
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(num_heads * part);
    for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
      const Item& it = items[i];
      decode_item<cache_t>(it, q_p + it.seq * num_heads * head_dim, k_p, v_p,
                           bt_p + it.seq * max_blocks, block_size, num_kv_heads, head_dim, group,
                           seq_lens[it.seq] - 1, soft_cap, slopes, scores.data(),
                           acc_p + it.slot * num_heads * head_dim, max_p + it.slot * num_heads,
                           sum_p + it.slot * num_heads);
    }
  });

  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / num_heads, h = bh % num_heads;
      const int64_t s0 = first_slot[b], s1 = first_slot[b + 1];
      float* o = out_p + bh * head_dim;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = s0; s < s1; ++s) m = std::max(m, max_p[s * num_heads + h]);
      float denom = 0.f;
      std::fill(o, o + head_dim, 0.f);
      for (int64_t s = s0; s < s1; ++s) {
        const float w = std::exp(max_p[s * num_heads + h] - m);
        denom += w * sum_p[s * num_heads + h];
        const float* a = acc_p + (s * num_heads + h) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / denom;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    }
  });
}

}  // namespace

// (Arguments: paged_attention_cpu.h.)
void paged_decode_into(const torch::Tensor& query, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const std::vector<int64_t>& seq_lens, double soft_cap, int64_t window,
                       const c10::optional<torch::Tensor>& slopes, torch::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat && query.is_contiguous(),
              "query must be a contiguous float32 [num_seqs, num_heads, head_dim] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache must be contiguous, equal-shaped [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous() &&
                  block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int64 [num_seqs, max_blocks]");
  TORCH_CHECK(static_cast<int64_t>(seq_lens.size()) == query.size(0), "one seq_len per sequence");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  for (int64_t len : seq_lens) {
    TORCH_CHECK(len >= 1 && len <= block_tables.size(1) * k_cache.size(1),
                "seq_len ", len, " outside the block table");
  }
  const float* slopes_p = nullptr;
  if (slopes.has_value()) {
    TORCH_CHECK(slopes->scalar_type() == torch::kFloat && slopes->is_contiguous() &&
                    slopes->numel() == query.size(1),
                "ALiBi slopes must be contiguous float32, one per query head");
    slopes_p = slopes->data_ptr<float>();
  }
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == torch::kFloat && out.is_contiguous(),
              "out must be a contiguous float32 tensor shaped as the query");
  const float cap = static_cast<float>(soft_cap);
  const bool known = pagedlm::visit_cache_dtype(k_cache.scalar_type(), [&](auto tag) {
    run_decode<decltype(tag)>(query, k_cache, v_cache, block_tables, seq_lens, cap, window, slopes_p, out);
  });
  TORCH_CHECK(known, "unsupported KV cache dtype ", k_cache.scalar_type());
}

// As paged_decode_into, into a new tensor.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, std::vector<int64_t> seq_lens,
                           double soft_cap, int64_t window, c10::optional<torch::Tensor> slopes) {
  torch::Tensor out = torch::empty_like(query);
  paged_decode_into(query, k_cache, v_cache, block_tables, seq_lens, soft_cap, window, slopes, out);
  return out;
}

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), whose
// library compiles this file beside its own: one library instead of two (csrc/__init__.py
// BUNDLED and LIBRARY_SOURCES).
void bind_paged_attention_cpu(lite_bind::Module& m) {
  m.def<&paged_decode>("paged_decode", "Paged decode attention on CPU");
}
