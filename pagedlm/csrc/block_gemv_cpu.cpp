// y = x @ W.T (+ bias) for a few rows of x, with W stored in ggml's 32-value block formats
// (Q4_1 or Q8_0) and dequantised in registers. Decode steps with few sequences are bound by
// the bytes of weights streamed from memory; a Q4_1 weight is 5 bits per value against 16
// (float16) or 32 (float32).
//
// The blocks hold exactly the values the loader dequantised (layers/quant_block_weights.py
// recovers them and checks every block), so the maths is that of F.linear on the float32
// weights; only the order of the float32 sums differs:
//
//   Q4_1:  w = fma(d, q, m)   d, m float16 widened to float32, q in 0..15
//   Q8_0:  w = d * q          d float16 widened to float32, q in -128..127
//   y[i, n] = sum_k x[i, k] * w[n, k]  (float32 FMAs)  + bias[n]
//
// d * q needs at most 11 + 8 significant bits, so it is exact in float32: fma(d, q, m) is
// the loader's round(round(d * q) + m) and d * q its round(d * q).
//
// Layout: blocks [N, K / 32, bytes] uint8, row n's blocks contiguous, each block as in a
// GGUF file, so one output row streams one contiguous span:
//
//   Q4_1 (20 B):  d f16 | m f16 | qs[16]    value j  = low nibble of qs[j],
//                                           value j + 16 = high nibble of qs[j]
//   Q8_0 (34 B):  d f16 | q[32] int8
//
// Each thread takes a range of output rows n; for each row and each tile of <= 8 rows of x,
// a block is widened once into registers (two of 16 lanes, or four of 8) and used by every
// row of the tile (x stays in L1/L2). Work per block is a few shifts and conversions.

#include "lite_bind.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLM_BLOCK_AVX2 1
#endif

#include "cpu_vec.h"

// Named (not anonymous) so that llama_decode_cpu.cpp can include this file next to others.
namespace pagedlm_block {

using namespace pagedlm_vec;

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;
constexpr int kMaxTile = 8;
// Each output row also prefetches the weights of the row this many ahead: at 1-2 rows of x
// the hardware prefetcher keeps up with the stream alone, but at 4-8 (a speculative
// verification) the FMAs of a row delay the loads of the next, and the prefetch overlaps
// them (`benchmarks/cpu/block_gemv_revs.py`, the model's linear layers with every layer its
// own weights: 1.04-1.07x at 4 rows, 1.11-1.17x at 6-8, level at 1-2; one, two or four rows
// ahead measured alike).
constexpr int64_t kPrefetchRowsAhead = 2;

#if defined(PAGEDLM_BLOCK_AVX2)
#if defined(__AVX512F__)
// With 16-lane registers, where the CPU has them: a block is two registers and a row two
// FMAs per block. Every row keeps two accumulators whatever the tile's height, so a row's
// sums are added in the same order alone or beside others: its result does not depend on
// the batch, and a speculative verification's k + 1 rows give what plain decoding gives.
// (The 8-lane tile below splits a row's sums by the tile's height.)
// w0 holds values 0 .. 15 of the block, w1 values 16 .. 31.
inline void widen16_q4_1(const uint8_t* blk, __m512& w0, __m512& w1) {
  int32_t dm_bits;
  std::memcpy(&dm_bits, blk, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));  // [d, m, 0, 0]
  const __m512 d = _mm512_broadcastss_ps(dm);
  const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
  w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))), m);
  w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), m);
}
inline void widen16_q8_0(const uint8_t* blk, __m512& w0, __m512& w1) {
  uint16_t dbits;
  std::memcpy(&dbits, blk, 2);
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(dbits));
  const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
  w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
  w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
}

template <int MT, bool kQ4>
inline void row_tile(const float* x, int64_t K, const uint8_t* row, int64_t num_blocks,
                     float* y, int64_t ldy) {
  constexpr int64_t kBytes = kQ4 ? kQ4_1Bytes : kQ8_0Bytes;
  __m512 acc0[MT], acc1[MT];
  for (int i = 0; i < MT; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 w0, w1;
    if constexpr (kQ4) {
      widen16_q4_1(row + b * kBytes, w0, w1);
    } else {
      widen16_q8_0(row + b * kBytes, w0, w1);
    }
    const float* xb = x + b * kBlock;
    for (int i = 0; i < MT; ++i) {
      acc0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K), w0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K + 16), w1, acc1[i]);
    }
  }
  for (int i = 0; i < MT; ++i) y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

#else
// w[g] holds values 8g .. 8g + 7 of the block.
inline void widen_q4_1(const uint8_t* blk, __m256 w[4]) {
  int32_t dm_bits;
  std::memcpy(&dm_bits, blk, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));  // [d, m, 0, 0]: one conversion
  const __m256 d = _mm256_broadcastss_ps(dm);
  const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m256i lo_mask = _mm256_set1_epi32(0x0F);
  // Bytes 0..7 give values 0..7 (low nibbles) and 16..23 (high); bytes 8..15 the rest.
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 12)));
  w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, lo_mask)), m);
  w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, lo_mask)), m);
  w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m);
  w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m);
}
inline void widen_q8_0(const uint8_t* blk, __m256 w[4]) {
  uint16_t dbits;
  std::memcpy(&dbits, blk, 2);
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(dbits));
  for (int g = 0; g < 4; ++g) {
    const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * g));
    w[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
  }
}

// One output row n for MT rows of x. Each x row takes four FMAs per block; NA independent
// accumulators per row split them into chains of 4 / NA, so that the FMA latency (4
// cycles) does not bound a block at 16 cycles when MT is small. MT * NA accumulators +
// 4 weights + 1 operand stay within the 16 ymm registers.
template <int MT, bool kQ4>
inline void row_tile(const float* x, int64_t K, const uint8_t* row, int64_t num_blocks,
                     float* y, int64_t ldy) {
  constexpr int NA = MT <= 2 ? 4 : (MT <= 4 ? 2 : 1);
  constexpr int64_t kBytes = kQ4 ? kQ4_1Bytes : kQ8_0Bytes;
  __m256 acc[MT][NA];
  for (int i = 0; i < MT; ++i)
    for (int a = 0; a < NA; ++a) acc[i][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m256 w[4];
    if constexpr (kQ4) {
      widen_q4_1(row + b * kBytes, w);
    } else {
      widen_q8_0(row + b * kBytes, w);
    }
    const float* xb = x + b * kBlock;
    for (int i = 0; i < MT; ++i) {
      for (int g = 0; g < 4; ++g) {
        acc[i][g % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * K + 8 * g), w[g], acc[i][g % NA]);
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    __m256 s = acc[i][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[i][a]);
    y[i * ldy] = hsum(s);
  }
}

#endif  // __AVX512F__

template <bool kQ4>
void row_all(const float* x, int64_t M, int64_t K, const uint8_t* row, int64_t num_blocks,
             float* y, int64_t ldy) {
  for (int64_t i0 = 0; i0 < M; i0 += kMaxTile) {
    const float* xi = x + i0 * K;
    float* yi = y + i0 * ldy;
    switch (std::min<int64_t>(M - i0, kMaxTile)) {
      case 1: row_tile<1, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      case 2: row_tile<2, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      case 3: row_tile<3, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      case 4: row_tile<4, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      case 5: row_tile<5, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      case 6: row_tile<6, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      case 7: row_tile<7, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
      default: row_tile<8, kQ4>(xi, K, row, num_blocks, yi, ldy); break;
    }
  }
}
#else
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The 32 values of one block as float32, in element order (portable reference path).
inline void dequant_q4_1(const uint8_t* blk, float* w) {
  const float d = half_at(blk), m = half_at(blk + 2);
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;  // d * q exact: one rounding
    w[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
  }
}
inline void dequant_q8_0(const uint8_t* blk, float* w) {
  const float d = half_at(blk);
  for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
}

template <bool kQ4>
void row_all(const float* x, int64_t M, int64_t K, const uint8_t* row, int64_t num_blocks,
             float* y, int64_t ldy) {
  constexpr int64_t kBytes = kQ4 ? kQ4_1Bytes : kQ8_0Bytes;
  float acc[kMaxTile];
  float w[kBlock];
  for (int64_t i0 = 0; i0 < M; i0 += kMaxTile) {
    const int64_t mt = std::min<int64_t>(M - i0, kMaxTile);
    std::fill(acc, acc + mt, 0.f);
    for (int64_t b = 0; b < num_blocks; ++b) {
      if constexpr (kQ4) {
        dequant_q4_1(row + b * kBytes, w);
      } else {
        dequant_q8_0(row + b * kBytes, w);
      }
      for (int64_t i = 0; i < mt; ++i) {
        const float* xb = x + (i0 + i) * K + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += xb[j] * w[j];
        acc[i] += s;
      }
    }
    for (int64_t i = 0; i < mt; ++i) y[(i0 + i) * ldy] = acc[i];
  }
}
#endif

template <bool kQ4>
void run(const torch::Tensor& x, const torch::Tensor& blocks, const c10::optional<torch::Tensor>& bias,
         torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), num_blocks = blocks.size(1);
  if (M == 0 || N == 0) return;
  const float* x_p = x.data_ptr<float>();
  const uint8_t* w_p = blocks.data_ptr<uint8_t>();
  float* y_p = y.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1) * blocks.size(2);
  // Enough rows per task that the split costs nothing next to streaming them.
  const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (n + kPrefetchRowsAhead < end) {
        const char* ahead = reinterpret_cast<const char*>(w_p + (n + kPrefetchRowsAhead) * row_bytes);
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
      }
      row_all<kQ4>(x_p, M, K, w_p + n * row_bytes, num_blocks, y_p + n, N);
    }
  });
  if (bias.has_value()) {  // y += bias, row by row (as torch's broadcast add)
    const float* b_p = bias->data_ptr<float>();
    const int64_t b_stride = bias->stride(0);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) y_p[m * N + n] += b_p[n * b_stride];
    }
  }
}

void check_and_run(const torch::Tensor& x, const torch::Tensor& blocks,
                   const c10::optional<torch::Tensor>& bias, int64_t block_bytes, bool q4,
                   torch::Tensor& y) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "block GEMV runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == torch::kByte && blocks.is_contiguous() &&
                  blocks.size(2) == block_bytes,
              "blocks must be contiguous uint8 [N, K / 32, ", block_bytes, "]");
  TORCH_CHECK(x.size(1) == blocks.size(1) * kBlock, "x has ", x.size(1),
              " features but the blocks hold ", blocks.size(1) * kBlock);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == blocks.size(0) &&
                    bias->scalar_type() == torch::kFloat,
                "bias must be float32 [N]");
  }
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == blocks.size(0) &&
                  y.scalar_type() == torch::kFloat && y.is_contiguous(),
              "y must be a contiguous float32 [", x.size(0), ", ", blocks.size(0), "] tensor");
  if (q4) {
    run<true>(x, blocks, bias, y);
  } else {
    run<false>(x, blocks, bias, y);
  }
}

torch::Tensor check_and_run(const torch::Tensor& x, const torch::Tensor& blocks,
                            const c10::optional<torch::Tensor>& bias, int64_t block_bytes, bool q4) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 3, "x must be [M, K] and blocks [N, K / 32, bytes]");
  torch::Tensor y = torch::empty({x.size(0), blocks.size(0)}, x.options().dtype(torch::kFloat));
  check_and_run(x, blocks, bias, block_bytes, q4, y);
  return y;
}

// x [M, K] float32 contiguous; blocks [N, K / 32, 20] uint8 (Q4_1); bias [N] or None.
// Returns float32 [M, N].
torch::Tensor q4_1_gemv(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> bias) {
  return check_and_run(x, blocks, bias, kQ4_1Bytes, true);
}

// x [M, K] float32 contiguous; blocks [N, K / 32, 34] uint8 (Q8_0); bias [N] or None.
// Returns float32 [M, N].
torch::Tensor q8_0_gemv(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> bias) {
  return check_and_run(x, blocks, bias, kQ8_0Bytes, false);
}

// Into y [M, N] float32 contiguous (a preallocated buffer): Q4_1 blocks if `q4_1`, else Q8_0.
void block_gemv_into(const torch::Tensor& x, const torch::Tensor& blocks, bool q4_1,
                     const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  check_and_run(x, blocks, bias, q4_1 ? kQ4_1Bytes : kQ8_0Bytes, q4_1, y);
}

}  // namespace pagedlm_block

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), which
// compiles this file with its own: one build instead of two (csrc/__init__.py BUNDLED).
inline void bind_block_gemv_cpu(lite_bind::Module& m) {
  m.def<&pagedlm_block::q4_1_gemv>("q4_1_gemv", "x @ W.T (+ bias) with W in Q4_1 blocks, CPU");
  m.def<&pagedlm_block::q8_0_gemv>("q8_0_gemv", "x @ W.T (+ bias) with W in Q8_0 blocks, CPU");
}
