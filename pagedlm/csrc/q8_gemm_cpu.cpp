// y = x @ W.T (+ bias) on CPU in integer arithmetic, as llama.cpp multiplies its quantised
// weights: W stays in its GGUF blocks of 32 values (Q4_1 or Q8_0), each row of x is rounded
// to int8 per block of 32 values, and the products of a block are summed exactly in
// integers before one float32 scaling:
//
//   x[i, 32b + j]  ~  e[i, b] * r[i, 32b + j]        e = max |x| over the block / 127,
//                                                    r = round(x / e) in -127..127
//   Q4_1:  w[n, 32b + j] = d[n, b] * q + m[n, b]     q in 0..15
//          y[i, n] = sum_b  d[n, b] e[i, b] (sum_j q r)  +  m[n, b] s[i, b],
//                  s[i, b] = e[i, b] sum_j r[i, 32b + j]
//   Q8_0:  w[n, 32b + j] = d[n, b] * q               q in -128..127
//          y[i, n] = sum_b  d[n, b] e[i, b] (sum_j q r)
//
// The only rounding beyond float32 sums is that of x to int8 (relative error <= 1/254 of
// the block's largest value): the weights are the file's own values.
//
// Why: on AVX2 one vpmaddubsw multiplies 32 byte pairs and adds them pairwise, four times
// the multiply-adds of one float32 FMA, and the CPU issues two of either per cycle; the
// int16 sums of a Q4_1 block (8 groups, each lane <= 2 * 15 * 127 = 3810) cannot overflow.
//
// Layout, for panels of 8 output features (P = ceil(N / 8), B = K / 32, 0 past N):
//
//   Q4_1  packed [P, B, 4, 32] uint8: pair t of block b holds groups 2t (low nibbles) and
//         2t + 1 (high nibbles) of 4 values; byte 4 c + u = q[8p + c, 32b + 4g + u]
//         scales [P, B, 2, 8] float16: d then m of the panel's 8 features
//   Q8_0  packed [P, B, 8, 32] int8: group g, byte 4 c + u = q[8p + c, 32b + 4g + u]
//         scales [P, B, 8] float16: d
//
// A group (32 bytes: 8 features x 4 values) against 4 values of one row of x broadcast to
// every feature: vpmaddubsw gives per feature two int16 sums of 2 products, vpmaddwd with
// ones one int32 sum of 4. Micro-kernel: up to 6 rows of x by one panel; per block, int16
// (Q4_1) or int32 (Q8_0) sums per row, then one float32 FMA with d * e (and one with m * s).
// Threads split the panels; a thread widens a Q4_1 panel's nibbles to bytes once, into a
// buffer that stays in L1/L2 while every row tile of x runs over it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLM_Q8_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;   // values per quantisation block
constexpr int64_t kCols = 8;     // output features per panel
constexpr int64_t kGroups = 8;   // groups of 4 values per block
constexpr int kMaxTile = 6;      // rows of x per micro-kernel call

// Activations of one call: r [M, K] int8, e and s [M, B] float32 (see the header).
struct Quantized {
  std::vector<int8_t> r;
  std::vector<float> e, s;
};

void quantize_rows(const float* x, int64_t M, int64_t K, Quantized& qa) {
  const int64_t B = K / kBlock;
  qa.r.resize(M * K);
  qa.e.resize(M * B);
  qa.s.resize(M * B);
  at::parallel_for(0, M * B, 64, [&](int64_t begin, int64_t end) {
    for (int64_t ib = begin; ib < end; ++ib) {
      const float* xb = x + ib * kBlock;  // row i, block b: x is [M, K] contiguous
      int8_t* rb = qa.r.data() + ib * kBlock;
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float e = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        // nearbyint: round half to even, as vcvtps2dq and torch.round do.
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
        rb[j] = static_cast<int8_t>(std::clamp(v, -127, 127));
        sum += rb[j];
      }
      qa.e[ib] = e;
      qa.s[ib] = e * static_cast<float>(sum);
    }
  });
}

// Q4_1 panel [B, 4, 32] nibbles -> [B, 8, 32] bytes.
void widen_panel(const uint8_t* packed, int64_t B, uint8_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    for (int t = 0; t < 4; ++t) {
      const uint8_t* src = packed + (b * 4 + t) * 32;
      uint8_t* lo = out + (b * kGroups + 2 * t) * 32;
      uint8_t* hi = lo + 32;
      for (int j = 0; j < 32; ++j) {
        lo[j] = src[j] & 0x0F;
        hi[j] = src[j] >> 4;
      }
    }
  }
}

// Store a tile's rows (8 features each) into y, the first `ncols` features, + bias.
inline void store_rows(const float* tile, int rows, float* y, int64_t ldy, int64_t ncols,
                       const float* bias) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = tile[r * kCols + c] + (bias ? bias[c] : 0.f);
  }
}

#ifdef PAGEDLM_Q8_AVX2
// Eight float16 scales as float32 (exact: GGUF stores them as float16). Kept as float16
// in memory they are a sixth of a Q4_1 panel's bytes instead of a third, and a decode
// step of a few rows spends its time streaming the weights.
inline __m256 load_scales(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows i0 .. i0 + kRows of y over one panel. `w` is the panel's groups as bytes [B, 8, 32]
// (Q4_1: 0..15 unsigned; Q8_0: signed), `sc` its scales.
template <int kRows, bool kQ4>
inline void tile(const int8_t* r, const float* e, const float* s, int64_t K, const uint8_t* w,
                 const at::Half* sc, float* out) {
  const int64_t B = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0;
  const int8_t* r0 = r;
  const int8_t* r1 = r + K;
  const int8_t* r2 = r + 2 * K;
  const int8_t* r3 = r + 3 * K;
  const int8_t* r4 = r + 4 * K;
  const int8_t* r5 = r + 5 * K;
  for (int64_t b = 0; b < B; ++b) {
    // Named accumulators, not an array: gcc keeps these in registers, an array it spills.
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    const uint8_t* wb = w + b * kGroups * 32;
    const int64_t k0 = b * kBlock;
    for (int g = 0; g < kGroups; ++g) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 32));
      int32_t bits;
      if constexpr (kQ4) {
        // Unsigned 0..15 weights times signed activations; int16 sums over the block.
#define PAGEDLM_ROW(i)                                                                  \
  if constexpr (kRows > i) {                                                            \
    std::memcpy(&bits, r##i + k0 + 4 * g, 4);                                           \
    a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(wv, _mm256_set1_epi32(bits)));   \
  }
        PAGEDLM_ROW(0) PAGEDLM_ROW(1) PAGEDLM_ROW(2) PAGEDLM_ROW(3) PAGEDLM_ROW(4) PAGEDLM_ROW(5)
#undef PAGEDLM_ROW
      } else {
        // Signed weights: |w| times the activation carrying w's sign (-128 -> 128 as a byte,
        // 2 * 128 * 127 < 2^15), widened to int32 every group.
        const __m256i aw = _mm256_abs_epi8(wv);
#define PAGEDLM_ROW(i)                                                                      \
  if constexpr (kRows > i) {                                                                \
    std::memcpy(&bits, r##i + k0 + 4 * g, 4);                                               \
    a##i = _mm256_add_epi32(                                                                \
        a##i, _mm256_madd_epi16(                                                            \
                  _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(bits), wv)),  \
                  ones));                                                                   \
  }
        PAGEDLM_ROW(0) PAGEDLM_ROW(1) PAGEDLM_ROW(2) PAGEDLM_ROW(3) PAGEDLM_ROW(4) PAGEDLM_ROW(5)
#undef PAGEDLM_ROW
      }
    }
    if constexpr (kQ4) {
      const __m256 d = load_scales(sc + b * 16);
      const __m256 m = load_scales(sc + b * 16 + 8);
#define PAGEDLM_ROW(i)                                                                      \
  if constexpr (kRows > i) {                                                                \
    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(a##i, ones));                     \
    f##i = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(e[i * B + b])), f##i);        \
    f##i = _mm256_fmadd_ps(m, _mm256_set1_ps(s[i * B + b]), f##i);                          \
  }
      PAGEDLM_ROW(0) PAGEDLM_ROW(1) PAGEDLM_ROW(2) PAGEDLM_ROW(3) PAGEDLM_ROW(4) PAGEDLM_ROW(5)
#undef PAGEDLM_ROW
    } else {
      const __m256 d = load_scales(sc + b * 8);
#define PAGEDLM_ROW(i)                                                                      \
  if constexpr (kRows > i) {                                                                \
    f##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##i), _mm256_mul_ps(d, _mm256_set1_ps(e[i * B + b])), f##i); \
  }
      PAGEDLM_ROW(0) PAGEDLM_ROW(1) PAGEDLM_ROW(2) PAGEDLM_ROW(3) PAGEDLM_ROW(4) PAGEDLM_ROW(5)
#undef PAGEDLM_ROW
    }
  }
  _mm256_storeu_ps(out, f0);
  if constexpr (kRows > 1) _mm256_storeu_ps(out + 8, f1);
  if constexpr (kRows > 2) _mm256_storeu_ps(out + 16, f2);
  if constexpr (kRows > 3) _mm256_storeu_ps(out + 24, f3);
  if constexpr (kRows > 4) _mm256_storeu_ps(out + 32, f4);
  if constexpr (kRows > 5) _mm256_storeu_ps(out + 40, f5);
}

template <bool kQ4>
void run_tile(int rows, const int8_t* r, const float* e, const float* s, int64_t K,
              const uint8_t* w, const at::Half* sc, float* out) {
  switch (rows) {
    case 1: tile<1, kQ4>(r, e, s, K, w, sc, out); break;
    case 2: tile<2, kQ4>(r, e, s, K, w, sc, out); break;
    case 3: tile<3, kQ4>(r, e, s, K, w, sc, out); break;
    case 4: tile<4, kQ4>(r, e, s, K, w, sc, out); break;
    case 5: tile<5, kQ4>(r, e, s, K, w, sc, out); break;
    default: tile<6, kQ4>(r, e, s, K, w, sc, out); break;
  }
}
#else
// Portable path: the same integer sums and scalings, one value at a time.
template <bool kQ4>
void run_tile(int rows, const int8_t* r, const float* e, const float* s, int64_t K,
              const uint8_t* w, const at::Half* sc, float* out) {
  const int64_t B = K / kBlock;
  for (int i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < kCols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int g = 0; g < kGroups; ++g) {
          for (int u = 0; u < 4; ++u) {
            const uint8_t byte = w[(b * kGroups + g) * 32 + 4 * c + u];
            const int32_t q = kQ4 ? static_cast<int32_t>(byte) : static_cast<int8_t>(byte);
            dot += q * r[i * K + b * kBlock + 4 * g + u];
          }
        }
        if constexpr (kQ4) {
          acc = std::fma(static_cast<float>(dot), static_cast<float>(sc[b * 16 + c]) * e[i * B + b], acc);
          acc = std::fma(static_cast<float>(sc[b * 16 + 8 + c]), s[i * B + b], acc);
        } else {
          acc = std::fma(static_cast<float>(dot), static_cast<float>(sc[b * 8 + c]) * e[i * B + b], acc);
        }
      }
      out[i * kCols + c] = acc;
    }
  }
}
#endif

template <bool kQ4>
void run_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
              int64_t N, const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), B = K / kBlock, P = packed.size(0);
  if (M == 0 || N == 0) return;
  // The calling thread's rounded activations, kept between calls: their memory is still in
  // cache at the next call and needs no allocation. (A reference, so that the worker
  // threads below use this thread's copy, not their own.)
  static thread_local Quantized kept;
  Quantized& qa = kept;
  quantize_rows(x.data_ptr<float>(), M, K, qa);
  const uint8_t* w_p = packed.data_ptr<uint8_t>();
  const at::Half* sc_p = scales.data_ptr<at::Half>();
  const float* bias_p = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* y_p = y.data_ptr<float>();
  const int64_t panel_bytes = packed[0].numel();
  const int64_t scale_floats = scales[0].numel();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> widened(kQ4 ? B * kGroups * 32 : 0);
    alignas(32) float out[kMaxTile * kCols];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* w = w_p + p * panel_bytes;
      if constexpr (kQ4) {
        widen_panel(w, B, widened.data());
        w = widened.data();
      }
      const int64_t ncols = std::min(kCols, N - p * kCols);
      for (int64_t i0 = 0; i0 < M; i0 += kMaxTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxTile, M - i0));
        run_tile<kQ4>(rows, qa.r.data() + i0 * K, qa.e.data() + i0 * B, qa.s.data() + i0 * B, K,
                      w, sc_p + p * scale_floats, out);
        store_rows(out, rows, y_p + i0 * N + p * kCols, N, ncols,
                   bias_p ? bias_p + p * kCols : nullptr);
      }
    }
  });
}

}  // namespace

// x [M, K] float32 contiguous, K a multiple of 32; packed and scales as in the header
// (`q4_1` chooses the format); N output features; bias [N] float32 or None; y [M, N]
// float32 contiguous (a preallocated buffer, or leading rows of one).
void q8_gemm_into(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                  int64_t N, bool q4_1, const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu(),
              "q8_gemm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1), B = K / kBlock, P = (N + kCols - 1) / kCols;
  TORCH_CHECK(K % kBlock == 0, "x has ", K, " features, not a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == P && packed.size(1) == B &&
                  packed.size(2) == (q4_1 ? 4 : kGroups) && packed.size(3) == 32,
              "packed must be contiguous uint8 [", P, ", ", B, ", ", (q4_1 ? 4 : kGroups),
              ", 32] for N=", N, ", K=", K);
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.numel() == P * B * (q4_1 ? 16 : 8),
              "scales must be contiguous float16 with ", P * B * (q4_1 ? 16 : 8), " values");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat &&
                    bias->is_contiguous(),
                "bias must be contiguous float32 [N]");
  }
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == N &&
                  y.scalar_type() == torch::kFloat && y.is_contiguous(),
              "y must be a contiguous float32 [", x.size(0), ", ", N, "] tensor");
  if (q4_1) {
    run_gemm<true>(x, packed, scales, N, bias, y);
  } else {
    run_gemm<false>(x, packed, scales, N, bias, y);
  }
}

// As q8_gemm_into, into a new float32 [M, N] tensor.
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                      bool q4_1, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "x must be a contiguous float32 [M, K] tensor");
  torch::Tensor y = torch::empty({x.size(0), N}, x.options().dtype(torch::kFloat));
  q8_gemm_into(x, packed, scales, N, q4_1, bias, y);
  return y;
}

#ifndef PAGEDLM_NO_PYBIND_MODULE  // set where another kernel file includes this one
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_gemm", &q8_gemm,
        "x @ W.T (+ bias) with W in Q4_1/Q8_0 blocks and x rounded to int8 per 32 values, CPU");
}
#endif
