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
#include "quant_lanes.h"

namespace tfs {

constexpr int64_t QK = 32;      // inputs per block (of the activations, and the kernels' unit)
constexpr int64_t kGroup = 8;   // output columns per group block

enum class QType : int64_t {  // GGUF's type ids
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14
};

// One file block decoded: the unsigned quant of each weight, the float16 scale (and min / dmin), and the small
// integer scales (and mins) of its blocks of 32 or 16.
struct FileBlock {
  uint16_t d = 0, m = 0;
  uint8_t sc[16] = {}, mn[16] = {};
  uint8_t u[256];
};

inline uint16_t u16_at(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

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
template <QType T> struct Spec;

struct SpecBase {
  static constexpr int kHeads = 1, kScaleRows = 0, kOffset = 0;
  static constexpr bool kHalves = false, kMin = false, kSigned = false, kOffsetAsMin = false;
};

// The scales of one block of 32 inputs: s[h], m[h] for its halves h (kHalves), else s[0], m[0] for all 32.
struct BlockScales {
  lanes::F s[2], m[2];
};

template <> struct Spec<QType::Q4_0> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 18, kBits = 4, kOffset = 8;
  // The integer road counts the -8 as a minimum, -8 d times the exact sum of the activations, as it always has.
  static constexpr bool kOffsetAsMin = true;
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b);
    for (int t = 0; t < 32; ++t) f.u[t] = (b[2 + t % 16] >> (t / 16 * 4)) & 15;
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {}}; }
};

template <> struct Spec<QType::Q4_1> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 20, kBits = 4, kHeads = 2;
  static constexpr bool kMin = true;
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b), f.m = u16_at(b + 2);
    for (int t = 0; t < 32; ++t) f.u[t] = (b[4 + t % 16] >> (t / 16 * 4)) & 15;
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {lanes::load_half(gb + 16)}}; }
};

template <> struct Spec<QType::Q5_0> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 22, kBits = 5, kOffset = 16;
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int t = 0; t < 32; ++t) f.u[t] = ((b[6 + t % 16] >> (t / 16 * 4)) & 15) | (((qh >> t) & 1) << 4);
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {}}; }
};

template <> struct Spec<QType::Q5_1> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 24, kBits = 5, kHeads = 2;
  static constexpr bool kMin = true;
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b), f.m = u16_at(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int t = 0; t < 32; ++t) f.u[t] = ((b[8 + t % 16] >> (t / 16 * 4)) & 15) | (((qh >> t) & 1) << 4);
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {lanes::load_half(gb + 16)}}; }
};

template <> struct Spec<QType::Q8_0> : SpecBase {
  static constexpr int kInputs = 32, kFileBytes = 34, kBits = 8;
  static constexpr bool kSigned = true;
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b);
    std::memcpy(f.u, b + 2, 32);
  }
  static BlockScales scales(const uint8_t* gb, int) { return {{lanes::load_half(gb)}, {}}; }
};

// K-quants: the 2-bit crumbs of weight w of a 256-weight super-block sit in byte 32 (w / 128) + w % 32 at bit
// 2 ((w % 128) / 32), and a high bit (Q3_K, Q5_K) in byte w % 32 at bit w / 32 (llama.cpp's interleave).
inline int crumb_of(const uint8_t* qs, int w) { return (qs[w / 128 * 32 + w % 32] >> (w % 128 / 32 * 2)) & 3; }

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins, for the 8 blocks of 32
inline void scale_min_k4(const uint8_t* s, FileBlock& f) {
  for (int j = 0; j < 4; ++j) {
    f.sc[j] = s[j] & 63, f.mn[j] = s[4 + j] & 63;
    f.sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
    f.mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

template <> struct Spec<QType::Q2_K> : SpecBase {
  static constexpr int kInputs = 256, kFileBytes = 84, kBits = 2, kHeads = 2, kScaleRows = 16;
  static constexpr bool kHalves = true, kMin = true;
  static void decode(const uint8_t* b, FileBlock& f) {
    std::memcpy(f.sc, b, 16);  // scale in the low nibble, min in the high: kept packed
    f.d = u16_at(b + 80), f.m = u16_at(b + 82);
    for (int w = 0; w < 256; ++w) f.u[w] = crumb_of(b + 16, w);
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
  static void decode(const uint8_t* b, FileBlock& f) {
    const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
    f.d = u16_at(b + 108);
    for (int i = 0; i < 16; ++i) {  // 6-bit scales: low 4 bits in bytes 0-7, high 2 bits in bytes 8-11
      const int low = (s[i % 8] >> (i / 8 * 4)) & 15, high = (s[8 + i % 4] >> (i / 4 * 2)) & 3;
      f.sc[i] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
    }
    // q = low 2 bits - 4 where the high bit is clear: u = q + 4 = low + 4 * high bit
    for (int w = 0; w < 256; ++w) f.u[w] = crumb_of(qs, w) | (((hmask[w % 32] >> (w / 32)) & 1) << 2);
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
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b), f.m = u16_at(b + 2);
    scale_min_k4(b + 4, f);
    for (int w = 0; w < 256; ++w) f.u[w] = (b[16 + w / 64 * 32 + w % 32] >> (w / 32 % 2 * 4)) & 15;
  }
};

template <> struct Spec<QType::Q5_K> : SpecK4<QType::Q5_K> {
  static constexpr int kFileBytes = 176, kBits = 5;
  static void decode(const uint8_t* b, FileBlock& f) {
    f.d = u16_at(b), f.m = u16_at(b + 2);
    scale_min_k4(b + 4, f);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int w = 0; w < 256; ++w)
      f.u[w] = ((qs[w / 64 * 32 + w % 32] >> (w / 32 % 2 * 4)) & 15) | (((qh[w % 32] >> (w / 32)) & 1) << 4);
  }
};

template <> struct Spec<QType::Q6_K> : SpecBase {
  static constexpr int kInputs = 256, kFileBytes = 210, kBits = 6, kScaleRows = 16, kOffset = 32;
  static constexpr bool kHalves = true;
  static void decode(const uint8_t* b, FileBlock& f) {
    const uint8_t *ql = b, *qh = b + 128;
    std::memcpy(f.sc, b + 192, 16);
    f.d = u16_at(b + 208);
    for (int w = 0; w < 256; ++w)  // low nibbles: byte 64 (w / 128) + w % 64, high nibble for the second 64
      f.u[w] = ((ql[w / 128 * 64 + w % 64] >> (w % 128 / 64 * 4)) & 15) | (crumb_of(qh, w) << 4);
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

// The quants of quad Qd (inputs 4 Qd .. 4 Qd + 3) of a block's 8 columns (`blk`: its kBits x 32 bytes).
template <int kBits, int Qd>
inline lanes::Q quad(const uint8_t* blk) {
  using namespace lanes;
  if constexpr (kBits == 8) {
    return load_q(blk + 32 * Qd);
  } else if constexpr (kBits >= 4) {
    const Q low = field<Qd / 4 * 4, 4, 0>(load_q(blk + 32 * (Qd % 4)));
    if constexpr (kBits == 4) return low;
    if constexpr (kBits == 5) return low | field<Qd, 1, 4>(load_q(blk + 128));
    if constexpr (kBits == 6) return low | field<Qd / 2 * 2, 2, 4>(load_q(blk + 128 + 32 * (Qd % 2)));
  } else {
    const Q low = field<Qd / 2 * 2, 2, 0>(load_q(blk + 32 * (Qd % 2)));
    if constexpr (kBits == 2) return low;
    if constexpr (kBits == 3) return low | field<Qd, 1, 2>(load_q(blk + 64));
  }
}

// Writes the quant u of column c's input t (0..31) into a block's planes (the inverse of `quad`).
template <int kBits>
inline void put_quant(uint8_t* blk, int c, int t, unsigned u) {
  const int q = t / 4, at = 4 * c + t % 4;
  if constexpr (kBits == 8) {
    blk[32 * q + at] = static_cast<uint8_t>(u);
    return;
  }
  auto put = [&](int vec, int shift, unsigned bits) { blk[32 * vec + at] |= static_cast<uint8_t>(bits << shift); };
  if constexpr (kBits >= 4) {
    put(q % 4, q / 4 * 4, u & 15);
    if constexpr (kBits == 5) put(4, q, (u >> 4) & 1);
    if constexpr (kBits == 6) put(4 + q % 2, q / 2 * 2, (u >> 4) & 3);
  } else {
    put(q % 2, q / 2 * 2, u & 3);
    if constexpr (kBits == 3) put(2, q, (u >> 2) & 1);
  }
}

// File blocks [n][nb] (of kInputs inputs each) -> group blocks [ceil(n / 8)][nb] (columns past n: zero).
template <QType T>
inline void repack(const uint8_t* src, uint8_t* dst, int64_t n, int64_t nb) {
  using S = Spec<T>;
  constexpr int64_t gbb = kGroupBytes<T>;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  std::memset(dst, 0, groups * nb * gbb);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    FileBlock f;
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* out = dst + (g * nb + b) * gbb;
        for (int c = 0; c < kGroup && g * kGroup + c < n; ++c) {
          S::decode(src + ((g * kGroup + c) * nb + b) * S::kFileBytes, f);
          std::memcpy(out + 2 * c, &f.d, 2);
          if constexpr (S::kHeads == 2) std::memcpy(out + 16 + 2 * c, &f.m, 2);
          for (int s = 0; s < S::kScaleRows; ++s)
            out[16 * S::kHeads + 8 * s + c] = S::kHalves ? f.sc[s] : s < 8 ? f.sc[s] : f.mn[s - 8];
          for (int w = 0; w < S::kInputs; ++w)
            put_quant<S::kBits>(out + kQuantsAt<T> + w / 32 * kBlockBytes<T>, c, w % 32, f.u[w]);
        }
      }
  });
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
