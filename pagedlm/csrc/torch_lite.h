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
