// What the kernels need of torch, and no more: tensors, their factories, parallel_for and pybind11 with
// torch's tensor casters. <torch/extension.h> brings the whole C++ frontend (nn, optim, data) besides, and
// parsing it was most of a build (64 of 111 s on a 2-core EPYC); this is the build users wait for on first use.
// With TFS_NO_TORCH, the kernels alone, without their torch entry points: a plain C++ build (the cross-compiled
// harness of tests/engine/neon_harness) that supplies c10::Half, c10::BFloat16 and at::parallel_for itself.
#pragma once
#include <algorithm>
#include <atomic>
#include <ATen/Parallel.h>
#if !TFS_NO_TORCH
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
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
#endif

namespace tfs {

// body(claim) runs once on each of torch's threads (at most n of them); claim() hands out 0, 1, ..., n - 1, each
// to whichever thread asks first, then -1. A fixed split (at::parallel_for's) makes a step wait for the slowest
// thread's whole share: on 2 cores shared with the server's event loop and its clients, the OS sets one thread
// aside for a moment in most steps, and a float32 decode step of one sequence took 1.7x as long beside a
// process busy a third of the time. Claimed a piece at a time, the other thread takes over the pieces left.
// What a piece computes must not depend on the thread that computes it.
template <typename Body>
inline void parallel_claims(int64_t n, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto claim = [&next, n]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(claim); });
}

#if !TFS_NO_TORCH
// f(keys, values): the KV caches' data as the kernels read it, float or c10::BFloat16 (both caches of one type).
template <typename F>
inline void with_cache_data(const at::Tensor& k_cache, const at::Tensor& v_cache, const F& f) {
  if (k_cache.scalar_type() == at::kBFloat16)
    f(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  else
    f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}
#endif

// f(i) for every i in [0, n), each i claimed by whichever thread is free (parallel_claims).
template <typename F>
inline void parallel_chunks(int64_t n, const F& f) {
  parallel_claims(n, [&](auto& claim) {
    for (int64_t i = claim(); i >= 0; i = claim()) f(i);
  });
}

}  // namespace tfs
