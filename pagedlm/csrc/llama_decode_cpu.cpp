// Every decoder layer of a Llama-family model for a pure-decode step (one new token per
// sequence), in one call from Python. At decode sizes a layer's dozen torch ops and module
// calls cost more in dispatch than in arithmetic (batch 1: ~12 ms of a 21 ms step on
// SmolLM2-135M); here each layer is a straight run of the kernels the Python layers call
// one by one, with the same inputs, so the result is the same float for float:
//
//   h = rms_norm(x (+ residual))                 layer_ops_cpu.cpp
//   qkv = h @ Wqkv.T (+ b)                       q8_gemm_cpu.cpp
//   q, k = rotary(positions, q, k)               layer_ops_cpu.cpp
//   cache[slot] = k, v                           (below; the cache's dtype, rounded to nearest)
//   o = paged_decode(q * scale, cache, ...)      paged_attention_cpu.cpp
//   x = o @ Wo.T (+ b);  h, residual = rms_norm(x + residual)
//   x = down(silu_and_mul(gate_up(h)))
//
// and after the last layer the model's final norm. The model's Python layers
// (models/llama.py) are the reference; models/llama_cpu_decode.py decides which models
// qualify and tests/test_llama_cpu_decode.py compares the two.

#define PAGEDLM_NO_PYBIND_MODULE
#include "layer_ops_cpu.cpp"
#include "paged_attention_cpu.cpp"
#include "q8_gemm_cpu.cpp"
#undef PAGEDLM_NO_PYBIND_MODULE

#include <array>
#include <chrono>
#include <string>

namespace {

// One integer-weight matmul: the packed blocks of layers/q8_weights.py.
struct Q8Linear {
  torch::Tensor packed, scales;
  c10::optional<torch::Tensor> bias;
  int64_t out_features = 0;
  bool q4_1 = false;

  torch::Tensor operator()(const torch::Tensor& x) const {
    return q8_gemm(x, packed, scales, out_features, q4_1, bias);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  Q8Linear qkv, o, gate_up, down;
  int64_t window = 0;  // 0: full attention
  torch::Tensor k_cache, v_cache;
};

// cache_flat[slot[t]] = src[t] for every token t; src [n, width] float32 contiguous.
void write_cache(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t n) {
  const int64_t width = src.size(1);
  const float* s = src.data_ptr<float>();
  switch (cache.scalar_type()) {
    case torch::kFloat: {
      float* c = cache.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) std::memcpy(c + slots[t] * width, s + t * width, width * sizeof(float));
      break;
    }
    case torch::kHalf: {
      at::Half* c = cache.data_ptr<at::Half>();
      for (int64_t t = 0; t < n; ++t) {
        const float* row = s + t * width;
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
        for (int64_t i = 0; i < width; ++i) c[slots[t] * width + i] = static_cast<at::BFloat16>(s[t * width + i]);
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", cache.scalar_type());
  }
}

enum Part { kNorms, kQkv, kRotaryCache, kAttention, kO, kGateUp, kSilu, kDown, kParts };
const char* const kPartNames[kParts] = {"rms_norm", "qkv_proj", "rotary+cache_write", "attention",
                                        "o_proj", "gate_up_proj", "silu_and_mul", "down_proj"};

// Adds the time since the previous lap to a part's total; does nothing without totals.
class Clock {
 public:
  explicit Clock(std::array<double, kParts>* totals) : totals_(totals), last_(now()) {}
  void lap(Part part) {
    if (totals_ == nullptr) return;
    const auto t = now();
    (*totals_)[part] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  std::array<double, kParts>* totals_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace

class LlamaDecoder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
               torch::Tensor cos_cache, torch::Tensor sin_cache, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        eps_(eps), scale_(static_cast<float>(scale)), cos_(cos_cache), sin_(sin_cache),
        final_norm_(final_norm) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "num_heads must be a positive multiple of num_kv_heads");
  }

  // One decoder layer, in order. `q4_1` holds the block format of qkv, o, gate_up, down.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, std::vector<torch::Tensor> packed,
                 std::vector<torch::Tensor> scales, std::vector<c10::optional<torch::Tensor>> biases,
                 std::vector<int64_t> out_features, std::vector<bool> q4_1, int64_t window,
                 torch::Tensor k_cache, torch::Tensor v_cache) {
    TORCH_CHECK(packed.size() == 4 && scales.size() == 4 && biases.size() == 4 &&
                    out_features.size() == 4 && q4_1.size() == 4,
                "a layer has four matmuls: qkv, o, gate_up, down");
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK(out_features[0] == q_size + 2 * kv_size, "qkv has ", out_features[0],
                " outputs, expected ", q_size + 2 * kv_size);
    TORCH_CHECK(out_features[2] % 2 == 0, "gate_up must have an even number of outputs");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads_ && k_cache.size(3) == head_dim_ &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
                "k_cache/v_cache must be contiguous [blocks, block_size, num_kv_heads, head_dim]");
    Layer layer;
    layer.input_norm = input_norm;
    layer.post_norm = post_norm;
    Q8Linear* linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      *linears[i] = Q8Linear{packed[i], scales[i], biases[i], out_features[i], q4_1[i]};
    }
    layer.window = window;
    layer.k_cache = k_cache;
    layer.v_cache = v_cache;
    layers_.push_back(std::move(layer));
  }

  // x [n, hidden] float32: the embedded tokens, one per sequence; positions [n] int64;
  // slot_mapping [n] int64; block_tables [n, max_blocks] int64; seq_lens incl. the new
  // token. Returns the final-normed hidden states [n, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, std::vector<int64_t> seq_lens) {
    const int64_t n = x.size(0);
    TORCH_CHECK(!layers_.empty(), "no layers added");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n && slot_mapping.dim() == 1 &&
                    slot_mapping.size(0) == n && slot_mapping.scalar_type() == torch::kLong &&
                    slot_mapping.is_contiguous() && static_cast<int64_t>(seq_lens.size()) == n,
                "one position, slot and seq_len per token");
    const int64_t num_slots = layers_[0].k_cache.size(0) * layers_[0].k_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the KV cache (",
                  num_slots, " slots)");
    }
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    Clock clock(profile_ ? &seconds_ : nullptr);
    torch::Tensor residual;
    for (size_t li = 0; li < layers_.size(); ++li) {
      Layer& layer = layers_[li];
      torch::Tensor h;
      if (li == 0) {
        residual = x;
        h = rms_norm(x, layer.input_norm, eps_, c10::nullopt)[0];
      } else {
        auto outs = rms_norm(x, layer.input_norm, eps_, residual);
        h = outs[0];
        residual = outs[1];
      }
      clock.lap(kNorms);
      torch::Tensor qkv = layer.qkv(h);  // [n, q_size + 2 kv_size]
      clock.lap(kQkv);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
      auto qk = rotary(positions, q, k, cos_, sin_);  // contiguous rotated copies
      write_cache(qk[1].view({n, kv_size}), layer.k_cache, slots, n);
      write_cache(qkv.narrow(1, q_size + kv_size, kv_size).contiguous(), layer.v_cache, slots, n);
      float* q_p = qk[0].data_ptr<float>();
      for (int64_t i = 0; i < n * q_size; ++i) q_p[i] *= scale_;
      clock.lap(kRotaryCache);
      torch::Tensor o = paged_decode(qk[0], layer.k_cache, layer.v_cache, block_tables, seq_lens, 0.0,
                                     layer.window, c10::nullopt);  // [n, heads, head_dim]
      clock.lap(kAttention);
      x = layer.o(o.view({n, q_size}));
      clock.lap(kO);
      auto outs = rms_norm(x, layer.post_norm, eps_, residual);
      residual = outs[1];
      clock.lap(kNorms);
      torch::Tensor gate_up = layer.gate_up(outs[0]);
      clock.lap(kGateUp);
      torch::Tensor act = silu_and_mul(gate_up);
      clock.lap(kSilu);
      x = layer.down(act);
      clock.lap(kDown);
    }
    torch::Tensor out = rms_norm(x, final_norm_, eps_, residual)[0];
    clock.lap(kNorms);
    return out;
  }

  // Time spent per part of the layers since profiling was turned on (seconds), by name.
  void set_profile(bool on) {
    profile_ = on;
    seconds_.fill(0.0);
  }
  std::vector<std::pair<std::string, double>> profile() const {
    std::vector<std::pair<std::string, double>> out;
    for (int i = 0; i < kParts; ++i) out.emplace_back(kPartNames[i], seconds_[i]);
    return out;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  float scale_;
  torch::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
  bool profile_ = false;
  std::array<double, kParts> seconds_{};
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor,
                          torch::Tensor>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("forward", &LlamaDecoder::forward)
      .def("set_profile", &LlamaDecoder::set_profile)
      .def("profile", &LlamaDecoder::profile);
}
