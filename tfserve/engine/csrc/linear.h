// Linear layers for steps of one to a few hundred rows, over weights in float32, float16 or bfloat16.
// A decode step multiplies every weight by only as many rows as there are sequences, so it is bound by
// reading the weights, where a general GEMM tuned for big matrices loses most of the bandwidth. The weight
// is repacked once into panels of kPanelCols output columns ([panels][K][kPanelCols], contiguous per panel,
// in the weight's storage type), and a tile of up to kTileRows rows x kPanelCols columns keeps its
// accumulators in registers while the panel streams past once. Half-precision
// weights are widened to float32 in registers; every product and sum is float32. Every row is computed the
// same way whatever the number of rows, so a request's result does not depend on what else is in the batch.
#pragma once
#include "torch_api.h"
#include <utility>
#include "vec.h"

#if TFS_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__)  // (every CPU with AVX512-BF16 has BW)
#define TFS_BF16_DOT 1  // bfloat16 panels through VDPBF16PS (Bf16DotTiles)
#endif

namespace tfs {

constexpr int64_t kPanelVecs = 2;
constexpr int64_t kPanelCols = kPanelVecs * Vec::N;
#if TFS_AVX512
constexpr bool kPrefetchStreams = true;  // software prefetch in tiles of one or two rows too (linear_tile)
#else
constexpr bool kPrefetchStreams = false;
#endif
#if TFS_AVX512 || TFS_NEON
constexpr int kTileRows = 12;  // 32 vector registers: 24 accumulators
#elif TFS_AVX2
constexpr int kTileRows = 6;   // 16 vector registers: 12 accumulators, 2 weights, 1 broadcast
#else
constexpr int kTileRows = 4;
#endif

template <typename W>
static void pack_panels(const W* src, W* dst, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanelCols && p * kPanelCols + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * kPanelCols + c] = src[(p * kPanelCols + c) * k + i];
  });
}

// y[r, :] = x[r] @ panels + bias for R rows and NP consecutive panels (the last one may be cut to `cols`).
// x: [R, k] (row stride ldx, or k where it is 0); y: row stride ldy. Few rows take several panels at once so
// that enough independent multiply-adds are in flight (one row of one panel would wait on each FMA's latency);
// each column still sums over k in order, so its result does not depend on R or NP.
template <int R, int NP, typename W>
static inline void linear_tile(const float* x, int64_t k, const W* panel, const float* bias, float* y,
                               int64_t ldy, int64_t cols, int64_t ldx = 0) {
  if (ldx == 0) ldx = k;
  constexpr int64_t P = kPanelCols;
  constexpr int V = kPanelVecs;
  const int64_t panel_stride = k * P;
  Vec acc[R][NP * V];
  for (int j = 0; j < NP * V; ++j) {
    const Vec b = bias ? Vec::load(bias + j * Vec::N) : Vec::zero();
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t i = 0; i < k; ++i) {
    Vec w[NP * V];
    for (int p = 0; p < NP; ++p) {
      const W* row = panel + p * panel_stride + i * P;
      // Tiles of several rows (one panel) ask for the panel ahead. One or two rows stream 2-4 panels at once:
      // on an AVX2 EPYC (Zen 3) the hardware prefetcher followed those better alone (prefetching made a float32
      // decode step of one sequence 10-15% slower); on a Zen 5 with AVX-512, asking 2 KiB ahead in each made
      // one or two rows' float16 layers 4-9% faster and float32 1-3% (30 SmolLM2 layers and its LM head, cold).
      if constexpr (NP == 1 || kPrefetchStreams) {
        constexpr int64_t kAheadRows = (NP == 1 ? 1024 : 2048) / (P * sizeof(W));  // 1-2 KiB ahead in the panel
        const char* ahead = reinterpret_cast<const char*>(row + kAheadRows * P);
        for (int64_t b = 0; b < static_cast<int64_t>(P * sizeof(W)); b += 64) __builtin_prefetch(ahead + b);
      }
      for (int j = 0; j < V; ++j) w[p * V + j] = Vec::load(row + j * Vec::N);
    }
    for (int r = 0; r < R; ++r) {
      const Vec a = Vec::set1(x[r * ldx + i]);
      for (int j = 0; j < NP * V; ++j) acc[r][j] = fma(a, w[j], acc[r][j]);
    }
  }
  const int64_t width = (NP - 1) * P + cols;
  for (int r = 0; r < R; ++r) {
    if (width == NP * P) {
      for (int j = 0; j < NP * V; ++j) acc[r][j].store(y + r * ldy + j * Vec::N);
    } else {  // the last panel's tail
      float tmp[NP * P];
      for (int j = 0; j < NP * V; ++j) acc[r][j].store(tmp + j * Vec::N);
      std::memcpy(y + r * ldy, tmp, width * sizeof(float));
    }
  }
}

template <typename W, int NP, int... Rs>
static void linear_tile_of(int rows, std::integer_sequence<int, Rs...>, const float* x, int64_t k,
                           const W* panel, const float* bias, float* y, int64_t ldy, int64_t cols, int64_t ldx = 0) {
  ((rows == Rs + 1 ? (linear_tile<Rs + 1, NP, W>(x, k, panel, bias, y, ldy, cols, ldx), true) : false) || ...);
}

// The tile kernels linear_panels runs: float rows over panels of W (every product and sum float32).
template <typename W>
struct FloatTiles {
  using X = float;
  using Wt = W;
  static int64_t x_stride(int64_t k) { return k; }
  static int64_t panel_size(int64_t k) { return k * kPanelCols; }  // elements of W per panel
  template <int R, int NP>
  static void tile(const X* x, int64_t k, const W* panel, const float* bias, float* y, int64_t ldy, int64_t cols) {
    linear_tile<R, NP, W>(x, k, panel, bias, y, ldy, cols);
  }
};

template <typename T, int NP, int... Rs>
static void tiles_of(int rows, std::integer_sequence<int, Rs...>, const typename T::X* x, int64_t k,
                     const typename T::Wt* panel, const float* bias, float* y, int64_t ldy, int64_t cols) {
  ((rows == Rs + 1 ? (T::template tile<Rs + 1, NP>(x, k, panel, bias, y, ldy, cols), true) : false) || ...);
}

// Rows a tile of linear_panels takes for m rows: as few tiles as kTileRows allows, balanced (32 rows -> 11, 11, 10).
inline int64_t tile_rows_for(int64_t m) {
  const int64_t num_tiles = (m + kTileRows - 1) / kTileRows;
  return num_tiles ? (m + num_tiles - 1) / num_tiles : 0;
}

template <typename T>
static void linear_panels(const typename T::X* xp, const typename T::Wt* wp, const float* bp, float* yp, int64_t m,
                          int64_t k, int64_t n, int64_t panels) {
  const int64_t num_tiles = (m + kTileRows - 1) / kTileRows, tile_rows = tile_rows_for(m);
  // panels per call: enough accumulators for the FMA pipes with one or two rows, and pieces enough to share
  // out (parallel_chunks): a 576-column layer is 18 panels on AVX-512, 5 pieces of 4 split 3 to 2
  int64_t group = tile_rows == 1 ? 4 : tile_rows == 2 ? 2 : 1;
  while (group > 1 && (panels + group - 1) / group < 4 * at::get_num_threads()) group /= 2;
  const int64_t num_groups = (panels + group - 1) / group;
  // a prompt's many rows in blocks of kBlockTiles tiles: pieces small enough that a thread set aside for a moment
  // leaves the other little to wait for at the end (whole panels of 2048 rows: 16% of a prefill's linear time)
  constexpr int64_t kBlockTiles = 16;
  const int64_t row_blocks = (num_tiles + kBlockTiles - 1) / kBlockTiles, block_rows = kBlockTiles * tile_rows;
  const int64_t ldx = T::x_stride(k), panel_size = T::panel_size(k);
  parallel_chunks(num_groups * row_blocks, [&](int64_t piece) {
    const int64_t g = piece / row_blocks, rb = piece % row_blocks;
    const int64_t p0 = g * group, np = std::min(group, panels - p0);
    const int64_t cols = std::min(kPanelCols, n - (p0 + np - 1) * kPanelCols);  // of the group's last panel
    for (int64_t r0 = rb * block_rows; r0 < std::min(m, (rb + 1) * block_rows); r0 += tile_rows) {
      const int rows = static_cast<int>(std::min(tile_rows, m - r0));
      const auto* x = xp + r0 * ldx;
      const auto* w = wp + p0 * panel_size;
      const float* b = bp ? bp + p0 * kPanelCols : nullptr;
      float* y = yp + r0 * n + p0 * kPanelCols;
      constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
      if (np == 4) tiles_of<T, 4>(rows, seq, x, k, w, b, y, n, cols);
      else if (np == 2) tiles_of<T, 2>(rows, seq, x, k, w, b, y, n, cols);
      else {  // one panel at a time (a group's remainder, or tiles of 3+ rows)
        for (int64_t p = 0; p < np; ++p) {
          const int64_t c = std::min(kPanelCols, n - (p0 + p) * kPanelCols);
          tiles_of<T, 1>(rows, seq, x, k, w + p * panel_size, b ? b + p * kPanelCols : nullptr, y + p * kPanelCols,
                         n, c);
        }
      }
    }
  });
}

#if TFS_BF16_DOT
// bfloat16 weights through the CPU's bfloat16 dot-product unit (AVX512-BF16's VDPBF16PS: 32 products a
// vector, twice the multiply-adds of float32 FMA): the panels hold each column's weights for inputs i, i+1 side
// by side ([panels][k/2][kPanelCols][2]), the rows' inputs are rounded to bfloat16 once (round to nearest even,
// as oneDNN does) and broadcast a pair at a time; the sums stay float32. A prompt's rows and decode batches are
// compute-bound, where this doubles the rate; one row reads the same bytes as the float32-arithmetic panels.
// Every row is still computed the same way whatever the number of rows.
// kInterleaved: the tile's R rows of pairs side by side, [k/2][R] (bf16_pairs), so that the 12 broadcasts of a
// step read one stream: rows one after the other ([R][k/2]) took 12 streams (and 12 address registers) from L2 once
// a prompt's rows outgrew L1, 180 GFLOP/s a core at 512 rows against 205 at 32; else [R][k/2]. Never inlined: in
// the attention kernel's loop the compiler kept its other values in registers and spilled the 24 accumulators.
template <int R, int NP, bool kInterleaved>
__attribute__((noinline)) static void bf16_dot_tile(const uint32_t* x, int64_t k, const c10::BFloat16* panel,
                                                    const float* bias, float* y, int64_t ldy, int64_t cols) {
  const int64_t k2 = (k + 1) / 2, panel_stride = k2 * 2 * kPanelCols;
  constexpr int V = kPanelVecs;
  __m512 acc[R][NP * V];
  for (int j = 0; j < NP * V; ++j) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t i = 0; i < k2; ++i) {
    __m512bh w[NP * V];
    for (int p = 0; p < NP; ++p) {
      const c10::BFloat16* row = panel + p * panel_stride + i * 2 * kPanelCols;
      __builtin_prefetch(reinterpret_cast<const char*>(row) + 2048);
      __builtin_prefetch(reinterpret_cast<const char*>(row) + 2048 + 64);
      for (int j = 0; j < V; ++j) w[p * V + j] = (__m512bh)_mm512_loadu_si512(row + j * 32);
    }
    const uint32_t* xi = kInterleaved ? x + i * R : x + i;
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(kInterleaved ? xi[r] : xi[r * k2]));
      for (int j = 0; j < NP * V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
    }
  }
  const int64_t width = (NP - 1) * kPanelCols + cols;
  for (int r = 0; r < R; ++r) {
    if (width == NP * kPanelCols) {
      for (int j = 0; j < NP * V; ++j) _mm512_storeu_ps(y + r * ldy + j * 16, acc[r][j]);
    } else {  // the last panel's tail
      float tmp[NP * kPanelCols];
      for (int j = 0; j < NP * V; ++j) _mm512_storeu_ps(tmp + j * 16, acc[r][j]);
      std::memcpy(y + r * ldy, tmp, width * sizeof(float));
    }
  }
}

// The tiles linear_panels runs over bf16_pairs' rows: each tile's rows interleaved.
struct Bf16DotTiles {
  using X = uint32_t;  // two bfloat16 inputs
  using Wt = c10::BFloat16;
  static int64_t x_stride(int64_t k) { return (k + 1) / 2; }
  static int64_t panel_size(int64_t k) { return x_stride(k) * 2 * kPanelCols; }
  template <int R, int NP>
  static void tile(const X* x, int64_t k, const Wt* panel, const float* bias, float* y, int64_t ldy, int64_t cols) {
    bf16_dot_tile<R, NP, true>(x, k, panel, bias, y, ldy, cols);
  }
};

// The same tiles over rows of pairs one after the other, [R][k/2] (attention's probabilities).
struct Bf16DotRowTiles : Bf16DotTiles {
  template <int R, int NP>
  static void tile(const X* x, int64_t k, const Wt* panel, const float* bias, float* y, int64_t ldy, int64_t cols) {
    bf16_dot_tile<R, NP, false>(x, k, panel, bias, y, ldy, cols);
  }
};

// w [n, k] -> [panels][k/2][kPanelCols][2], zero past n and k
static void pack_pair_panels(const c10::BFloat16* src, c10::BFloat16* dst, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols, k2 = (k + 1) / 2;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanelCols && p * kPanelCols + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[((p * k2 + i / 2) * kPanelCols + c) * 2 + i % 2] = src[(p * kPanelCols + c) * k + i];
  });
}

// x [m, k] float32 -> pairs of bfloat16 (round to nearest even; an odd k's last pair padded with 0), each tile
// of `tile_rows` rows (the last one: the rest) at its first row's place r0 * k/2, its rows interleaved [k/2][rows]
// (Bf16DotTiles).
static void bf16_pairs(const float* x, uint32_t* out, int64_t m, int64_t k, int64_t tile_rows) {
  const int64_t k2 = (k + 1) / 2;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t r0 = r / tile_rows * tile_rows, rows = std::min(tile_rows, m - r0);
      uint32_t* o = out + r0 * k2 + (r - r0);  // pair i at o[i * rows]
      const float* xr = x + r * k;
      const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int>(rows)));
      int64_t i = 0;
      for (; 2 * i + 32 <= k; i += 16) {  // 32 inputs: 16 pairs
        const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 2 * i + 16), _mm512_loadu_ps(xr + 2 * i));
        _mm512_i32scatter_epi32(o + i * rows, index, (__m512i)pairs, 4);
      }
      for (; i < k2; ++i) {
        const uint32_t lo = c10::BFloat16(xr[2 * i]).x, hi = 2 * i + 1 < k ? c10::BFloat16(xr[2 * i + 1]).x : 0;
        o[i * rows] = lo | hi << 16;
      }
    }
  });
}
#endif

}  // namespace tfs

#include "amx.h"

#if !TFS_NO_TORCH
// w: [out_features, in_features] -> panels [ceil(out / kPanelCols), in_features, kPanelCols] of `dtype`
// (default: w's own; float32, float16 or bfloat16). `dot`: bfloat16 panels for the CPU's bfloat16 dot
// products (Bf16DotTiles: [panels, ceil(in / 2), 2 * kPanelCols]) where the build has them (`bf16_dot`).
torch::Tensor pack_linear_weight(torch::Tensor w, c10::optional<at::ScalarType> dtype, bool dot) {
  const auto type = dtype.value_or(w.scalar_type());
  TORCH_CHECK(w.dim() == 2, "weight: [out_features, in_features]");
  TORCH_CHECK(type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16,
              "panels: float32, float16 or bfloat16");
  auto wc = w.to(type).contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + tfs::kPanelCols - 1) / tfs::kPanelCols;
  if (dot) {
    TORCH_CHECK(type == torch::kBFloat16, "dot-product panels hold bfloat16");
#if TFS_BF16_DOT
    auto out = torch::zeros({panels, (k + 1) / 2, 2 * tfs::kPanelCols}, wc.options());
    tfs::pack_pair_panels(wc.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), n, k);
    return out;
#else
    TORCH_CHECK(false, "this build has no bfloat16 dot products (bf16_dot is False)");
#endif
  }
  auto out = torch::zeros({panels, k, tfs::kPanelCols}, wc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, type, "pack_linear_weight", [&] {
    tfs::pack_panels<scalar_t>(wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, k);
  });
  return out;
}

// y = x @ W.T + bias, W packed by pack_linear_weight. x: float32 [rows, in_features] -> [rows, out_features].
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: float32 [rows, in_features]");
  auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), n = out_features;
  const bool dot = packed.size(2) == 2 * tfs::kPanelCols;  // pack_linear_weight(..., dot=true)
  TORCH_CHECK(packed.size(1) == (dot ? (k + 1) / 2 : k) && (dot || packed.size(2) == tfs::kPanelCols) &&
              panels * tfs::kPanelCols >= n, "packed weight mismatch");
  auto y = torch::empty({m, n}, x.options());
  torch::Tensor bias_padded;
  const float* bp = nullptr;
  if (bias) {  // padded to whole panels so that every tile loads whole vectors
    bias_padded = torch::zeros({panels * tfs::kPanelCols}, x.options());
    bias_padded.narrow(0, 0, n).copy_(*bias);
    bp = bias_padded.data_ptr<float>();
  }
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (dot) {
#if TFS_BF16_DOT
    TORCH_CHECK(packed.scalar_type() == torch::kBFloat16, "dot-product panels hold bfloat16");
#if TFS_AMX
    if (tfs::g_use_amx.load(std::memory_order_relaxed)) {  // chosen at run time (amx.py, use_amx)
      tfs::amx_linear(xp, packed.data_ptr<c10::BFloat16>(), bp, yp, m, k, n, panels);
      return y;
    }
#endif
    auto pairs = torch::empty({m, (k + 1) / 2}, torch::kInt32);
    auto* xpairs = reinterpret_cast<uint32_t*>(pairs.data_ptr<int32_t>());
    tfs::bf16_pairs(xp, xpairs, m, k, tfs::tile_rows_for(m));
    tfs::linear_panels<tfs::Bf16DotTiles>(xpairs, packed.data_ptr<c10::BFloat16>(), bp, yp, m, k, n, panels);
    return y;
#else
    TORCH_CHECK(false, "this build has no bfloat16 dot products (bf16_dot is False)");
#endif
  }
  switch (packed.scalar_type()) {
    case torch::kFloat32:
      tfs::linear_panels<tfs::FloatTiles<float>>(xp, packed.data_ptr<float>(), bp, yp, m, k, n, panels);
      break;
    case torch::kFloat16:
      tfs::linear_panels<tfs::FloatTiles<c10::Half>>(xp, packed.data_ptr<c10::Half>(), bp, yp, m, k, n, panels);
      break;
    case torch::kBFloat16:
      tfs::linear_panels<tfs::FloatTiles<c10::BFloat16>>(xp, packed.data_ptr<c10::BFloat16>(), bp, yp, m, k, n, panels);
      break;
    default:
      TORCH_CHECK(false, "panels: float32, float16 or bfloat16");
  }
  return y;
}
#endif  // !TFS_NO_TORCH
