// Test-only bindings of lite_tensor.h's pieces, compared with torch's own in
// tests/test_lite_tensor.py: dtype conversions, view strides, parallel_for's chunks and
// errors, and the binding layer's argument and result conversions.
#include "lite_bind.h"

namespace {

template <typename T>
torch::Tensor narrow_to(const torch::Tensor& x, torch::ScalarType type) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32");
  torch::Tensor out = torch::empty(x.sizes(), type);
  const float* src = x.data_ptr<float>();
  T* dst = out.data_ptr<T>();
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = static_cast<T>(src[i]);
  return out;
}

// x (float32) in `dtype` by the scalar conversions: torch.float16, bfloat16, float8s.
torch::Tensor convert(torch::Tensor x, int64_t which) {
  switch (which) {
    case 0: return narrow_to<at::Half>(x, torch::kHalf);
    case 1: return narrow_to<at::BFloat16>(x, torch::kBFloat16);
    case 2: return narrow_to<at::Float8_e4m3fn>(x, torch::kFloat8_e4m3fn);
    default: return narrow_to<at::Float8_e5m2>(x, torch::kFloat8_e5m2);
  }
}

template <typename T>
void widen_from(const torch::Tensor& x, float* dst) {
  const T* src = x.data_ptr<T>();
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = static_cast<float>(src[i]);
}

// x (float16, bfloat16 or a float8) as float32 by the scalar conversions.
torch::Tensor widen(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  torch::Tensor out = torch::empty(x.sizes(), torch::kFloat);
  const bool known = pagedlm::visit_cache_dtype(x.scalar_type(), [&](auto tag) {
    widen_from<decltype(tag)>(x, out.data_ptr<float>());
  });
  TORCH_CHECK(known, "no conversion from ", x.scalar_type());
  return out;
}

// The strides of x.view(shape) (after narrowing dimension `dim` to [start, start + length)).
std::vector<int64_t> view_strides(torch::Tensor x, int64_t dim, int64_t start, int64_t length,
                                  std::vector<int64_t> shape) {
  torch::Tensor v = x.narrow(dim, start, length).view(shape);
  std::vector<int64_t> out = v.strides();
  // The view's first element, counted from x's.
  out.push_back((static_cast<char*>(v.data_ptr()) - static_cast<char*>(x.data_ptr())) / x.element_size());
  return out;
}

// Every chunk parallel_for(begin, end, grain) hands out, as [first, last) pairs in order,
// and how many threads ran them; with `throw_at` inside a chunk, that chunk throws.
std::vector<std::pair<int64_t, int64_t>> chunks(int64_t begin, int64_t end, int64_t grain,
                                                int64_t throw_at, bool nested) {
  std::vector<std::pair<int64_t, int64_t>> seen(64, {-1, -1});
  at::parallel_for(begin, end, grain, [&](int64_t first, int64_t last) {
    if (first <= throw_at && throw_at < last) TORCH_CHECK(false, "chunk ", first, " failed");
    const int tid = omp_get_thread_num();
    if (nested) {  // a parallel_for inside one runs serially, in one chunk
      int calls = 0;
      at::parallel_for(0, 1000, 1, [&](int64_t, int64_t) { ++calls; });
      TORCH_CHECK(calls == 1, "a nested parallel_for split its range");
    }
    seen[tid] = {first, last};
  });
  std::vector<std::pair<int64_t, int64_t>> out;
  for (auto& c : seen) {
    if (c.first >= 0) out.push_back(c);
  }
  return out;
}

int64_t threads() { return at::get_num_threads(); }

// Echoes of the argument conversions: an optional tensor's element count (-1 for None),
// the sum of a list of ints, a bool and a double.
double echo(c10::optional<torch::Tensor> t, std::vector<int64_t> xs, bool flag, double f) {
  int64_t sum = 0;
  for (int64_t x : xs) sum += x;
  return (t ? t->numel() : -1) * 1e6 + sum * 1e3 + (flag ? 100 : 0) + f;
}

// What a tensor argument arrived as (dtype, sizes, strides in elements), after adding 1 to
// its first element in place, and the argument itself (returned as the same object).
std::pair<std::string, torch::Tensor> describe(torch::Tensor x) {
  using pagedlm_lite::operator<<;
  std::ostringstream text;
  text << x.scalar_type() << ' ' << x.sizes() << ' ' << x.strides();
  if (x.numel() > 0) {
    switch (x.scalar_type()) {
      case torch::kLong: *x.data_ptr<int64_t>() += 1; break;
      case torch::kInt: *x.data_ptr<int32_t>() += 1; break;
      case torch::kFloat: *x.data_ptr<float>() += 1; break;
      default: break;
    }
  }
  return {text.str(), x};
}

// A bound class: a running sum kept in a tensor the object holds.
class Accumulator {
 public:
  explicit Accumulator(torch::Tensor into) : into_(into) {
    TORCH_CHECK(into.scalar_type() == torch::kFloat && into.numel() == 1, "into must be one float32");
  }
  static Accumulator make(torch::Tensor into) { return Accumulator(into); }
  void add(double x) { *into_.data_ptr<float>() += static_cast<float>(x); }
  int64_t calls() const { return calls_; }
  std::vector<std::pair<std::string, double>> state() const {
    return {{"value", *into_.data_ptr<float>()}};
  }

 private:
  torch::Tensor into_;
  int64_t calls_ = 0;
};

}  // namespace

PAGEDLM_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def<&convert>("convert");
  m.def<&widen>("widen");
  m.def<&view_strides>("view_strides");
  m.def<&chunks>("chunks");
  m.def<&threads>("threads");
  m.def<&echo>("echo");
  m.def<&describe>("describe");
  m.attr("answer", 42);
  m.cls<Accumulator>("Accumulator")
      .init<torch::Tensor>()
      .def_static<&Accumulator::make>("make")
      .def<&Accumulator::add>("add")
      .def<&Accumulator::calls>("calls")
      .def<&Accumulator::state>("state");
}
