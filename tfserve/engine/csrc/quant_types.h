// GGUF's block types as the kernels of quant.h read them: how each file block decodes (at load, once), how
// its weights are laid out again for 8 output columns at a time, and the small per-type step the kernels
// call: the unsigned quants of 4 inputs x 8 columns, and the float scales of one block of 32 inputs.
//
// Every type is written as w = scale * (u - offset) + min with u an unsigned integer of kBits bits, the
// scale and min per block of 32 inputs (or per 16: kHalves), exactly as gguf-py's dequantize computes it:
//   Q4_0  d * (u - 8)              Q4_1  d * u + m            (blocks of 32, d and m float16)
//   Q5_0  d * (u - 16)             Q5_1  d * u + m
//   Q8_0  d * q, q signed
//   Q2_K  (d * s) * u - (dmin * m)   s, m: 4 bits per 16 weights   } super-blocks of 256 weights,
//   Q3_K  (d * (s - 32)) * (u - 4)   s: 6 bits per 16              } d and dmin float16 per
//   Q4_K  (d * s) * u - (dmin * m)   s, m: 6 bits per 32           } super-block, every product
//   Q5_K  the same, u of 5 bits                                     } rounded to float32 as numpy does
//   Q6_K  (d * s) * (u - 32)         s: int8 per 16                }
#pragma once
#include <vector>

#include "quant_lanes.h"

namespace tfs {

constexpr int64_t QK = 32;      // inputs per block (of the activations, and the kernels' unit)
constexpr int64_t kGroup = 8;   // output columns per group block

enum class QType : int64_t {  // GGUF's type ids
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14
};

inline uint32_t u32_at(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t u64_at(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// ---- Repacked group blocks ---------------------------------------------------------------------------------
// Per group of 8 output columns and file block of kInputs inputs (32, or a super-block of 256), one group block:
//   float16 d[8] (and m / dmin[8] where kHeads == 2)
//   kScaleRows x 8 bytes: the small scales, row s for column c at byte 8 s + c (K-quants; decoded from their
//                         packed 6 bits at repack, not widened: 1 byte a weight block)
//   kInputs / 32 blocks of 32 x kBits bytes: the quants of 4 inputs x 8 columns in each 32-byte vector, so that
//     4 activations broadcast to every lane multiply all 8 columns at once (maddubs / dpbusd), split by bits:
//       nibble plane (bits 0-3 of u): 4 vectors, vector p: inputs 4p..4p+3 in low nibbles, 16+4p.. in high
//       crumb plane (bits 0-1 of u for Q2_K/Q3_K, bits 4-5 for Q6_K): 2 vectors, quad q (inputs 4q..4q+3) in
//                   vector q % 2 at bits 2 (q / 2)
//       bit plane (bit 2 of Q3_K's u, bit 4 of Q5's): 1 vector, quad q at bit q
//       8 bits (Q8_0): 8 vectors, quad q in vector q
// About the file's bytes per weight: Q4_K 4.625 bpw (file 4.5), Q5_K 5.625 (5.5), Q3_K 3.5625 (3.4375), the others
// exactly the file's.
//
// Repacking writes every byte of a group block from whole words of the file's: each plane is a fixed permutation
// of the file's bits, done with the delta swaps below (a few operations per 64 bits), never weight by weight.
template <QType T> struct Spec;

// Swaps the bits of x at positions p in `mask` with those at p + shift.
inline uint64_t delta_swap(uint64_t x, uint64_t mask, int shift) {
  const uint64_t t = (x ^ (x >> shift)) & mask;
  return x ^ t ^ (t << shift);
}
// Swaps the bits of b at positions p in `mask` with those of a at p + shift.
inline void delta_swap(uint64_t& a, uint64_t& b, uint64_t mask, int shift) {
  const uint64_t t = ((a >> shift) ^ b) & mask;
  b ^= t, a ^= t << shift;
}
// The 8 x 8 bit matrix of x transposed: bit c of byte r to bit r of byte c.
inline uint64_t transpose8(uint64_t x) {
  x = delta_swap(x, 0x00AA00AA00AA00AAull, 7);
  x = delta_swap(x, 0x0000CCCC0000CCCCull, 14);
  return delta_swap(x, 0x00000000F0F0F0F0ull, 28);
}

// Nibble plane of a block of 32 whose file byte i holds input i (low nibble) and 16 + i (high): the file's bytes
// as they are, 4 to a vector (Q4_0, Q4_1, Q5_0, Q5_1). `at`: the block's column c.
inline void nibbles_32(const uint8_t* qs, uint8_t* at) {
  for (int p = 0; p < 4; ++p) put_u32(at + 32 * p, u32_at(qs + 4 * p));
}
// Nibble planes of two blocks of 32 from 32 file bytes: byte i holds input i (i < 16: bytes 0-15, else 16-31) of
// the first block in its low nibble, of the second in its high (Q4_K, Q5_K, Q6_K's low 4 bits).
inline void nibbles_pair(const uint8_t* qs, uint8_t* first, uint8_t* second) {
  constexpr uint64_t low = 0x0F0F0F0F0F0F0F0Full;
  for (int p = 0; p < 4; p += 2) {
    const uint64_t a = u64_at(qs + 4 * p), b = u64_at(qs + 16 + 4 * p);
    const uint64_t x = (a & low) | (b & low) << 4, y = (a >> 4 & low) | (b & ~low);
    put_u32(first + 32 * p, uint32_t(x)), put_u32(first + 32 * p + 32, uint32_t(x >> 32));
    put_u32(second + 32 * p, uint32_t(y)), put_u32(second + 32 * p + 32, uint32_t(y >> 32));
  }
}
// Q5_0 / Q5_1's qh, bit t = 4 q + j the high bit of input t, as the bit plane's 4 bytes of a column: byte j, bit q.
// Nibble q spread to byte q, then the 8 x 8 bits transposed.
inline uint32_t quad_bits(uint32_t qh) {
  uint64_t x = qh;
  x = (x | x << 16) & 0x0000FFFF0000FFFFull;
  x = (x | x << 8) & 0x00FF00FF00FF00FFull;
  x = (x | x << 4) & 0x0F0F0F0F0F0F0F0Full;
  return uint32_t(transpose8(x));
}
// K-quants' 2-bit crumbs: 32 file bytes hold 4 blocks of 32 inputs, input t = 8 i + 4 r + j of block k in byte t
// at bit 2 k (llama.cpp's interleave); the crumb plane wants it in vector r, byte 4 c + j, at bit 2 i. As 4 words
// of 64 bits, address (i | r j k b) -> (k | r j i b): i and k swap, two cross-word delta swaps. `at`: block 0's
// crumb plane, column c; kStride: bytes from a block to the next.
template <int kStride>
inline void crumbs_k(const uint8_t* qs, uint8_t* at) {
  uint64_t w[4];
  for (int i = 0; i < 4; ++i) w[i] = u64_at(qs + 8 * i);
  delta_swap(w[0], w[1], 0x3333333333333333ull, 2), delta_swap(w[2], w[3], 0x3333333333333333ull, 2);
  delta_swap(w[0], w[2], 0x0F0F0F0F0F0F0F0Full, 4), delta_swap(w[1], w[3], 0x0F0F0F0F0F0F0F0Full, 4);
  for (int k = 0; k < 4; ++k) put_u32(at + kStride * k, uint32_t(w[k])), put_u32(at + kStride * k + 32, uint32_t(w[k] >> 32));
}
// K-quants' high bits (Q3_K's hmask, Q5_K's qh): input t = 4 q + j of block s in byte t at bit s; the bit plane
// wants it in byte 4 c + j at bit q. Address (q j s) -> (s j q): q0 and s0 swap inside each word, then (as the
// crumbs) q1, q2 with s1, s2 across words.
template <int kStride>
inline void high_bits_k(const uint8_t* qh, uint8_t* at) {
  uint64_t w[4];
  for (int i = 0; i < 4; ++i) w[i] = delta_swap(u64_at(qh + 8 * i), 0x00000000AAAAAAAAull, 31);
  delta_swap(w[0], w[1], 0x3333333333333333ull, 2), delta_swap(w[2], w[3], 0x3333333333333333ull, 2);
  delta_swap(w[0], w[2], 0x0F0F0F0F0F0F0F0Full, 4), delta_swap(w[1], w[3], 0x0F0F0F0F0F0F0F0Full, 4);
  for (int i = 0; i < 4; ++i)
    put_u32(at + kStride * 2 * i, uint32_t(w[i])), put_u32(at + kStride * (2 * i + 1), uint32_t(w[i] >> 32));
}

struct SpecBase {
  static constexpr int kHeads = 1, kScaleRows = 0, kOffset = 0;
  static constexpr bool kHalves = false, kMin = false, kSigned = false, kOffsetAsMin = false;
};

// Each Spec's pack(b, c, gb) writes file block b as column c of group block gb: its head(s), scale rows, quants.

// Column c's float16 d (and m) in a group block, from the file block's bytes at `d_at` (and `m_at`).
inline void put_heads(const uint8_t* b, int c, uint8_t* gb, int d_at, int m_at = -1) {
  std::memcpy(gb + 2 * c, b + d_at, 2);
  if (m_at >= 0) std::memcpy(gb + 16 + 2 * c, b + m_at, 2);
}

// The scales of one block of 32 inputs: s[h], m[h] for its halves h (kHalves), else s[0], m[0] for all 32.
struct BlockScales {
  lanes::F s[2], m[2];
};

template <> struct Spec<QType::Q4_0> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 18, kBits = 4, kOffset = 8;
  // The integer road counts the -8 as a minimum, -8 d times the exact sum of the activations, as it always has.
  static constexpr bool kOffsetAsMin = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) { put_heads(b, c, gb, 0), nibbles_32(b + 2, gb + 16 + 4 * c); }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {}}; }
};

template <> struct Spec<QType::Q4_1> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 20, kBits = 4, kHeads = 2;
  static constexpr bool kMin = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) { put_heads(b, c, gb, 0, 2), nibbles_32(b + 4, gb + 32 + 4 * c); }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {lanes::load_half(gb + 16)}}; }
};

template <> struct Spec<QType::Q5_0> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 22, kBits = 5, kOffset = 16;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {
    put_heads(b, c, gb, 0), nibbles_32(b + 6, gb + 16 + 4 * c);
    put_u32(gb + 16 + 128 + 4 * c, quad_bits(u32_at(b + 2)));
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {}}; }
};

template <> struct Spec<QType::Q5_1> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 24, kBits = 5, kHeads = 2;
  static constexpr bool kMin = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {
    put_heads(b, c, gb, 0, 2), nibbles_32(b + 8, gb + 32 + 4 * c);
    put_u32(gb + 32 + 128 + 4 * c, quad_bits(u32_at(b + 4)));
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {lanes::load_half(gb + 16)}}; }
};

template <> struct Spec<QType::Q8_0> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 34, kBits = 8;
  static constexpr bool kSigned = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {  // quad q: the file's 4 bytes at 4 q
    put_heads(b, c, gb, 0);
    for (int q = 0; q < 8; ++q) put_u32(gb + 16 + 32 * q + 4 * c, u32_at(b + 2 + 4 * q));
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {}}; }
};

// K-quants: the 2-bit crumbs of weight w of a 256-weight super-block sit in byte 32 (w / 128) + w % 32 at bit
// 2 ((w % 128) / 32), and a high bit (Q3_K, Q5_K) in byte w % 32 at bit w / 32 (llama.cpp's interleave):
// crumbs_k and high_bits_k regroup them.

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins, for the 8 blocks of 32: scale rows 0-7 and 8-15 of column c
inline void scale_min_k4(const uint8_t* s, int c, uint8_t* gb) {
  uint8_t* row = gb + 32 + c;
  for (int j = 0; j < 4; ++j) {
    row[8 * j] = s[j] & 63, row[8 * (8 + j)] = s[4 + j] & 63;
    row[8 * (4 + j)] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
    row[8 * (12 + j)] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

template <> struct Spec<QType::Q2_K> : SpecBase {
  static constexpr int kInputs = 256, kFileBytes = 84, kBits = 2, kHeads = 2, kScaleRows = 16;
  static constexpr bool kHalves = true, kMin = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {
    put_heads(b, c, gb, 80, 82);
    for (int s = 0; s < 16; ++s) gb[32 + 8 * s + c] = b[s];  // scale in the low nibble, min in the high: kept packed
    for (int h = 0; h < 2; ++h) crumbs_k<64>(b + 16 + 32 * h, gb + 160 + 64 * 4 * h + 4 * c);
  }
  static BlockScales scales(const uint8_t* gb, int j) {
    using namespace lanes;
    const F d = load_half(gb), dmin = load_half(gb + 16), neg = set1(-1.f);
    const uint8_t* s = gb + 32 + 16 * j;
    return {{d * load_u8_field<0, 4>(s), d * load_u8_field<0, 4>(s + 8)},
            {(dmin * load_u8_field<4, 4>(s)) * neg, (dmin * load_u8_field<4, 4>(s + 8)) * neg}};
  }
};

template <> struct Spec<QType::Q3_K> : SpecBase {
  static constexpr int kInputs = 256, kFileBytes = 110, kBits = 3, kScaleRows = 16, kOffset = 4;
  static constexpr bool kHalves = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {
    const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
    put_heads(b, c, gb, 108);
    for (int i = 0; i < 16; ++i) {  // 6-bit scales: low 4 bits in bytes 0-7, high 2 bits in bytes 8-11
      const int low = (s[i % 8] >> (i / 8 * 4)) & 15, high = (s[8 + i % 4] >> (i / 4 * 2)) & 3;
      gb[16 + 8 * i + c] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
    }
    // q = low 2 bits - 4 where the high bit is clear: u = q + 4 = low + 4 * high bit
    uint8_t* blk = gb + 144 + 4 * c;
    for (int h = 0; h < 2; ++h) crumbs_k<96>(qs + 32 * h, blk + 96 * 4 * h);
    high_bits_k<96>(hmask, blk + 64);
  }
  static BlockScales scales(const uint8_t* gb, int j) {
    using namespace lanes;
    const F d = load_half(gb);
    return {{d * load_i8(gb + 16 + 16 * j), d * load_i8(gb + 24 + 16 * j)}, {}};
  }
};

template <QType T> struct SpecK4 : SpecBase {  // Q4_K and Q5_K
  static constexpr int kInputs = 256, kHeads = 2, kScaleRows = 16;  // rows 0-7 the scales, 8-15 the mins
  static constexpr bool kMin = true;
  static BlockScales scales(const uint8_t* gb, int j) {
    using namespace lanes;
    const F d = load_half(gb), dmin = load_half(gb + 16);
    return {{d * load_u8(gb + 32 + 8 * j)}, {(dmin * load_u8(gb + 96 + 8 * j)) * set1(-1.f)}};
  }
};

template <> struct Spec<QType::Q4_K> : SpecK4<QType::Q4_K> {
  static constexpr int kFileBytes = 144, kBits = 4;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {  // block j's nibbles: bytes 32 (j / 2), nibble j % 2
    put_heads(b, c, gb, 0, 2), scale_min_k4(b + 4, c, gb);
    uint8_t* blk = gb + 160 + 4 * c;
    for (int i = 0; i < 4; ++i) nibbles_pair(b + 16 + 32 * i, blk + 128 * 2 * i, blk + 128 * (2 * i + 1));
  }
};

template <> struct Spec<QType::Q5_K> : SpecK4<QType::Q5_K> {
  static constexpr int kFileBytes = 176, kBits = 5;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {  // Q4_K's nibbles, and a high bit
    put_heads(b, c, gb, 0, 2), scale_min_k4(b + 4, c, gb);
    uint8_t* blk = gb + 160 + 4 * c;
    for (int i = 0; i < 4; ++i) nibbles_pair(b + 48 + 32 * i, blk + 160 * 2 * i, blk + 160 * (2 * i + 1));
    high_bits_k<160>(b + 16, blk + 128);
  }
};

template <> struct Spec<QType::Q6_K> : SpecBase {
  static constexpr int kInputs = 256, kFileBytes = 210, kBits = 6, kScaleRows = 16, kOffset = 32;
  static constexpr bool kHalves = true;
  static void pack(const uint8_t* b, int c, uint8_t* gb) {
    put_heads(b, c, gb, 208);
    for (int s = 0; s < 16; ++s) gb[16 + 8 * s + c] = b[192 + s];
    uint8_t* blk = gb + 144 + 4 * c;
    for (int h = 0; h < 2; ++h) {  // low nibbles of weight w: byte 64 (w / 128) + w % 64, the high nibble past 64
      for (int i = 0; i < 2; ++i) nibbles_pair(b + 64 * h + 32 * i, blk + 192 * (4 * h + i), blk + 192 * (4 * h + i + 2));
      crumbs_k<192>(b + 128 + 32 * h, blk + 192 * 4 * h + 128);
    }
  }
  static BlockScales scales(const uint8_t* gb, int j) {
    using namespace lanes;
    const F d = load_half(gb);
    return {{d * load_i8(gb + 16 + 16 * j), d * load_i8(gb + 24 + 16 * j)}, {}};
  }
};

// Layout sizes of a type's group block (see above).
template <QType T> constexpr int kBlockBytes = 32 * Spec<T>::kBits;  // one block of 32 inputs x 8 columns
template <QType T> constexpr int kQuantsAt = 16 * Spec<T>::kHeads + 8 * Spec<T>::kScaleRows;
template <QType T> constexpr int kSubBlocks = Spec<T>::kInputs / 32;
template <QType T> constexpr int64_t kGroupBytes = kQuantsAt<T> + kSubBlocks<T> * kBlockBytes<T>;
// where each type's `pack` writes its quants
static_assert(kQuantsAt<QType::Q4_0> == 16 && kQuantsAt<QType::Q5_0> == 16 && kQuantsAt<QType::Q8_0> == 16 &&
              kQuantsAt<QType::Q4_1> == 32 && kQuantsAt<QType::Q5_1> == 32 && kQuantsAt<QType::Q2_K> == 160 &&
              kQuantsAt<QType::Q3_K> == 144 && kQuantsAt<QType::Q4_K> == 160 && kQuantsAt<QType::Q5_K> == 160 &&
              kQuantsAt<QType::Q6_K> == 144);

// The quants of quad Qd (inputs 4 Qd .. 4 Qd + 3) of a block's 8 columns (`blk`: its kBits x 32 bytes; or of two
// groups' blocks, lanes::GroupPair).
template <int kBits, int Qd, typename Src>
inline auto quad(Src blk) {
  using namespace lanes;
  if constexpr (kBits == 8) {
    return load_q(blk + 32 * Qd);
  } else if constexpr (kBits >= 4) {
    const auto low = field<Qd / 4 * 4, 4, 0>(load_q(blk + 32 * (Qd % 4)));
    if constexpr (kBits == 4) return low;
    if constexpr (kBits == 5) return low | field<Qd, 1, 4>(load_q(blk + 128));
    if constexpr (kBits == 6) return low | field<Qd / 2 * 2, 2, 4>(load_q(blk + 128 + 32 * (Qd % 2)));
  } else {
    const auto low = field<Qd / 2 * 2, 2, 0>(load_q(blk + 32 * (Qd % 2)));
    if constexpr (kBits == 2) return low;
    if constexpr (kBits == 3) return low | field<Qd, 1, 2>(load_q(blk + 64));
  }
}

// File blocks [n][nb] (of kInputs inputs each) -> group blocks [ceil(n / 8)][nb] (columns past n: zero). Every
// byte of the output is written (no memset first); the work is split over group blocks, in pieces of 32 KiB
// or more, so that a small tensor (128 x 896) stays on one thread.
// `rows[r]`: where row r's file blocks start (the rows of several layers' weights, stacked, need not be one
// stretch of memory: no copy of them is made first).
template <QType T>
inline void repack(const uint8_t* const* rows, uint8_t* dst, int64_t n, int64_t nb) {
  using S = Spec<T>;
  constexpr int64_t gbb = kGroupBytes<T>;
  static constexpr uint8_t kZero[S::kFileBytes] = {};  // the file block of a column past n
  const int64_t groups = (n + kGroup - 1) / kGroup;
  at::parallel_for(0, groups * nb, std::max<int64_t>(1, 32768 / gbb), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / nb, b = i % nb;
      const int num_cols = static_cast<int>(std::min<int64_t>(kGroup, n - g * kGroup));
      uint8_t* gb = dst + i * gbb;
      for (int c = 0; c < num_cols; ++c) S::pack(rows[g * kGroup + c] + b * S::kFileBytes, c, gb);
      for (int c = num_cols; c < kGroup; ++c) {
        S::pack(kZero, c, gb);
        for (int s = 0; s < S::kScaleRows; ++s) gb[16 * S::kHeads + 8 * s + c] = 0;  // Q3_K's would read -32
      }
    }
  });
}

// The same over one weight's file blocks [n][nb], one stretch of memory at `src`.
template <QType T>
inline void repack(const uint8_t* src, uint8_t* dst, int64_t n, int64_t nb) {
  std::vector<const uint8_t*> rows(n);
  for (int64_t r = 0; r < n; ++r) rows[r] = src + r * nb * Spec<T>::kFileBytes;
  repack<T>(rows.data(), dst, n, nb);
}

// f(std::integral_constant<QType, t>) for the type id t; false where no kernel has it.
template <typename Fn>
inline bool dispatch(int64_t qtype, Fn&& f) {
  switch (static_cast<QType>(qtype)) {
#define TFS_QTYPE_CASE(T) case QType::T: f(std::integral_constant<QType, QType::T>{}); return true;
    TFS_QTYPE_CASE(Q4_0) TFS_QTYPE_CASE(Q4_1) TFS_QTYPE_CASE(Q5_0) TFS_QTYPE_CASE(Q5_1) TFS_QTYPE_CASE(Q8_0)
    TFS_QTYPE_CASE(Q2_K) TFS_QTYPE_CASE(Q3_K) TFS_QTYPE_CASE(Q4_K) TFS_QTYPE_CASE(Q5_K) TFS_QTYPE_CASE(Q6_K)
#undef TFS_QTYPE_CASE
  }
  return false;
}

constexpr const char* kQTypesHelp =
    "qtype: a GGUF block type id: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K";

}  // namespace tfs
