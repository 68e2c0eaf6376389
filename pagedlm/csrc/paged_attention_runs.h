// A speculative verification's k + 1 rows, which read the same blocks, computed together
// (run_item, called by paged_attention_cpu.cpp's run_decode, the only file that includes
// this): each tile of K and V read once for every row, its keys transposed into lanes
// for four rows or more.
#pragma once
#include "paged_attention_tiles.h"

namespace {

using namespace pagedlm_vec;

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

}  // namespace
