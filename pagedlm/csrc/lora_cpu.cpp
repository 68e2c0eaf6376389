// Multi-adapter LoRA delta for float32 on CPU: every token of a batch through its own
// adapter slot's A and B (or none), added to the layer's output in place. The layout and
// the maths are those of pagedlm/layers/lora.py (lora_reference is the definition):
//
//   a      [max_loras, S, R, in]     b [max_loras, R, out] (B transposed)     ranks [max_loras]
//   bounds [S, 2]  slice s covers output columns lo_s:hi_s
//   y[t, lo_s:hi_s] += (a[l, s, :r] @ x[t]) @ b[l, :r, lo_s:hi_s],  l = slots[t] >= 0, r = ranks[l]
//
// Work split: tokens in parallel, each a shrink (S*r dot products over `in`) then an
// expand (r multiply-adds of a row of b into y's slice, vectorised along the output, no
// horizontal sums). A decode step's tokens of one adapter reread the same A and B, which
// stay in cache (rank 16 and a hidden size of 576: 37 KiB for A); a token's result
// depends on nothing but its own row, so neither the batch nor the thread count changes
// it. Prompt chunks do not come here: layers/lora.py gives them GEMMs. No module of its
// own: the C++ decoder's exports it (csrc/__init__.py BUNDLED) and applies it after each
// of a layer's matmuls in pure-decode steps with adapters.
#pragma once
#include "torch_lite.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace pagedlm_lora {

inline float lora_dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
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
  // Small steps (a batch-1 decode) in one thread: a fork costs more than the work.
  const int64_t grain = num_tokens * (num_slices * max_rank * in + out * max_rank) < 200000
                            ? num_tokens : 1;
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(num_slices * max_rank);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t r = rp[slot];
      if (r == 0) continue;
      const float* xt = xp + t * xs;
      float* yt = yp + t * ys;
      for (int64_t s = 0; s < num_slices; ++s) {
        const float* as = ap + ((slot * num_slices + s) * max_rank) * in;
        for (int64_t k = 0; k < r; ++k) h[s * max_rank + k] = lora_dot(as + k * in, xt, in);
      }
      const float* bl = bp + slot * max_rank * out;
      for (int64_t s = 0; s < num_slices; ++s) {
        const int64_t lo = bd[2 * s], hi = bd[2 * s + 1];
        for (int64_t k = 0; k < r; ++k) {
          const float hk = h[s * max_rank + k];
          const float* __restrict bk = bl + k * out;
#pragma omp simd
          for (int64_t o = lo; o < hi; ++o) yt[o] += hk * bk[o];
        }
      }
    }
  });
}

}  // namespace pagedlm_lora

inline void bind_lora_cpu(pybind11::module_& m) {
  m.def("lora_add", &pagedlm_lora::lora_add,
        "y += each token's LoRA delta (its slot's A, then B)");
}
