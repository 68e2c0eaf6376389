// Every decoder layer of a Llama-family model for one engine step of up to a few hundred
// tokens (decodes, prefill chunks, or both), in one call from Python. At these sizes a
// layer's dozen torch ops and module calls cost more in dispatch than in arithmetic (a
// batch-1 step of SmolLM2-135M with q8 weights: 25.3 ms through the Python layers, 12.2 ms
// here); each layer is a straight run of the kernels the Python layers call one by one,
// with the same inputs, so the result is the same float for float:
//
//   h = rms_norm(x (+ residual))                 layer_ops_cpu.cpp
//   qkv = h @ Wqkv.T (+ b)                       q8_gemm / panel_gemm / block_gemv_cpu.cpp
//   q, k = rotary(positions, q, k)               layer_ops_cpu.cpp
//   cache[slot] = k, v                           (llama_decode_parts.h; the cache's dtype, rounded)
//   o = paged_decode(q * scale, cache, ...)      paged_attention_cpu.cpp (decodes)
//       paged_prefill(q, cache, scale, ...)      prefill_attention_cpu.cpp (prefill chunks)
//   x = o @ Wo.T (+ b);  h, residual = rms_norm(x + residual)
//   x = down(silu_and_mul(gate_up(h)))
//
// With LoRA adapters in the step, each of the four matmuls is followed by its layer's
// multi-adapter delta (lora_cpu.cpp, the slots of layers/lora.py), before the ranks' sum.
//
// After the last layer comes the model's final norm. Every kernel writes into activation
// buffers the decoder keeps from step to step (Workspace, llama_decode_parts.h), not into
// new tensors. The model's Python layers (models/llama.py) are the reference;
// models/llama_cpu_decode.py decides which models and steps qualify, and
// tests/test_llama_cpu_decode.py compares the two.
//
// Those kernels have no module of their own: this one exports their functions too
// (csrc/__init__.py BUNDLED), so their code compiles once. The two attention kernels, the
// longest of them to compile, are translation units of this library built beside this one.
#include "block_gemv_cpu.cpp"
#include "layer_ops_cpu.cpp"
#include "lora_cpu.cpp"
#include "paged_attention_cpu.h"
#include "panel_gemm_cpu.cpp"
#include "prefill_attention_cpu.h"
#include "q8_gemm_cpu.cpp"
#include "shm_allreduce_cpu.cpp"
#include "step_inputs_cpu.cpp"

#include <array>
#include <chrono>
#include <string>

#include "llama_decode_parts.h"  // Linear, Workspace, write_cache

namespace {

// A matmul's LoRA adapter slots (layers/lora.py's LoRAWeights), if LoRA is on.
struct LoraSlots {
  torch::Tensor a, b, bounds, ranks;
  bool on = false;
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  std::vector<Linear> linears;  // qkv, o, gate_up, down
  std::array<LoraSlots, 4> lora;
  int64_t window = 0;  // 0: full attention
  torch::Tensor k_cache, v_cache;
  // The softmax scale the query is multiplied by; with a float8 cache also its K / V
  // quantisation (x * inv, clamped to +-fp8_max, rounded by c10's conversion, as torch's
  // .to does) and the V scale the attention output is multiplied by (layers/attention.py).
  float q_scale = 1.f, k_inv = 1.f, v_inv = 1.f, out_scale = 1.f, fp8_max = 0.f;
};

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
  // The softmax scale is each layer's (add_layer's q_scale).
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               torch::Tensor cos_cache, torch::Tensor sin_cache, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        eps_(static_cast<float>(eps)), cos_(cos_cache), sin_(sin_cache), final_norm_(final_norm) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "num_heads must be a positive multiple of num_kv_heads");
  }

  // One decoder layer, in order; `linears` are its qkv, o, gate_up and down matmuls.
  // q_scale: the query's softmax scale; k_inv, v_inv, out_scale, fp8_max: a float8 cache's
  // quantisation (see Layer; ignored for other caches).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, std::vector<Linear> linears,
                 int64_t window, torch::Tensor k_cache, torch::Tensor v_cache, double q_scale,
                 double k_inv, double v_inv, double out_scale, double fp8_max) {
    TORCH_CHECK(linears.size() == 4, "a layer has four matmuls: qkv, o, gate_up, down");
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK(linears[0].out_features() == q_size + 2 * kv_size, "qkv has ",
                linears[0].out_features(), " outputs, expected ", q_size + 2 * kv_size);
    TORCH_CHECK(linears[2].out_features() % 2 == 0, "gate_up must have an even number of outputs");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads_ && k_cache.size(3) == head_dim_ &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
                "k_cache/v_cache must be contiguous [blocks, block_size, num_kv_heads, head_dim]");
    Layer layer;
    layer.input_norm = input_norm;
    layer.post_norm = post_norm;
    layer.linears = std::move(linears);
    layer.window = window;
    layer.k_cache = k_cache;
    layer.v_cache = v_cache;
    layer.q_scale = static_cast<float>(q_scale);
    const bool fp8 = k_cache.element_size() == 1;
    TORCH_CHECK(!fp8 || fp8_max > 0, "a float8 cache needs its range (fp8_max)");
    layer.k_inv = fp8 ? static_cast<float>(k_inv) : 1.f;
    layer.v_inv = fp8 ? static_cast<float>(v_inv) : 1.f;
    layer.out_scale = fp8 ? static_cast<float>(out_scale) : 1.f;
    layer.fp8_max = fp8 ? static_cast<float>(fp8_max) : 0.f;
    layers_.push_back(std::move(layer));
  }

  // x [n, hidden] float32: the step's embedded tokens, the decodes' first (one token per
  // sequence), then each prefill's (attention/metadata.py's order); positions [n] int64;
  // slot_mapping [n] int64; block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs]
  // incl. the new tokens; num_decodes: the sequences at the front with one token each;
  // query_start [num_seqs + 1]: each sequence's first token, or empty when every sequence
  // decodes (num_decodes == num_seqs == n). Returns the final-normed hidden states [n, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, std::vector<int64_t> seq_lens,
                        int64_t num_decodes, std::vector<int64_t> query_start) {
    const int64_t n = x.size(0);
    const int64_t num_seqs = static_cast<int64_t>(seq_lens.size());
    TORCH_CHECK(!layers_.empty(), "no layers added");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n && slot_mapping.dim() == 1 &&
                    slot_mapping.size(0) == n && slot_mapping.scalar_type() == torch::kLong &&
                    slot_mapping.is_contiguous(),
                "one position and slot per token");
    if (query_start.empty()) {
      TORCH_CHECK(num_seqs == n && num_decodes == n, "one seq_len per token in a pure-decode step");
    } else {
      TORCH_CHECK(static_cast<int64_t>(query_start.size()) == num_seqs + 1 && query_start.front() == 0 &&
                      query_start.back() == n && 0 <= num_decodes && num_decodes <= num_seqs &&
                      query_start[num_decodes] == num_decodes,
                  "query_start must hold num_seqs + 1 offsets from 0 to num_tokens, one token for "
                  "each of the num_decodes first sequences");
    }
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                    block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(),
                "block_tables must be contiguous int64 [num_seqs, max_blocks]");
    // The prefills' rows, as the prefill kernel takes them.
    const int64_t nd = num_decodes, np = n - num_decodes;
    std::vector<int64_t> prefill_start, prefill_lens;
    if (np > 0) {
      prefill_start.assign(query_start.begin() + nd, query_start.end());
      for (int64_t& s : prefill_start) s -= nd;
      prefill_lens.assign(seq_lens.begin() + nd, seq_lens.end());
    }
    const std::vector<int64_t> decode_lens(seq_lens.begin(), seq_lens.begin() + nd);
    const torch::Tensor decode_tables = block_tables.narrow(0, 0, nd);
    const torch::Tensor prefill_tables = block_tables.narrow(0, nd, num_seqs - nd);
    const int64_t num_slots = layers_[0].k_cache.size(0) * layers_[0].k_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the KV cache (",
                  num_slots, " slots)");
    }
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t hidden = x.size(1);
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                    hidden == layers_[0].input_norm.numel(),
                "x must be a contiguous float32 [n, hidden] tensor");
    const int64_t* pos = checked_positions(positions, n, cos_, sin_);
    ws_.reserve(n, hidden, q_size, kv_size, layers_[0].linears[2].out_features());
    auto rows = [n](const torch::Tensor& buf) { return buf.narrow(0, 0, n); };
    torch::Tensor residual = rows(ws_.residual), h = rows(ws_.h), xb = rows(ws_.x);
    torch::Tensor qkv = rows(ws_.qkv), gate_up = rows(ws_.gate_up), act = rows(ws_.act);
    torch::Tensor q = rows(ws_.q).view({n, num_heads_, head_dim_});
    torch::Tensor k = rows(ws_.k).view({n, num_kv_heads_, head_dim_});
    torch::Tensor attn = rows(ws_.attn).view({n, num_heads_, head_dim_});
    float* const res_p = residual.data_ptr<float>();
    float* const h_p = h.data_ptr<float>();
    float* const x_p = xb.data_ptr<float>();
    // residual = the embedded tokens, then residual += each sub-layer's output, in place.
    std::memcpy(res_p, x.data_ptr<float>(), n * hidden * sizeof(float));
    Clock clock(profile_ ? &seconds_ : nullptr);
    for (size_t li = 0; li < layers_.size(); ++li) {
      Layer& layer = layers_[li];
      if (li == 0) {
        rms_norm_rows(res_p, layer.input_norm.data_ptr<float>(), eps_, nullptr, nullptr, h_p, n, hidden);
      } else {
        rms_norm_rows(x_p, layer.input_norm.data_ptr<float>(), eps_, res_p, res_p, h_p, n, hidden);
      }
      clock.lap(kNorms);
      layer.linears[0](h, qkv);  // [n, q_size + 2 kv_size]
      apply_lora(layer, 0, h, qkv);
      clock.lap(kQkv);
      rotary_into(qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_}), pos, cos_, sin_, q);
      rotary_into(qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_}), pos, cos_, sin_, k);
      write_cache(k.view({n, kv_size}), layer.k_cache, slots, n, layer.k_inv, layer.fp8_max);
      write_cache(qkv.narrow(1, q_size + kv_size, kv_size), layer.v_cache, slots, n, layer.v_inv,
                  layer.fp8_max);
      // The decode kernel takes its queries scaled, the prefill kernel its scale (as the
      // Python backend calls them: attention/cpu_kernels.py).
      float* q_p = q.data_ptr<float>();
      for (int64_t i = 0; i < nd * q_size; ++i) q_p[i] *= layer.q_scale;
      clock.lap(kRotaryCache);
      if (nd > 0) {
        torch::Tensor attn_d = attn.narrow(0, 0, nd);
        paged_decode_into(q.narrow(0, 0, nd), layer.k_cache, layer.v_cache, decode_tables,
                          decode_lens, 0.0, layer.window, c10::nullopt, attn_d);
      }
      if (np > 0) {  // [np, heads, head_dim]
        torch::Tensor attn_p = attn.narrow(0, nd, np);
        paged_prefill_into(q.narrow(0, nd, np), layer.k_cache, layer.v_cache, prefill_tables,
                           prefill_start, prefill_lens, layer.q_scale, layer.window, attn_p);
      }
      if (layer.fp8_max > 0) {
        float* a_p = attn.data_ptr<float>();
        for (int64_t i = 0; i < n * q_size; ++i) a_p[i] *= layer.out_scale;
      }
      clock.lap(kAttention);
      layer.linears[1](attn.view({n, q_size}), xb);
      apply_lora(layer, 1, attn.view({n, q_size}), xb);
      if (world_ > 1) round_ = all_reduce_rounds(comm_, rank_, round_, x_p, n * hidden, timeout_ms_);
      clock.lap(kO);
      rms_norm_rows(x_p, layer.post_norm.data_ptr<float>(), eps_, res_p, res_p,
                    h_p, n, hidden);
      clock.lap(kNorms);
      layer.linears[2](h, gate_up);
      apply_lora(layer, 2, h, gate_up);
      clock.lap(kGateUp);
      silu_and_mul_rows(gate_up.data_ptr<float>(), act.data_ptr<float>(), n, act.size(1));
      clock.lap(kSilu);
      layer.linears[3](act, xb);
      apply_lora(layer, 3, act, xb);
      if (world_ > 1) round_ = all_reduce_rounds(comm_, rank_, round_, x_p, n * hidden, timeout_ms_);
      clock.lap(kDown);
    }
    // A new tensor: the caller keeps it past the next step, which reuses the workspace.
    torch::Tensor out = torch::empty({n, hidden}, torch::kFloat);
    rms_norm_rows(x_p, final_norm_.data_ptr<float>(), eps_, res_p, res_p,
                  out.data_ptr<float>(), n, hidden);
    clock.lap(kNorms);
    return out;
  }

  // Tensor parallelism on one machine: each rank's o_proj and down_proj outputs are partial
  // sums, added over the ranks through the shared-memory segment of shm_allreduce_cpu.cpp,
  // as the Python layers' all-reduce does (the same function: the same sums). The rounds
  // continue those of the Python side's calls: set_round before a step, round after it.
  void set_all_reduce(torch::Tensor segment, int64_t rank, int64_t world, int64_t chunk,
                      int64_t timeout_ms) {
    TORCH_CHECK(segment.scalar_type() == torch::kUInt8 && segment.is_contiguous() &&
                    segment.numel() >= world * kFlagBytes + 2 * world * chunk * 4,
                "segment too small for ", world, " ranks of ", chunk, " floats");
    TORCH_CHECK(0 <= rank && rank < world && chunk > 0, "rank out of range");
    comm_segment_ = segment;
    comm_ = Segment{segment.data_ptr<uint8_t>(), world, chunk};
    rank_ = rank;
    world_ = world;
    timeout_ms_ = timeout_ms;
  }
  int64_t round() const { return round_; }
  void set_round(int64_t round) { round_ = round; }

  // LoRA: the adapter slots of layer `layer`'s matmul `which` (0 qkv, 1 o, 2 gate_up,
  // 3 down), as layers/lora.py keeps them (the same tensors: loads reach the decoder).
  void set_lora(int64_t layer, int64_t which, torch::Tensor a, torch::Tensor b,
                torch::Tensor bounds, torch::Tensor ranks) {
    TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(layers_.size()) && 0 <= which &&
                    which < 4, "no such layer or matmul");
    layers_[layer].lora[which] = LoraSlots{a, b, bounds, ranks, true};
  }
  // Each token's adapter slot for the next forward (-1: none), or None: no adapter.
  void set_lora_slots(c10::optional<torch::Tensor> slots) { lora_slots_ = slots; }

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
  void apply_lora(Layer& layer, int which, const torch::Tensor& in, torch::Tensor& out) {
    const LoraSlots& l = layer.lora[which];
    if (lora_slots_ && l.on) pagedlm_lora::lora_add(in, out, l.a, l.b, l.bounds, *lora_slots_, l.ranks);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_;  // as the RMSNorm kernel takes it
  torch::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
  Workspace ws_;
  c10::optional<torch::Tensor> lora_slots_;
  bool profile_ = false;
  std::array<double, kParts> seconds_{};
  torch::Tensor comm_segment_;  // keeps the mapping alive
  Segment comm_{nullptr, 1, 1};
  int64_t rank_ = 0, world_ = 1, timeout_ms_ = 0, round_ = 1;
};

PAGEDLM_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_block_gemv_cpu(m);
  bind_layer_ops_cpu(m);
  bind_lora_cpu(m);
  bind_paged_attention_cpu(m);
  bind_panel_gemm_cpu(m);
  bind_prefill_attention_cpu(m);
  bind_q8_gemm_cpu(m);
  bind_shm_allreduce_cpu(m);
  bind_step_inputs_cpu(m);
  // (lite_bind.h's types are per library: a second build of this one in a process, as
  // tests/isa_builds.py loads beside the native one, registers its own classes.)
  m.cls<Linear>("Linear")
      .def_static<&Linear::q8>("q8")
      .def_static<&Linear::panel>("panel")
      .def_static<&Linear::block>("block");
  m.cls<LlamaDecoder>("LlamaDecoder")
      .init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor>()
      .def<&LlamaDecoder::add_layer>("add_layer")
      .def<&LlamaDecoder::forward>("forward")
      .def<&LlamaDecoder::set_all_reduce>("set_all_reduce")
      .def<&LlamaDecoder::set_lora>("set_lora")
      .def<&LlamaDecoder::set_lora_slots>("set_lora_slots")
      .def<&LlamaDecoder::round>("round")
      .def<&LlamaDecoder::set_round>("set_round")
      .def<&LlamaDecoder::set_profile>("set_profile")
      .def<&LlamaDecoder::profile>("profile");
}
