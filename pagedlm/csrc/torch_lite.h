// What the kernels use of torch, without <torch/extension.h>.
//
// torch/extension.h brings the whole C++ frontend (autograd, nn, optim, data loaders):
// parsing it took 32 s per file on the 2-core test machine, most of a first start's build
// of these kernels. They need tensors, two factory functions, at::parallel_for and
// pybind11 with torch's tensor type casters, which parse in about 5 s. The names are
// the torch:: ones torch/types.h declares, so the sources read as before.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using at::Tensor;
using at::empty;
using at::empty_like;
constexpr auto kByte = at::kByte;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt = at::kInt;
constexpr auto kLong = at::kLong;
constexpr auto kHalf = at::kHalf;
constexpr auto kBFloat16 = at::kBFloat16;
constexpr auto kFloat = at::kFloat;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat8_e4m3fn = at::kFloat8_e4m3fn;
constexpr auto kFloat8_e5m2 = at::kFloat8_e5m2;
}  // namespace torch

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
