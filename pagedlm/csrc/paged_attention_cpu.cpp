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
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "paged_attention_runs.h"
#include "paged_attention_tiles.h"

namespace {

using namespace pagedlm_vec;

#if defined(PAGEDLM_TILED)
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
