// at::parallel_for and at::get_num_threads for the harness's build without torch: two "threads" run one after the
// other, so the kernels' work splits (parallel_claims, parallel_chunks) run as they do on two cores, in one order.
#pragma once
#include <algorithm>
#include <cstdint>

namespace at {

inline int get_num_threads() { return 2; }

// f(begin, end) over [begin, end) in at most get_num_threads() pieces of at least `grain`, in order.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t most = (end - begin) / std::max<int64_t>(grain, 1);
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(get_num_threads(), most));
  const int64_t step = (end - begin + pieces - 1) / pieces;
  for (int64_t a = begin; a < end; a += step) f(a, std::min(end, a + step));
}

}  // namespace at
