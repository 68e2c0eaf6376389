// y = x @ W.T (+ bias) on CPU for float32 x, with W pre-packed in column panels of float32
// or float16 values (float16 widened to float32 in registers or in a per-thread buffer; all
// products and sums in float32).
//
// Why not F.linear: at the row counts of decode steps (8 to 64 rows) torch's float32 GEMM on
// the 2-core dev box (MKL on an AMD CPU) reaches 22 to 80 GFLOP/s of the FMA units' 200
// (benchmarks/cpu/fma_peak.py); this kernel 60 to 122 (benchmarks/cpu/panel_gemm.py).
//
// Layout: W [N, K] is packed as panels of 16 output features, k-major inside a panel, so
// the micro-kernel reads one contiguous 64-byte (32 for float16) row of a panel per k:
//
//   packed [P = ceil(N / 16), K, 16]    packed[p, k, j] = W[16 p + j, k]  (0 past N)
//
// Micro-kernel: a tile of up to 6 rows of x by one panel, 12 accumulators of 8 lanes:
//
//   for k: b0, b1 = packed[p, k, 0:8], packed[p, k, 8:16]
//          for r < 6: a = broadcast x[r, k]; acc[r][0] += a * b0; acc[r][1] += a * b1
//
// Threads split the panels. A thread widens a group of float16 panels (<= 256 KiB of
// float32, so it stays in L2) once and runs every row tile of x over it, so the widening
// costs once per panel instead of once per row tile. With 6 rows or fewer there is one row
// tile, and float16 panels are widened in registers instead.
//
// Each output is sum_k x[i, k] * W[n, k] in float32 FMAs in order of k (+ bias): the same
// maths as F.linear up to the order of the float32 sums.

#include "lite_bind.h"

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLM_PANEL_AVX2 1
#endif

// Named (not anonymous) so that llama_decode_cpu.cpp can include this file next to others.
namespace pagedlm_panel {

constexpr int64_t kPanel = 16;      // output features per panel
constexpr int64_t kMaxTile = 6;     // rows of x per micro-kernel call
constexpr int64_t kGroupBytes = 256 * 1024;  // widened float32 panels per group

// Tile rows r0..r0+rows of y (row stride ldy), panel columns [0, ncols) from x rows (stride
// K) and one panel: `kHalf` panels are uint16 float16 bits, else float32.
#ifdef PAGEDLM_PANEL_AVX2
template <int kRows, bool kHalf>
inline void tile(const float* x, int64_t K, const void* panel, const float* bias, float* y,
                 int64_t ldy, int64_t ncols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* x0 = x;
  const float* x1 = x + K;
  const float* x2 = x + 2 * K;
  const float* x3 = x + 3 * K;
  const float* x4 = x + 4 * K;
  const float* x5 = x + 5 * K;
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    if constexpr (kHalf) {
      const uint16_t* w = static_cast<const uint16_t*>(panel) + k * kPanel;
      b0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
      b1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
    } else {
      const float* w = static_cast<const float*>(panel) + k * kPanel;
      b0 = _mm256_loadu_ps(w);
      b1 = _mm256_loadu_ps(w + 8);
    }
    __m256 a;
    // Named accumulators, not an array: gcc keeps these in registers, an array it spills.
#define PAGEDLM_ROW(r)                             \
  if constexpr (kRows > r) {                       \
    a = _mm256_broadcast_ss(x##r + k);             \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);     \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);     \
  }
    PAGEDLM_ROW(0) PAGEDLM_ROW(1) PAGEDLM_ROW(2) PAGEDLM_ROW(3) PAGEDLM_ROW(4) PAGEDLM_ROW(5)
#undef PAGEDLM_ROW
  }
  alignas(32) float out[kMaxTile][kPanel];
#define PAGEDLM_OUT(r)                                \
  if constexpr (kRows > r) {                          \
    _mm256_store_ps(out[r], c##r##0);                 \
    _mm256_store_ps(out[r] + 8, c##r##1);             \
  }
  PAGEDLM_OUT(0) PAGEDLM_OUT(1) PAGEDLM_OUT(2) PAGEDLM_OUT(3) PAGEDLM_OUT(4) PAGEDLM_OUT(5)
#undef PAGEDLM_OUT
  for (int r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = out[r][j] + (bias ? bias[j] : 0.0f);
  }
}
#else
template <int kRows, bool kHalf>
inline void tile(const float* x, int64_t K, const void* panel, const float* bias, float* y,
                 int64_t ldy, int64_t ncols) {
  float acc[kMaxTile][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kPanel];
    for (int64_t j = 0; j < kPanel; ++j) {
      w[j] = kHalf ? static_cast<float>(c10::Half(
                         static_cast<const uint16_t*>(panel)[k * kPanel + j], c10::Half::from_bits()))
                   : static_cast<const float*>(panel)[k * kPanel + j];
    }
    for (int r = 0; r < kRows; ++r) {
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] = std::fma(x[r * K + k], w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
  }
}
#endif

template <bool kHalf>
void tile_rows(int64_t rows, const float* x, int64_t K, const void* panel, const float* bias,
               float* y, int64_t ldy, int64_t ncols) {
  switch (rows) {
    case 1: tile<1, kHalf>(x, K, panel, bias, y, ldy, ncols); break;
    case 2: tile<2, kHalf>(x, K, panel, bias, y, ldy, ncols); break;
    case 3: tile<3, kHalf>(x, K, panel, bias, y, ldy, ncols); break;
    case 4: tile<4, kHalf>(x, K, panel, bias, y, ldy, ncols); break;
    case 5: tile<5, kHalf>(x, K, panel, bias, y, ldy, ncols); break;
    default: tile<6, kHalf>(x, K, panel, bias, y, ldy, ncols); break;
  }
}

void widen(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDLM_PANEL_AVX2
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}

// x [M, K] float32 contiguous; packed [ceil(N / 16), K, 16] float32 or float16 contiguous;
// bias [N] float32 or None; y [M, N] float32 contiguous (a preallocated buffer).
void panel_gemm_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                     const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "panel GEMM runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const bool half = packed.scalar_type() == torch::kHalf;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  (half || packed.scalar_type() == torch::kFloat),
              "packed must be a contiguous float32 or float16 [P, K, 16] tensor");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features but the panels hold ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "N = ", N, " does not fit ", P, " panels");
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat &&
                    bias->is_contiguous(),
                "bias must be contiguous float32 [N]");
    bias_p = bias->data_ptr<float>();
  }
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.scalar_type() == torch::kFloat &&
                  y.is_contiguous(),
              "y must be a contiguous float32 [", M, ", ", N, "] tensor");
  if (M == 0 || N == 0) return;
  const float* x_p = x.data_ptr<float>();
  float* y_p = y.data_ptr<float>();
  const char* w_p = static_cast<const char*>(packed.data_ptr());
  const int64_t panel_bytes = K * kPanel * packed.element_size();
  const int64_t num_tiles = (M + kMaxTile - 1) / kMaxTile;
  const bool widen_once = half && num_tiles > 1;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (K * kPanel * 4));

  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(widen_once ? group * K * kPanel : 0);
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      if (widen_once) {
        for (int64_t p = g0; p < g1; ++p) {
          widen(reinterpret_cast<const uint16_t*>(w_p + p * panel_bytes),
                widened.data() + (p - g0) * K * kPanel, K * kPanel);
        }
      }
      for (int64_t t = 0; t < num_tiles; ++t) {
        // Tiles as even as possible: 64 rows are 11 tiles of 5 or 6, not 10 of 6 and one of 4.
        const int64_t r0 = t * M / num_tiles, r1 = (t + 1) * M / num_tiles;
        for (int64_t p = g0; p < g1; ++p) {
          const int64_t ncols = std::min(kPanel, N - p * kPanel);
          const float* b = bias_p ? bias_p + p * kPanel : nullptr;
          float* y_tile = y_p + r0 * N + p * kPanel;
          const float* x_tile = x_p + r0 * K;
          if (widen_once) {
            tile_rows<false>(r1 - r0, x_tile, K, widened.data() + (p - g0) * K * kPanel, b,
                             y_tile, N, ncols);
          } else if (half) {
            tile_rows<true>(r1 - r0, x_tile, K, w_p + p * panel_bytes, b, y_tile, N, ncols);
          } else {
            tile_rows<false>(r1 - r0, x_tile, K, w_p + p * panel_bytes, b, y_tile, N, ncols);
          }
        }
      }
    }
  });
}

// As panel_gemm_into, into a new float32 [M, N] tensor.
torch::Tensor panel_gemm(torch::Tensor x, torch::Tensor packed, int64_t N,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "x must be a contiguous float32 [M, K] tensor");
  torch::Tensor y = torch::empty({x.size(0), N}, x.options().dtype(torch::kFloat));
  panel_gemm_into(x, packed, N, bias, y);
  return y;
}

}  // namespace pagedlm_panel

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), which
// compiles this file with its own: one build instead of two (csrc/__init__.py BUNDLED).
inline void bind_panel_gemm_cpu(lite_bind::Module& m) {
  m.def<&pagedlm_panel::panel_gemm>("panel_gemm", "x @ W.T (+ bias) with W packed in 16-column panels, CPU");
}
