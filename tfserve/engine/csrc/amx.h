// bfloat16 linear layers through AMX tiles (TDPBF16PS: Sapphire Rapids and later Xeons), over the very panels the
// AVX512-BF16 path reads ([panels][k/2][kPanelCols][2], pack_pair_panels): 16 pair rows of one panel's 16 columns
// are a B tile in the VNNI-pair layout TDPBF16PS expects ([K/2][N*2], 64 bytes a row, 128 between rows).
// -march=native on a CPU without AMX leaves it off, so the tile code carries its own target attribute: it is in every
// x86-64 build with bfloat16 dot products by a new enough compiler, and runs only where amx.py chose it at run time
// (CPU flags, the kernel's tile permission, a probe in a child process: `use_amx`). Written to Intel's documented
// tile configuration without AMX hardware to run it on; the probe (amx_probe) is what vouches for it on a machine.
// Every row is computed the same way whatever the number of rows (16-row tiles, padded with zero rows), so while
// AMX is on every bfloat16 linear row goes through it, decode rows too: no result depends on its batch.
// Included by linear.h after its bfloat16 dot-product tiles (TFS_BF16_DOT, bf16_pairs, kPanelCols).
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if TFS_BF16_DOT && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TFS_AMX 1
#define TFS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16"), noinline))
#endif

namespace tfs {

inline std::atomic<bool> g_use_amx{false};  // set by use_amx once amx.py has decided (never on without TFS_AMX)

#if TFS_AMX
static_assert(kPanelCols == 32, "an AMX panel is two tiles of 16 float32 columns");
constexpr int64_t kAmxRows = 16;   // rows of a C tile (and of an A tile)
constexpr int64_t kAmxPairs = 16;  // input pairs a step: 64 bytes of an A row, 16 rows of B

// Palette 1's 64-byte configuration: tmm0/1 C (16 rows x 16 float32), tmm2 A (16 rows x 16 pairs), tmm3/4 B (16
// pair rows x 16 columns' pairs) for the panel's two halves; an in_features whose pairs are not whole steps of 16
// has its last `tail` pairs in tmm5 (A, 16 rows x tail pairs) and tmm6/7 (B, tail rows). Unused tiles stay 0.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes a row, tmm0..tmm15
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

inline TileConfig amx_config(int64_t tail) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  if (tail) {
    cfg.rows[5] = kAmxRows, cfg.colsb[5] = static_cast<uint16_t>(tail * 4);
    cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(tail), cfg.colsb[6] = cfg.colsb[7] = 64;
  }
  return cfg;
}

// Row tiles x panels, pieces [begin, end) of panels * row_tiles (piece = panel * row_tiles + row tile: a panel's
// row tiles one after the other, so its weights stay in cache). x: row-major pairs [row_tiles * 16][k2], rows past m
// zero; y[r, :n] = x[r] @ panels + bias for r < m, y's rows ldy apart (n: the columns from the first panel's on; a
// caller holding one panel of a wider layer passes that panel, its place in y and the columns left from there). The
// tile configuration is each thread's: loaded and released here.
TFS_AMX_TARGET static void amx_pieces(int64_t begin, int64_t end, const uint32_t* x, const c10::BFloat16* panels,
                                      const float* bias, float* y, int64_t m, int64_t k2, int64_t n, int64_t ldy) {
  const int64_t row_tiles = (m + kAmxRows - 1) / kAmxRows, steps = k2 / kAmxPairs, tail = k2 % kAmxPairs;
  const int64_t panel_size = k2 * 2 * kPanelCols, x_stride = k2 * 4, w_stride = 2 * kPanelCols * 2;  // bytes
  const TileConfig cfg = amx_config(tail);
  _tile_loadconfig(&cfg);
  alignas(64) float c[kAmxRows][kPanelCols];
  for (int64_t piece = begin; piece < end; ++piece) {
    const int64_t p = piece / row_tiles, r0 = piece % row_tiles * kAmxRows;
    const uint32_t* a = x + r0 * k2;
    const c10::BFloat16* w = panels + p * panel_size;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t s = 0; s < steps; ++s) {
      const c10::BFloat16* ws = w + s * kAmxPairs * 2 * kPanelCols;
      _tile_loadd(2, a + s * kAmxPairs, x_stride);
      _tile_loadd(3, ws, w_stride);
      _tile_loadd(4, ws + kPanelCols, w_stride);  // columns 16..31: 64 bytes on
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    if (tail) {
      const c10::BFloat16* ws = w + steps * kAmxPairs * 2 * kPanelCols;
      _tile_loadd(5, a + steps * kAmxPairs, x_stride);
      _tile_loadd(6, ws, w_stride);
      _tile_loadd(7, ws + kPanelCols, w_stride);
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, &c[0][0], kPanelCols * 4);
    _tile_stored(1, &c[0][16], kPanelCols * 4);
    const int64_t rows = std::min(kAmxRows, m - r0), cols = std::min(kPanelCols, n - p * kPanelCols);
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = y + (r0 + r) * ldy + p * kPanelCols;
      for (int64_t j = 0; j < cols; ++j) yr[j] = c[r][j] + (bias ? bias[p * kPanelCols + j] : 0.f);
    }
  }
  _tile_release();
}

// x [m, k] float32 -> row-major bfloat16 pairs [ceil(m / 16) * 16][k2] (bf16_pairs, one row a tile), pad rows zero.
inline std::vector<uint32_t> amx_rows(const float* x, int64_t m, int64_t k) {
  const int64_t k2 = (k + 1) / 2, padded = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  std::vector<uint32_t> pairs(padded * k2, 0u);
  bf16_pairs(x, pairs.data(), m, k, 1);
  return pairs;
}

// y = x @ W.T + bias through AMX, W from pack_linear_weight(..., dot=true); bias padded to whole panels or null.
inline void amx_linear(const float* x, const c10::BFloat16* panels, const float* bias, float* y, int64_t m, int64_t k,
                       int64_t n, int64_t num_panels) {
  const std::vector<uint32_t> pairs = amx_rows(x, m, k);
  const int64_t pieces = num_panels * ((m + kAmxRows - 1) / kAmxRows);
  at::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
    amx_pieces(begin, end, pairs.data(), panels, bias, y, m, (k + 1) / 2, n, n);
  });
}

// The probe amx.py runs in a child process before AMX is chosen: one thread, no torch, a layer whose shapes take
// every edge (a partial row tile, a pair tail, an odd in_features, a partial panel, a bias) against products of the
// same bfloat16 numbers summed in double. Returns the largest error relative to the largest output.
inline double amx_probe() {
  constexpr int64_t m = 21, k = 71, n = 45, k2 = (k + 1) / 2, num_panels = (n + kPanelCols - 1) / kPanelCols;
  std::vector<float> x(m * k), w(n * k), bias(num_panels * kPanelCols, 0.f), y(m * n), ref(m * n);
  uint32_t state = 12345u;
  auto next = [&] { state = state * 1664525u + 1013904223u; return static_cast<float>(state >> 8) / 16777216.f - 0.5f; };
  for (auto& v : x) v = next();
  for (auto& v : w) v = next();
  for (int64_t j = 0; j < n; ++j) bias[j] = next();
  std::vector<c10::BFloat16> packed(num_panels * k2 * 2 * kPanelCols, c10::BFloat16(0.f));
  for (int64_t c = 0; c < n; ++c)  // pack_pair_panels' layout, written out here to stay off the thread pool
    for (int64_t i = 0; i < k; ++i)
      packed[((c / kPanelCols * k2 + i / 2) * kPanelCols + c % kPanelCols) * 2 + i % 2] = c10::BFloat16(w[c * k + i]);
  const int64_t padded = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  std::vector<uint32_t> pairs(padded * k2, 0u);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i)
      pairs[r * k2 + i / 2] |= static_cast<uint32_t>(c10::BFloat16(x[r * k + i]).x) << (16 * (i % 2));
  amx_pieces(0, num_panels * (padded / kAmxRows), pairs.data(), packed.data(), bias.data(), y.data(), m, k2, n, n);
  double err = 0, scale = 0;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double s = bias[c];
      for (int64_t i = 0; i < k; ++i)
        s += static_cast<double>(static_cast<float>(c10::BFloat16(x[r * k + i]))) *
             static_cast<double>(static_cast<float>(c10::BFloat16(w[c * k + i])));
      err = std::max(err, std::abs(s - static_cast<double>(y[r * n + c])));
      scale = std::max(scale, std::abs(s));
      if (std::isnan(y[r * n + c])) return INFINITY;
    }
  return err / scale;
}
#endif

}  // namespace tfs
