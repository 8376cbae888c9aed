// The peak rate of each unit the kernels multiply on, measured in registers: kPeakChains independent chains of
// the unit's widest multiply-add (no memory traffic: what the unit gives when nothing else waits), on each of
// torch's threads at once. `tfserve bench roofline` reports how much of it a batch's step reaches. Ops are counted
// as 2 per multiply-add, as GFLOP/s are.
//   float32   FMA (AVX-512, AVX2, NEON)
//   bfloat16  VDPBF16PS, 32 products a 512-bit vector (AVX512-BF16 builds)
//   int8      VPDPBUSD, 64 products a 512-bit vector (AVX512-VNNI), 32 a 256-bit one (AVX-VNNI), else AVX2's
//             maddubs + madd (two instructions for 32)
// A unit the build lacks measures 0.
#pragma once
#include <chrono>
#include <string>

#include "quant_lanes.h"

namespace tfs {

constexpr int kPeakChains = 12;  // independent accumulators: enough for 2 pipes of a 4-6 cycle latency

// Multiply-adds one thread does in `iters` rounds of the unit's instruction over kPeakChains accumulators; 0
// where the build has no such unit.
inline double peak_rounds(const std::string& unit, int64_t iters) {
#if TFS_AVX512 || TFS_AVX2
#if TFS_AVX512
  using V = __m512;
  using VI = __m512i;
  constexpr int kLanes = 16;
#define TFS_PEAK_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#else
  using V = __m256;
  using VI = __m256i;
  constexpr int kLanes = 8;
#define TFS_PEAK_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#endif
  V acc[kPeakChains];
  VI iacc[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) {
    std::memset(&acc[i], 0, sizeof(V));
    std::memset(&iacc[i], 0, sizeof(VI));
  }
  V a, b;
  VI ia, ib;
  std::memset(&a, 0, sizeof(V)), std::memset(&b, 0, sizeof(V));
  std::memset(&ia, 1, sizeof(VI)), std::memset(&ib, 1, sizeof(VI));
  asm volatile("" : "+v"(a), "+v"(b), "+v"(ia), "+v"(ib));  // unknown to the compiler: nothing folds
  double macs_per_round = 0;
  if (unit == "float32") {
    for (int64_t t = 0; t < iters; ++t)
      for (int i = 0; i < kPeakChains; ++i) acc[i] = TFS_PEAK_FMA(a, b, acc[i]);
    macs_per_round = kLanes;
  } else if (unit == "bfloat16") {
#if TFS_AVX512 && defined(__AVX512BF16__)
    for (int64_t t = 0; t < iters; ++t)
      for (int i = 0; i < kPeakChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
    macs_per_round = 32;
#endif
  } else if (unit == "int8") {
#if TFS_AVX512 && defined(__AVX512VNNI__)
    for (int64_t t = 0; t < iters; ++t)
      for (int i = 0; i < kPeakChains; ++i) iacc[i] = _mm512_dpbusd_epi32(iacc[i], ia, ib);
    macs_per_round = 64;
#else  // the block kernels' 256-bit integer dot products: AVX-VNNI, else maddubs + madd
    __m256i y[kPeakChains];
    __m256i ya = _mm256_set1_epi8(1), yb = _mm256_set1_epi8(2);
    for (int i = 0; i < kPeakChains; ++i) y[i] = _mm256_setzero_si256();
    for (int64_t t = 0; t < iters; ++t)
      for (int i = 0; i < kPeakChains; ++i) {
        asm volatile("" : "+v"(ya));  // a new input each time: maddubs + madd cannot be hoisted
#if TFS_VNNI
        y[i] = TFS_DPBUSD(y[i], ya, yb);
#else
        y[i] = _mm256_add_epi32(y[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ya, yb), _mm256_set1_epi16(1)));
#endif
      }
    for (int i = 0; i < kPeakChains; ++i) asm volatile("" : : "v"(y[i]));
    macs_per_round = 32;
#endif
  }
#undef TFS_PEAK_FMA
  for (int i = 0; i < kPeakChains; ++i) asm volatile("" : : "v"(acc[i]), "v"(iacc[i]));  // the results are used
  return macs_per_round * kPeakChains * static_cast<double>(iters);
#else
  (void)unit, (void)iters;
  return 0;
#endif
}

// GOP/s of `unit` on all of torch's threads together, over about `seconds`.
inline double unit_peak_gops(const std::string& unit, double seconds) {
  using clock = std::chrono::steady_clock;
  const int64_t threads = at::get_num_threads();
  int64_t iters = 1 << 12;
  for (;;) {  // rounds enough for a tenth of `seconds` on one thread, then all of them at once
    const auto start = clock::now();
    if (peak_rounds(unit, iters) == 0) return 0;
    if (std::chrono::duration<double>(clock::now() - start).count() > seconds / 10 || iters > (int64_t{1} << 40)) break;
    iters *= 2;
  }
  iters *= 10;
  std::vector<double> macs(threads, 0.0);
  const auto start = clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) macs[t] = peak_rounds(unit, iters);
  });
  const double elapsed = std::chrono::duration<double>(clock::now() - start).count();
  double total = 0;
  for (double m : macs) total += m;
  return 2 * total / elapsed / 1e9;
}

}  // namespace tfs
