// Linear layers over block-quantized weights, read as GGUF stores them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of
// 32 weights along the input dimension) and the K-quants Q2_K .. Q6_K (super-blocks of 256); quant_types.h says
// how each type's blocks are regrouped at load (`repack_blocks`) and decoded.
//
// Decode rows: the activations are quantized per block of 32 to int8 with a float scale (as llama.cpp's Q8_0,
// also for K-quants, where llama.cpp's Q8_K keeps one scale per 256: coarser), so every block's dot product is
// integer arithmetic (maddubs + madd on AVX2, dpbusd with VNNI), 8 output columns per 256-bit vector (16, two
// groups, per 512-bit one with AVX-512 VNNI for tiles of 3+ rows), then float multiply-adds by the scales. A tile
// of up to 8 rows unpacks each block once.
//
// Rows from `float_from` on (a step's prompt tokens: the runner packs decodes first) take the other road: each
// panel of columns is dequantized exactly as GGUF defines it (every product and sum rounded as numpy rounds
// them), then multiplied in float32 by the panel kernel of linear.h (what the float32 engine computes over the
// same file), or with `dot` rounded to bfloat16 for the CPU's bfloat16 dot products (twice the rate). Which road
// a row takes depends only on what kind of token it is, so a request's results still do not depend on its batch.
#pragma once
#include "torch_api.h"
#include "linear.h"
#include "quant_types.h"

namespace tfs {

// Activations of one row as int8 blocks: x[i] ~ d * q[i]; s = sum(x), exact (float32), for the types with a minimum;
// per 16 inputs, s16 = sum(x) (Q2_K's minimums are per 16) and q16 = sum(q) (an offset such as Q6_K's 32 is
// subtracted in integers: sum (u - 32) q = sum u q - 32 sum q, no error beyond the activations' own).
struct QuantRows {
  std::vector<int8_t> q;        // [rows, k]
  std::vector<float> d, s;      // [rows, k / 32]
  std::vector<float> s16;       // [rows, k / 16]
  std::vector<int32_t> q16;     // [rows, k / 16]
};

// One block of 32 activations to int8: d = max|x| / 127, q = round(x / d) (half to even); the sums of x and of
// q per 16, and of x over all 32.
inline void quantize_block(const float* x, int8_t* q, float& d, float& s, float* s16, int32_t* q16) {
#if TFS_AVX512
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(d ? 1.f / d : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  s16[0] = _mm512_reduce_add_ps(a), s16[1] = _mm512_reduce_add_ps(b), s = s16[0] + s16[1];
  q16[0] = _mm512_reduce_add_epi32(qa), q16[1] = _mm512_reduce_add_epi32(qb);
#elif TFS_AVX2
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(x + 8 * i)));
  d = Vec{m}.max() / 127.f;
  const __m256 inv = _mm256_set1_ps(d ? 1.f / d : 0.f);
  __m256i n[4];  // rounded half to even, as the default rounding mode
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  for (int h = 0; h < 2; ++h) {
    s16[h] = Vec{_mm256_add_ps(v[2 * h], v[2 * h + 1])}.sum();
    const __m256i t = _mm256_add_epi32(n[2 * h], n[2 * h + 1]);
    const __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    const __m128i w = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    q16[h] = _mm_cvtsi128_si32(_mm_add_epi32(w, _mm_shuffle_epi32(w, 0xB1)));
  }
  s = s16[0] + s16[1];
#else
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  d = amax / 127.f;
  const float inv = d ? 1.f / d : 0.f;
  for (int h = 0; h < 2; ++h) {
    s16[h] = 0.f, q16[h] = 0;
    for (int j = 16 * h; j < 16 * h + 16; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
      s16[h] += x[j], q16[h] += q[j];
    }
  }
  s = s16[0] + s16[1];
#endif
}

inline void quantize_rows(const float* x, int64_t rows, int64_t k, QuantRows& out) {
  const int64_t nb = k / QK;
  out.q.resize(rows * k);
  out.d.resize(rows * nb);
  out.s.resize(rows * nb);
  out.s16.resize(2 * rows * nb);
  out.q16.resize(2 * rows * nb);
  at::parallel_for(0, rows * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block(x + i * QK, out.q.data() + i * QK, out.d[i], out.s[i], out.s16.data() + 2 * i, out.q16.data() + 2 * i);
  });
}

constexpr int64_t kAheadBytes = 2048;  // about 13 blocks of Q4_0: as many loads in flight as the memory needs

// Quads whose maddubs pairs may be summed in int16 (|pair| <= 2 x 127 x max u): 8 of 4-bit quants (2 x 127 x 15
// x 8 < 32768), 4 of 5-bit, 2 of 6-bit; never across the halves of a type with scales per 16.
template <QType T>
constexpr int kRun = std::min(Spec<T>::kHalves ? 4 : 8, Spec<T>::kBits <= 4 ? 8 : Spec<T>::kBits == 5 ? 4 : 2);

// The float scales of block j of a group block (or of two groups', side by side)
template <QType T>
inline BlockScales block_scales(const uint8_t* gb, int j) { return Spec<T>::scales(gb, j); }
#if TFS_GROUP_PAIRS
struct PairScales { lanes::F16 s[2], m[2]; };
template <QType T>
inline PairScales block_scales(lanes::GroupPair gb, int j) {
  const BlockScales a = Spec<T>::scales(gb.first, j), b = Spec<T>::scales(gb.first + gb.stride, j);
  return {{join(a.s[0], b.s[0]), join(a.s[1], b.s[1])}, {join(a.m[0], b.m[0]), join(a.m[1], b.m[1])}};
}
#endif

// Asks for the bytes `offset` on from a tile's first group block. The blocks are read front to back and the next
// tile's follow; a pair's two groups are two streams: the second runs on into the next pair's first group, the
// first, past its own end, into the next pair's second (its start cold otherwise: a row's pass over cold weights
// in pairs took 1.2x as long).
inline void prefetch_at(const uint8_t* group, int64_t offset) { __builtin_prefetch(group + offset); }
#if TFS_GROUP_PAIRS
inline void prefetch_at(lanes::GroupPair group, int64_t offset) {
  __builtin_prefetch(group.first + group.stride + offset);
  __builtin_prefetch(group.first + (offset < group.stride ? offset : 2 * group.stride + offset));
}
#endif

// y[r, 0:cols] for R rows over one group of 8 columns (Cols 8; `group`: its nbk group blocks of type T) or two
// (Cols 16), activations rows r0..r0+R of xq. y: row stride ldy.
template <QType T, int R, int Cols>
static inline void group_tile(typename lanes::Lanes<Cols>::Src group, int64_t nbk, const QuantRows& xq, int64_t r0,
                              int64_t k, float* y, int64_t ldy, int64_t cols) {
  using namespace lanes;
  using S = Spec<T>;
  using L = lanes::Lanes<Cols>;
  using I = typename L::I;
  using F = typename L::F;
  constexpr int64_t gbb = kGroupBytes<T>, kSubs = kSubBlocks<T>, kStep = gbb / kSubs;
  // what the sums hold beyond w x per unit of the activations' quants (q16): an offset in u (Q5_0's 16), or the
  // 128 of Q8_0's flip
  constexpr int kQ16Offset = (S::kOffsetAsMin ? 0 : S::kOffset) + (S::kSigned && kSignedAsUnsigned ? 128 : 0);
  static_assert(!S::kHalves || !S::kSigned, "signed quants are corrected over the whole block");
  const int64_t nb = k / QK;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F{};
  for (int64_t b = 0; b < nbk; ++b) {
    const auto gb = group + b * gbb;
    for (int j = 0; j < kSubs; ++j) {
      for (int64_t line = 0; line < kStep; line += 64) prefetch_at(group, b * gbb + j * kStep + kAheadBytes + line);
      const int64_t blk = b * kSubs + j;  // the block of 32 inputs
      const auto quants = gb + (kQuantsAt<T> + j * kBlockBytes<T>);
      I lo[R], hi[R];  // the sums over inputs 0-15 and 16-31 (kHalves), else all in lo
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = I{};
      [[maybe_unused]] P run[R];  // int16 pair sums of the last kRun quads (kPairsInInt16)
      static_for<8>([&](auto qd) TFS_LOOP_INLINE {
        constexpr int Qd = decltype(qd)::value;
        auto u = quad<S::kBits, Qd>(quants);
        if constexpr (S::kSigned && kSignedAsUnsigned) u = flip(u);
        for (int r = 0; r < R; ++r) {
          int32_t x;
          std::memcpy(&x, xq.q.data() + (r0 + r) * k + blk * QK + 4 * Qd, 4);
          I& sum = S::kHalves && Qd >= 4 ? hi[r] : lo[r];
          if constexpr (kPairsInInt16 && !S::kSigned) {
            run[r] = Qd % kRun<T> == 0 ? pairs(u, x) : run[r] + pairs(u, x);
            if constexpr (Qd % kRun<T> == kRun<T> - 1) sum = sum + widen(run[r]);
          } else if constexpr (S::kSigned && !kSignedAsUnsigned) {
            sum = dot_signed(sum, u, x);
          } else {
            sum = dot(sum, u, x);
          }
        }
      });
      const auto sc = block_scales<T>(gb, j);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + blk;
        const F xd = L::set1(xq.d[i]);
        if constexpr (S::kHalves) {
          I a = lo[r], c = hi[r];
          if constexpr (S::kOffset != 0) a = a - S::kOffset * xq.q16[2 * i], c = c - S::kOffset * xq.q16[2 * i + 1];
          F t = fma(to_float(c), sc.s[1] * xd, to_float(a) * (sc.s[0] * xd));
          if constexpr (S::kMin) t = fma(sc.m[1], L::set1(xq.s16[2 * i + 1]), fma(sc.m[0], L::set1(xq.s16[2 * i]), t));
          acc[r] = acc[r] + t;
        } else {
          I a = lo[r];
          if constexpr (kQ16Offset != 0) a = a - kQ16Offset * (xq.q16[2 * i] + xq.q16[2 * i + 1]);
          acc[r] = fma(to_float(a), sc.s[0] * xd, acc[r]);
          if constexpr (S::kMin) acc[r] = fma(sc.m[0], L::set1(xq.s[i]), acc[r]);
          if constexpr (S::kOffsetAsMin) acc[r] = fma(sc.s[0] * L::set1(-S::kOffset), L::set1(xq.s[i]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[Cols];
    store(out, acc[r]);
    std::memcpy(y + r * ldy, out, cols * sizeof(float));
  }
}

template <QType T, int Cols, int... Rs>
static void group_tile_of(int rows, std::integer_sequence<int, Rs...>, typename lanes::Lanes<Cols>::Src group,
                          int64_t nbk, const QuantRows& xq, int64_t r0, int64_t k, float* y, int64_t ldy, int64_t cols) {
  ((rows == Rs + 1 ? (group_tile<T, Rs + 1, Cols>(group, nbk, xq, r0, k, y, ldy, cols), true) : false) || ...);
}

// Rows a tile unpacks each block for: 8 where 32 vector registers hold their int and float sums (AVX-512:
// 1.1x at 32 rows for Q4_0; Q6_K's two sums a row still gain 1.25x over 4), 4 for 8-bit blocks (3 vectors a
// row live: they spill at 8) and on AVX2. With group pairs (VNNI: no vpsignb temporaries) 8-bit blocks take 8
// too, as fast as 4 or a little faster (Zen 5).
// Groups of 8 columns a tile takes at once: two side by side in 512-bit registers where there are (and VNNI):
// half the broadcasts and float work a column, 1.1-1.5x from 8 rows (Zen 5 runs a 512-bit dpbusd at half the
// 256-bit rate, so the integer work a column stays the same).
#if TFS_GROUP_PAIRS
template <QType T> constexpr int kQuantTileRows = 8;
constexpr int64_t kTileGroups = 2;
#elif TFS_AVX512
template <QType T> constexpr int kQuantTileRows = Spec<T>::kSigned ? 4 : 8;
constexpr int64_t kTileGroups = 1;
#else
template <QType T> constexpr int kQuantTileRows = 4;
constexpr int64_t kTileGroups = 1;
#endif

template <QType T>
static void quant_linear(const uint8_t* w, const QuantRows& xq, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t nbk = k / Spec<T>::kInputs, gbb = kGroupBytes<T>, groups = (n + kGroup - 1) / kGroup;
  constexpr int kRows = kQuantTileRows<T>;
  constexpr auto rows_seq = std::make_integer_sequence<int, kRows>{};
  // Groups a thread claims at a time (parallel_chunks): one piece a thread for one or two rows, which only
  // stream the weight, else about 4. Each piece starts where the prefetch of the piece before (another
  // thread's, maybe) did not reach: pieces of 4 groups made one row's pass over 30 SmolLM2 layers 1.7x as slow
  // (Zen 5; their weights cold, as in a decode step). Whole tiles of groups to a piece.
  const int64_t threads = at::get_num_threads(), pieces = m <= 2 ? threads : 4 * threads;
  // one or two rows stream the weight: one stream a thread, not a pair's two (a row's pass over cold weights took
  // 1.1-1.3x as long in pairs, even with prefetch_at's help)
  const int64_t tile_groups = m <= 2 ? 1 : kTileGroups;
  const int64_t piece_tiles = (std::max<int64_t>(4, (groups + pieces - 1) / pieces) + tile_groups - 1) / tile_groups;
  const int64_t piece_groups = piece_tiles * tile_groups;
  parallel_chunks((groups + piece_groups - 1) / piece_groups, [&](int64_t piece) {
    const uint8_t* first = w + piece * piece_groups * nbk * gbb;  // the piece's first bytes, asked for at once
    for (int64_t t = 0; t < tile_groups; ++t)  // (of each group of a tile: another stream)
      for (int64_t line = 0; line < kAheadBytes; line += 64) __builtin_prefetch(first + t * nbk * gbb + line);
    const int64_t end = std::min(groups, (piece + 1) * piece_groups);
    for (int64_t g = piece * piece_groups; g < end; g += tile_groups) {
      const uint8_t* group = w + g * nbk * gbb;
      float* yg = y + g * kGroup;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
#if TFS_GROUP_PAIRS
        if (tile_groups == 2 && g + 1 < end) {  // a last group alone (an odd count) takes the 8 columns' tile
          group_tile_of<T, 16>(rows, rows_seq, lanes::GroupPair{group, nbk * gbb}, nbk, xq, r0, k, yg + r0 * n, n,
                               std::min(2 * kGroup, n - g * kGroup));
          continue;
        }
#endif
        group_tile_of<T, 8>(rows, rows_seq, group, nbk, xq, r0, k, yg + r0 * n, n, std::min(kGroup, n - g * kGroup));
      }
    }
  });
}

// Block j (32 inputs) of a group block's 8 columns, each weight as GGUF dequantizes it: scale * (u - offset), then
// + min (two roundings, as numpy), handed to put(quad, v) a quad at a time: v[i] the 8 columns at input 4 quad + i.
template <QType T, typename Put>
static inline void dequantize_quads(const uint8_t* gb, int j, Put&& put) {
  using namespace lanes;
  using S = Spec<T>;
  const uint8_t* quants = gb + kQuantsAt<T> + j * kBlockBytes<T>;
  const BlockScales sc = S::scales(gb, j);
  static_for<8>([&](auto qd) {
    constexpr int Qd = decltype(qd)::value, h = S::kHalves && Qd >= 4;
    I in[4];
    inputs<S::kSigned>(quad<S::kBits, Qd>(quants), in);
    F v[4];
    for (int i = 0; i < 4; ++i) {
      v[i] = to_float(S::kOffset ? in[i] - S::kOffset : in[i]) * sc.s[h];
      if constexpr (S::kMin) v[i] = v[i] + sc.m[h];
    }
    put(Qd, v);
  });
}

#if TFS_BF16_DOT
// Block j of a group block straight into the bfloat16 road's pair rows (`at`: its first input's pair row, at the
// group's columns; pair rows `row` apart), in 512-bit registers: a quad's 32 quants as they lie (column c's four
// inputs at 4c), each column's scale spread over its four lanes, both halves rounded by one vcvtne2ps2bf16 (to
// nearest even; no dequantized weight is a float32 subnormal, which it would read as 0: the smallest, a float16
// scale's 2^-24 times a quant, is far above 2^-126) and put in pair order by one vpermw. The same values as
// dequantize_quads (the same int -> float, product and sum), as torch rounds them to bfloat16.
template <QType T>
static inline void dequantize_pair_rows(const uint8_t* gb, int j, c10::BFloat16* at, int64_t row) {
  using S = Spec<T>;
  const uint8_t* quants = gb + kQuantsAt<T> + j * kBlockBytes<T>;
  const BlockScales sc = S::scales(gb, j);
  const __m512i spread[2] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                             _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7)};
  constexpr int kScales = S::kHalves ? 2 : 1;
  __m512 scale[kScales][2], min[kScales][2];  // [half][columns 0-3, 4-7]
  for (int h = 0; h < kScales; ++h)
    for (int c = 0; c < 2; ++c) {
      scale[h][c] = _mm512_permutexvar_ps(spread[c], _mm512_castps256_ps512(sc.s[h].v));
      if constexpr (S::kMin) min[h][c] = _mm512_permutexvar_ps(spread[c], _mm512_castps256_ps512(sc.m[h].v));
    }
  // word 4c + i of the rounded quad (column c, input i) -> pair row 0's word 2c + i (i < 2), pair row 1's 2c + i - 2
  const __m512i order = _mm512_set_epi16(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2,
                                         29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  static_for<8>([&](auto qd) {
    constexpr int Qd = decltype(qd)::value, h = S::kHalves && Qd >= 4;
    const __m256i q = quad<S::kBits, Qd>(quants).v;
    __m512 v[2];
    for (int c = 0; c < 2; ++c) {
      const __m128i bytes = c ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
      __m512i u = S::kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
      if constexpr (S::kOffset != 0) u = _mm512_sub_epi32(u, _mm512_set1_epi32(S::kOffset));
      v[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(u), scale[h][c]);
      if constexpr (S::kMin) v[c] = _mm512_add_ps(v[c], min[h][c]);
    }
    const __m512i pairs = _mm512_permutexvar_epi16(order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[1], v[0])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 2 * Qd * row), _mm512_castsi512_si256(pairs));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + (2 * Qd + 1) * row), _mm512_extracti64x4_epi64(pairs, 1));
  });
}
#endif

// The columns [c0, c0 + cols) as one panel, exactly dequantized, zero past `cols`: float32 [k][kPanelCols], or
// (kPairs, the bfloat16 road) Bf16DotTiles' panel [k/2][kPanelCols][2], each weight rounded to the nearest
// bfloat16 (even on ties, as torch rounds: the same panel pack_linear_weight makes of the dequantized weight).
template <QType T, bool kPairs = false, typename Out>
static void dequantize_panel(const uint8_t* w, int64_t nbk, int64_t groups, int64_t c0, int64_t cols, Out* panel) {
  constexpr int64_t P = kPanelCols, kIn = Spec<T>::kInputs, kWidth = kPairs ? 2 : 1;  // values a column-input
  // Block by block, each across the panel's groups: a pair row's (or row's) lines are written whole while in L1
  // (group by group, a panel larger than L1 took each line from L2 once a group). The groups are as many streams
  // of blocks, each asked for kAheadBytes ahead: the pass over cold weights waited on memory without.
  for (int64_t g0 = 0; g0 < std::min(P, cols); g0 += kGroup)  // (all of kAheadBytes at once: the loads queue up)
    for (int64_t line = 0; line < kAheadBytes * kGroup / P; line += 64)
      __builtin_prefetch(w + (c0 + g0) / kGroup * nbk * kGroupBytes<T> + line);
  for (int64_t b = 0; b < nbk; ++b)
    for (int j = 0; j < kSubBlocks<T>; ++j)
      for (int64_t g0 = 0; g0 < P; g0 += kGroup) {
        const int64_t g = (c0 + g0) / kGroup, first = b * kIn + j * QK;  // the block's first input
        Out* at = panel + (first * P + g0 * kWidth);  // (pairs: first / 2 pair rows of 2 P, at column g0)
        if (g >= groups || g0 >= cols) {
          for (int64_t t = 0; t < QK / kWidth; ++t)
            std::fill(at + t * kWidth * P, at + t * kWidth * P + kWidth * kGroup, Out(0));
          continue;
        }
        const uint8_t* gb = w + (g * nbk + b) * kGroupBytes<T>;
        if (j == 0)
          for (int64_t line = 0; line < kGroupBytes<T>; line += 64) __builtin_prefetch(gb + kAheadBytes + line);
        if constexpr (kPairs) {
#if TFS_BF16_DOT
          dequantize_pair_rows<T>(gb, j, at, 2 * P);
#endif
        } else {
          dequantize_quads<T>(gb, j, [&](int qd, const lanes::F* v) {
            for (int i = 0; i < 4; ++i) lanes::store(at + (4 * qd + i) * P, v[i]);
          });
        }
      }
  if (cols < P)  // columns of the last group past out_features: their zero scales already gave 0
    for (int64_t i = 0; i < nbk * kIn / kWidth; ++i)
      std::fill(panel + (i * P + cols) * kWidth, panel + (i + 1) * P * kWidth, Out(0));
}

// Every panel of columns [p * kPanelCols, p * kPanelCols + cols) dequantized exactly (dequantize_panel: float32,
// or kPairs bfloat16 pairs) into a buffer of the thread's, then multiply(p, cols, panel); the panels claimed by
// whichever thread is free. What the prompt roads share: each panel is dequantized once for all of a step's rows.
template <QType T, bool kPairs, typename Multiply>
static void dequantized_panels(const uint8_t* w, int64_t k, int64_t n, const Multiply& multiply) {
  using Out = std::conditional_t<kPairs, c10::BFloat16, float>;
  const int64_t nbk = k / Spec<T>::kInputs, panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  parallel_claims(panels, [&](auto& claim) {
    thread_local std::vector<Out> buffer;  // each thread's, kept: every value is written before it is read
    if (buffer.size() < static_cast<size_t>(k * kPanelCols)) buffer.resize(k * kPanelCols);
    Out* panel = buffer.data();
    for (int64_t p = claim(); p >= 0; p = claim()) {
      const int64_t cols = std::min(kPanelCols, n - p * kPanelCols);
      dequantize_panel<T, kPairs>(w, nbk, groups, p * kPanelCols, cols, panel);
      multiply(p, cols, static_cast<const Out*>(panel));
    }
  });
}

#if TFS_BF16_DOT
// The prompt road where the CPU has bfloat16 dot products: each panel dequantized exactly and rounded to bfloat16,
// multiplied by the rows rounded to bfloat16, float32 sums (VDPBF16PS, or AMX tiles where amx.py turned them on):
// twice the float32 rate. The rounding is bfloat16's relative 2^-9 per value, a row's outliers included (int8
// activations lose a block's small values next to a large one: SmolLM2's first prompt rows answered wrongly).
template <QType T>
static void dequant_linear_bf16(const uint8_t* w, const float* x, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t k2 = k / 2;
#if TFS_AMX
  if (g_use_amx.load(std::memory_order_relaxed)) {
    const std::vector<uint32_t> pairs = amx_rows(x, m, k);
    dequantized_panels<T, true>(w, k, n, [&](int64_t p, int64_t, const c10::BFloat16* panel) {
      amx_pieces(0, (m + kAmxRows - 1) / kAmxRows, pairs.data(), panel, nullptr, y + p * kPanelCols, m, k2,
                 n - p * kPanelCols, n);
    });
    return;
  }
#endif
  const int64_t tile_rows = tile_rows_for(m);
  std::vector<uint32_t> pairs(m * k2);
  bf16_pairs(x, pairs.data(), m, k, tile_rows);
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  dequantized_panels<T, true>(w, k, n, [&](int64_t p, int64_t cols, const c10::BFloat16* panel) {
    for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
      const int rows = static_cast<int>(std::min(tile_rows, m - r0));
      tiles_of<Bf16DotTiles, 1>(rows, seq, pairs.data() + r0 * k2, k, panel, nullptr, y + r0 * n + p * kPanelCols,
                                n, cols);
    }
  });
}
#endif

template <QType T>
static void dequant_linear(const uint8_t* w, const float* x, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t tile_rows = tile_rows_for(m);
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  dequantized_panels<T, false>(w, k, n, [&](int64_t p, int64_t cols, const float* panel) {
    for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
      const int rows = static_cast<int>(std::min(tile_rows, m - r0));
      linear_tile_of<float, 1>(rows, seq, x + r0 * k, k, panel, nullptr, y + r0 * n + p * kPanelCols, n, cols);
    }
  });
}

// Rows `ids` of the weight (output columns), exactly dequantized: out [num_ids, k]. A row's weights are spread
// over its group's blocks, 4 bytes in 32: each block of its group is dequantized whole (8 rows' worth of
// arithmetic for the one read the layout costs anyway) and the row's column kept.
template <QType T>
static void dequantize_rows(const uint8_t* w, const int64_t* ids, int64_t num_ids, int64_t k, float* out) {
  const int64_t nbk = k / Spec<T>::kInputs, num_blocks = k / QK;
  at::parallel_for(0, num_ids * num_blocks, 64, [&](int64_t begin, int64_t end) {
    float rows[QK * kGroup];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = ids[i / num_blocks], blk = i % num_blocks, c = id % kGroup;
      const uint8_t* gb = w + (id / kGroup * nbk + blk / kSubBlocks<T>) * kGroupBytes<T>;
      // a row's group is one stretch of memory, read cold (a token embedding): ask for it ahead
      if (blk % kSubBlocks<T> == 0)
        for (int64_t line = 0; line < kGroupBytes<T>; line += 64) __builtin_prefetch(gb + kAheadBytes + line);
      dequantize_quads<T>(gb, static_cast<int>(blk % kSubBlocks<T>), [&](int qd, const lanes::F* v) {
        for (int i = 0; i < 4; ++i) lanes::store(rows + (4 * qd + i) * kGroup, v[i]);
      });
      float* o = out + i / num_blocks * k + blk * QK;
      for (int64_t t = 0; t < QK; ++t) o[t] = rows[t * kGroup + c];
    }
  });
}

inline int64_t file_block_bytes(int64_t qtype) {
  int64_t bytes = 0;
  dispatch(qtype, [&](auto t) { bytes = Spec<decltype(t)::value>::kFileBytes; });
  return bytes;
}

inline int64_t block_inputs(int64_t qtype) {
  int64_t inputs = 0;
  dispatch(qtype, [&](auto t) { inputs = Spec<decltype(t)::value>::kInputs; });
  return inputs;
}

inline int64_t group_block_bytes(int64_t qtype) {
  int64_t bytes = 0;
  dispatch(qtype, [&](auto t) { bytes = kGroupBytes<decltype(t)::value>; });
  return bytes;
}

}  // namespace tfs

#if !TFS_NO_TORCH
// GGUF blocks of several layers, uint8 [out_features_i, bytes per row] each (one row size, one `qtype`: GGUF's type
// id), stacked by output features -> the kernels' layout, uint8 [ceil(sum out_features_i / 8), in_features /
// inputs per block (32, or 256 for K-quants), group block bytes]: the layout of their concatenation, read from
// where each part lies (copying the query, key and value or gate and up weights of a 1.5B model into one array
// first cost 1 s of a 2-core machine's start, more than the repacking).
torch::Tensor repack_block_parts(const std::vector<torch::Tensor>& parts, int64_t qtype) {
  const int64_t bb = tfs::file_block_bytes(qtype);
  TORCH_CHECK(bb, tfs::kQTypesHelp);
  TORCH_CHECK(!parts.empty(), "parts: one tensor of blocks or more");
  std::vector<torch::Tensor> held;  // contiguous parts, alive while their rows are read
  int64_t n = 0;
  for (const auto& part : parts) {
    TORCH_CHECK(part.dim() == 2 && part.scalar_type() == torch::kUInt8 && part.size(1) % bb == 0 &&
                part.size(1) == parts[0].size(1), "blocks: uint8 [out_features, bytes per row], one row size");
    held.push_back(part.contiguous());
    n += part.size(0);
  }
  const int64_t row_bytes = parts[0].size(1), nb = row_bytes / bb;
  std::vector<const uint8_t*> rows;
  rows.reserve(n);
  for (const auto& part : held)
    for (int64_t r = 0; r < part.size(0); ++r) rows.push_back(part.data_ptr<uint8_t>() + r * row_bytes);
  auto out = torch::empty({(n + tfs::kGroup - 1) / tfs::kGroup, nb, tfs::group_block_bytes(qtype)}, held[0].options());
  tfs::dispatch(qtype, [&](auto t) { tfs::repack<decltype(t)::value>(rows.data(), out.data_ptr<uint8_t>(), n, nb); });
  return out;
}

// GGUF blocks uint8 [out_features, bytes per row] of `qtype` (GGUF's type id) -> the kernels' layout, uint8
// [ceil(out_features / 8), in_features / inputs per block (32, or 256 for K-quants), group block bytes].
torch::Tensor repack_blocks(torch::Tensor blocks, int64_t qtype) { return repack_block_parts({blocks}, qtype); }

static void check_packed(const torch::Tensor& packed, int64_t qtype, int64_t out_features, int64_t k) {
  TORCH_CHECK(tfs::file_block_bytes(qtype), tfs::kQTypesHelp);
  const int64_t inputs = tfs::block_inputs(qtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              k % inputs == 0 && packed.size(0) == (out_features + tfs::kGroup - 1) / tfs::kGroup &&
              packed.size(1) == k / inputs && packed.size(2) == tfs::group_block_bytes(qtype),
              "packed blocks do not match x and out_features");
}

// y = x @ W.T + bias with W repacked by repack_blocks. x: float32 [rows, in_features] -> [rows, out_features].
// Rows before `float_from` (all where it is negative) multiply with int8 activations, the rest over the exactly
// dequantized weight: in float32, or with `dot` in bfloat16 through the CPU's dot products (`bf16_dot` builds).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t out_features,
                           c10::optional<torch::Tensor> bias, int64_t float_from, bool dot) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: float32 [rows, in_features]");
  auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  check_packed(packed, qtype, n, k);
  const int64_t mi = float_from < 0 ? m : std::min(float_from, m);  // rows on the integer road
  auto y = torch::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  tfs::dispatch(qtype, [&](auto t) {
    constexpr tfs::QType T = decltype(t)::value;
    if (mi > 0) {
      tfs::QuantRows xq;
      tfs::quantize_rows(xp, mi, k, xq);
      tfs::quant_linear<T>(w, xq, yp, mi, k, n);
    }
    if (mi < m && dot) {
#if TFS_BF16_DOT
      tfs::dequant_linear_bf16<T>(w, xp + mi * k, yp + mi * n, m - mi, k, n);
#else
      TORCH_CHECK(false, "this build has no bfloat16 dot products (bf16_dot is False)");
#endif
    } else if (mi < m) {
      tfs::dequant_linear<T>(w, xp + mi * k, yp + mi * n, m - mi, k, n);
    }
  });
  if (bias) y.add_(*bias);
  return y;
}

// Rows `ids` (int64 [num_ids]) of the weight behind `packed` (repack_blocks), as gguf-py's dequantize gives
// them: float32 [num_ids, in_features]. A token embedding's lookup over the blocks an LM head multiplies by.
torch::Tensor dequantize_rows(torch::Tensor packed, int64_t qtype, int64_t out_features, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3, "packed: from repack_blocks");
  const int64_t k = packed.size(1) * tfs::block_inputs(qtype);
  check_packed(packed, qtype, out_features, k);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids: int64 [num_ids]");
  auto ic = ids.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < ic.size(0); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < out_features, "ids: ", ip[i], " is not a row of ", out_features);
  auto out = torch::empty({ic.size(0), k}, packed.options().dtype(torch::kFloat32));
  tfs::dispatch(qtype, [&](auto t) {
    tfs::dequantize_rows<decltype(t)::value>(packed.data_ptr<uint8_t>(), ip, ic.size(0), k, out.data_ptr<float>());
  });
  return out;
}

// w: float32 [out_features, in_features] -> Q8_0 blocks uint8 [out_features, in_features / 32 * 34], as GGUF
// quantizes: per block d = max|w| / 127 (stored as float16), q = round(w / d).
torch::Tensor quantize_q8_0(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % tfs::QK == 0, "weight: [out_features, in_features], in_features % 32 == 0");
  auto wc = w.to(torch::kFloat32).contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = k / tfs::QK;
  auto out = torch::empty({n, nb * 34}, w.options().dtype(torch::kUInt8));
  const float* src = wc.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = src + i * tfs::QK;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.f, inv = d ? 1.f / d : 0.f;
      const uint16_t h = c10::Half(d).x;
      std::memcpy(dst + i * 34, &h, 2);
      for (int j = 0; j < 32; ++j) dst[i * 34 + 2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(x[j] * inv)));
    }
  });
  return out;
}
#endif  // !TFS_NO_TORCH
