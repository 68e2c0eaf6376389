// Paged decode attention for CPU: one query token per sequence, K/V read straight from
// the cache blocks (no gathered copy of the context), split over the context so that a
// batch of one long sequence still keeps every core busy.
//
// Cache layout (one layer):  [num_blocks, block_size, num_kv_heads, head_dim]
// Token t of sequence b lives in block block_tables[b, t / block_size], row t % block_size.
//
// Work item = (sequence, kv head, partition of <= kPartition context tokens). Each item
// computes, for the `group` query heads that share its kv head, the partition's softmax
// maximum, sum of exponentials and un-normalised weighted sum of V; a second pass merges
// the partitions of each (sequence, kv head):
//
//   out = sum_p exp(m_p - m) * acc_p / sum_p exp(m_p - m) * s_p,   m = max_p m_p
//
// Score of query head h (= kv_head * group + g) against key t, query at position
// q = seq_len - 1 (the same maths as attention/reference.py):
//   s = (q_h . k_t) * scale;  s = cap * tanh(s / cap) if cap > 0;  s += slope_h * (t - q);
//   visible iff t <= q and (window <= 0 or q - t < window).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
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

constexpr int64_t kPartition = 256;

struct Item {
  int64_t seq;
  int64_t kv_head;
  int64_t begin;  // first context token of the partition
  int64_t end;    // one past the last
  int64_t slot;   // index of this item's partial results
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

// Rows ahead of the one being read that are fetched into cache. A sequence's blocks lie
// anywhere in the cache, so the hardware prefetcher loses the stream at every block edge;
// the row pointers are known in advance, so the loops ask for them explicitly.
constexpr int64_t kPrefetchRows = 32;

// What to prefetch for a row: the whole token (every kv head: a contiguous run of
// num_kv_heads * head_dim values), so the items of the other kv heads of this sequence and
// partition, which run right after on the same thread, find it in cache.
struct Span {
  int64_t back;  // values from the row's start back to its token's start
  int64_t len;   // values in the token
};

template <typename cache_t>
inline void prefetch_row(const cache_t* row, Span span) {
  const char* p = reinterpret_cast<const char*>(row - span.back);
  for (int64_t off = 0; off < span.len * static_cast<int64_t>(sizeof(cache_t)); off += 64) {
    _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

// scores[g * n + i + t] = q_g . row_t for t < count (<= 4) and g < NG.
template <int NG, typename cache_t>
inline void qk_tile(const float* q /*[NG, D]*/, const cache_t* const* rows, int count,
                    int64_t head_dim, float* scores, int64_t n, int64_t i) {
  const cache_t* r[4];
  for (int t = 0; t < 4; ++t) r[t] = rows[std::min(t, count - 1)];  // pad with the last row
  __m256 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < 4; ++t) acc[g][t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    __m256 qv[NG];
    for (int g = 0; g < NG; ++g) qv[g] = _mm256_loadu_ps(q + g * head_dim + d);
    for (int t = 0; t < 4; ++t) {
      const __m256 kv = load8(r[t] + d);
      for (int g = 0; g < NG; ++g) acc[g][t] = _mm256_fmadd_ps(qv[g], kv, acc[g][t]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    alignas(16) float out[4];
    _mm_store_ps(out, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    for (int t = 0; t < count; ++t) scores[g * n + i + t] = out[t];
  }
}

// acc[g, d0 : d0 + 8 * CB] = sum_i p[g * n + i] * row_i[d0 : d0 + 8 * CB] for g < NG.
template <int NG, int CB, typename cache_t>
inline void pv_tile(const float* p, int64_t n, const cache_t* const* rows, int64_t d0,
                    float* acc /*[NG, D]*/, int64_t head_dim, Span span) {
  __m256 a[NG][CB];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CB; ++c) a[g][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (d0 == 0 && i + kPrefetchRows < n) prefetch_row(rows[i + kPrefetchRows], span);
    __m256 pb[NG];
    for (int g = 0; g < NG; ++g) pb[g] = _mm256_set1_ps(p[g * n + i]);
    for (int c = 0; c < CB; ++c) {
      const __m256 v = load8(rows[i] + d0 + 8 * c);
      for (int g = 0; g < NG; ++g) a[g][c] = _mm256_fmadd_ps(pb[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < CB; ++c) _mm256_storeu_ps(acc + g * head_dim + d0 + 8 * c, a[g][c]);
}

template <int NG, typename cache_t>
inline void qk_heads(const float* q, const cache_t* const* rows, int64_t n, int64_t head_dim,
                     float* scores, Span span) {
  for (int64_t i = 0; i < n; i += 4) {
    for (int64_t j = i + kPrefetchRows; j < std::min(n, i + kPrefetchRows + 4); ++j) {
      prefetch_row(rows[j], span);
    }
    qk_tile<NG>(q, rows + i, static_cast<int>(std::min<int64_t>(4, n - i)), head_dim, scores, n, i);
  }
}

template <int NG, typename cache_t>
inline void pv_heads(const float* p, int64_t n, const cache_t* const* rows, float* acc,
                     int64_t head_dim, Span span) {
  int64_t d0 = 0;
  for (; d0 + 32 <= head_dim; d0 += 32) pv_tile<NG, 4>(p, n, rows, d0, acc, head_dim, span);
  switch ((head_dim - d0) / 8) {
    case 3: pv_tile<NG, 3>(p, n, rows, d0, acc, head_dim, span); break;
    case 2: pv_tile<NG, 2>(p, n, rows, d0, acc, head_dim, span); break;
    case 1: pv_tile<NG, 1>(p, n, rows, d0, acc, head_dim, span); break;
    default: break;
  }
}

// Every query head of the group, NG <= 3 at a time.
template <typename cache_t>
void qk_group(const float* qg, const cache_t* const* rows, int64_t n, int64_t head_dim,
              int64_t group, float* scores, Span span) {
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const float* q = qg + g0 * head_dim;
    float* s = scores + g0 * n;
    switch (std::min<int64_t>(3, group - g0)) {
      case 3: qk_heads<3>(q, rows, n, head_dim, s, span); break;
      case 2: qk_heads<2>(q, rows, n, head_dim, s, span); break;
      default: qk_heads<1>(q, rows, n, head_dim, s, span); break;
    }
  }
}

template <typename cache_t>
void pv_group(const float* scores, const cache_t* const* rows, int64_t n, int64_t head_dim,
              int64_t group, float* acc, Span span) {
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const float* p = scores + g0 * n;
    float* a = acc + g0 * head_dim;
    switch (std::min<int64_t>(3, group - g0)) {
      case 3: pv_heads<3>(p, n, rows, a, head_dim, span); break;
      case 2: pv_heads<2>(p, n, rows, a, head_dim, span); break;
      default: pv_heads<1>(p, n, rows, a, head_dim, span); break;
    }
  }
}
#endif

// Calls f(i, row) for the partition's tokens in order, i = 0..n-1, row = the token's
// head_dim values of kv head `kv_head`: one block-table lookup per block, not per token.
template <typename cache_t, typename F>
inline void for_each_row(const Item& it, const cache_t* cache, const int64_t* block_table,
                         int64_t block_size, int64_t token_stride, int64_t head_offset, F&& f) {
  int64_t t = it.begin;
  while (t < it.end) {
    const int64_t block = block_table[t / block_size];
    const int64_t first = t % block_size;
    const int64_t rows = std::min(block_size - first, it.end - t);
    const cache_t* base = cache + (block * block_size + first) * token_stride + head_offset;
    for (int64_t r = 0; r < rows; ++r) f(t - it.begin + r, base + r * token_stride);
    t += rows;
  }
}

template <typename cache_t>
void decode_item(const Item& it, const float* q /*[H, D] of this seq, pre-scaled*/,
                 const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_table,
                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t group,
                 int64_t q_pos, float soft_cap, const float* slopes, float* scores /*[G, P]*/,
                 float* acc /*[G, D]*/, float* m_out /*[G]*/, float* s_out /*[G]*/) {
  const int64_t n = it.end - it.begin;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t head_offset = it.kv_head * head_dim;
  const float* qg = q + it.kv_head * group * head_dim;  // the group's query heads, [G, D]

#if defined(PAGEDLM_TILED)
  const bool tiled = head_dim % 8 == 0;
#else
  const bool tiled = false;
#endif
  const cache_t* k_rows[kPartition];
  const cache_t* v_rows[kPartition];
  if (tiled) {
    for_each_row(it, k_cache, block_table, block_size, token_stride, head_offset,
                 [&](int64_t i, const cache_t* k) { k_rows[i] = k; });
    for_each_row(it, v_cache, block_table, block_size, token_stride, head_offset,
                 [&](int64_t i, const cache_t* v) { v_rows[i] = v; });
#if defined(PAGEDLM_TILED)
    qk_group(qg, k_rows, n, head_dim, group, scores, Span{head_offset, token_stride});
#endif
  } else {
    for_each_row(it, k_cache, block_table, block_size, token_stride, head_offset,
                 [&](int64_t i, const cache_t* k) {
                   for (int64_t g = 0; g < group; ++g) scores[g * n + i] = dot(qg + g * head_dim, k, head_dim);
                 });
  }
  if (soft_cap > 0.f || slopes != nullptr) {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < n; ++i) {
        float s = scores[g * n + i];
        if (soft_cap > 0.f) s = soft_cap * std::tanh(s / soft_cap);
        if (slopes != nullptr) s += slopes[it.kv_head * group + g] * static_cast<float>(it.begin + i - q_pos);
        scores[g * n + i] = s;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = exp_approx(s[i] - m);
      sum += s[i];
    }
    m_out[g] = m;
    s_out[g] = sum;
  }
  if (tiled) {
#if defined(PAGEDLM_TILED)
    pv_group(scores, v_rows, n, head_dim, group, acc, Span{head_offset, token_stride});
#endif
    return;
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for_each_row(it, v_cache, block_table, block_size, token_stride, head_offset,
               [&](int64_t i, const cache_t* v) {
                 for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + i], v, acc + g * head_dim, head_dim);
               });
}

template <typename cache_t>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const std::vector<int64_t>& seq_lens, float soft_cap,
         int64_t window, const float* slopes, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  std::vector<Item> items;
  std::vector<int64_t> first_slot(num_seqs * num_kv_heads + 1, 0);
  int64_t slot = 0;
  // Items run sequence by sequence, partition by partition, kv head by kv head: the kv
  // heads of one token are adjacent in the cache, so consecutive items (one thread's
  // share of them) read one contiguous stream. The partial results of each (sequence,
  // kv head) stay consecutive slots for the merge below.
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t len = seq_lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t num_parts = (len - start + kPartition - 1) / kPartition;
    for (int64_t h = 0; h < num_kv_heads; ++h) first_slot[b * num_kv_heads + h] = slot + h * num_parts;
    for (int64_t part = 0; part < num_parts; ++part) {
      const int64_t p = start + part * kPartition;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        items.push_back({b, h, p, std::min(p + kPartition, len), slot + h * num_parts + part});
      }
    }
    slot += num_kv_heads * num_parts;
  }
  first_slot[num_seqs * num_kv_heads] = slot;

  auto opts = torch::TensorOptions().dtype(torch::kFloat);
  torch::Tensor acc = torch::empty({slot, group, head_dim}, opts);
  torch::Tensor maxes = torch::empty({slot, group}, opts);
  torch::Tensor sums = torch::empty({slot, group}, opts);
  float* acc_p = acc.data_ptr<float>();
  float* max_p = maxes.data_ptr<float>();
  float* sum_p = sums.data_ptr<float>();
  const float* q_p = q.data_ptr<float>();
  const cache_t* k_p = k_cache.data_ptr<cache_t>();
  const cache_t* v_p = v_cache.data_ptr<cache_t>();
  const int64_t* bt_p = block_tables.data_ptr<int64_t>();

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * kPartition);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      decode_item<cache_t>(it, q_p + it.seq * num_heads * head_dim, k_p, v_p,
                           bt_p + it.seq * max_blocks, block_size, num_kv_heads, head_dim, group,
                           seq_lens[it.seq] - 1, soft_cap, slopes, scores.data(),
                           acc_p + it.slot * group * head_dim, max_p + it.slot * group,
                           sum_p + it.slot * group);
    }
  });

  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads;
      const int64_t s0 = first_slot[bh], s1 = first_slot[bh + 1];
      for (int64_t g = 0; g < group; ++g) {
        float* o = out_p + (b * num_heads + h * group + g) * head_dim;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = s0; s < s1; ++s) m = std::max(m, max_p[s * group + g]);
        float denom = 0.f;
        std::fill(o, o + head_dim, 0.f);
        for (int64_t s = s0; s < s1; ++s) {
          const float w = std::exp(max_p[s * group + g] - m);
          denom += w * sum_p[s * group + g];
          const float* a = acc_p + (s * group + g) * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / denom;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
      }
    }
  });
}

}  // namespace

// query [num_seqs, num_heads, head_dim] float32 contiguous, already multiplied by the
// softmax scale; caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
// block_tables [num_seqs, max_blocks] int64; seq_lens on the host. Returns float32
// [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, std::vector<int64_t> seq_lens,
                           double soft_cap, int64_t window, c10::optional<torch::Tensor> slopes) {
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
  torch::Tensor slopes_f;
  if (slopes.has_value()) {
    slopes_f = slopes->to(torch::kFloat).contiguous();
    TORCH_CHECK(slopes_f.numel() == query.size(1), "one ALiBi slope per query head");
    slopes_p = slopes_f.data_ptr<float>();
  }
  torch::Tensor out = torch::empty_like(query);
  const float cap = static_cast<float>(soft_cap);
  switch (k_cache.scalar_type()) {
    case torch::kFloat:
      run<float>(query, k_cache, v_cache, block_tables, seq_lens, cap, window, slopes_p, out);
      break;
    case torch::kBFloat16:
      run<at::BFloat16>(query, k_cache, v_cache, block_tables, seq_lens, cap, window, slopes_p, out);
      break;
    case torch::kHalf:
      run<at::Half>(query, k_cache, v_cache, block_tables, seq_lens, cap, window, slopes_p, out);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention on CPU");
}
