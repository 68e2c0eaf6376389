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
// Where the compiler targets AVX-512 VNNI, pairs of panels run through one 512-bit
// vpdpbusd per row and group instead (tile512), and fours through two (tile512x4): the
// same integer sums, the same bits.
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
// ones one int32 sum of 4. Micro-kernel: up to 4 rows of x by two panels (Q4_1) or 6 rows
// by one panel (Q8_0, and a last odd Q4_1 panel); per block, int16 (Q4_1) or int32 (Q8_0)
// sums per row and panel, then one float32 FMA with d * e (and one with m * s).
// Threads split the panels. Up to kUnpackRows rows of x, the micro-kernel unpacks a Q4_1
// panel's nibbles in registers; past that, rows go in chunks that fit L2, and for each
// chunk a thread widens a panel's nibbles to bytes into a buffer that stays in L1 while
// every row tile of the chunk runs over it. Every output is the same sequence of operations whatever
// the tile, chunk or thread it falls in, so a row's result does not depend on its batch.
//
// The micro-kernels: q8_gemm_tiles.h (the format's constants, the AVX2 tile, the portable
// path) and q8_gemm_tiles512.h (the AVX-512 VNNI tiles); this file rounds the activations,
// splits rows and panels over threads and binds the entry points.

#include "lite_bind.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "q8_gemm_tiles.h"
#include "q8_gemm_tiles512.h"

namespace {

constexpr int64_t kUnpackRows = 32;  // up to this many rows of x, Q4_1 panels stay packed
// A 512-bit tile over packed panels prefetches, block by block, the same block of the
// thread's next pair of panels, so that the weights stream from memory while the tile
// computes. Without it a step of a few rows waits on memory and then computes, instead of
// both at once: with the weights streaming (`benchmarks/cpu/q8_gemm_revs.py --stream`),
// 1.14x at 1 row, 1.24-1.32x at 4-8 rows (the rows of a speculative verification); one,
// two or three pairs ahead measured the same. Past kPrefetchRows rows a panel is reused by
// enough tiles to hide its load, and the prefetches measured 2-3% slower.
constexpr int64_t kPrefetchRows = 64;

// Activations of one call: r [M, K] int8, e and s [M, B] float32 (see the header); c [M, B]
// = -128 * sum_j r[i, 32b + j], the offset term of a Q8_0 block's products with w + 128.
struct Quantized {
  std::vector<int8_t> r;
  std::vector<float> e, s;
  std::vector<int32_t> c;
};

void quantize_rows(const float* x, int64_t M, int64_t K, Quantized& qa) {
  const int64_t B = K / kBlock;
  qa.r.resize(M * K);
  qa.e.resize(M * B);
  qa.s.resize(M * B);
  qa.c.resize(M * B);
  at::parallel_for(0, M * B, 64, [&](int64_t begin, int64_t end) {
    for (int64_t ib = begin; ib < end; ++ib) {
      const float* xb = x + ib * kBlock;  // row i, block b: x is [M, K] contiguous
      int8_t* rb = qa.r.data() + ib * kBlock;
#ifdef PAGEDLM_Q8_AVX2
      // The loop below on 8 lanes: the same products, rounded by vcvtps2dq (to nearest,
      // half to even, as nearbyint in the default rounding mode).
      __m256 v[4];
      __m256 vmax = _mm256_setzero_ps();
      const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        vmax = _mm256_max_ps(_mm256_and_ps(v[j], no_sign), vmax);  // a NaN lane keeps vmax, as std::max
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const float e = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
      __m256i q[4], vsum = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        q[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv)), lo), hi);
        vsum = _mm256_add_epi32(vsum, q[j]);
      }
      // int32 -> int8 in order: the packs work within 128-bit lanes, the permute undoes that.
      const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rb),
                          _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(vsum), _mm256_extracti128_si256(vsum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
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
#endif
      qa.e[ib] = e;
      qa.s[ib] = e * static_cast<float>(sum);
      qa.c[ib] = -128 * sum;
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

// Rows [i_begin, i_end) of y over kPan adjacent panels starting at panel p (widened `w`,
// second panel at w + wstride): tiles of the most rows the micro-kernel takes. The first
// 512-bit tile also prefetches the pair of panels at `pf_w` / `pf_sc` (if not null).
template <int kPan, bool kQ4, bool kPacked>
void panel_rows(const Quantized& qa, int64_t i_begin, int64_t i_end, int64_t K, const uint8_t* w,
                int64_t wstride, const at::Half* sc, int64_t sstride, int64_t p, int64_t N,
                const float* bias, float* y, const uint8_t* pf_w = nullptr,
                const at::Half* pf_sc = nullptr) {
#ifdef PAGEDLM_Q8_VNNI512
  constexpr bool kWide = kPan == 2;  // pairs of panels go through tile512
  constexpr bool kQuad = kPan == 4;  // fours through tile512x4
#else
  constexpr bool kWide = false;
  constexpr bool kQuad = false;
  static_assert(kPan <= 2, "four panels at a time need the 512-bit tiles");
#endif
  constexpr int kTile = kWide ? 8 : kQuad ? 6 : kPan == 1 ? 6 : 4;
  // Four panels take 6 rows a tile where more than 8 rows come (1.03-1.05x at 16-512 rows,
  // `benchmarks/cpu/q8_gemm_revs.py`), 4 below (6 + 2 for 8 rows measured 0.96x).
  const int64_t tile = kQuad && i_end - i_begin <= 8 ? 4 : kTile;
  const int64_t B = K / kBlock;
  alignas(64) float out[kTile * kPan * kCols];
  for (int64_t i0 = i_begin; i0 < i_end; i0 += tile) {
    const int rows = static_cast<int>(std::min<int64_t>(tile, i_end - i0));
#ifdef PAGEDLM_Q8_VNNI512
    if constexpr (kQuad) {
      run_tile512x4<kQ4, kPacked>(rows, qa.r.data() + i0 * K, qa.e.data() + i0 * B, qa.s.data() + i0 * B,
                                  qa.c.data() + i0 * B, K, w, wstride, sc, sstride, out,
                                  i0 == i_begin ? pf_w : nullptr, pf_sc);
    } else if constexpr (kWide) {
      run_tile512<kQ4, kPacked>(rows, qa.r.data() + i0 * K, qa.e.data() + i0 * B, qa.s.data() + i0 * B,
                                qa.c.data() + i0 * B, K, w, wstride, sc, sstride, out,
                                i0 == i_begin ? pf_w : nullptr, pf_sc);
    } else
#endif
    if constexpr (!kQuad) run_tile<kPan, kQ4, kPacked>(rows, qa.r.data() + i0 * K, qa.e.data() + i0 * B, qa.s.data() + i0 * B, K,
                        w, wstride, sc, sstride, out);
    for (int j = 0; j < kPan; ++j) {
      const int64_t col = (p + j) * kCols;
      for (int i = 0; i < rows; ++i) {
        const float* o = out + (i * kPan + j) * kCols;
        float* yr = y + (i0 + i) * N + col;
        for (int64_t c = 0; c < std::min(kCols, N - col); ++c) yr[c] = o[c] + (bias ? bias[col + c] : 0.f);
      }
    }
  }
}

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
  // Elements of one panel and of its scales.
  const int64_t panel_bytes = packed.size(0) ? packed.numel() / packed.size(0) : 0;
  const int64_t scale_count = scales.size(0) ? scales.numel() / scales.size(0) : 0;
  const int64_t wide_bytes = B * kGroups * 32;
  // Rows go in chunks of about 192 KiB of rounded activations, which stay in L2 while every
  // panel of the thread runs over them (a Q4_1 panel is widened again per chunk: 1/mc of
  // the work). Measured 1.2x at 2048 rows over one pass of every panel.
  const int64_t mc = std::max<int64_t>(24, (196608 / K) / 12 * 12);
  // Threads split units of panels: pairs (the last panel alone where P is odd), except for
  // Q8_0 on AVX2, whose two extra operations per multiply (sign, widening) leave no
  // registers for a second panel (pairs measured 0.7x at 4 rows on the LM head).
#ifdef PAGEDLM_Q8_VNNI512
  constexpr int64_t kUnit = 4;  // 512-bit tiles hold Q8_0 pairs too, and fours (tile512x4)
#else
  constexpr int64_t kUnit = kQ4 ? 2 : 1;
#endif
  // Up to kUnpackRows rows, the tiles unpack Q4_1 nibbles in registers instead of reading
  // a widened copy: 1.5 operations per group and row tile against a store and reload of
  // every panel per call, which dominates when a panel meets few rows. Measured per layer
  // shape, 2 threads: 1.5-2x at 1-2 rows, 1.1-1.3x at 4-16, even at 32.
  // The 512-bit tiles unpack for 8 rows at a time: there, packed was never slower than
  // widened (`benchmarks/cpu/q8_gemm_revs.py --baseline-rev e73e1f0`: 1.00-1.05x, 1-2048 rows).
#ifdef PAGEDLM_Q8_VNNI512
  const bool in_registers = kQ4;
#else
  const bool in_registers = kQ4 && M <= kUnpackRows;
#endif
  at::parallel_for(0, (P + kUnit - 1) / kUnit, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> widened(kQ4 && !in_registers ? 2 * wide_bytes : 0);
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
      const int64_t m1 = std::min(M, m0 + mc);
      for (int64_t u = begin; u < end; ++u) {
#ifdef PAGEDLM_Q8_VNNI512
        if (kUnit * u + 3 < P) {  // four panels
          const int64_t p = kUnit * u;
          const uint8_t* w = w_p + p * panel_bytes;
          const at::Half* sc = sc_p + p * scale_count;
          const bool next = m1 - m0 <= kPrefetchRows && u + 1 < end && p + 7 < P;
          const uint8_t* pf = next ? w + 4 * panel_bytes : nullptr;
          if (in_registers) {
            panel_rows<4, kQ4, true>(qa, m0, m1, K, w, panel_bytes, sc, scale_count, p, N, bias_p, y_p,
                                     pf, sc + 4 * scale_count);
          } else {
            panel_rows<4, kQ4, false>(qa, m0, m1, K, w, panel_bytes, sc, scale_count, p, N, bias_p, y_p,
                                      pf, sc + 4 * scale_count);
          }
          continue;
        }
#endif
        // The panels of a unit in pairs (the last alone where their count is odd).
        for (int64_t p = kUnit * u; p < std::min(P, kUnit * (u + 1)); p += (kUnit == 1 ? 1 : 2)) {
        const bool pair = kUnit > 1 && p + 1 < P;
        const uint8_t* w = w_p + p * panel_bytes;
        const at::Half* sc = sc_p + p * scale_count;
        if (in_registers) {
          if (pair) {
            // The thread's next pair (a whole one), fetched while this one computes.
            const bool next = kUnit == 2 && m1 - m0 <= kPrefetchRows && u + 1 < end && p + 3 < P;
            panel_rows<2, kQ4, true>(qa, m0, m1, K, w, panel_bytes, sc, scale_count, p, N, bias_p, y_p,
                                     next ? w + 2 * panel_bytes : nullptr, sc + 2 * scale_count);
          } else {
            panel_rows<1, kQ4, true>(qa, m0, m1, K, w, panel_bytes, sc, scale_count, p, N, bias_p, y_p);
          }
          continue;
        }
        int64_t wstride = panel_bytes;
        if constexpr (kQ4) {
          widen_panel(w, B, widened.data());
          if (pair) widen_panel(w + panel_bytes, B, widened.data() + wide_bytes);
          w = widened.data();
          wstride = wide_bytes;
        }
        if (pair) {
          // Q8_0 panels are read as stored: the next pair is prefetched as above.
          const bool next = kUnit == 2 && !kQ4 && m1 - m0 <= kPrefetchRows && u + 1 < end && p + 3 < P;
          panel_rows<2, kQ4, false>(qa, m0, m1, K, w, wstride, sc, scale_count, p, N, bias_p, y_p,
                                    next ? w + 2 * panel_bytes : nullptr, sc + 2 * scale_count);
        } else {
          panel_rows<1, kQ4, false>(qa, m0, m1, K, w, wstride, sc, scale_count, p, N, bias_p, y_p);
        }
        }
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

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), which
// compiles this file with its own: one build instead of two (csrc/__init__.py BUNDLED).
inline void bind_q8_gemm_cpu(lite_bind::Module& m) {
  m.def<&q8_gemm>("q8_gemm", "x @ W.T (+ bias) with W in Q4_1/Q8_0 blocks and x rounded to int8 per 32 values, CPU");
}
