// Fused element-wise layers for float32 on CPU: RMSNorm (with the residual add), SiLU-and-
// multiply, and rotate-half rotary embedding. Each replaces 4-8 torch
// ops, and with them as many passes over the activations and as many dispatches (which
// dominate at decode sizes: a few rows of 576 values). References: layers/norm.py,
// layers/activation.py, layers/rotary.py; tests/test_layer_ops_cpu.py checks these
// against them.
//
//   rms_norm:     s = x (+ residual);  out = weight * s / sqrt(mean(s^2) + eps)
//   silu_and_mul: x = [gate | up] (last dim);  out = gate / (1 + exp(-gate)) * up
//   rotary:       per head, x = [x1 | x2] (halves of head_dim), cos/sin rows of the
//                 position (the cache holds [f | f], so the first half is used):
//                 x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin

#include "lite_bind.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagedlm_vec;

// Rows per parallel task: enough work per task that a decode step's few rows stay on
// one thread (a parallel region costs more than they do).
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), name,
              " must be a contiguous float32 [num_tokens, hidden] tensor");
}

}  // namespace

// The rows of rms_norm: x, out [rows, hidden]; with a residual r, s = x + r is written to
// `sum` (which may be r itself: each value is read before it is overwritten) and normed.
void rms_norm_rows(const float* x_p, const float* w_p, float eps, const float* r_p, float* s_p,
                   float* o_p, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x_p + t * hidden;
      float* orow = o_p + t * hidden;
      const float* src = xr;
      if (s_p != nullptr) {
        float* srow = s_p + t * hidden;
        const float* rr = r_p + t * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) srow[i] = xr[i] + rr[i];
        src = srow;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += src[i] * src[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) orow[i] = w_p[i] * (src[i] * inv);
    }
  });
}

// Returns {out, s}: s = x + residual when a residual is given (else out only, s undefined).
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() &&
                  weight.numel() == hidden, "weight must be float32 [hidden]");
  torch::Tensor sum;
  const float* r_p = nullptr;
  float* s_p = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual and x differ in shape");
    sum = torch::empty_like(x);
    r_p = residual->data_ptr<float>();
    s_p = sum.data_ptr<float>();
  }
  torch::Tensor out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), static_cast<float>(eps), r_p, s_p,
                out.data_ptr<float>(), rows, hidden);
  if (s_p != nullptr) return {out, sum};
  return {out};
}

// x [rows, 2 inter] -> o [rows, inter], both contiguous.
void silu_and_mul_rows(const float* x_p, float* o_p, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = x_p + t * 2 * inter;
      const float* u = g + inter;
      float* o = o_p + t * inter;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < inter; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even ([gate | up])");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  torch::Tensor out = torch::empty({rows, inter}, x.options());
  silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  return out;
}

// x: [num_tokens, num_heads, head_dim] float32 with unit stride in the last dim (a view
// into the fused qkv projection is fine). Writes the rotated copy to `out`, contiguous
// [num_tokens, num_heads, head_dim] float32.
void rotary_into(const torch::Tensor& x, const int64_t* pos, const torch::Tensor& cos_cache,
                 const torch::Tensor& sin_cache, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1,
              "query/key must be float32 [num_tokens, heads, head_dim] with unit last stride");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && cos_cache.size(1) == head_dim, "rotary dim must equal head_dim");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kFloat && out.numel() == x.numel(),
              "rotary output must be a contiguous float32 tensor of the input's size");
  const float* cos_p = cos_cache.data_ptr<float>();
  const float* sin_p = sin_cache.data_ptr<float>();
  const float* x_p = x.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_p + pos[t] * head_dim;
      const float* s = sin_p + pos[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = x_p + t * s0 + h * s1;
        const float* x2 = x1 + half;
        float* o1 = o_p + (t * heads + h) * head_dim;
        float* o2 = o1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o1[i] = x1[i] * c[i] - x2[i] * s[i];
          o2[i] = x2[i] * c[i] + x1[i] * s[i];
        }
      }
    }
  });
}

torch::Tensor rotary_one(const torch::Tensor& x, const int64_t* pos, const torch::Tensor& cos_cache,
                         const torch::Tensor& sin_cache) {
  torch::Tensor out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  rotary_into(x, pos, cos_cache, sin_cache, out);
  return out;
}

// Checks rotary's positions [num_tokens] and cos/sin caches; returns the positions.
const int64_t* checked_positions(const torch::Tensor& positions, int64_t num_tokens,
                                 const torch::Tensor& cos_cache, const torch::Tensor& sin_cache) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong &&
                  positions.is_contiguous(), "positions must be contiguous int64 [num_tokens]");
  TORCH_CHECK(cos_cache.scalar_type() == torch::kFloat && cos_cache.is_contiguous() &&
                  sin_cache.scalar_type() == torch::kFloat && sin_cache.is_contiguous() &&
                  cos_cache.sizes() == sin_cache.sizes(),
              "cos/sin caches must be contiguous float32 [max_position, rotary_dim]");
  TORCH_CHECK(positions.size(0) == num_tokens, "one position per token");
  const int64_t max_pos = cos_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary cache (",
                max_pos, " positions)");
  }
  return pos;
}

std::vector<torch::Tensor> rotary(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                                  torch::Tensor cos_cache, torch::Tensor sin_cache) {
  TORCH_CHECK(query.size(0) == key.size(0), "query and key differ in tokens");
  const int64_t* pos = checked_positions(positions, query.size(0), cos_cache, sin_cache);
  return {rotary_one(query, pos, cos_cache, sin_cache), rotary_one(key, pos, cos_cache, sin_cache)};
}

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), which
// compiles this file with its own: one build instead of two (csrc/__init__.py BUNDLED).
inline void bind_layer_ops_cpu(lite_bind::Module& m) {
  m.def<&rms_norm>("rms_norm", "RMSNorm with optional residual add (float32, CPU)");
  m.def<&silu_and_mul>("silu_and_mul", "silu(gate) * up (float32, CPU)");
  m.def<&rotary>("rotary", "rotate-half RoPE of query and key (float32, CPU)");
}
