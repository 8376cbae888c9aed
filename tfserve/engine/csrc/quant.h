// Linear layers over block-quantized weights, read as GGUF stores them: Q4_0, Q4_1 and Q8_0 (blocks of 32
// weights along the input dimension with a float16 scale, and for Q4_1 a float16 minimum). The activations
// are quantized per block of 32 to int8 with a float scale (as llama.cpp's Q8_0/Q8_1), so every block's dot
// product is integer arithmetic (maddubs + madd on AVX2), 8 output columns per vector over blocks regrouped
// at load (`repack_blocks`, below), then one float multiply-add by the two scales per 8 columns. A tile of
// up to 4 rows unpacks each group block once. Plain C++ elsewhere (the compiler vectorises the loops).
//
// Rows from `float_from` on (a step's prompt tokens: the runner packs decodes first) take the other road:
// each panel of columns is dequantized exactly as GGUF defines it (d * q + m, every product and sum rounded)
// and multiplied in float32 by the panel kernel of linear.h, which is faster for many rows and computes what
// the float32 engine computes over the same file. Which road a row takes depends only on what kind of token
// it is, so a request's results still do not depend on its batch.
#pragma once
#include "torch_api.h"
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

// ---- Repacked blocks: 8 output columns per vector ---------------------------------------------------------
// The kernels read the blocks regrouped: per group of 8 output columns and block of 32 inputs, the 8 scales,
// then (4-bit) the 8 minimums, then the quants laid out so that one 32-byte load holds 4 consecutive inputs of
// all 8 columns. Multiplied by 4 activations broadcast to every lane, `maddubs` + `madd` give 8 columns' sums
// at once: no horizontal sums, and one float multiply-add per 8 columns per block instead of one per column.
//   4-bit: uint16 d[8], uint16 m[8] (Q4_0: m = -8 d, exact in float16), uint8 q[4][32] where byte
//          q[p][4c + i] is column c's original qs[4p + i]: weight 4p + i in its low nibble, 16 + 4p + i in its high.
//   8-bit: uint16 d[8], int8 q[8][32] where q[j][4c + i] is column c's weight 4j + i.
constexpr int64_t kGroup = 8;

inline bool four_bit(QType t) { return t != QType::Q8_0; }
constexpr int64_t group_block_bytes(bool four) { return four ? 32 + 128 : 16 + 256; }
inline int64_t group_block_bytes(QType t) { return group_block_bytes(four_bit(t)); }

// blocks: [n][nb] GGUF blocks -> [ceil(n / 8)][nb] group blocks (columns past n: zero).
inline void repack(const uint8_t* src, uint8_t* dst, int64_t n, int64_t nb, QType t) {
  const int64_t bb = block_bytes(t), gbb = group_block_bytes(t), groups = (n + kGroup - 1) / kGroup;
  std::memset(dst, 0, groups * nb * gbb);
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* out = dst + (g * nb + b) * gbb;
        auto* d = reinterpret_cast<uint16_t*>(out);
        for (int64_t c = 0; c < kGroup && g * kGroup + c < n; ++c) {
          const uint8_t* blk = src + ((g * kGroup + c) * nb + b) * bb;
          d[c] = *reinterpret_cast<const uint16_t*>(blk);
          if (t == QType::Q8_0) {
            const int8_t* q = reinterpret_cast<const BlockQ8_0*>(blk)->qs;
            for (int j = 0; j < 8; ++j)
              for (int i = 0; i < 4; ++i) out[16 + j * 32 + 4 * c + i] = static_cast<uint8_t>(q[4 * j + i]);
          } else {
            const bool q41 = t == QType::Q4_1;
            d[kGroup + c] = q41 ? reinterpret_cast<const BlockQ4_1*>(blk)->m
                                : c10::Half(-8.f * half_to_float(d[c])).x;
            const uint8_t* q = q41 ? reinterpret_cast<const BlockQ4_1*>(blk)->qs : reinterpret_cast<const BlockQ4_0*>(blk)->qs;
            for (int p = 0; p < 4; ++p)
              for (int i = 0; i < 4; ++i) out[32 + p * 32 + 4 * c + i] = q[4 * p + i];
          }
        }
      }
  });
}

// Column c's weight k (0..31) of a group block, as GGUF dequantizes it: d * q + m (Q4_1), d * (q - 8) (Q4_0),
// d * q (Q8_0), every product and sum rounded.
inline float group_weight(const uint8_t* gb, QType t, int64_t c, int64_t k) {
  const auto* h = reinterpret_cast<const uint16_t*>(gb);
  const float d = half_to_float(h[c]);
  if (t == QType::Q8_0) {
    return d * static_cast<float>(static_cast<int8_t>(gb[16 + (k / 4) * 32 + 4 * c + k % 4]));
  }
  const int64_t kk = k % 16;
  const uint8_t byte = gb[32 + (kk / 4) * 32 + 4 * c + kk % 4];
  const int q = k < 16 ? (byte & 0x0F) : (byte >> 4);
  if (t == QType::Q4_0) return d * static_cast<float>(q - 8);
  return d * static_cast<float>(q) + half_to_float(h[kGroup + c]);
}

// VNNI (AVX512-VNNI with VL, or AVX-VNNI: Zen 4 and later, Intel since Ice Lake / Alder Lake) multiplies 4
// u8 x s8 pairs and adds them into an int32 lane in one instruction, where AVX2 needs maddubs (to int16), an
// int16 add and a final madd: the same integers, as no int16 sum here can saturate.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TFS_VNNI 1
#define TFS_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define TFS_VNNI 1
#define TFS_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

constexpr int64_t kAheadBytes = 2048;  // about 13 group blocks: as many loads in flight as the memory needs

// y[r, 0:cols] for R rows over one group of 8 columns (`group`: its nb group blocks). The activations are
// int8 blocks (QuantRows) of rows r0..r0+R. y: row stride ldy.
template <bool kFour, int R>
static inline void group_tile(const uint8_t* group, int64_t nb, const QuantRows& xq, int64_t r0, int64_t k,
                              float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t gbb = group_block_bytes(kFour);
#if TFS_AVX2 || TFS_AVX512
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = group + b * gbb;
    // the blocks are read front to back (and the next group's follow): ask for the bytes kAheadBytes on
    for (int64_t line = 0; line < gbb; line += 64) __builtin_prefetch(gb + kAheadBytes + line);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb)));
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    if constexpr (kFour) {  // int16 sums cannot overflow: 8 x 2 x 15 x 128 < 32768
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32 + 32 * p));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq.q.data() + (r0 + r) * k + b * QK;
          int32_t a, c;
          std::memcpy(&a, xb + 4 * p, 4);
          std::memcpy(&c, xb + 16 + 4 * p, 4);
#if TFS_VNNI
          sums[r] = TFS_DPBUSD(sums[r], lo, _mm256_set1_epi32(a));
          sums[r] = TFS_DPBUSD(sums[r], hi, _mm256_set1_epi32(c));
#else
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(c)));
#endif
        }
      }
#if !TFS_VNNI
      for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(sums[r], ones);
#endif
    } else {  // s8 x s8: |w| (u8) times x with w's sign, as maddubs wants (no pair reaches 2 x 127 x 127 > 32767)
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 16 + 32 * j));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, xq.q.data() + (r0 + r) * k + b * QK + 4 * j, 4);
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
#if TFS_VNNI
          sums[r] = TFS_DPBUSD(sums[r], aw, xs);
#else
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
#endif
        }
      }
    }
    const __m256 m = kFour ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16)))
                           : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * (k / QK) + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(xq.d[i])), acc[r]);
      if constexpr (kFour) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kGroup];
    _mm256_store_ps(out, acc[r]);
    std::memcpy(y + r * ldy, out, cols * sizeof(float));
  }
#else
  float acc[R][kGroup] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = group + b * gbb;
    const auto* h = reinterpret_cast<const uint16_t*>(gb);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * (k / QK) + b;
      const int8_t* xb = xq.q.data() + (r0 + r) * k + b * QK;
      for (int c = 0; c < kGroup; ++c) {
        int sum = 0;
        if constexpr (kFour) {
          for (int p = 0; p < 4; ++p)
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = gb[32 + 32 * p + 4 * c + t];
              sum += (byte & 0x0F) * xb[4 * p + t] + (byte >> 4) * xb[16 + 4 * p + t];
            }
        } else {
          for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t) sum += static_cast<int8_t>(gb[16 + 32 * j + 4 * c + t]) * xb[4 * j + t];
        }
        acc[r][c] = std::fma(static_cast<float>(sum), half_to_float(h[c]) * xq.d[i], acc[r][c]);
        if constexpr (kFour) acc[r][c] = std::fma(half_to_float(h[kGroup + c]), xq.s[i], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], cols * sizeof(float));
#endif
}

template <bool kFour, int... Rs>
static void group_tile_of(int rows, std::integer_sequence<int, Rs...>, const uint8_t* group, int64_t nb,
                          const QuantRows& xq, int64_t r0, int64_t k, float* y, int64_t ldy, int64_t cols) {
  ((rows == Rs + 1 ? (group_tile<kFour, Rs + 1>(group, nb, xq, r0, k, y, ldy, cols), true) : false) || ...);
}

// Rows a tile unpacks each group block for: 8 where 32 vector registers hold their int and float sums (4-bit
// on AVX-512: 1.1x at 32 rows; 8-bit blocks keep 3 vectors a row live and spill at 8), else 4.
#if TFS_AVX512
template <bool kFour> constexpr int kQuantTileRows = kFour ? 8 : 4;
#else
template <bool kFour> constexpr int kQuantTileRows = 4;
#endif

template <bool kFour>
static void quant_linear(const uint8_t* w, const QuantRows& xq, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t nb = k / QK, gbb = group_block_bytes(kFour), groups = (n + kGroup - 1) / kGroup;
  constexpr int kRows = kQuantTileRows<kFour>;
  constexpr auto rows_seq = std::make_integer_sequence<int, kRows>{};
  // Groups a thread claims at a time (parallel_chunks): one piece a thread for one or two rows, which only
  // stream the weight, else about 4. Each piece starts where the prefetch of the piece before (another
  // thread's, maybe) did not reach: pieces of 4 groups made one row's pass over 30 SmolLM2 layers 1.7x as slow
  // (Zen 5; their weights cold, as in a decode step).
  const int64_t threads = at::get_num_threads(), pieces = m <= 2 ? threads : 4 * threads;
  const int64_t piece_groups = std::max<int64_t>(4, (groups + pieces - 1) / pieces);
  parallel_chunks((groups + piece_groups - 1) / piece_groups, [&](int64_t piece) {
    const uint8_t* first = w + piece * piece_groups * nb * gbb;  // the piece's first bytes, asked for at once
    for (int64_t line = 0; line < kAheadBytes; line += 64) __builtin_prefetch(first + line);
    for (int64_t g = piece * piece_groups; g < std::min(groups, (piece + 1) * piece_groups); ++g) {
      const int64_t cols = std::min(kGroup, n - g * kGroup);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
        group_tile_of<kFour>(rows, rows_seq, w + g * nb * gbb, nb, xq, r0, k, y + r0 * n + g * kGroup, n, cols);
      }
    }
  });
}

#if TFS_AVX2 || TFS_AVX512
// The 8 columns of one group block as float32 panel rows (`rows`: [32][ld], the group's 8 columns at
// offset 0 of each row), each value as GGUF dequantizes it (multiply, then add: two roundings, as numpy).
template <QType T>
static inline void dequantize_group_block(const uint8_t* gb, float* rows, int64_t ld) {
  // bytes 4c + i of each 128-bit lane -> [i][c]; then the lanes' dwords interleaved: 8 bytes per input
  const __m256i by_input = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                            0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb)));
  const __m256 m = T == QType::Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16)))
                                    : _mm256_setzero_ps();
  alignas(32) uint8_t buf[32];
  auto emit = [&](__m256i quads, int64_t k0) {  // quads: 4 inputs x 8 columns, from input k0 on
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf),
                       _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(quads, by_input), lanes));
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(buf + 8 * i));
      __m256 v;
      if constexpr (T == QType::Q8_0) {
        v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
      } else if constexpr (T == QType::Q4_0) {
        const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q8), _mm256_set1_epi32(8));
        v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
      } else {
        v = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8))), m);
      }
      _mm256_storeu_ps(rows + (k0 + i) * ld, v);
    }
  };
  if constexpr (T == QType::Q8_0) {
    for (int j = 0; j < 8; ++j) emit(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 16 + 32 * j)), 4 * j);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32 + 32 * p));
      emit(_mm256_and_si256(v, low), 4 * p);
      emit(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), 16 + 4 * p);
    }
  }
}
#endif

// The columns [c0, c0 + cols) as one float32 panel [k][kPanelCols] (zero past `cols`), exactly dequantized.
template <QType T>
static void dequantize_panel(const uint8_t* w, int64_t nb, int64_t groups, int64_t c0, int64_t cols, float* panel) {
  constexpr int64_t P = kPanelCols;
  const int64_t gbb = group_block_bytes(T);
  for (int64_t g0 = 0; g0 < P; g0 += kGroup) {
    const int64_t g = (c0 + g0) / kGroup;
    for (int64_t b = 0; b < nb; ++b) {
      float* rows = panel + b * QK * P + g0;
      if (g >= groups || g0 >= cols) {
        for (int64_t j = 0; j < QK; ++j) std::fill(rows + j * P, rows + j * P + kGroup, 0.f);
        continue;
      }
      const uint8_t* gb = w + (g * nb + b) * gbb;
#if TFS_AVX2 || TFS_AVX512
      dequantize_group_block<T>(gb, rows, P);
#else
      for (int64_t c = 0; c < kGroup; ++c)
        for (int64_t j = 0; j < QK; ++j) rows[j * P + c] = group_weight(gb, T, c, j);
#endif
    }
  }
  if (cols < P)  // columns of the last group past out_features: their zero scales already gave 0
    for (int64_t i = 0; i < nb * QK; ++i) std::fill(panel + i * P + cols, panel + (i + 1) * P, 0.f);
}

template <QType T>
static void dequant_linear(const uint8_t* w, const float* x, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t nb = k / QK, panels = (n + kPanelCols - 1) / kPanelCols, groups = (n + kGroup - 1) / kGroup;
  const int64_t num_tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t tile_rows = (m + num_tiles - 1) / num_tiles;
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  parallel_claims(panels, [&](auto& claim) {
    std::vector<float> panel(k * kPanelCols);
    for (int64_t p = claim(); p >= 0; p = claim()) {
      const int64_t cols = std::min(kPanelCols, n - p * kPanelCols);
      dequantize_panel<T>(w, nb, groups, p * kPanelCols, cols, panel.data());
      for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
        const int rows = static_cast<int>(std::min(tile_rows, m - r0));
        linear_tile_of<float, 1>(rows, seq, x + r0 * k, k, panel.data(), nullptr, y + r0 * n + p * kPanelCols, n,
                                 cols);
      }
    }
  });
}

}  // namespace tfs

// GGUF blocks uint8 [out_features, in_features / 32 * block bytes] of `qtype` (GGUF's type id: 2 Q4_0,
// 3 Q4_1, 8 Q8_0) -> the kernels' layout, uint8 [ceil(out_features / 8), in_features / 32, group block bytes].
torch::Tensor repack_blocks(torch::Tensor blocks, int64_t qtype) {
  using tfs::QType;
  const auto type = static_cast<QType>(qtype);
  TORCH_CHECK(type == QType::Q4_0 || type == QType::Q4_1 || type == QType::Q8_0, "qtype: 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.size(1) % tfs::block_bytes(type) == 0,
              "blocks: uint8 [out_features, bytes per row]");
  auto bc = blocks.contiguous();
  const int64_t n = bc.size(0), nb = bc.size(1) / tfs::block_bytes(type);
  auto out = torch::empty({(n + tfs::kGroup - 1) / tfs::kGroup, nb, tfs::group_block_bytes(type)}, bc.options());
  tfs::repack(bc.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), n, nb, type);
  return out;
}

// y = x @ W.T + bias with W repacked by repack_blocks. x: float32 [rows, in_features] -> [rows, out_features].
// Rows before `float_from` (all where it is negative) multiply with int8 activations, the rest in float32
// over the exactly dequantized weight.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t out_features,
                           c10::optional<torch::Tensor> bias, int64_t float_from) {
  using tfs::QType;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: float32 [rows, in_features]");
  const auto type = static_cast<QType>(qtype);
  TORCH_CHECK(type == QType::Q4_0 || type == QType::Q4_1 || type == QType::Q8_0, "qtype: 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)");
  auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              k % tfs::QK == 0 && packed.size(0) == (n + tfs::kGroup - 1) / tfs::kGroup &&
              packed.size(1) == k / tfs::QK && packed.size(2) == tfs::group_block_bytes(type),
              "packed blocks do not match x and out_features");
  const int64_t mi = float_from < 0 ? m : std::min(float_from, m);  // rows on the integer road
  auto y = torch::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (mi > 0) {
    tfs::QuantRows xq;
    tfs::quantize_rows(xp, mi, k, xq);
    if (tfs::four_bit(type)) tfs::quant_linear<true>(w, xq, yp, mi, k, n);
    else tfs::quant_linear<false>(w, xq, yp, mi, k, n);
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
