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
// Those k + 1 rows read the same blocks. Consecutive rows that do (a "run") share their
// items: each 16-token tile of K, then of V, is read and widened to float32 once into L1
// and used by every row of the run, with each row's sums in the same order as alone
// (run_item; 1.02-1.21x for 7-row verifications with cold caches,
// benchmarks/cpu/decode_attention_cold.py --verify-rows 7). With AVX-512 a run's keys are
// transposed instead, 32 at a time, so that its q . k puts keys in lanes and needs no sums
// across lanes, in the same order all the same (qk_keys; 1.07-1.20x more for 16-row runs).
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
#include <type_traits>
#include <utility>
#include <vector>

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

#if defined(PAGEDLM_TILED512)
// Keys in lanes (AVX-512, head_dim % 16 == 0). qk_tile's scores each end in a sum across
// the lanes of a register, and those reductions cost more than the multiply-adds. Here the
// 16 keys of a tile are transposed to [head_dim][16] float32 (each row of it one dim of the
// 16 keys), and q . k is a chain of 16-lane multiply-adds over d, each lane one key's score,
// nothing left to reduce. A score's sum runs over d in four chains (d mod 4), added as
// (c0 + c1) + (c2 + c3): the same operations whatever lane, tile or row computes it, so a
// run's rows (run_item) still get their plain decode's scores bit for bit. A run transposes
// a tile once for all its rows, where qk_tile's reductions were each row's own.
constexpr int64_t kKeyLanes = 16;
constexpr int64_t kKeyTile = 2 * kKeyLanes;  // keys per pass: each broadcast query value serves two
// Rows a run needs for its keys to be transposed: the transposition costs more than the
// lane sums it saves for fewer (2-row runs 0.91-1.00x, 4 rows 1.00-1.15x, 8 rows
// 1.08-1.30x, decode_attention_cold.py --verify-rows R --baseline-rev 5dd5bf8).
constexpr int64_t kKeysInLanesRows = 4;

// kt[d * 16 + t] = (toks[t] + off)[d] as float32, d < head_dim, t < 16; tokens past
// `count` repeat the last (their lanes are never stored).
template <typename cache_t>
inline void transpose_keys(const cache_t* const* toks, int64_t off, int count, int64_t head_dim,
                           float* kt) {
  const cache_t* r[kKeyLanes];
  for (int t = 0; t < kKeyLanes; ++t) r[t] = toks[std::min(t, count - 1)] + off;
  for (int64_t d0 = 0; d0 < head_dim; d0 += kKeyLanes) {
    __m512 x[kKeyLanes];
    for (int t = 0; t < kKeyLanes; ++t) x[t] = load16(r[t] + d0);
    transpose16(x);
    for (int j = 0; j < kKeyLanes; ++j) _mm512_store_ps(kt + (d0 + j) * kKeyLanes, x[j]);
  }
}

// scores[g * n + t] = q_g . k_t for t < count (<= 16 KV), g < NG, from the KV transposed
// tiles of 16 keys at kt, kt + 16 * head_dim, ... (64-byte aligned, as transpose_keys
// writes them), in qk_tile's order (Lanes16): x_j = the chain of multiply-adds over
// d = j, j + 16, j + 32, ..., y_j = x_j + x_{j+8}, score = ((y0 + y1) + (y2 + y3)) +
// ((y4 + y5) + (y6 + y7)), which is what store_scores's lane sums add (to8, then hsum4).
// Each x_j is a register of 16 keys here, and the sums are plain vector additions.
template <int NG, int KV, int M = 0>
inline void qk_keys(const float* q /*[NG, D]*/, const float* kt, int64_t head_dim, int count,
                    float* scores, int64_t n) {
  if constexpr (M > 0) head_dim = M * kKeyLanes;  // known when compiled: loops unrolled
  const int64_t tile = head_dim * kKeyLanes;
  __m512 lo[NG][KV], hi[NG][KV];  // (y0 + y1) + (y2 + y3), then (y4 + y5) + (y6 + y7)
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    __m512 y[NG][KV];  // y_{2i}, then y_{2i} + y_{2i+1}
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      const int j = 2 * i + u;
      __m512 x[2][NG][KV];  // x_j and x_{j+8}
      for (int w = 0; w < 2; ++w)
        for (int g = 0; g < NG; ++g)
          for (int v = 0; v < KV; ++v) x[w][g][v] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += kKeyLanes) {
        for (int w = 0; w < 2; ++w) {
          const int64_t dim = d + j + 8 * w;
          __m512 k[KV];
          for (int v = 0; v < KV; ++v) {
            k[v] = _mm512_load_ps(kt + v * tile + dim * kKeyLanes);
            in_register(k[v]);
          }
          for (int g = 0; g < NG; ++g) {
            __m512 qb = _mm512_set1_ps(q[g * head_dim + dim]);
            if constexpr (KV > 1) in_register(qb);
            for (int v = 0; v < KV; ++v) x[w][g][v] = _mm512_fmadd_ps(qb, k[v], x[w][g][v]);
          }
        }
      }
      for (int g = 0; g < NG; ++g) {
        for (int v = 0; v < KV; ++v) {
          const __m512 yj = _mm512_add_ps(x[0][g][v], x[1][g][v]);
          y[g][v] = u == 0 ? yj : _mm512_add_ps(y[g][v], yj);
        }
      }
    }
    for (int g = 0; g < NG; ++g) {
      for (int v = 0; v < KV; ++v) {
        if (i == 0) lo[g][v] = y[g][v];
        if (i == 1) lo[g][v] = _mm512_add_ps(lo[g][v], y[g][v]);
        if (i == 2) hi[g][v] = y[g][v];
        if (i == 3) hi[g][v] = _mm512_add_ps(hi[g][v], y[g][v]);
      }
    }
  }
  for (int v = 0; v < KV; ++v) {
    const int left = count - v * static_cast<int>(kKeyLanes);
    if (left <= 0) break;
    const __mmask16 keep = left >= kKeyLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int g = 0; g < NG; ++g) {
      _mm512_mask_storeu_ps(scores + g * n + v * kKeyLanes, keep, _mm512_add_ps(lo[g][v], hi[g][v]));
    }
  }
}

// qk_keys for the query heads of kv head h (q and scores as qk_all's), NG <= 3 at a time;
// KV tiles of 16 keys (count <= 16 KV).
template <int KV>
inline void qk_keys_heads(const float* q, const float* kt, int64_t h, int64_t head_dim,
                          int64_t group, int count, float* scores, int64_t n) {
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t head = h * group + g0;
    const float* qh = q + head * head_dim;
    float* s = scores + head * n;
    const int ng = static_cast<int>(std::min<int64_t>(3, group - g0));
    if (head_dim == 64 && ng == 3) {
      qk_keys<3, KV, 4>(qh, kt, head_dim, count, s, n);
      continue;
    }
    switch (ng) {
      case 3: qk_keys<3, KV>(qh, kt, head_dim, count, s, n); break;
      case 2: qk_keys<2, KV>(qh, kt, head_dim, count, s, n); break;
      default: qk_keys<1, KV>(qh, kt, head_dim, count, s, n); break;
    }
  }
}

#endif

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

// One row's attention over the n tokens whose K and V rows (every kv head of a token, one
// contiguous run of the cache's token stride) are k_toks[i] and v_toks[i]: for the query
// heads of kv heads it.kv0 .. it.kv1 - 1, the scores, their softmax numerators and the
// un-normalised weighted sum of V. The other heads' rows of scores, acc, m_out and s_out
// are left alone.
template <typename T>
void attend(const Item& it, int64_t n, const float* q /*[H, D] of this row, pre-scaled*/,
            const T* const* k_toks, const T* const* v_toks, int64_t head_dim, int64_t group,
            int64_t q_pos, float soft_cap, const float* slopes, float* scores /*[H, n]*/,
            float* acc /*[H, D]*/, float* m_out /*[H]*/, float* s_out /*[H]*/) {
  const int64_t h0 = it.kv0 * group, h1 = it.kv1 * group;
#if defined(PAGEDLM_TILED)
  const bool tiled = head_dim % 8 == 0;
#else
  const bool tiled = false;
#endif
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
  cap_and_slope(scores, n, h0, h1, it.begin - q_pos, soft_cap, slopes);
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
void decode_item(const Item& it, const float* q /*[H, D] of this seq, pre-scaled*/,
                 const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_table,
                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t group,
                 int64_t q_pos, float soft_cap, const float* slopes, float* scores /*[H, P]*/,
                 float* acc /*[H, D]*/, float* m_out /*[H]*/, float* s_out /*[H]*/) {
  const int64_t n = it.end - it.begin;
  int64_t offsets[kMaxPartition];
  token_offsets(it, block_table, block_size, num_kv_heads * head_dim, offsets);
  const cache_t* k_toks[kMaxPartition];
  const cache_t* v_toks[kMaxPartition];
  for (int64_t i = 0; i < n; ++i) {
    k_toks[i] = k_cache + offsets[i];
    v_toks[i] = v_cache + offsets[i];
  }
  attend(it, n, q, k_toks, v_toks, head_dim, group, q_pos, soft_cap, slopes, scores, acc, m_out, s_out);
}

#if defined(PAGEDLM_TILED)

// dst[0 : n] = src[0 : n] as float32, each value as the tiles above widen it for a head of
// n values (n % 8 == 0): widening is exact, so a tile reading dst computes what it
// computes reading src.
template <typename cache_t>
inline void widen(const cache_t* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(PAGEDLM_TILED512)
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
#endif
  for (; d < n; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

// qk_tile over a run's widened (float32) tile: the same sums, with each key vector and
// query vector loaded once per step of d (named registers, not arrays, which the
// compiler keeps in memory once they pass through in_register).
template <int NG, typename L>
inline void qk_tile_f32(const float* q, const float* const* toks, int64_t off, int count,
                        int64_t head_dim, float* scores, int64_t n, int64_t i) {
  using V = typename L::V;
  const float* r0 = toks[0] + off;
  const float* r1 = toks[std::min(1, count - 1)] + off;
  const float* r2 = toks[std::min(2, count - 1)] + off;
  const float* r3 = toks[std::min(3, count - 1)] + off;
  V a00 = L::zero(), a01 = L::zero(), a02 = L::zero(), a03 = L::zero();
  V a10 = L::zero(), a11 = L::zero(), a12 = L::zero(), a13 = L::zero();
  V a20 = L::zero(), a21 = L::zero(), a22 = L::zero(), a23 = L::zero();
  for (int64_t d = 0; d < head_dim; d += L::kW) {
    V q0 = L::load(q + d), q1 = q0, q2 = q0;
    in_register(q0);
    if constexpr (NG > 1) { q1 = L::load(q + head_dim + d); in_register(q1); }
    if constexpr (NG > 2) { q2 = L::load(q + 2 * head_dim + d); in_register(q2); }
#define PAGEDLM_KEY(t)                                  \
    {                                                   \
      V k = L::load(r##t + d);                          \
      in_register(k);                                   \
      a0##t = L::fmadd(q0, k, a0##t);                   \
      if constexpr (NG > 1) a1##t = L::fmadd(q1, k, a1##t); \
      if constexpr (NG > 2) a2##t = L::fmadd(q2, k, a2##t); \
    }
    PAGEDLM_KEY(0) PAGEDLM_KEY(1) PAGEDLM_KEY(2) PAGEDLM_KEY(3)
#undef PAGEDLM_KEY
  }
  store_scores<L>(a00, a01, a02, a03, count, scores + i);
  if constexpr (NG > 1) store_scores<L>(a10, a11, a12, a13, count, scores + n + i);
  if constexpr (NG > 2) store_scores<L>(a20, a21, a22, a23, count, scores + 2 * n + i);
}

template <int NG>
inline void qk_tile_f32_any(const float* q, const float* const* toks, int64_t off, int count,
                            int64_t head_dim, float* scores, int64_t n, int64_t i) {
#if defined(PAGEDLM_TILED512)
  if (head_dim % 16 == 0) return qk_tile_f32<NG, Lanes16>(q, toks, off, count, head_dim, scores, n, i);
#endif
  qk_tile_f32<NG, Lanes8>(q, toks, off, count, head_dim, scores, n, i);
}

// acc[g, d0 : d0 + W * CB] (+)= sum_{i < count} p[g * stride + i] * (toks[i] + off)[d0 : ...]
// for g < NG, added to what acc holds unless `first`: pv_tile's sums, a chunk of tokens at
// a time (each lane's chain of multiply-adds runs over the tokens in the same order).
template <int NG, int CB, typename L>
inline void pv_chunk(const float* p, int64_t stride, int64_t count, const float* const* toks,
                     int64_t off, int64_t d0, float* acc, int64_t head_dim, bool first) {
  using V = typename L::V;
  V a[NG][CB];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CB; ++c) a[g][c] = first ? L::zero() : L::load(acc + g * head_dim + d0 + L::kW * c);
  for (int64_t i = 0; i < count; ++i) {
    V pb[NG];
    for (int g = 0; g < NG; ++g) pb[g] = L::set1(p[g * stride + i]);
    const float* row = toks[i] + off + d0;
    for (int c = 0; c < CB; ++c) {
      V v = L::load(row + L::kW * c);
      in_register(v);
      for (int g = 0; g < NG; ++g) a[g][c] = L::fmadd(pb[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CB; ++c) L::store(acc + g * head_dim + d0 + L::kW * c, a[g][c]);
}

template <int NG, typename L>
inline void pv_chunk_heads(const float* p, int64_t stride, int64_t count, const float* const* toks,
                           int64_t off, float* acc, int64_t head_dim, bool first) {
  int64_t d0 = 0;
  for (; d0 + 4 * L::kW <= head_dim; d0 += 4 * L::kW) {
    pv_chunk<NG, 4, L>(p, stride, count, toks, off, d0, acc, head_dim, first);
  }
  switch ((head_dim - d0) / L::kW) {
    case 3: pv_chunk<NG, 3, L>(p, stride, count, toks, off, d0, acc, head_dim, first); break;
    case 2: pv_chunk<NG, 2, L>(p, stride, count, toks, off, d0, acc, head_dim, first); break;
    case 1: pv_chunk<NG, 1, L>(p, stride, count, toks, off, d0, acc, head_dim, first); break;
    default: break;
  }
}

template <int NG>
inline void pv_chunk_any(const float* p, int64_t stride, int64_t count, const float* const* toks,
                         int64_t off, float* acc, int64_t head_dim, bool first) {
#if defined(PAGEDLM_TILED512)
  if (head_dim % 16 == 0) return pv_chunk_heads<NG, Lanes16>(p, stride, count, toks, off, acc, head_dim, first);
#endif
  pv_chunk_heads<NG, Lanes8>(p, stride, count, toks, off, acc, head_dim, first);
}

// Widen tokens [t0, t0 + count) of the item's kv heads into `tile` (token stride as in
// the cache) and point toks[i] at token t0 + i there; fetch the next tile's tokens.
template <typename cache_t>
inline void widen_tile(const cache_t* cache, const int64_t* offsets, int64_t t0, int64_t count,
                       int64_t n, int64_t kv0, int64_t kv1, int64_t head_dim, int64_t token_stride,
                       float* tile, const float** toks) {
  const int64_t bytes = (kv1 - kv0) * head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t j = t0 + kRunTile; j < std::min(n, t0 + 2 * kRunTile); ++j) {
    prefetch_token(cache + offsets[j] + kv0 * head_dim, bytes);
  }
  for (int64_t i = 0; i < count; ++i) {
    const cache_t* src = cache + offsets[t0 + i];
    float* dst = tile + i * token_stride;
    widen(src + kv0 * head_dim, dst + kv0 * head_dim, (kv1 - kv0) * head_dim);
    toks[i] = dst;
  }
}

// A run's partition (rows it.seq .. it.seq_end - 1: a speculative verification's k + 1
// rows). decode_item's work for every row, with the cache read and widened once per
// kRunTile tokens instead of once per row: each tile's K, then V, sits in L1 as float32
// while every row that sees those tokens multiplies it. Each row's scores, softmax and
// sums are decode_item's, in the same order over the same values (widening is exact), so
// its result is the one it gets alone, bit for bit.
template <typename cache_t>
void run_item(const Item& it, const float* q /*[rows, H, D]*/, const cache_t* k_cache,
              const cache_t* v_cache, const int64_t* block_table /*the run's longest row's*/,
              int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t group, const int64_t* seq_lens, const int64_t* first_slot, float soft_cap,
              const float* slopes, float* scores /*[kMaxRunRows, H, P]*/, float* tile,
              float* acc_p, float* max_p, float* sum_p) {
  const int64_t n = it.end - it.begin;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t h0 = it.kv0 * group, h1 = it.kv1 * group;
  int64_t offsets[kMaxPartition];
  token_offsets(it, block_table, block_size, token_stride, offsets);
  const float* toks[kRunTile];
  auto seen = [&](int64_t b) { return std::min(it.end, seq_lens[b]) - it.begin; };  // tokens row b sees
  auto row_scores = [&](int64_t b) { return scores + (b - it.seq) * num_heads * kMaxPartition; };
  auto row_acc = [&](int64_t b) { return acc_p + (first_slot[b] + it.slot) * num_heads * head_dim; };
  // q . k for every row, a tile of keys at a time.
#if defined(PAGEDLM_TILED512)
  const bool keys_in_lanes = head_dim % 16 == 0 && it.seq_end - it.seq >= kKeysInLanesRows;
  if (keys_in_lanes) {  // each tile's keys transposed once for every row
    const int64_t bytes = (it.kv1 - it.kv0) * head_dim * static_cast<int64_t>(sizeof(cache_t));
    const int64_t per_head = kKeyTile * head_dim;  // floats of one kv head's transposed keys
    for (int64_t t0 = 0; t0 < n; t0 += kKeyTile) {
      const int count = static_cast<int>(std::min(kKeyTile, n - t0));
      for (int64_t j = t0 + kKeyTile; j < std::min(n, t0 + 2 * kKeyTile); ++j) {
        prefetch_token(k_cache + offsets[j] + it.kv0 * head_dim, bytes);
      }
      const cache_t* keys[kKeyTile];
      for (int i = 0; i < count; ++i) keys[i] = k_cache + offsets[t0 + i];
      for (int64_t h = it.kv0; h < it.kv1; ++h) {
        float* kt = tile + (h - it.kv0) * per_head;
        transpose_keys(keys, h * head_dim, std::min(count, static_cast<int>(kKeyLanes)), head_dim, kt);
        if (count > kKeyLanes) {
          transpose_keys(keys + kKeyLanes, h * head_dim, count - static_cast<int>(kKeyLanes),
                         head_dim, kt + kKeyLanes * head_dim);
        }
      }
      for (int64_t b = it.seq; b < it.seq_end; ++b) {
        const int64_t c = std::min<int64_t>(count, seen(b) - t0);
        if (c <= 0) continue;
        for (int64_t h = it.kv0; h < it.kv1; ++h) {
          const float* kt = tile + (h - it.kv0) * per_head;
          float* sb = row_scores(b) + t0;
          const float* qb = q + b * num_heads * head_dim;
          if (c > kKeyLanes) {
            qk_keys_heads<2>(qb, kt, h, head_dim, group, static_cast<int>(c), sb, seen(b));
          } else {
            qk_keys_heads<1>(qb, kt, h, head_dim, group, static_cast<int>(c), sb, seen(b));
          }
        }
      }
    }
  }
  for (int64_t t0 = 0; t0 < n && !keys_in_lanes; t0 += kRunTile) {
#else
  for (int64_t t0 = 0; t0 < n; t0 += kRunTile) {
#endif
    const int64_t count = std::min(kRunTile, n - t0);
    widen_tile(k_cache, offsets, t0, count, n, it.kv0, it.kv1, head_dim, token_stride, tile, toks);
    for (int64_t b = it.seq; b < it.seq_end; ++b) {
      const int64_t nb = seen(b);
      const int64_t c = std::min(count, nb - t0);
      const float* qb = q + b * num_heads * head_dim;
      float* sb = row_scores(b);
      for (int64_t i = 0; i < c; i += 4) {
        const int cnt = static_cast<int>(std::min<int64_t>(4, c - i));
        for (int64_t h = it.kv0; h < it.kv1; ++h) {
          for (int64_t g0 = 0; g0 < group; g0 += 3) {
            const int64_t head = h * group + g0;
            const float* qh = qb + head * head_dim;
            float* s = sb + head * nb;
            switch (std::min<int64_t>(3, group - g0)) {
              case 3: qk_tile_f32_any<3>(qh, toks + i, h * head_dim, cnt, head_dim, s, nb, t0 + i); break;
              case 2: qk_tile_f32_any<2>(qh, toks + i, h * head_dim, cnt, head_dim, s, nb, t0 + i); break;
              default: qk_tile_f32_any<1>(qh, toks + i, h * head_dim, cnt, head_dim, s, nb, t0 + i); break;
            }
          }
        }
      }
    }
  }
  // Each row's softmax over the tokens it sees (a row shorter than the partition's start
  // has no part in it), while the first values arrive.
  const int64_t bytes = (it.kv1 - it.kv0) * head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t j = 0; j < std::min(n, kRunTile); ++j) prefetch_token(v_cache + offsets[j] + it.kv0 * head_dim, bytes);
  for (int64_t b = it.seq; b < it.seq_end; ++b) {
    const int64_t nb = seen(b);
    if (nb <= 0) continue;
    float* sb = row_scores(b);
    cap_and_slope(sb, nb, h0, h1, it.begin - (seq_lens[b] - 1), soft_cap, slopes);
    const int64_t slot = first_slot[b] + it.slot;
    for (int64_t h = h0; h < h1; ++h) {
      softmax_numerators(sb + h * nb, nb, max_p + slot * num_heads + h, sum_p + slot * num_heads + h);
    }
  }
  // p . V for every row, a tile of values at a time, each row's sums kept in its slot.
  for (int64_t t0 = 0; t0 < n; t0 += kRunTile) {
    const int64_t count = std::min(kRunTile, n - t0);
    widen_tile(v_cache, offsets, t0, count, n, it.kv0, it.kv1, head_dim, token_stride, tile, toks);
    for (int64_t b = it.seq; b < it.seq_end; ++b) {
      const int64_t nb = seen(b);
      const int64_t c = std::min(count, nb - t0);
      if (c <= 0) continue;
      const float* sb = row_scores(b);
      float* ab = row_acc(b);
      for (int64_t h = it.kv0; h < it.kv1; ++h) {
        for (int64_t g0 = 0; g0 < group; g0 += 3) {
          const int64_t head = h * group + g0;
          const float* ph = sb + head * nb + t0;
          float* a = ab + head * head_dim;
          switch (std::min<int64_t>(3, group - g0)) {
            case 3: pv_chunk_any<3>(ph, nb, c, toks, h * head_dim, a, head_dim, t0 == 0); break;
            case 2: pv_chunk_any<2>(ph, nb, c, toks, h * head_dim, a, head_dim, t0 == 0); break;
            default: pv_chunk_any<1>(ph, nb, c, toks, h * head_dim, a, head_dim, t0 == 0); break;
          }
        }
      }
    }
  }
}
#endif

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
  // Runs: consecutive rows that see the same blocks from the same first key, their lengths
  // monotonic (a speculative verification's k + 1 rows, which the model runner orders
  // longest first), computed together by run_item. Adjacent rows agree on the blocks of
  // the shorter, so every row agrees with the run's longest on its own. Which rows form a
  // run changes no row's result, only the work: a run of one is a plain row. Float32
  // caches have nothing to widen, so their rows stay apart, as do heads without the tiled
  // kernels (head_dim % 8 != 0).
  const int64_t* bt_p = block_tables.data_ptr<int64_t>();
#if defined(PAGEDLM_TILED)
  const bool runs_on = !std::is_same_v<cache_t, float> && head_dim % 8 == 0;
#else
  const bool runs_on = false;
#endif
  auto same_blocks = [&](int64_t a, int64_t b) {
    const int64_t* ta = bt_p + a * max_blocks;
    const int64_t* tb = bt_p + b * max_blocks;
    const int64_t shorter = std::min(seq_lens[a], seq_lens[b]);
    return std::equal(ta, ta + (shorter + block_size - 1) / block_size, tb);
  };
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first row, one past the last)
  for (int64_t b = 0; b < num_seqs;) {
    int64_t e = b + 1;
    int direction = 0;  // +1 lengths growing, -1 shrinking, 0 not known yet
    while (runs_on && e < num_seqs && e - b < kMaxRunRows && starts[e] == starts[e - 1] &&
           same_blocks(e - 1, e)) {
      const int step = seq_lens[e] > seq_lens[e - 1] ? 1 : seq_lens[e] < seq_lens[e - 1] ? -1 : 0;
      if (step != 0 && direction != 0 && step != direction) break;
      if (step != 0) direction = step;
      ++e;
    }
    runs.emplace_back(b, e);
    b = e;
  }
  auto longest_of = [&](int64_t b, int64_t e) {
    int64_t best = b;
    for (int64_t r = b + 1; r < e; ++r) best = seq_lens[r] > seq_lens[best] ? r : best;
    return best;
  };
  // Partitions of kMaxPartition tokens from each sequence's first visible key (never a
  // size chosen by the batch: see the header); a run's partitions are its longest row's.
  // With fewer than four per thread, each partition's kv heads are split over up to that
  // many items, and then a run's rows.
  const int64_t part = kMaxPartition;
  int64_t num_parts = 0;
  for (const auto& [b, e] : runs) num_parts += (spans[longest_of(b, e)] + part - 1) / part;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t splits = num_parts >= want ? 1
      : std::min<int64_t>(num_kv_heads, (want + num_parts - 1) / std::max<int64_t>(1, num_parts));
  const int64_t kv_per_item = (num_kv_heads + splits - 1) / splits;
  const int64_t per_part = num_parts * ((num_kv_heads + kv_per_item - 1) / kv_per_item);
  const int64_t row_splits = per_part >= want ? 1 : (want + per_part - 1) / std::max<int64_t>(1, per_part);
  // Each row's partial results are consecutive slots for the merge below, partition by
  // partition.
  std::vector<int64_t> first_slot(num_seqs + 1, 0);
  int64_t slots = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    first_slot[b] = slots;
    slots += (spans[b] + part - 1) / part;
  }
  first_slot[num_seqs] = slots;
  // Items run by run, partition by partition. A partition's rows are those long enough to
  // reach it: consecutive, the lengths being monotonic.
  std::vector<Item> items;
  bool any_run = false;
  for (const auto& [b, e] : runs) {
    const int64_t longest = longest_of(b, e);
    int64_t j = 0;
    for (int64_t p = starts[longest]; p < seq_lens[longest]; p += part, ++j) {
      int64_t r0 = b, r1 = e;
      while (seq_lens[r0] <= p) ++r0;
      while (seq_lens[r1 - 1] <= p) --r1;
      const int64_t chunk = (r1 - r0 + row_splits - 1) / row_splits;
      for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
        const int64_t c1 = std::min(r1, c0 + chunk);
        const int64_t top = longest_of(c0, c1);
        any_run = any_run || c1 - c0 > 1;
        for (int64_t kv = 0; kv < num_kv_heads; kv += kv_per_item) {
          items.push_back({c0, p, std::min(p + part, seq_lens[top]), j, kv,
                           std::min(num_kv_heads, kv + kv_per_item), c1, top});
        }
      }
    }
  }
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

  // Threads take items from a shared counter, not an even split of the item list: the
  // items differ in size (a batch's long sequences come first, in full partitions; its
  // short ones last, in one small item each), so halves of the list can differ in work
  // several-fold.
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(num_heads * part);
    // A run's rows' scores and its widened tile of tokens, kept by the thread between calls.
    static thread_local std::vector<float> run_space;
    float* run_tile = nullptr;  // 64-byte aligned (the transposed keys' aligned loads and stores)
    if (any_run) {
      run_space.resize((kMaxRunRows * num_heads * part) + kRunTileFloats * num_kv_heads * head_dim + 16);
      const auto p = reinterpret_cast<uintptr_t>(run_space.data() + kMaxRunRows * num_heads * part);
      run_tile = reinterpret_cast<float*>((p + 63) & ~static_cast<uintptr_t>(63));
    }
    for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
      const Item& it = items[i];
#if defined(PAGEDLM_TILED)
      if (it.seq_end - it.seq > 1) {
        run_item<cache_t>(it, q_p, k_p, v_p, bt_p + it.longest * max_blocks, block_size,
                          num_heads, num_kv_heads, head_dim, group, seq_lens.data(),
                          first_slot.data(), soft_cap, slopes, run_space.data(),
                          run_tile, acc_p, max_p, sum_p);
        continue;
      }
#endif
      const int64_t slot = first_slot[it.seq] + it.slot;
      decode_item<cache_t>(it, q_p + it.seq * num_heads * head_dim, k_p, v_p,
                           bt_p + it.seq * max_blocks, block_size, num_kv_heads, head_dim, group,
                           seq_lens[it.seq] - 1, soft_cap, slopes, scores.data(),
                           acc_p + slot * num_heads * head_dim, max_p + slot * num_heads,
                           sum_p + slot * num_heads);
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
