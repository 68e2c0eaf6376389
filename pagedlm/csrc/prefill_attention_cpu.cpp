// Causal prefill attention for CPU over every prefill (or prefill chunk) of a step in one
// parallel region, K/V read from the paged cache (the step's own tokens are already
// written there, so a prefix from the cache and the new tokens are read alike).
//
// Cache layout (one layer): [num_blocks, block_size, num_kv_heads, head_dim], as in
// paged_attention_cpu.cpp. Query i of sequence r sits at position q_first + i,
// q_first = seq_len - q_len, and sees key j iff j <= q_first + i and (window <= 0 or
// q_first + i - j < window); score = (q . k_j) * scale (the maths of attention/reference.py).
//
// Work item = (sequence, kv head, block of queries): its R rows are the `group` query
// heads of the kv head times the block's queries (row = g * QB + i), so one pass over a
// K/V row serves every query head that shares it. An item walks its visible keys in
// chunks of kChunk with the online softmax (running maximum m and sum l per row):
//
//   S[key, row] = k_key . q_row           (Q transposed once: a key's value broadcast
//                                           times R/W rows of q per multiply-add)
//   m' = max(m, max_key S);  P = exp(S - m');  l = l exp(m - m') + sum_key P
//   O[row, :] = O[row, :] exp(m - m') + sum_key P[key, row] v_key
//
// and writes O / l. Both products are register tiles of broadcast-times-vector FMAs,
// W = 16 lanes with AVX-512 and 8 without (GCC vector extensions). Items run longest first
// and are handed out one at a time, so the threads finish together although causal items
// differ in length: torch's SDPA takes one call per sequence, each split on its own.
//
// The vectors and register tiles: prefill_attention_tiles.h; this file walks an item's
// chunks with the online softmax and hands the items to the threads.

#include "prefill_attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "prefill_attention_tiles.h"

namespace {

struct Item {
  int64_t seq, kv_head, q_begin, q_end;  // queries [q_begin, q_end) of the sequence
  int64_t cost;                           // visible (query head, key) pairs, for ordering
};

// Per-thread scratch of one item.
struct Scratch {
  std::vector<float> qt;   // [D, R] queries transposed, scaled
  std::vector<float> k, v; // [kChunk, D] a chunk's K and V rows as float32
  std::vector<float> s;    // [kChunk, R] scores, then probabilities
  std::vector<float> o;    // [R, D] running output
  std::vector<float> m, l; // [R] running maximum and sum
  std::vector<float> corr; // [R] this chunk's rescaling of o and l
  std::vector<int32_t> qpos, lo;  // [R] a row's query position and first visible key
};

template <typename cache_t>
void run_item(const Item& it, const float* q, int64_t q_row0 /*token of the sequence's query 0*/,
              int64_t q_first, const cache_t* k_cache, const cache_t* v_cache,
              const int64_t* block_table, int64_t block_size, int64_t num_kv_heads, int64_t group,
              int64_t D, int64_t QB, int64_t R, float scale, int64_t window, float* out,
              Scratch& w) {
  const int64_t num_heads = num_kv_heads * group;
  const int64_t nq = it.q_end - it.q_begin;
  // Rows: row = g * QB + i (query head h * group + g, query q_begin + i); the padding rows
  // (i >= nq, row >= group * QB) repeat the block's last query and are not written out.
  int32_t pos_max = 0, lo_min = std::numeric_limits<int32_t>::max();
  int32_t pos_min = std::numeric_limits<int32_t>::max(), lo_max = 0;
  for (int64_t row = 0; row < R; ++row) {
    const int64_t i = std::min(row % QB, nq - 1);
    const int64_t pos = q_first + it.q_begin + i;
    w.qpos[row] = static_cast<int32_t>(pos);
    w.lo[row] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
    pos_max = std::max(pos_max, w.qpos[row]);
    pos_min = std::min(pos_min, w.qpos[row]);
    lo_min = std::min(lo_min, w.lo[row]);
    lo_max = std::max(lo_max, w.lo[row]);
  }
  // Q^T, scaled: a row's query (null for the padding rows, whose qt stays 0).
  auto row_query = [&](int64_t row) -> const float* {
    if (row / QB >= group || row % QB >= nq) return nullptr;
    return q + ((q_row0 + it.q_begin + row % QB) * num_heads + it.kv_head * group + row / QB) * D;
  };
#if defined(__AVX512F__)
  // 16 rows x 16 dims at a time, transposed in registers (R and D are multiples of 16):
  // a scalar store per value, each to another cache line, had cost a tenth of the kernel.
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const float* src[16];
    for (int j = 0; j < 16; ++j) src[j] = row_query(r0 + j);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 x[16];
      for (int j = 0; j < 16; ++j) {
        x[j] = src[j] ? _mm512_mul_ps(_mm512_loadu_ps(src[j] + d0), vscale) : _mm512_setzero_ps();
      }
      pagedlm_vec::transpose16(x);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(w.qt.data() + (d0 + j) * R + r0, x[j]);
    }
  }
#else
  std::fill(w.qt.begin(), w.qt.end(), 0.f);
  for (int64_t row = 0; row < R; ++row) {
    if (const float* qr = row_query(row)) {
      for (int64_t d = 0; d < D; ++d) w.qt[d * R + row] = qr[d] * scale;
    }
  }
#endif
  std::fill(w.o.begin(), w.o.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::max());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const int64_t token_stride = num_kv_heads * D;
  const int64_t RVs = R / kW;
  float* corr_row = w.corr.data();  // per row: exp(m_old - m_new) of the current chunk
  for (int64_t c0 = lo_min; c0 <= pos_max; c0 += kChunk) {
    const int64_t keys = std::min<int64_t>(kChunk, pos_max + 1 - c0);
    const int64_t padded = (keys + kKeyTile - 1) / kKeyTile * kKeyTile;
    // The block of key c0 + t and its row there, stepped along (no division per key).
    int64_t blk = c0 / block_size, in_blk = c0 % block_size;
    for (int64_t t = 0; t < padded; ++t) {
      float* kd = w.k.data() + t * D;
      float* vd = w.v.data() + t * D;
      if (t >= keys) {
        std::fill(kd, kd + D, 0.f);
        std::fill(vd, vd + D, 0.f);
        continue;
      }
      const int64_t off = (block_table[blk] * block_size + in_blk) * token_stride + it.kv_head * D;
      if (++in_blk == block_size) in_blk = 0, ++blk;
      to_float(k_cache + off, kd, D);
      to_float(v_cache + off, vd, D);
    }
    for (int64_t key0 = 0; key0 < padded; key0 += kKeyTile) {
      int64_t rv = 0;
      for (; rv + kRowVecTile <= RVs; rv += kRowVecTile) qk_tile<kRowVecTile>(w.k.data(), key0, w.qt.data(), R, D, w.s.data(), rv);
      for (; rv < RVs; ++rv) qk_tile<1>(w.k.data(), key0, w.qt.data(), R, D, w.s.data(), rv);
    }
    // Mask, chunk maximum, online-softmax update, probabilities in place of the scores.
    // A chunk that every row sees whole (all but the diagonal's and a window's edge) needs
    // no mask, and its maximum runs in four independent chains instead of one: the same
    // maximum, the same probabilities and sums.
    const bool whole = c0 >= lo_max && c0 + keys - 1 <= pos_min;
    for (int64_t rv = 0; rv < RVs; ++rv) {
      vi qp, lo;
      std::memcpy(&qp, w.qpos.data() + rv * kW, sizeof(vi));
      std::memcpy(&lo, w.lo.data() + rv * kW, sizeof(vi));
      auto visible = [&](int64_t t) {  // lanes whose row sees key c0 + t
        const vi kp = vi{} + static_cast<int32_t>(c0 + t);
        return (kp <= qp) & (kp >= lo);
      };
      const float* srv = w.s.data() + rv * kW;
      const vf m_old = load(w.m.data() + rv * kW);
      vf mx[4] = {m_old, m_old, m_old, m_old};
      int64_t t = 0;
      for (; whole && t + 4 <= keys; t += 4) {
        for (int j = 0; j < 4; ++j) {
          const vf sv = load(srv + (t + j) * R);
          mx[j] = sv > mx[j] ? sv : mx[j];
        }
      }
      for (; t < keys; ++t) {
        const vf sv = load(srv + t * R);
        mx[0] = (whole || visible(t)) && sv > mx[0] ? sv : mx[0];
      }
      mx[0] = mx[1] > mx[0] ? mx[1] : mx[0];
      mx[2] = mx[3] > mx[2] ? mx[3] : mx[2];
      const vf m_new = mx[2] > mx[0] ? mx[2] : mx[0];
      const vf c = exp_vec(m_old - m_new);
      vf sum = load(w.l.data() + rv * kW) * c;
      for (t = 0; t < padded; ++t) {
        float* sp = w.s.data() + t * R + rv * kW;
        vf p = vf{};
        if (t < keys) {
          p = exp_vec(load(sp) - m_new);
          if (!whole) p = visible(t) ? p : vf{};
        }
        store(sp, p);
        sum += p;
      }
      store(w.m.data() + rv * kW, m_new);
      store(w.l.data() + rv * kW, sum);
      store(corr_row + rv * kW, c);
    }
    int64_t row = 0;
    for (; row + kRowTile <= R; row += kRowTile) pv_rows<kRowTile>(w.s.data(), w.v.data(), padded, R, D, corr_row, w.o.data(), row);
    for (; row < R; ++row) pv_rows<1>(w.s.data(), w.v.data(), padded, R, D, corr_row, w.o.data(), row);
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t row = g * QB + i;
      const float inv = 1.f / w.l[row];
      float* dst = out + ((q_row0 + it.q_begin + i) * num_heads + it.kv_head * group + g) * D;
      const float* src = w.o.data() + row * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
    }
  }
}

template <typename cache_t>
void run_prefill(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& block_tables, const std::vector<int64_t>& query_start,
                 const std::vector<int64_t>& seq_lens, double scale, int64_t window,
                 torch::Tensor& out) {
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  // Rows per item: a multiple of the vector width and of the PV row tile near kRowsPerItem.
  const int64_t unit = std::lcm<int64_t>(kW, kRowTile);
  const int64_t R = std::max<int64_t>(1, (std::max<int64_t>(kRowsPerItem, group) + unit - 1) / unit) * unit;
  const int64_t QB = std::max<int64_t>(1, R / group);
  const int64_t num_seqs = static_cast<int64_t>(seq_lens.size());
  std::vector<Item> items;
  for (int64_t r = 0; r < num_seqs; ++r) {
    const int64_t q_len = query_start[r + 1] - query_start[r];
    const int64_t q_first = seq_lens[r] - q_len;
    for (int64_t b = 0; b < q_len; b += QB) {
      const int64_t e = std::min(q_len, b + QB);
      const int64_t last = q_first + e - 1;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, q_first + b - window + 1) : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({r, h, b, e, (last + 1 - first_key) * (e - b)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float* q_p = q.data_ptr<float>();
  const cache_t* k_p = k_cache.data_ptr<cache_t>();
  const cache_t* v_p = v_cache.data_ptr<cache_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  float* out_p = out.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w;
    w.qt.resize(D * R);
    w.k.resize(kChunk * D);
    w.v.resize(kChunk * D);
    w.s.resize(kChunk * R);
    w.o.resize(R * D);
    w.m.resize(R);
    w.l.resize(R);
    w.corr.resize(R);
    w.qpos.resize(R);
    w.lo.resize(R);
    for (int64_t n; (n = next.fetch_add(1)) < n_items;) {
      const Item& it = items[n];
      const int64_t q_len = query_start[it.seq + 1] - query_start[it.seq];
      run_item(it, q_p, query_start[it.seq], seq_lens[it.seq] - q_len, k_p, v_p, bt + it.seq * max_blocks,
               block_size, num_kv_heads, group, D, QB, R, static_cast<float>(scale), window, out_p, w);
    }
  });
}

}  // namespace

// (Arguments: prefill_attention_cpu.h.)
void paged_prefill_into(const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                        const std::vector<int64_t>& query_start, const std::vector<int64_t>& seq_lens,
                        double scale, int64_t window, torch::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_prefill runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [num_tokens, num_heads, head_dim] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] "
              "tensors of one dtype");
  const int64_t num_heads = q.size(1), D = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q (", D, ") and the cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads=", num_heads, " is not a multiple of num_kv_heads=",
              num_kv_heads);
  TORCH_CHECK(D % kW == 0, "head_dim=", D, " is not a multiple of ", kW);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kLong &&
                  block_tables.is_contiguous() && block_tables.size(0) == static_cast<int64_t>(seq_lens.size()),
              "block_tables must be contiguous int64 [num_seqs, max_blocks]");
  TORCH_CHECK(query_start.size() == seq_lens.size() + 1 && query_start.front() == 0 &&
                  query_start.back() == q.size(0),
              "query_start must hold num_seqs + 1 offsets from 0 to num_tokens");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat && out.is_contiguous(),
              "out must be a contiguous float32 tensor shaped as q");
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    const int64_t q_len = query_start[r + 1] - query_start[r];
    TORCH_CHECK(q_len >= 0 && seq_lens[r] >= q_len && seq_lens[r] <= max_blocks * block_size,
                "sequence ", r, ": ", q_len, " queries and context length ", seq_lens[r],
                " do not fit its block table of ", max_blocks, " blocks");
  }
  if (q.size(0) == 0) return;
  const bool known = pagedlm::visit_cache_dtype(k_cache.scalar_type(), [&](auto tag) {
    run_prefill<decltype(tag)>(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window, out);
  });
  TORCH_CHECK(known, "cache dtype must be float32, float16, bfloat16 or float8 (e4m3fn, e5m2)");
}

// As paged_prefill_into, into a new tensor.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, std::vector<int64_t> query_start,
                            std::vector<int64_t> seq_lens, double scale, int64_t window) {
  torch::Tensor out = torch::empty_like(q);
  paged_prefill_into(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window, out);
  return out;
}

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), whose
// library compiles this file beside its own (csrc/__init__.py BUNDLED and LIBRARY_SOURCES).
void bind_prefill_attention_cpu(lite_bind::Module& m) {
  m.def<&paged_prefill>("paged_prefill", "causal attention of every prefill of a step against its paged context, CPU");
  m.attr("lanes", kW);  // head_dim must be a multiple of this
}
