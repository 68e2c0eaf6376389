// The part of torch's C++ API these kernels use, written without torch's headers.
//
// A first start builds the kernels, and with torch's and pybind11's headers about 30 of
// its 50 CPU-seconds went to parsing them (about 10 s per translation unit, on the 2-core
// test machine): more than the kernels' own code. The kernels need little of torch: a
// view of a tensor (data pointer, dtype, sizes, strides), narrow/view, an allocator for
// their outputs, parallel_for over OpenMP, the float16/bfloat16/float8 types and
// TORCH_CHECK. This header gives those under torch's names, so the kernel sources read
// as before; lite_bind.h turns Python's torch tensors into these views and back.
//
// The views own nothing by themselves: a view made from a Python tensor holds a
// reference to it (`owner`), so a tensor kept by a C++ object (the decoder's weights)
// lives as long as that object. Outputs are allocated here (through the hook lite_bind.h
// installs) and reach Python as torch tensors over that memory, through DLPack.
//
// The number types (Half, BFloat16, float8): lite_numbers.h.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lite_numbers.h"

namespace pagedlm_lite {

// Torch's dtypes the kernels meet; lite_bind.h maps torch.<name> to each.
enum class ScalarType : int8_t {
  Byte, Char, Short, Int, Long, Half, Float, Double, Bool, BFloat16, Float8_e5m2, Float8_e4m3fn,
  Undefined
};
constexpr int kNumScalarTypes = static_cast<int>(ScalarType::Undefined);
// torch's names for them (torch.uint8, ...), in the enum's order.
constexpr const char* kScalarTypeNames[kNumScalarTypes + 1] = {
    "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool",
    "bfloat16", "float8_e5m2", "float8_e4m3fn", "undefined"};
constexpr int64_t kElementSizes[kNumScalarTypes + 1] = {1, 1, 2, 4, 8, 2, 4, 8, 1, 2, 1, 1, 0};

inline std::ostream& operator<<(std::ostream& out, ScalarType t) {
  return out << kScalarTypeNames[static_cast<int>(t)];
}
inline std::ostream& operator<<(std::ostream& out, const std::vector<int64_t>& sizes) {
  out << '[';
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  return out << ']';
}

// Messages of TORCH_CHECK: its arguments streamed one after the other.
template <typename... Args>
[[noreturn]] void fail(const char* condition, const Args&... args) {
  std::ostringstream message;
  if constexpr (sizeof...(Args) == 0) {
    message << "Expected " << condition << " to be true, but got false.";
  } else {
    (message << ... << args);
  }
  throw std::runtime_error(message.str());
}

template <typename T> constexpr ScalarType scalar_type_of = ScalarType::Undefined;
template <> constexpr ScalarType scalar_type_of<uint8_t> = ScalarType::Byte;
template <> constexpr ScalarType scalar_type_of<int8_t> = ScalarType::Char;
template <> constexpr ScalarType scalar_type_of<int16_t> = ScalarType::Short;
template <> constexpr ScalarType scalar_type_of<int32_t> = ScalarType::Int;
template <> constexpr ScalarType scalar_type_of<int64_t> = ScalarType::Long;
template <> constexpr ScalarType scalar_type_of<Half> = ScalarType::Half;
template <> constexpr ScalarType scalar_type_of<float> = ScalarType::Float;
template <> constexpr ScalarType scalar_type_of<double> = ScalarType::Double;
template <> constexpr ScalarType scalar_type_of<bool> = ScalarType::Bool;
template <> constexpr ScalarType scalar_type_of<BFloat16> = ScalarType::BFloat16;
template <> constexpr ScalarType scalar_type_of<Float8_e5m2> = ScalarType::Float8_e5m2;
template <> constexpr ScalarType scalar_type_of<Float8_e4m3fn> = ScalarType::Float8_e4m3fn;

// The strides of a contiguous tensor of these sizes (a dimension of size 0 counts as 1,
// as torch's do).
inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

struct Device {
  bool cpu;
  bool is_cpu() const { return cpu; }
};

struct TensorOptions {
  ScalarType type;
  TensorOptions dtype(ScalarType t) const { return {t}; }
};

class Tensor {
 public:
  Tensor() = default;
  // `source`: the Python tensor this views whole (returned as itself), or null; `owner`
  // keeps the memory alive.
  Tensor(void* data, ScalarType type, std::vector<int64_t> sizes, std::vector<int64_t> strides,
         bool cpu, std::shared_ptr<void> owner, void* source)
      : data_(data), type_(type), sizes_(std::move(sizes)), strides_(std::move(strides)),
        cpu_(cpu), owner_(std::move(owner)), source_(source) {}

  bool defined() const { return type_ != ScalarType::Undefined; }
  ScalarType scalar_type() const { return type_; }
  TensorOptions options() const { return {type_}; }
  Device device() const { return {cpu_}; }
  bool is_cpu() const { return cpu_; }
  int64_t element_size() const { return kElementSizes[static_cast<int>(type_)]; }
  int64_t dim() const { return static_cast<int64_t>(sizes_.size()); }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t size(int64_t d) const { return sizes_[wrap(d)]; }
  int64_t stride(int64_t d) const { return strides_[wrap(d)]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : sizes_) n *= s;
    return n;
  }
  // As torch's: dimensions of size 1 may have any stride; an empty tensor is contiguous.
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int64_t d = dim() - 1; d >= 0; --d) {
      if (sizes_[d] == 0) return true;
      if (sizes_[d] != 1 && strides_[d] != expected) return false;
      expected *= sizes_[d];
    }
    return true;
  }
  void* data_ptr() const { return data_; }
  template <typename T>
  T* data_ptr() const {
    if (scalar_type_of<T> != type_) {
      fail("", "expected scalar type ", scalar_type_of<T>, " but found ", type_);
    }
    return static_cast<T*>(data_);
  }
  // The Python tensor to return for this one (null for a narrowed or reshaped view, or
  // memory allocated here); what keeps the memory alive.
  void* source() const { return source_; }
  const std::shared_ptr<void>& owner() const { return owner_; }

  Tensor narrow(int64_t d, int64_t start, int64_t length) const {
    d = wrap(d);
    if (start < 0 || length < 0 || start + length > sizes_[d]) {
      fail("", "narrow(", d, ", ", start, ", ", length, ") outside a dimension of ", sizes_[d]);
    }
    Tensor t = *this;
    t.data_ = static_cast<char*>(data_) + start * strides_[d] * element_size();
    t.sizes_[d] = length;
    t.source_ = nullptr;
    return t;
  }
  // The same elements in another shape, without a copy, where torch's view allows it:
  // each run of dimensions that are laid out one inside the other may be split or merged.
  Tensor view(std::vector<int64_t> shape) const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (n != numel()) fail("", "view ", shape, " of a tensor ", sizes_, ": a different element count");
    std::vector<int64_t> strides(shape.size());
    if (!view_strides(shape, strides)) {
      fail("", "view ", shape, " of a tensor ", sizes_, " with strides ", strides_,
           ": its layout does not allow it");
    }
    Tensor t = *this;
    t.sizes_ = std::move(shape);
    t.strides_ = std::move(strides);
    t.source_ = nullptr;
    return t;
  }
  Tensor contiguous() const {
    if (!is_contiguous()) fail("", "a contiguous tensor is required, got strides ", strides_);
    return *this;
  }

 private:
  // Strides of `shape` over this tensor's memory; false if a new dimension would span
  // old dimensions that are not laid out one inside the other.
  bool view_strides(const std::vector<int64_t>& shape, std::vector<int64_t>& out) const {
    const int64_t new_dims = static_cast<int64_t>(shape.size());
    if (numel() == 0 || dim() == 0) {  // any shape: contiguous strides
      out = contiguous_strides(shape);
      return true;
    }
    // Walk the old dimensions from the innermost, in runs that are one block of memory
    // (each dimension's stride the product of the inner ones' sizes, times the run's
    // innermost stride); the new dimensions over each run must hold exactly its elements.
    int64_t v = new_dims - 1;
    int64_t base = strides_.back(), run_numel = 1, view_numel = 1;
    for (int64_t d = dim() - 1; d >= 0; --d) {
      run_numel *= sizes_[d];
      const bool run_ends = d == 0 || (sizes_[d - 1] != 1 && strides_[d - 1] != run_numel * base);
      if (!run_ends) continue;
      while (v >= 0 && (view_numel < run_numel || shape[v] == 1)) {
        out[v] = view_numel * base;
        view_numel *= shape[v];
        --v;
      }
      if (view_numel != run_numel) return false;
      if (d > 0) {
        base = strides_[d - 1];
        run_numel = 1;
        view_numel = 1;
      }
    }
    return v == -1;
  }

  int64_t wrap(int64_t d) const {
    const int64_t n = dim();
    if (d < -n || d >= n) fail("", "dimension ", d, " out of range for a ", n, "-d tensor");
    return d < 0 ? d + n : d;
  }

  void* data_ = nullptr;
  ScalarType type_ = ScalarType::Undefined;
  std::vector<int64_t> sizes_, strides_;
  bool cpu_ = true;
  std::shared_ptr<void> owner_;
  void* source_ = nullptr;
};

// The allocator of new tensors, installed by lite_bind.h at module import.
inline Tensor (*allocate)(const std::vector<int64_t>& sizes, ScalarType type) = nullptr;

inline Tensor empty(const std::vector<int64_t>& sizes, TensorOptions options) {
  if (allocate == nullptr) fail("", "no tensor allocator (lite_bind.h) in this library");
  return allocate(sizes, options.type);
}
inline Tensor empty(const std::vector<int64_t>& sizes, ScalarType type) { return empty(sizes, TensorOptions{type}); }
inline Tensor empty_like(const Tensor& t) { return empty(t.sizes(), t.options()); }

// Releasing Python's lock around a long wait (for the ranks' all-reduce), through hooks
// lite_bind.h installs.
inline void* (*save_thread)() = nullptr;
inline void (*restore_thread)(void*) = nullptr;
struct gil_scoped_release {
  void* state = save_thread ? save_thread() : nullptr;
  gil_scoped_release() = default;
  gil_scoped_release(const gil_scoped_release&) = delete;
  gil_scoped_release& operator=(const gil_scoped_release&) = delete;
  ~gil_scoped_release() {
    if (state != nullptr) restore_thread(state);
  }
};

// torch's threads: torch sets OpenMP's thread count (torch.set_num_threads), and this
// library shares torch's OpenMP runtime (libgomp, loaded by torch first).
inline int get_num_threads() { return omp_get_max_threads(); }

inline thread_local bool in_parallel_region = false;

// at::parallel_for's contract and its split over OpenMP's threads: f(begin, end) on
// contiguous chunks, at most one per thread; serial for a range of up to `grain`
// elements, with one thread, or inside another parallel_for. An exception in a chunk is
// rethrown here, after every chunk has finished.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  if (range <= grain || range <= 1 || in_parallel_region || omp_in_parallel() || get_num_threads() == 1) {
    const bool outer = in_parallel_region;
    in_parallel_region = true;
    try {
      f(begin, end);
    } catch (...) {
      in_parallel_region = outer;
      throw;
    }
    in_parallel_region = outer;
    return;
  }
  int64_t threads = get_num_threads();
  if (grain > 0) threads = std::min<int64_t>(threads, (range + grain - 1) / grain);
  std::exception_ptr error;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t chunk = (range + team - 1) / team;
    const int64_t first = begin + tid * chunk;
    if (first < end) {
      in_parallel_region = true;
      try {
        f(first, std::min(end, first + chunk));
      } catch (...) {
#pragma omp critical(pagedlm_parallel_for_error)
        if (!error) error = std::current_exception();
      }
      in_parallel_region = false;
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace pagedlm_lite

#define TORCH_CHECK(cond, ...)                                          \
  do {                                                                  \
    if (!(cond)) ::pagedlm_lite::fail(#cond, ##__VA_ARGS__);            \
  } while (false)

// torch's names, so that the kernels read as written against torch.
namespace torch {
using pagedlm_lite::Tensor;
using pagedlm_lite::empty;
using pagedlm_lite::empty_like;
using ScalarType = pagedlm_lite::ScalarType;
constexpr auto kByte = ScalarType::Byte;
constexpr auto kUInt8 = ScalarType::Byte;
constexpr auto kInt = ScalarType::Int;
constexpr auto kLong = ScalarType::Long;
constexpr auto kHalf = ScalarType::Half;
constexpr auto kBFloat16 = ScalarType::BFloat16;
constexpr auto kFloat = ScalarType::Float;
constexpr auto kFloat32 = ScalarType::Float;
constexpr auto kFloat8_e4m3fn = ScalarType::Float8_e4m3fn;
constexpr auto kFloat8_e5m2 = ScalarType::Float8_e5m2;
}  // namespace torch

namespace at {
using pagedlm_lite::BFloat16;
using pagedlm_lite::Float8_e4m3fn;
using pagedlm_lite::Float8_e5m2;
using pagedlm_lite::get_num_threads;
using pagedlm_lite::Half;
using pagedlm_lite::parallel_for;
}  // namespace at

namespace c10 {
using pagedlm_lite::Half;
using ScalarType = pagedlm_lite::ScalarType;
template <typename T>
using optional = std::optional<T>;
inline constexpr std::nullopt_t nullopt = std::nullopt;
}  // namespace c10

namespace pagedlm {
// f(T{}) with T the element type of a KV cache of dtype `t` (float32, float16, bfloat16,
// float8 e4m3fn or e5m2), for kernels templated on it; false for any other dtype.
template <typename F>
bool visit_cache_dtype(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::ScalarType::Float: f(float{}); return true;
    case c10::ScalarType::Half: f(at::Half{}); return true;
    case c10::ScalarType::BFloat16: f(at::BFloat16{}); return true;
    case c10::ScalarType::Float8_e4m3fn: f(at::Float8_e4m3fn{}); return true;
    case c10::ScalarType::Float8_e5m2: f(at::Float8_e5m2{}); return true;
    default: return false;
  }
}
}  // namespace pagedlm
