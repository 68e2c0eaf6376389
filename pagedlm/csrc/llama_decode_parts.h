// Pieces of the decoder (llama_decode_cpu.cpp, the only file that includes this, after the
// kernels these call): one linear layer's matmul as its Python object computes it, the
// step's activation workspace, and the write of a step's K and V into the paged cache.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

// One linear layer's matmul, x @ W.T (+ bias), as its Python matmul object computes it
// (layers/q8_weights.py, layers/panel_weights.py, layers/quant_block_weights.py):
//   q8     the int8 kernel over Q4_1 / Q8_0 blocks;
//   panel  float32 or float16 panels;
//   block  GGUF blocks for inputs of up to `max_rows` rows, panels for larger ones.
class Linear {
 public:
  static Linear q8(torch::Tensor packed, torch::Tensor scales, int64_t out_features, bool q4_1,
                   c10::optional<torch::Tensor> bias) {
    Linear l(kQ8, out_features, bias);
    l.packed_ = packed;
    l.scales_ = scales;
    l.q4_1_ = q4_1;
    return l;
  }
  static Linear panel(torch::Tensor panels, int64_t out_features, c10::optional<torch::Tensor> bias) {
    Linear l(kPanel, out_features, bias);
    l.packed_ = panels;
    return l;
  }
  static Linear block(torch::Tensor blocks, bool q4_1, int64_t max_rows, torch::Tensor panels,
                      int64_t out_features, c10::optional<torch::Tensor> bias) {
    Linear l(kBlock, out_features, bias);
    l.blocks_ = blocks;
    l.q4_1_ = q4_1;
    l.max_rows_ = max_rows;
    l.packed_ = panels;
    return l;
  }

  int64_t out_features() const { return out_features_; }

  // y = x @ W.T (+ bias); y [rows, out_features] float32 contiguous, preallocated.
  void operator()(const torch::Tensor& x, torch::Tensor& y) const {
    switch (kind_) {
      case kQ8:
        q8_gemm_into(x, packed_, scales_, out_features_, q4_1_, bias_, y);
        return;
      case kBlock:
        if (x.size(0) <= max_rows_) {
          pagedlm_block::block_gemv_into(x, blocks_, q4_1_, bias_, y);
          return;
        }
        [[fallthrough]];
      default:
        pagedlm_panel::panel_gemm_into(x, packed_, out_features_, bias_, y);
    }
  }

 private:
  enum Kind { kQ8, kPanel, kBlock };
  Linear(Kind kind, int64_t out_features, c10::optional<torch::Tensor> bias)
      : kind_(kind), out_features_(out_features), bias_(std::move(bias)) {}

  Kind kind_;
  int64_t out_features_;
  c10::optional<torch::Tensor> bias_;
  torch::Tensor packed_, scales_, blocks_;
  bool q4_1_ = false;
  int64_t max_rows_ = 0;
};

namespace {

// A step's activations, reused by every layer and every step (grown to the largest batch
// seen): the same few hundred kilobytes stay in cache, where a fresh tensor per op would
// take its memory from wherever the allocator finds it, write-missing on every store.
// The buffers are slices of one allocation, each starting 64 bytes further into a 4 KiB
// page than the one before: buffers at equal page offsets (as separate large allocations
// are) make the loads of one and the stores of another alias in the low 12 address bits,
// which stalls the loads.
struct Workspace {
  int64_t rows = 0;  // capacity
  torch::Tensor memory, residual, h, x, qkv, q, k, attn, gate_up, act;

  void reserve(int64_t n, int64_t hidden, int64_t q_size, int64_t kv_size, int64_t inter2) {
    if (n <= rows) return;
    rows = std::max<int64_t>(n, 2 * rows);
    const std::array<int64_t, 9> widths = {hidden, hidden, hidden, q_size + 2 * kv_size, q_size,
                                           kv_size, q_size, inter2, inter2 / 2};
    constexpr int64_t kPage = 1024, kStagger = 16;  // in floats: 4 KiB and 64 bytes
    std::array<int64_t, 9> offsets{};
    int64_t total = 0;
    for (size_t i = 0; i < widths.size(); ++i) {
      offsets[i] = total;
      const int64_t end = total + rows * widths[i];
      total = (end + kPage - 1) / kPage * kPage + static_cast<int64_t>(i + 1) * kStagger;
    }
    memory = torch::empty({total + kPage}, torch::kFloat);
    // The first slice at a page boundary, whatever the allocator's alignment.
    const int64_t lead = (kPage - (reinterpret_cast<uintptr_t>(memory.data_ptr<float>()) / 4) % kPage) % kPage;
    std::array<torch::Tensor*, 9> bufs = {&residual, &h, &x, &qkv, &q, &k, &attn, &gate_up, &act};
    for (size_t i = 0; i < widths.size(); ++i) {
      *bufs[i] = memory.narrow(0, lead + offsets[i], rows * widths[i]).view({rows, widths[i]});
    }
  }
};

template <typename fp8_t>
void write_fp8_rows(const float* s, int64_t stride, fp8_t* c, const int64_t* slots, int64_t n,
                    int64_t width, float inv, float fp8_max) {
  for (int64_t t = 0; t < n; ++t) {
    const float* row = s + t * stride;
    fp8_t* dst = c + slots[t] * width;
    for (int64_t i = 0; i < width; ++i) {
      dst[i] = static_cast<fp8_t>(std::min(std::max(row[i] * inv, -fp8_max), fp8_max));
    }
  }
}

// cache_flat[slot[t]] = src[t] for every token t; src [n, width] float32 with unit stride
// in the last dim (a view into the fused qkv output is fine).
void write_cache(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t n,
                 float inv = 1.f, float fp8_max = 0.f) {
  const int64_t width = src.size(1), stride = src.stride(0);
  TORCH_CHECK(src.stride(1) == 1, "cache rows must have unit stride");
  const float* s = src.data_ptr<float>();
  switch (cache.scalar_type()) {
    case torch::kFloat: {
      float* c = cache.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) std::memcpy(c + slots[t] * width, s + t * stride, width * sizeof(float));
      break;
    }
    case torch::kHalf: {
      at::Half* c = cache.data_ptr<at::Half>();
      for (int64_t t = 0; t < n; ++t) {
        const float* row = s + t * stride;
        at::Half* dst = c + slots[t] * width;
        int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
        // vcvtps2ph rounds to nearest even, as at::Half's conversion (and torch's .to) does.
        for (; i + 8 <= width; i += 8) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                           _mm256_cvtps_ph(_mm256_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT));
        }
#endif
        for (; i < width; ++i) dst[i] = static_cast<at::Half>(row[i]);
      }
      break;
    }
    case torch::kBFloat16: {
      at::BFloat16* c = cache.data_ptr<at::BFloat16>();
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < width; ++i) c[slots[t] * width + i] = static_cast<at::BFloat16>(s[t * stride + i]);
      }
      break;
    }
    case torch::kFloat8_e4m3fn:
      write_fp8_rows(s, stride, cache.data_ptr<at::Float8_e4m3fn>(), slots, n, width, inv, fp8_max);
      break;
    case torch::kFloat8_e5m2:
      write_fp8_rows(s, stride, cache.data_ptr<at::Float8_e5m2>(), slots, n, width, inv, fp8_max);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", cache.scalar_type());
  }
}
}  // namespace
