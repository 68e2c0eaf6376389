// The exponential race (Gumbel-max) of the sampler's random rows, fused for CPU: hash, noise
// and argmax in one pass over the logits, instead of ~20 torch passes over [rows, vocab] int64
// tensors. The maths is that of pagedlm/sample/noise.py (random_uniform, exponential_race):
//
//   token_r = argmax_j  y_j - log(-log u_j),   y_j = x_j / temperature_r   (ties: lowest j)
//
// with u_j from a counter-based splitmix64 hash, in unsigned 64-bit arithmetic
// (G = 0x9E3779B97F4A7C15, mix64 = splitmix64's finaliser):
//
//   key_r = mix64(mix64(seed_r + G) ^ step_r)
//   b_j   = mix64(key_r + (j + 1) G) >> 41              23 bits, bit-equal to torch's
//   u_j   = (b_j + 1/2) / 2^23                          exact in float32, so u is bit-equal too
//
// Noise. g_j = -log(-log u_j) is two polynomial logs (Cephes' logf: a degree-8 polynomial of
// the mantissa) rather than libm calls, so that 8 lanes go at once. Over all 2^23 values of b
// its largest difference from the float64 value is 5.4e-7, as for torch's float32 log(-log u)
// (tests/test_sampler_cpu.py checks every b): the kernel's pick can differ from the torch
// reference's only where a row's two best race values are within about 1e-6, i.e. at float
// rounding. (The scalar fallback, for CPUs without AVX2 + FMA, rounds a little differently;
// within one build an element's value never depends on the batch or the threads.)
//
// Two exact prefilters; the kernel returns precisely argmax_j fl(y_j - l_j) of its own values
// l_j = log(-log u_j), skipped elements included:
//  1. g lies in [-2.8116, 16.6356] for every b (b = 0, b = 2^23 - 1), inside [kNoiseMin,
//     kNoiseMax]. With M the largest y of a chunk, the element holding M has a race of at least
//     T = fl(M + kNoiseMin); later T is the best race computed so far. A block of 32 whose every
//     fl(y + kNoiseMax) is below T holds no winner (fl is monotone), and is not even hashed:
//     masked (-inf) tokens cost a compare.
//  2. Once hashed, g_j <= -log(1 - u_j) <= (23 - floor(log2(2^23 - b_j - 1/2))) ln2, an exponent
//     read (noise_bound8). A block whose every y + that bound is below T needs no log. The
//     bound exceeds g by less than 0.77 wherever g > 2, and only near-record noise can lift a
//     token to the top, so logs are computed for a few blocks per row: the cost is the hash.
//
// Work split: item = (row, chunk of the vocabulary); a single row is cut into several chunks so
// that every thread has work, and the chunk results are merged per row afterwards. Every race
// value is a function of (y_j, key_r, j) alone and the merge is exact, so the pick does not
// depend on the batch, the chunking or the number of threads.
//
// Special values, as torch.argmax of the reference race: -inf never wins unless the whole row
// is -inf (then index 0); +inf beats every finite value; NaN beats everything (first NaN).
//
// The hash and the noise's logs: sampler_noise.h; this file races the rows and binds the
// entry points.

#include "lite_bind.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

#include "sampler_noise.h"

namespace {

constexpr float kNoiseMin = -2.82f;   // < -log(-log(2^-24))      = -2.81154 (b = 0)
constexpr float kNoiseMax = 16.64f;   // > -log(-log(1 - 2^-24))  = 16.63553 (b = 2^23 - 1)
constexpr int64_t kBlock = 32;        // elements per prefilter test; chunks start at multiples
constexpr int64_t kMinChunk = 4096;   // smallest vocabulary chunk worth a work item
constexpr float kInf = std::numeric_limits<float>::infinity();

// The best (value, index) seen so far; `beats` is torch.argmax's order: NaN first, then larger
// values, then the lower index.
struct Best {
  float value;
  int64_t index;
};

inline bool beats(const Best& a, const Best& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

inline int64_t first_nan(const float* x, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    if (std::isnan(x[j])) return j;
  }
  return -1;
}

// A chunk without a value above -inf: every race is -inf (the lowest index wins) unless one
// is NaN. Top-k masks leave most chunks like this, so they are answered without hashing.
inline Best all_masked(const float* x, int64_t begin, int64_t end) {
  const int64_t nan = first_nan(x, begin, end);
  return nan < 0 ? Best{-kInf, begin} : Best{std::numeric_limits<float>::quiet_NaN(), nan};
}

#if defined(__AVX2__) && defined(__FMA__)

// One row's chunk [begin, end): begin is a multiple of kBlock, end too unless it is the row's end.
// A block of kBlock = 32 values is 4 vectors; each stage runs on all 4, so that their long
// dependency chains (the hash's multiplies, the logs' polynomials) overlap.
template <bool kScaled>
Best race_chunk(const float* x, float temperature, uint64_t key, int64_t begin, int64_t end) {
  constexpr int kVecs = kBlock / 8;
  const __m256 vt = _mm256_set1_ps(temperature);
  __m256 vmax = _mm256_set1_ps(-kInf);
  int64_t j = begin;
  for (; j + 8 <= end; j += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(x + j), vmax);  // NaN skipped
  float m = _mm256_cvtss_f32(hmax8(vmax));
  for (; j < end; ++j) m = std::max(m, x[j]);  // this order skips NaN too
  if (m == -kInf) return all_masked(x, begin, end);
  if (kScaled) m /= temperature;  // division by t > 0 is monotone: the max of y
  __m256 threshold = _mm256_set1_ps(m + kNoiseMin);

  const __m256 noise_max = _mm256_set1_ps(kNoiseMax);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Per lane, the best race so far and its index: lane l sees indices = l mod 8 in increasing
  // order and keeps the first of equal values, so the lowest index wins ties.
  __m256 best = _mm256_set1_ps(-kInf);
  __m256i best_index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(begin)), lane);
  __m256 any_nan = _mm256_setzero_ps();
  alignas(32) float tail[kBlock];
  for (j = begin; j < end; j += kBlock) {
    const float* p = x + j;
    if (end - j < kBlock) {  // the row's last block: pad with -inf, which never wins
      std::fill(tail, tail + kBlock, -kInf);
      std::copy(x + j, x + end, tail);
      p = tail;
    }
    __m256 y[kVecs], bound[kVecs];
    for (int k = 0; k < kVecs; ++k) {
      y[k] = _mm256_loadu_ps(p + 8 * k);
      if (kScaled) y[k] = _mm256_div_ps(y[k], vt);
      bound[k] = noise_max;
    }
    if (!any_reaches<kVecs>(y, bound, threshold)) continue;  // no hash needed
    __m256i bits[kVecs];
    for (int k = 0; k < kVecs; ++k) {
      bits[k] = uniform_bits8(key, j + 8 * k);
      bound[k] = noise_bound8(bits[k]);
    }
    if (!any_reaches<kVecs>(y, bound, threshold)) continue;  // no log needed
    __m256 race[kVecs];
    log_exponential8<kVecs>(bits, race);
    for (int k = 0; k < kVecs; ++k) {
      race[k] = _mm256_sub_ps(y[k], race[k]);
      any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(y[k], y[k], _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(race[k], best, _CMP_GT_OQ);
      const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j + 8 * k)), lane);
      best = _mm256_blendv_ps(best, race[k], gt);
      best_index = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(at), gt));
      // maxps returns its second operand when one is NaN: NaN never reaches the threshold.
      threshold = _mm256_max_ps(race[k], threshold);
    }
    threshold = hmax8(threshold);
  }
  if (_mm256_movemask_ps(any_nan) != 0) {
    return {std::numeric_limits<float>::quiet_NaN(), first_nan(x, begin, end)};
  }
  alignas(32) float values[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), best_index);
  Best result{values[0], indices[0]};
  for (int i = 1; i < 8; ++i) {
    const Best b{values[i], indices[i]};
    if (beats(b, result)) result = b;
  }
  return result;
}

// out[j] = u_j for j in [0, n).
void uniform_row(uint64_t key, int64_t n, float* out) {
  alignas(32) float tail[8];
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 u = uniform8(uniform_bits8(key, j));
    if (n - j >= 8) {
      _mm256_storeu_ps(out + j, u);
    } else {
      _mm256_store_ps(tail, u);
      std::copy(tail, tail + (n - j), out + j);
    }
  }
}

// out[i] = -log(-log u(bits[i])) for i in [0, n).
void noise_from_bits_range(const int32_t* bits, int64_t n, float* out) {
  alignas(32) int32_t in[8];
  alignas(32) float res[8];
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t k = std::min<int64_t>(8, n - i);
    std::fill(in, in + 8, 0);
    std::copy(bits + i, bits + i + k, in);
    const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(in));
    __m256 l;
    log_exponential8<1>(&b, &l);
    _mm256_store_ps(res, _mm256_xor_ps(l, _mm256_set1_ps(-0.0f)));
    std::copy(res, res + k, out + i);
  }
}

#else

// Portable scalar path (no AVX2 + FMA): the same race one element at a time.

template <bool kScaled>
Best race_chunk(const float* x, float temperature, uint64_t key, int64_t begin, int64_t end) {
  float m = -kInf;
  for (int64_t j = begin; j < end; ++j) m = std::max(m, x[j]);  // this order skips NaN
  if (m == -kInf) return all_masked(x, begin, end);
  if (kScaled) m /= temperature;
  float threshold = m + kNoiseMin;
  Best best{-kInf, begin};
  for (int64_t j = begin; j < end; ++j) {
    const float y = kScaled ? x[j] / temperature : x[j];
    if (y + kNoiseMax < threshold) continue;
    if (std::isnan(y)) return {y, j};
    const float r = y - log_exponential1(uniform_bits(key, j));
    if (r > best.value) best = {r, j};
    threshold = std::max(threshold, r);
  }
  return best;
}

void uniform_row(uint64_t key, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = uniform1(uniform_bits(key, j));
}

void noise_from_bits_range(const int32_t* bits, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = -log_exponential1(static_cast<uint32_t>(bits[i]));
}

#endif

void check_rows(const torch::Tensor& seeds, const torch::Tensor& steps) {
  TORCH_CHECK(seeds.device().is_cpu() && steps.device().is_cpu(), "seeds and steps must be CPU tensors");
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == torch::kLong && seeds.is_contiguous(),
              "seeds must be a contiguous int64 [num_rows] tensor");
  TORCH_CHECK(steps.dim() == 1 && steps.scalar_type() == torch::kLong && steps.is_contiguous() &&
                  steps.size(0) == seeds.size(0),
              "steps must be a contiguous int64 [num_rows] tensor, like seeds");
}

}  // namespace

// x [num_rows, vocab] float32 contiguous (logits, -inf = masked); seeds, steps [num_rows] int64;
// temperature: None, or [num_rows] float32 > 0 that x is divided by first (exactly as torch's
// x / temperature[:, None]). Returns the sampled index of each row, int64 [num_rows].
torch::Tensor exponential_race(torch::Tensor x, torch::Tensor seeds, torch::Tensor steps,
                               c10::optional<torch::Tensor> temperature) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor [num_rows, vocab]");
  check_rows(seeds, steps);
  TORCH_CHECK(seeds.size(0) == x.size(0), "one seed and step per row of x: ", seeds.size(0),
              " for ", x.size(0), " rows");
  const int64_t num_rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab >= 1 && vocab <= std::numeric_limits<int32_t>::max() - 2 * kBlock,
              "vocab size must be in [1, 2^31 - 64], got ", vocab);
  const float* t_p = nullptr;
  if (temperature.has_value()) {
    TORCH_CHECK(temperature->device().is_cpu() && temperature->dim() == 1 &&
                    temperature->scalar_type() == torch::kFloat && temperature->is_contiguous() &&
                    temperature->size(0) == num_rows,
                "temperature must be a contiguous float32 [num_rows] tensor");
    t_p = temperature->data_ptr<float>();
    for (int64_t r = 0; r < num_rows; ++r) {
      TORCH_CHECK(t_p[r] > 0.0f && std::isfinite(t_p[r]), "temperature must be positive and finite, got ",
                  t_p[r], " in row ", r);
    }
  }
  torch::Tensor out = torch::empty({num_rows}, seeds.options());
  if (num_rows == 0) return out;

  // Enough items for every thread (a few per thread, as rows cost different amounts once the
  // prefilter skips), but no chunk under kMinChunk.
  const int64_t threads = at::get_num_threads();
  int64_t num_chunks = std::clamp<int64_t>((4 * threads + num_rows - 1) / num_rows, 1,
                                           std::max<int64_t>(1, vocab / kMinChunk));
  const int64_t per_chunk = (vocab + num_chunks - 1) / num_chunks;
  const int64_t chunk_len = (per_chunk + kBlock - 1) / kBlock * kBlock;
  num_chunks = (vocab + chunk_len - 1) / chunk_len;

  const float* x_p = x.data_ptr<float>();
  const int64_t* seed_p = seeds.data_ptr<int64_t>();
  const int64_t* step_p = steps.data_ptr<int64_t>();
  std::vector<Best> partial(num_rows * num_chunks);
  at::parallel_for(0, num_rows * num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_chunks, c = item % num_chunks;
      const uint64_t key = row_key(seed_p[r], step_p[r]);
      const float t = t_p ? t_p[r] : 1.0f;
      const int64_t b = c * chunk_len, e = std::min(b + chunk_len, vocab);
      const float* row = x_p + r * vocab;
      partial[item] = t == 1.0f ? race_chunk<false>(row, t, key, b, e) : race_chunk<true>(row, t, key, b, e);
    }
  });
  int64_t* out_p = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    Best best = partial[r * num_chunks];
    for (int64_t c = 1; c < num_chunks; ++c) {
      if (beats(partial[r * num_chunks + c], best)) best = partial[r * num_chunks + c];
    }
    out_p[r] = best.index;
  }
  return out;
}

// The kernel's u, float32 [num_rows, vocab_size]: for checking the hash against random_uniform.
torch::Tensor uniform(torch::Tensor seeds, torch::Tensor steps, int64_t vocab_size) {
  check_rows(seeds, steps);
  TORCH_CHECK(vocab_size >= 0, "vocab_size must be >= 0, got ", vocab_size);
  const int64_t num_rows = seeds.size(0);
  torch::Tensor out = torch::empty({num_rows, vocab_size}, seeds.options().dtype(torch::kFloat));
  const int64_t* seed_p = seeds.data_ptr<int64_t>();
  const int64_t* step_p = steps.data_ptr<int64_t>();
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uniform_row(row_key(seed_p[r], step_p[r]), vocab_size, out_p + r * vocab_size);
    }
  });
  return out;
}

// The kernel's noise -log(-log u) for 23-bit hash values b (u = (b + 1/2) / 2^23): for checking
// the polynomial logs and the prefilter's bounds over every b.
torch::Tensor noise_from_bits(torch::Tensor bits) {
  TORCH_CHECK(bits.device().is_cpu() && bits.scalar_type() == torch::kInt && bits.is_contiguous(),
              "bits must be a contiguous int32 CPU tensor");
  const int64_t n = bits.numel();
  const int32_t* b_p = bits.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(b_p[i] >= 0 && b_p[i] < (1 << 23), "bits must be in [0, 2^23), got ", b_p[i]);
  }
  torch::Tensor out = torch::empty(bits.sizes(), bits.options().dtype(torch::kFloat));
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, n, 8192, [&](int64_t begin, int64_t end) {
    noise_from_bits_range(b_p + begin, end - begin, out_p + begin);
  });
  return out;
}

PAGEDLM_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def<&exponential_race>("exponential_race", "argmax_j x_j / t - log(-log u_j): the sampled token per row");
  m.def<&uniform>("uniform", "The kernel's u [num_rows, vocab_size] (random_uniform's hash)");
  m.def<&noise_from_bits>("noise_from_bits", "The kernel's -log(-log u) for 23-bit hash values");
}
