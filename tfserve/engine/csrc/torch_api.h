// What the kernels need of torch, and no more: tensors, their factories, parallel_for and pybind11 with
// torch's tensor casters. <torch/extension.h> brings the whole C++ frontend (nn, optim, data) besides, and
// parsing it was most of a build (64 of 111 s on a 2-core EPYC); this is the build users wait for on first use.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;  // torch::Tensor, torch::empty, torch::kFloat ... as <torch/extension.h> spells them
// torch/types.h's names of the dtypes these kernels take
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
}  // namespace torch
