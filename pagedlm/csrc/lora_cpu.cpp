// Multi-adapter LoRA delta for float32 on CPU: every token of a batch through its own
// adapter slot's A and B (or none), added to the layer's output in place. The layout and
// the maths are those of pagedlm/layers/lora.py (lora_reference is the definition):
//
//   a      [max_loras, S, R, in]     b [max_loras, R, out] (B transposed)     ranks [max_loras]
//   bounds [S, 2]  slice s covers output columns lo_s:hi_s
//   y[t, lo_s:hi_s] += (a[l, s, :r] @ x[t]) @ b[l, :r, lo_s:hi_s],  l = slots[t] >= 0, r = ranks[l]
//
// Work split: blocks of up to 8 tokens of one adapter in parallel, each a shrink (S*r
// dot products over `in` per token) then an expand (r multiply-adds of a row of b into
// y's slice, vectorised along the output, no horizontal sums), in output chunks that keep
// the chunk of b in L1 for the block's tokens. Prompt chunks of 128 tokens or more do not
// come here: layers/lora.py gives them GEMMs. No module of its own: the C++ decoder's
// exports it (csrc/__init__.py BUNDLED) and applies it after each of a layer's matmuls in
// pure-decode steps with adapters.
#pragma once
#include "lite_bind.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace pagedlm_lora {

constexpr int64_t kLanes = 16;

// The dot products of KR rows of A with TN input rows over n values, as a tile: each
// pair has its own 16-lane accumulator (KR * TN independent chains of multiply-adds, with
// each A and x vector loaded once per tile), whose lanes are then summed in order and the
// tail added. A pair's arithmetic does not depend on the tile it is in, so every tiling
// of the same rows and tokens gives the same results.
template <int KR, int TN>
inline void dot_tile(const float* const* a, const float* const* x, int64_t n, float* out,
                     int64_t out_stride) {
  float acc[KR][TN][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int kr = 0; kr < KR; ++kr) {
      for (int tn = 0; tn < TN; ++tn) {
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[kr][tn][l] += a[kr][i + l] * x[tn][i + l];
      }
    }
  }
  for (int kr = 0; kr < KR; ++kr) {
    for (int tn = 0; tn < TN; ++tn) {
      float total = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) total += acc[kr][tn][l];
      for (int64_t j = i; j < n; ++j) total += a[kr][j] * x[tn][j];
      out[tn * out_stride + kr] = total;
    }
  }
}

// out[t * out_stride + k] = a_k . x_t for rows k < num_rows of `a` (row stride `in`) and
// the num_x input rows, in tiles of up to 2 rows x 4 tokens.
inline void dot_block(const float* a, int64_t num_rows, const float* const* x, int64_t num_x,
                      int64_t in, float* out, int64_t out_stride) {
  for (int64_t k = 0; k < num_rows; k += 2) {
    const float* rows[2] = {a + k * in, a + std::min(k + 1, num_rows - 1) * in};
    const bool two = k + 1 < num_rows;
    for (int64_t t = 0; t < num_x; t += 4) {
      const int64_t tn = std::min<int64_t>(4, num_x - t);
      float* o = out + t * out_stride + k;
      const float* const* xs = x + t;
      switch (tn * 2 + (two ? 1 : 0)) {
        case 9: dot_tile<2, 4>(rows, xs, in, o, out_stride); break;
        case 8: dot_tile<1, 4>(rows, xs, in, o, out_stride); break;
        case 7: dot_tile<2, 3>(rows, xs, in, o, out_stride); break;
        case 6: dot_tile<1, 3>(rows, xs, in, o, out_stride); break;
        case 5: dot_tile<2, 2>(rows, xs, in, o, out_stride); break;
        case 4: dot_tile<1, 2>(rows, xs, in, o, out_stride); break;
        case 3: dot_tile<2, 1>(rows, xs, in, o, out_stride); break;
        default: dot_tile<1, 1>(rows, xs, in, o, out_stride); break;
      }
    }
  }
}

inline void lora_check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("lora_add: ") + what);
}

inline void lora_add(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& a,
              const torch::Tensor& b, const torch::Tensor& bounds, const torch::Tensor& slots,
              const torch::Tensor& ranks) {
  lora_check(x.scalar_type() == torch::kFloat && y.scalar_type() == torch::kFloat &&
            a.scalar_type() == torch::kFloat && b.scalar_type() == torch::kFloat,
        "x, y, a and b must be float32");
  lora_check(x.dim() == 2 && y.dim() == 2 && a.dim() == 4 && b.dim() == 3, "bad ranks of tensors");
  lora_check(x.stride(1) == 1 && y.stride(1) == 1, "x and y rows must be contiguous");
  lora_check(a.is_contiguous() && b.is_contiguous(), "a and b must be contiguous");
  lora_check(slots.scalar_type() == torch::kInt && ranks.scalar_type() == torch::kInt &&
            bounds.scalar_type() == torch::kLong,
        "slots and ranks must be int32, bounds int64");
  const int64_t num_tokens = x.size(0), in = x.size(1), num_slices = a.size(1),
                max_rank = a.size(2), out = y.size(1), max_loras = a.size(0);
  lora_check(y.size(0) == num_tokens && slots.numel() == num_tokens, "token counts differ");
  lora_check(a.size(3) == in && b.size(1) == max_rank && b.size(2) == out, "weight shapes");
  lora_check(bounds.size(0) == num_slices && ranks.numel() == max_loras, "slices or slots");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  const int64_t* bd = bounds.data_ptr<int64_t>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  for (int64_t t = 0; t < num_tokens; ++t) lora_check(sp[t] < max_loras, "slot out of range");
  // Tokens of one adapter in blocks of up to kBlock: A's rows and B's row chunks are read
  // once per block from L2 and reused from L1 by its tokens (8: the block's input rows
  // stay in L1 for SmolLM2's hidden size; 4 and 16 measured slower). Each token's arithmetic is
  // the same whatever its block (the same dot products, the same order of additions into
  // each output), so neither the batch nor the thread count changes a result.
  constexpr int64_t kBlock = 8, kChunk = 256;
  // The adapter tokens ordered by slot (a counting sort, stable), then cut into blocks:
  // block i is order[start_i, start_i + len_i), all of slot_i.
  std::vector<int64_t> first(max_loras + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (sp[t] >= 0 && rp[sp[t]] > 0) ++first[sp[t] + 1];
  }
  for (int64_t l = 0; l < max_loras; ++l) first[l + 1] += first[l];
  std::vector<int64_t> order(first[max_loras]);
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (sp[t] >= 0 && rp[sp[t]] > 0) order[fill[sp[t]]++] = t;
  }
  struct Block {
    int32_t slot;
    int64_t start, len;
  };
  std::vector<Block> blocks;
  for (int32_t slot = 0; slot < max_loras; ++slot) {
    for (int64_t i = first[slot]; i < first[slot + 1]; i += kBlock) {
      blocks.push_back({slot, i, std::min(kBlock, first[slot + 1] - i)});
    }
  }
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  // Small steps (a batch-1 decode) in one thread: a fork costs more than the work.
  const int64_t grain = num_tokens * (num_slices * max_rank * in + out * max_rank) < 200000
                            ? std::max<int64_t>(num_blocks, 1) : 1;
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kBlock * num_slices * max_rank);
    for (int64_t bi = begin; bi < end; ++bi) {
      const int32_t slot = blocks[bi].slot;
      const int64_t* tokens = order.data() + blocks[bi].start;
      const int64_t nb = blocks[bi].len;
      const int64_t r = rp[slot];
      const int64_t width = num_slices * max_rank;
      const float* xrows[kBlock];
      for (int64_t j = 0; j < nb; ++j) xrows[j] = xp + tokens[j] * xs;
      for (int64_t s = 0; s < num_slices; ++s) {
        const float* as = ap + ((slot * num_slices + s) * max_rank) * in;
        dot_block(as, r, xrows, nb, in, h.data() + s * max_rank, width);
      }
      const float* bl = bp + slot * max_rank * out;
      for (int64_t s = 0; s < num_slices; ++s) {
        const int64_t lo = bd[2 * s], hi = bd[2 * s + 1];
        for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
          const int64_t c1 = std::min(hi, c0 + kChunk);
          for (int64_t j = 0; j < nb; ++j) {
            float* __restrict yt = yp + tokens[j] * ys;
            const float* hj = h.data() + j * width + s * max_rank;
            // y[o] + h_0 b_0[o] + h_1 b_1[o] + ..., 64 outputs at a time in registers.
            int64_t o0 = c0;
            for (; o0 + 64 <= c1; o0 += 64) {
              float acc[64];
#pragma omp simd
              for (int64_t l = 0; l < 64; ++l) acc[l] = yt[o0 + l];
              for (int64_t k = 0; k < r; ++k) {
                const float hk = hj[k];
                const float* __restrict bk = bl + k * out + o0;
#pragma omp simd
                for (int64_t l = 0; l < 64; ++l) acc[l] += hk * bk[l];
              }
#pragma omp simd
              for (int64_t l = 0; l < 64; ++l) yt[o0 + l] = acc[l];
            }
            for (int64_t k = 0; k < r; ++k) {
              const float hk = hj[k];
              const float* __restrict bk = bl + k * out;
#pragma omp simd
              for (int64_t o = o0; o < c1; ++o) yt[o] += hk * bk[o];
            }
          }
        }
      }
    }
  });
}

}  // namespace pagedlm_lora

inline void bind_lora_cpu(lite_bind::Module& m) {
  m.def<&pagedlm_lora::lora_add>("lora_add", "y += each token's LoRA delta (its slot's A, then B)");
}
