// Collectives among the tensor-parallel ranks of one machine, over shared memory (the gloo transport goes
// through TCP and costs ~1 ms an all-reduce on 2 cores; these cost microseconds). Every rank copies its tensor
// into its slot of a shared buffer, publishes the call's sequence number in its flag, and waits for every
// peer's; then each reads all the slots. Two buffers alternate by the sequence's parity: a rank reuses a buffer
// only after every peer has published the next number, which it does after reading that buffer.
#pragma once
#include "torch_api.h"
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace shm {

// Wait until every rank's flag reaches `seq`: spin, then yield, then sleep; fail after `timeout_s`.
inline void wait_for_peers(const int64_t* flags, int64_t world, int64_t seq, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t spins = 0; __atomic_load_n(&flags[r], __ATOMIC_ACQUIRE) < seq; ++spins) {
      if (spins < 4096) continue;
      if (spins < 65536) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s)
        throw std::runtime_error("rank " + std::to_string(r) + " did not reach the collective within " +
                                 std::to_string(static_cast<int>(timeout_s)) + " s");
    }
  }
}

// Publish x (float32, contiguous) as rank `rank`'s part of call `seq`; returns the slots of this call once every
// rank has written its part: float32 [world, capacity] (a view of the shared buffer: read it before the call
// after next).
inline float* exchange(const torch::Tensor& x, torch::Tensor& flags, torch::Tensor& data, int64_t rank, int64_t seq,
                       double timeout_s) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "shm collectives take contiguous float32");
  const int64_t world = flags.size(0), capacity = data.size(2);
  TORCH_CHECK(x.numel() <= capacity, "tensor larger than the shared buffer");
  float* slots = data.data_ptr<float>() + (seq & 1) * world * capacity;
  std::memcpy(slots + rank * capacity, x.data_ptr<float>(), x.numel() * sizeof(float));
  int64_t* f = flags.data_ptr<int64_t>();
  __atomic_store_n(&f[rank], seq, __ATOMIC_RELEASE);
  wait_for_peers(f, world, seq, timeout_s);
  return slots;
}

}  // namespace shm

// x = the sum over ranks of x, in place; summed in rank order, so every rank gets the same bits.
inline void shm_all_reduce_(torch::Tensor x, torch::Tensor flags, torch::Tensor data, int64_t rank, int64_t seq,
                            double timeout_s) {
  const float* slots = shm::exchange(x, flags, data, rank, seq, timeout_s);
  const int64_t world = flags.size(0), capacity = data.size(2), n = x.numel();
  float* out = x.data_ptr<float>();
  std::memcpy(out, slots, n * sizeof(float));
  for (int64_t r = 1; r < world; ++r) {
    const float* part = slots + r * capacity;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] += part[i];
  }
}

// Every rank's x [rows, cols] side by side: [rows, world * cols].
inline torch::Tensor shm_all_gather(torch::Tensor x, torch::Tensor flags, torch::Tensor data, int64_t rank,
                                    int64_t seq, double timeout_s) {
  const float* slots = shm::exchange(x, flags, data, rank, seq, timeout_s);
  const int64_t world = flags.size(0), capacity = data.size(2), rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({rows, world * cols}, x.options());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < world; ++r)
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(o + i * world * cols + r * cols, slots + r * capacity + i * cols, cols * sizeof(float));
  return out;
}
