// Linear layers over block-quantized weights, read as GGUF stores them: Q4_0, Q4_1 and Q8_0 (blocks of 32
// weights along the input dimension with a float16 scale, and for Q4_1 a float16 minimum). The activations
// are quantized per block of 32 to int8 with a float scale (as llama.cpp's Q8_0/Q8_1), so every block's dot
// product is integer arithmetic: 32 multiply-adds of u8 or s8 weights by s8 activations in two instructions
// on AVX2 (maddubs + madd), one with VNNI; then one float multiply-add by the two scales. A tile of R rows x
// C output columns decodes each weight block once for R rows and loads each activation block once for C
// columns. Plain C++ elsewhere (the compiler vectorises the integer loops).
//
// Rows from `float_from` on (a step's prompt tokens: the runner packs decodes first) take the other road:
// each panel of columns is dequantized exactly as GGUF defines it (d * q + m, every product and sum rounded)
// and multiplied in float32 by the panel kernel of linear.h, which is faster for many rows and computes what
// the float32 engine computes over the same file. Which road a row takes depends only on what kind of token
// it is, so a request's results still do not depend on its batch.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "linear.h"
#include "vec.h"

namespace tfs {

constexpr int64_t QK = 32;  // weights per block

enum class QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGUF's type ids

struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "GGUF block sizes");

inline int64_t block_bytes(QType t) {
  return t == QType::Q4_0 ? 18 : t == QType::Q4_1 ? 20 : 34;
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Activations of one row as int8 blocks: x[i] ~ d * q[i]; s = sum(x), exact, for the minimum of Q4_0/Q4_1
// (llama.cpp's Q8_1 keeps d * sum(q): the quantized sum, a larger error where the minimum is large).
struct QuantRows {
  std::vector<int8_t> q;   // [rows, k]
  std::vector<float> d, s; // [rows, k / 32]
};

inline void quantize_rows(const float* x, int64_t rows, int64_t k, QuantRows& out) {
  const int64_t nb = k / QK;
  out.q.resize(rows * k);
  out.d.resize(rows * nb);
  out.s.resize(rows * nb);
  at::parallel_for(0, rows * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + i * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, inv = d ? 1.f / d : 0.f;
      float sum = 0.f;
      int8_t* qb = out.q.data() + i * QK;
      for (int j = 0; j < QK; ++j) {
        qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
        sum += xb[j];
      }
      out.d[i] = d;
      out.s[i] = sum;
    }
  });
}

#if TFS_AVX2 || TFS_AVX512
// 32 weights of a block as bytes: u8 0..15 for the 4-bit types, s8 for Q8_0.
template <QType T> inline __m256i load_quants(const void* block);
// 16 bytes of nibbles -> 32 bytes: the low nibbles (weights 0-15) in the low lane, the high ones in the high
// lane. One broadcast load, one variable shift, one and.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}
template <> inline __m256i load_quants<QType::Q4_0>(const void* b) {
  return unpack_nibbles(static_cast<const BlockQ4_0*>(b)->qs);
}
template <> inline __m256i load_quants<QType::Q4_1>(const void* b) {
  return unpack_nibbles(static_cast<const BlockQ4_1*>(b)->qs);
}
template <> inline __m256i load_quants<QType::Q8_0>(const void* b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const BlockQ8_0*>(b)->qs));
}

// The 32 products of a weight block and an activation block, summed in 8 int32 lanes.
template <QType T> inline __m256i dot_block(__m256i w, __m256i x) {
  if constexpr (T == QType::Q8_0) {  // s8 x s8: |w| (u8) times x with w's sign, as maddubs wants
    const __m256i ax = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
    x = ax;
  }
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

template <QType T> inline float block_scale(const void* b) { return half_to_float(*static_cast<const uint16_t*>(b)); }
// What a quant of 0 stands for, over the block's scale: Q4_1's minimum, Q4_0's -8 (its quants are offset).
template <QType T> inline float block_min(const void* b) {
  if constexpr (T == QType::Q4_1) return half_to_float(static_cast<const BlockQ4_1*>(b)->m);
  else if constexpr (T == QType::Q4_0) return -8.f * half_to_float(static_cast<const BlockQ4_0*>(b)->d);
  else return 0.f;
}

// The integer dot product of a weight block and an activation block, in plain C++.
template <QType T> inline int dot_block_scalar(const void* b, const int8_t* x) {
  int sum = 0;
  if constexpr (T == QType::Q8_0) {
    const int8_t* q = static_cast<const BlockQ8_0*>(b)->qs;
    for (int j = 0; j < 32; ++j) sum += q[j] * x[j];
  } else {
    const uint8_t* q = T == QType::Q4_1 ? static_cast<const BlockQ4_1*>(b)->qs : static_cast<const BlockQ4_0*>(b)->qs;
    for (int j = 0; j < 16; ++j) sum += (q[j] & 0x0F) * x[j] + (q[j] >> 4) * x[j + 16];
  }
  return sum;
}

// y[r, c] = sum over blocks of scale_w * d_x * dot + min_w * s_x, for R rows and C columns starting at `w`
// (C rows of the weight, each `nb` blocks). y: row stride ldy.
template <QType T, int R, int C>
static inline void quant_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantRows& xq, int64_t r0,
                              int64_t k, float* y, int64_t ldy) {
  const int64_t bb = block_bytes(T);
  float mins[R][C] = {};
#if TFS_AVX2 || TFS_AVX512
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[C];
    float dw[C], mw[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = w + c * row_bytes + b * bb;
      // (no software prefetch: each column is one sequential stream, which the hardware follows)
      wq[c] = load_quants<T>(blk);
      dw[c] = block_scale<T>(blk);
      mw[c] = block_min<T>(blk);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * (k / QK) + b;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * QK));
      const float dx = xq.d[i], sx = xq.s[i];
      for (int c = 0; c < C; ++c) {
        const __m256 p = _mm256_cvtepi32_ps(dot_block<T>(wq[c], xv));
        acc[r][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw[c] * dx), acc[r][c]);
        if constexpr (T != QType::Q8_0) mins[r][c] += mw[c] * sx;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum(acc[r][c]) + mins[r][c];
#else
  float acc[R][C] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = w + c * row_bytes + b * bb;
      const float dw = block_scale<T>(blk), mw = block_min<T>(blk);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * (k / QK) + b;
        acc[r][c] += dw * xq.d[i] * static_cast<float>(dot_block_scalar<T>(blk, xq.q.data() + i * QK));
        mins[r][c] += mw * xq.s[i];
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = acc[r][c] + mins[r][c];
#endif
}

template <QType T, int C, int... Rs>
static void quant_tile_of(int rows, std::integer_sequence<int, Rs...>, const uint8_t* w, int64_t row_bytes,
                          int64_t nb, const QuantRows& xq, int64_t r0, int64_t k, float* y, int64_t ldy) {
  ((rows == Rs + 1 ? (quant_tile<T, Rs + 1, C>(w, row_bytes, nb, xq, r0, k, y, ldy), true) : false) || ...);
}

constexpr int kQuantTileRows = 4;
constexpr int kQuantTileCols = 2;

template <QType T, int C>
static void quant_columns(const uint8_t* w, const QuantRows& xq, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t nb = k / QK, row_bytes = nb * block_bytes(T);
  constexpr auto rows_seq = std::make_integer_sequence<int, kQuantTileRows>{};
  at::parallel_for(0, (n + C - 1) / C, 16 / C, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t c0 = g * C;
      for (int64_t r0 = 0; r0 < m; r0 += kQuantTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kQuantTileRows, m - r0));
        if (c0 + C <= n) {
          quant_tile_of<T, C>(rows, rows_seq, w + c0 * row_bytes, row_bytes, nb, xq, r0, k, y + r0 * n + c0, n);
        } else {  // the last columns, one at a time
          for (int64_t c = c0; c < n; ++c)
            quant_tile_of<T, 1>(rows, rows_seq, w + c * row_bytes, row_bytes, nb, xq, r0, k, y + r0 * n + c, n);
        }
      }
    }
  });
}

// One row takes 4 columns at a time (more independent work per activation block), more rows 2.
template <QType T>
static void quant_linear(const uint8_t* w, const QuantRows& xq, float* y, int64_t m, int64_t k, int64_t n) {
  if (m == 1) quant_columns<T, 4>(w, xq, y, m, k, n);
  else quant_columns<T, kQuantTileCols>(w, xq, y, m, k, n);
}

// The weight's rows [c0, c0 + cols) as one float32 panel [k][kPanelCols] (zero past `cols`), each value as
// GGUF dequantizes it: d * q for Q8_0, d * (q - 8) for Q4_0, d * q + m for Q4_1.
template <QType T>
static void dequantize_panel(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t c0, int64_t cols, float* panel) {
  constexpr int64_t P = kPanelCols;
  const int64_t bb = block_bytes(T);
  for (int64_t c = 0; c < P; ++c) {
    if (c >= cols) {
      for (int64_t i = 0; i < nb * QK; ++i) panel[i * P + c] = 0.f;
      continue;
    }
    const uint8_t* row = w + (c0 + c) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb;
      const float d = block_scale<T>(blk);
      float* out = panel + b * QK * P + c;
      if constexpr (T == QType::Q8_0) {
        const int8_t* q = static_cast<const BlockQ8_0*>(static_cast<const void*>(blk))->qs;
        for (int j = 0; j < 32; ++j) out[j * P] = d * static_cast<float>(q[j]);
      } else if constexpr (T == QType::Q4_0) {
        const uint8_t* q = reinterpret_cast<const BlockQ4_0*>(blk)->qs;
        for (int j = 0; j < 16; ++j) {
          out[j * P] = d * static_cast<float>((q[j] & 0x0F) - 8);
          out[(j + 16) * P] = d * static_cast<float>((q[j] >> 4) - 8);
        }
      } else {
        const uint8_t* q = reinterpret_cast<const BlockQ4_1*>(blk)->qs;
        const float m = half_to_float(reinterpret_cast<const BlockQ4_1*>(blk)->m);
        for (int j = 0; j < 16; ++j) {
          out[j * P] = d * static_cast<float>(q[j] & 0x0F) + m;
          out[(j + 16) * P] = d * static_cast<float>(q[j] >> 4) + m;
        }
      }
    }
  }
}

template <QType T>
static void dequant_linear(const uint8_t* w, const float* x, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t nb = k / QK, row_bytes = nb * block_bytes(T);
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t num_tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t tile_rows = (m + num_tiles - 1) / num_tiles;
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(k * kPanelCols);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanelCols, n - p * kPanelCols);
      dequantize_panel<T>(w, row_bytes, nb, p * kPanelCols, cols, panel.data());
      for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
        const int rows = static_cast<int>(std::min(tile_rows, m - r0));
        linear_tile_of<float, 1>(rows, seq, x + r0 * k, k, panel.data(), nullptr, y + r0 * n + p * kPanelCols, n,
                                 cols);
      }
    }
  });
}

}  // namespace tfs

// y = x @ W.T + bias with W in GGUF blocks: `blocks` uint8 [out_features, in_features / 32 * block bytes],
// `qtype` GGUF's type id (2: Q4_0, 3: Q4_1, 8: Q8_0). x: float32 [rows, in_features] -> [rows, out_features].
// Rows before `float_from` (all where it is negative) multiply with int8 activations, the rest in float32
// over the dequantized weight.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype, c10::optional<torch::Tensor> bias,
                           int64_t float_from) {
  using tfs::QType;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: float32 [rows, in_features]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [out_features, bytes per row]");
  const auto type = static_cast<QType>(qtype);
  TORCH_CHECK(type == QType::Q4_0 || type == QType::Q4_1 || type == QType::Q8_0, "qtype: 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)");
  auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % tfs::QK == 0 && blocks.size(1) == k / tfs::QK * tfs::block_bytes(type), "blocks do not match x");
  const int64_t mi = float_from < 0 ? m : std::min(float_from, m);  // rows on the integer road
  auto y = torch::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (mi > 0) {
    tfs::QuantRows xq;
    tfs::quantize_rows(xp, mi, k, xq);
    switch (type) {
      case QType::Q4_0: tfs::quant_linear<QType::Q4_0>(w, xq, yp, mi, k, n); break;
      case QType::Q4_1: tfs::quant_linear<QType::Q4_1>(w, xq, yp, mi, k, n); break;
      case QType::Q8_0: tfs::quant_linear<QType::Q8_0>(w, xq, yp, mi, k, n); break;
    }
  }
  if (mi < m) {
    switch (type) {
      case QType::Q4_0: tfs::dequant_linear<QType::Q4_0>(w, xp + mi * k, yp + mi * n, m - mi, k, n); break;
      case QType::Q4_1: tfs::dequant_linear<QType::Q4_1>(w, xp + mi * k, yp + mi * n, m - mi, k, n); break;
      case QType::Q8_0: tfs::dequant_linear<QType::Q8_0>(w, xp + mi * k, yp + mi * n, m - mi, k, n); break;
    }
  }
  if (bias) y.add_(*bias);
  return y;
}

// w: float32 [out_features, in_features] -> Q8_0 blocks uint8 [out_features, in_features / 32 * 34], as GGUF
// quantizes: per block d = max|w| / 127 (stored as float16), q = round(w / d).
torch::Tensor quantize_q8_0(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % tfs::QK == 0, "weight: [out_features, in_features], in_features % 32 == 0");
  auto wc = w.to(torch::kFloat32).contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = k / tfs::QK;
  auto out = torch::empty({n, nb * 34}, w.options().dtype(torch::kUInt8));
  const float* src = wc.data_ptr<float>();
  auto* dst = reinterpret_cast<tfs::BlockQ8_0*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, n * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = src + i * tfs::QK;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.f, inv = d ? 1.f / d : 0.f;
      dst[i].d = c10::Half(d).x;
      for (int j = 0; j < 32; ++j) dst[i].qs[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
    }
  });
  return out;
}
