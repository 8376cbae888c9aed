// The registers of the block kernels (quant.h): 8 output columns side by side, one lane a column.
//   Q: 32 bytes, 4 consecutive inputs of each of 8 columns (byte 4c + i: column c's input i)
//   I: 8 int32 sums, F: 8 float32 values
// AVX2 and AVX-512 builds hold them in 256-bit registers (the group of 8 columns is what the repacked blocks
// are built around); other builds in arrays the compiler vectorises, so the kernels are written once.
#pragma once
#include <type_traits>
#include <utility>
#include "vec.h"

// VNNI (AVX512-VNNI with VL, or AVX-VNNI: Zen 4 and later, Intel since Ice Lake / Alder Lake) multiplies 4
// u8 x s8 pairs and adds them into an int32 lane in one instruction, where AVX2 needs maddubs (to int16) and
// a madd: the same integers, as no int16 pair sum here can saturate (|x| <= 127, quants < 64 unsigned).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TFS_VNNI 1
#define TFS_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define TFS_VNNI 1
#define TFS_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
// AVX-512 with VNNI: two groups of 8 columns side by side in 512-bit registers (Q16 below)
#if TFS_AVX512 && defined(__AVX512VNNI__)
#define TFS_GROUP_PAIRS 1
#endif

namespace tfs {

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// f(std::integral_constant<int, 0>), ..., f(<N - 1>): a loop whose index is a constant (shift counts, offsets).
// With group pairs always inlined (and so is the tiles' f): GCC outlined some of a pair tile's loops, its sums then
// passed through memory. Elsewhere left to the compiler: forced, one row of Q4_1 took 1.04x as long (AVX2 build).
#if TFS_GROUP_PAIRS
#define TFS_LOOP_INLINE __attribute__((always_inline))
#else
#define TFS_LOOP_INLINE
#endif
template <typename Fn, int... Is>
TFS_LOOP_INLINE inline void static_for_impl(Fn&& f, std::integer_sequence<int, Is...>) {
  (f(std::integral_constant<int, Is>{}), ...);
}
template <int N, typename Fn>
TFS_LOOP_INLINE inline void static_for(Fn&& f) { static_for_impl(f, std::make_integer_sequence<int, N>{}); }

namespace lanes {

#if TFS_AVX2 || TFS_AVX512
struct Q { __m256i v; };
struct I { __m256i v; };
struct F { __m256 v; };

inline Q load_q(const uint8_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
// bits [From, From + Width) of every byte, moved to bit To; the others zero
template <int From, int Width, int To>
inline Q field(Q a) {
  constexpr int mask = ((1 << Width) - 1) << To;
  __m256i v = a.v;
  if constexpr (From > To) v = _mm256_srli_epi16(v, From - To);  // the mask drops what crossed from the next byte
  if constexpr (From < To) v = _mm256_slli_epi16(v, To - From);
  return {_mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(mask)))};
}
inline Q operator|(Q a, Q b) { return {_mm256_or_si256(a.v, b.v)}; }

inline I zero_i() { return {_mm256_setzero_si256()}; }
// acc + per column sum_i u[4c + i] * x[i]: u unsigned bytes, x four int8 in one int32
inline I dot(I acc, Q u, int32_t x) {
#if TFS_VNNI
  return {TFS_DPBUSD(acc.v, u.v, _mm256_set1_epi32(x))};
#else
  const __m256i pairs = _mm256_maddubs_epi16(u.v, _mm256_set1_epi32(x));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
#endif
}
// the same with signed bytes w (Q8_0): |w| times x with w's sign, as u8 x s8 wants (|x| <= 127: no overflow)
inline I dot_signed(I acc, Q w, int32_t x) {
  const __m256i aw = _mm256_sign_epi8(w.v, w.v), xs = _mm256_sign_epi8(_mm256_set1_epi32(x), w.v);
#if TFS_VNNI
  return {TFS_DPBUSD(acc.v, aw, xs)};
#else
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), _mm256_set1_epi16(1)))};
#endif
}
inline I operator+(I a, I b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline I operator-(I a, int32_t s) { return {_mm256_sub_epi32(a.v, _mm256_set1_epi32(s))}; }
// signed bytes + 128 (w ^ 0x80): once a quad for all rows, where dot_signed takes two vpsignb a row
inline Q flip(Q w) { return {_mm256_xor_si256(w.v, _mm256_set1_epi8(static_cast<char>(0x80)))}; }
// Without VNNI, a run of `dot`s sums its maddubs pairs in int16 and widens once (madd): one instruction a quad
// fewer. P: 16 int16 pair sums; the kernels keep a run short enough that no sum can pass 32767.
#if TFS_VNNI
constexpr bool kPairsInInt16 = false;
#else
constexpr bool kPairsInInt16 = true;
#endif
struct P { __m256i v; };
inline P pairs(Q u, int32_t x) { return {_mm256_maddubs_epi16(u.v, _mm256_set1_epi32(x))}; }
inline P operator+(P a, P b) { return {_mm256_add_epi16(a.v, b.v)}; }
inline I widen(P a) { return {_mm256_madd_epi16(a.v, _mm256_set1_epi16(1))}; }
// out[i]: input i of the 8 columns of q, widened (unsigned bytes, or signed where kSigned)
template <bool kSigned>
inline void inputs(Q q, I out[4]) {
  // bytes 4c + i of each 128-bit half -> [i][c]; then the halves' dwords interleaved: 8 bytes per input
  const __m256i by_input = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                            0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i t = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q.v, by_input),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) out[i] = {kSigned ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i])};
}

inline F to_float(I a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline F set1(float x) { return {_mm256_set1_ps(x)}; }
inline F zero_f() { return {_mm256_setzero_ps()}; }
inline F load_half(const uint8_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
// 8 bytes as floats: unsigned, signed, or one field of them (bits [From, From + Width))
inline F load_u8(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))}; }
inline F load_i8(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))}; }
template <int From, int Width>
inline F load_u8_field(const uint8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (From) b = _mm_srli_epi16(b, From);
  b = _mm_and_si128(b, _mm_set1_epi8((1 << Width) - 1));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))};
}
inline F operator*(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F operator+(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline void store(float* p, F a) { _mm256_storeu_ps(p, a.v); }
#else  // plain C++ (and NEON, for now): the same operations on arrays

struct Q { uint8_t v[32]; };
struct I { int32_t v[8]; };
struct F { float v[8]; };

inline Q load_q(const uint8_t* p) { Q q; std::memcpy(q.v, p, 32); return q; }
template <int From, int Width, int To>
inline Q field(Q a) {
  constexpr unsigned mask = ((1u << Width) - 1) << To;
  for (uint8_t& b : a.v) b = static_cast<uint8_t>((From >= To ? b >> (From - To) : b << (To - From)) & mask);
  return a;
}
inline Q operator|(Q a, Q b) { for (int j = 0; j < 32; ++j) a.v[j] |= b.v[j]; return a; }

inline I zero_i() { return I{}; }
inline I dot(I acc, Q u, int32_t x) {
  int8_t xb[4];
  std::memcpy(xb, &x, 4);
  for (int c = 0; c < 8; ++c)
    for (int i = 0; i < 4; ++i) acc.v[c] += u.v[4 * c + i] * xb[i];
  return acc;
}
inline I dot_signed(I acc, Q w, int32_t x) {
  int8_t xb[4];
  std::memcpy(xb, &x, 4);
  for (int c = 0; c < 8; ++c)
    for (int i = 0; i < 4; ++i) acc.v[c] += static_cast<int8_t>(w.v[4 * c + i]) * xb[i];
  return acc;
}
inline I operator+(I a, I b) { for (int c = 0; c < 8; ++c) a.v[c] += b.v[c]; return a; }
inline I operator-(I a, int32_t s) { for (int c = 0; c < 8; ++c) a.v[c] -= s; return a; }
inline Q flip(Q w) { for (uint8_t& b : w.v) b ^= 0x80; return w; }
constexpr bool kPairsInInt16 = false;  // no int16 stage: P is the int32 sum itself
struct P { I v; };
inline P pairs(Q u, int32_t x) { return {dot(zero_i(), u, x)}; }
inline P operator+(P a, P b) { return {a.v + b.v}; }
inline I widen(P a) { return a.v; }
template <bool kSigned>
inline void inputs(Q q, I out[4]) {
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 8; ++c)
      out[i].v[c] = kSigned ? static_cast<int8_t>(q.v[4 * c + i]) : static_cast<int32_t>(q.v[4 * c + i]);
}

inline F to_float(I a) { F f; for (int c = 0; c < 8; ++c) f.v[c] = static_cast<float>(a.v[c]); return f; }
inline F set1(float x) { F f; for (float& v : f.v) v = x; return f; }
inline F zero_f() { return set1(0.f); }
inline F load_half(const uint8_t* p) {
  F f;
  for (int c = 0; c < 8; ++c) {
    uint16_t h;
    std::memcpy(&h, p + 2 * c, 2);
    f.v[c] = half_to_float(h);
  }
  return f;
}
inline F load_u8(const uint8_t* p) { F f; for (int c = 0; c < 8; ++c) f.v[c] = p[c]; return f; }
inline F load_i8(const uint8_t* p) { F f; for (int c = 0; c < 8; ++c) f.v[c] = static_cast<int8_t>(p[c]); return f; }
template <int From, int Width>
inline F load_u8_field(const uint8_t* p) {
  F f;
  for (int c = 0; c < 8; ++c) f.v[c] = static_cast<float>((p[c] >> From) & ((1 << Width) - 1));
  return f;
}
inline F operator*(F a, F b) { for (int c = 0; c < 8; ++c) a.v[c] *= b.v[c]; return a; }
inline F operator+(F a, F b) { for (int c = 0; c < 8; ++c) a.v[c] += b.v[c]; return a; }
inline F fma(F a, F b, F c) { for (int j = 0; j < 8; ++j) c.v[j] = std::fma(a.v[j], b.v[j], c.v[j]); return c; }
inline void store(float* p, F a) { std::memcpy(p, a.v, sizeof(a.v)); }
#endif

// Q8_0's signed quants as u = w + 128 (flip), the unsigned operand dpbusd wants, and 128 x the block's sum of
// activations subtracted in integers: the same sums as dot_signed's, for one xor a quad instead of two vpsignb a
// row. Not on maddubs, whose int16 pairs would saturate (2 x 255 x 127).
#if TFS_VNNI
constexpr bool kSignedAsUnsigned = true;
#else
constexpr bool kSignedAsUnsigned = false;
#endif

#if TFS_GROUP_PAIRS
// Two groups of 8 columns at once, the first in the low 256 bits: one broadcast of an activation quad serves 16
// columns, and the float work a row and block (scales, sums) covers both groups, with no shuffle a row. Each lane
// does what its column's lane of Q, I, F does: the results are the same bits.
//   GroupPair: where the two groups' bytes are (the second `stride` bytes on), read as one
struct GroupPair {
  const uint8_t* first;
  int64_t stride;
  GroupPair operator+(int64_t offset) const { return {first + offset, stride}; }
};
struct Q16 { __m512i v; };
struct I16 { __m512i v; };
struct F16 { __m512 v; };

inline Q16 load_q(GroupPair p) {
  return {_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.first))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.first + p.stride)), 1)};
}
template <int From, int Width, int To>
inline Q16 field(Q16 a) {
  constexpr int mask = ((1 << Width) - 1) << To;
  __m512i v = a.v;
  if constexpr (From > To) v = _mm512_srli_epi16(v, From - To);
  if constexpr (From < To) v = _mm512_slli_epi16(v, To - From);
  return {_mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(mask)))};
}
inline Q16 operator|(Q16 a, Q16 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline Q16 flip(Q16 w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8(static_cast<char>(0x80)))}; }
inline I16 dot(I16 acc, Q16 u, int32_t x) { return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(x))}; }
inline I16 operator+(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 operator-(I16 a, int32_t s) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(s))}; }
inline F16 join(F a, F b) { return {_mm512_insertf32x8(_mm512_castps256_ps512(a.v), b.v, 1)}; }
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
#endif

// The registers of one group (Cols 8: Q, I, F over a group block's bytes) or of two (Cols 16, TFS_GROUP_PAIRS).
template <int Cols> struct Lanes;
template <> struct Lanes<8> {
  using Q = lanes::Q; using I = lanes::I; using F = lanes::F;
  using Src = const uint8_t*;
  static F set1(float x) { return lanes::set1(x); }
};
#if TFS_GROUP_PAIRS
template <> struct Lanes<16> {
  using Q = Q16; using I = I16; using F = F16;
  using Src = GroupPair;
  static F set1(float x) { return {_mm512_set1_ps(x)}; }
};
#endif

}  // namespace lanes
}  // namespace tfs
