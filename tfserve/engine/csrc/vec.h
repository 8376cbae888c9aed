// One vector type for the kernels, whatever the CPU: `Vec` holds `Vec::N` floats in the widest registers the
// build targets (-march=native): AVX-512 (16 lanes), AVX2+FMA (8), ARM NEON (4), or plain C++ (8, left to the
// compiler). The kernels are written once against it; `kIsa` names the path compiled.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TFS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TFS_AVX2 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define TFS_NEON 1
#endif

namespace tfs {

#if TFS_AVX512
constexpr const char* kIsa = "AVX-512";
struct Vec {
  static constexpr int N = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static Vec load(const c10::BFloat16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  Vec round() const { return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  Vec ldexp(Vec n) const { return {_mm512_scalef_ps(v, n.v)}; }  // v * 2^n, n integral
};
#elif TFS_AVX2
constexpr const char* kIsa = "AVX2";
struct Vec {
  static constexpr int N = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
#if defined(__F16C__)
  static Vec load(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
#else
  static Vec load(const c10::Half* p) { float f[8]; for (int i = 0; i < 8; ++i) f[i] = p[i]; return load(f); }
#endif
  static Vec load(const c10::BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  float max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  Vec round() const { return {_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  Vec ldexp(Vec n) const {  // v * 2^n, n integral in [-126, 127]
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(v, _mm256_castsi256_ps(e))};
  }
};
#elif TFS_NEON
constexpr const char* kIsa = "NEON";
struct Vec {
  static constexpr int N = 4;
  float32x4_t v;
  static Vec zero() { return {vdupq_n_f32(0.f)}; }
  static Vec set1(float x) { return {vdupq_n_f32(x)}; }
  static Vec load(const float* p) { return {vld1q_f32(p)}; }
  static Vec load(const c10::Half* p) { return {vcvt_f32_f16(vld1_f16(reinterpret_cast<const __fp16*>(p)))}; }
  static Vec load(const c10::BFloat16* p) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16))};
  }
  void store(float* p) const { vst1q_f32(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
  float sum() const { return vaddvq_f32(v); }
  float max() const { return vmaxvq_f32(v); }
  Vec round() const { return {vrndnq_f32(v)}; }
  Vec ldexp(Vec n) const {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.v), vdupq_n_s32(127)), 23);
    return {vmulq_f32(v, vreinterpretq_f32_s32(e))};
  }
};
#else
constexpr const char* kIsa = "scalar";
struct Vec {  // plain C++; the compiler vectorises what it can
  static constexpr int N = 8;
  float v[8];
  static Vec zero() { return set1(0.f); }
  static Vec set1(float x) { Vec r; for (float& f : r.v) f = x; return r; }
  template <typename T> static Vec load(const T* p) { Vec r; for (int i = 0; i < N; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  friend Vec fma(Vec a, Vec b, Vec c) { for (int i = 0; i < N; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
  friend Vec operator*(Vec a, Vec b) { for (int i = 0; i < N; ++i) a.v[i] *= b.v[i]; return a; }
  friend Vec operator+(Vec a, Vec b) { for (int i = 0; i < N; ++i) a.v[i] += b.v[i]; return a; }
  friend Vec operator-(Vec a, Vec b) { for (int i = 0; i < N; ++i) a.v[i] -= b.v[i]; return a; }
  friend Vec operator/(Vec a, Vec b) { for (int i = 0; i < N; ++i) a.v[i] /= b.v[i]; return a; }
  friend Vec max(Vec a, Vec b) { for (int i = 0; i < N; ++i) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
  float sum() const { float s = 0.f; for (float f : v) s += f; return s; }
  float max() const { float m = v[0]; for (float f : v) m = std::max(m, f); return m; }
  Vec round() const { Vec r; for (int i = 0; i < N; ++i) r.v[i] = std::nearbyint(v[i]); return r; }
  Vec ldexp(Vec n) const { Vec r; for (int i = 0; i < N; ++i) r.v[i] = std::ldexp(v[i], static_cast<int>(n.v[i])); return r; }
};
#endif

// Keeps a loaded vector in a register for its several uses: the compiler would otherwise fold the load into
// each multiply-add, and a core that loads one 512-bit vector a cycle then waits on its loads, not its FMAs.
inline void in_register(Vec& v) {
#if TFS_AVX512 || TFS_AVX2
  asm("" : "+v"(v.v));
#elif TFS_NEON
  asm("" : "+w"(v.v));
#else
  (void)v;
#endif
}

// Lane i of the result is a[i].sum(), for Vec::N vectors: the scores of Vec::N tokens from their dot
// products' partial sums, in a few shuffles where the ISA has pairwise adds (each lane's order is fixed).
inline Vec sums(const Vec* a) {
#if TFS_AVX512
  // halves, then quarters, then pairs and single lanes of every vector folded together: 31 shuffles, 15 adds
  __m512 h[8], f[4], g[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s halves summed, 8-15: a[2i+1]'s
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i].v, a[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(a[2 * i].v, a[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter j: a[4i + j]'s four partial sums
    f[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter j: a[8i + j]'s two, then a[8i + 4 + j]'s two
    g[i] = _mm512_add_ps(_mm512_shuffle_ps(f[2 * i], f[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(f[2 * i], f[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter j: the sums of a[j], a[4 + j], a[8 + j], a[12 + j]; lane i takes a[i]'s
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t)};
#elif TFS_AVX2
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0].v, a[1].v), _mm256_hadd_ps(a[2].v, a[3].v));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4].v, a[5].v), _mm256_hadd_ps(a[6].v, a[7].v));
  // s0123: a0..a3's sums of lanes 0-3, then of lanes 4-7; s4567 the same for a4..a7
  return {_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31))};
#elif TFS_NEON
  return {vpaddq_f32(vpaddq_f32(a[0].v, a[1].v), vpaddq_f32(a[2].v, a[3].v))};
#else
  alignas(64) float s[Vec::N];
  for (int i = 0; i < Vec::N; ++i) s[i] = a[i].sum();
  return Vec::load(s);
#endif
}

// The sums of `sums`, for partials turned: p[l] holds lane l's partial of Vec::N rows, one row per lane of the
// result; lane c of the result is row c's sum in the very pairing `sums` adds it (vertical adds only), so a
// prompt's tiles, whose lanes run across keys, give each score the decode kernel's bits.
inline Vec fold(const Vec* p) {
#if TFS_AVX512  // sums: halves (l + 8), quarters (l + 4), pairs (l + 2), then the last two
  Vec e[8], f[4];
  for (int l = 0; l < 8; ++l) e[l] = p[l] + p[l + 8];
  for (int l = 0; l < 4; ++l) f[l] = e[l] + e[l + 4];
  return (f[0] + f[2]) + (f[1] + f[3]);
#elif TFS_AVX2  // sums: neighbours, then pairs of them, then the two halves
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
#elif TFS_NEON
  return (p[0] + p[1]) + (p[2] + p[3]);
#else  // sums: each lane's Vec::sum, in order from 0
  Vec s = Vec::zero();
  for (int l = 0; l < Vec::N; ++l) s = s + p[l];
  return s;
#endif
}

// exp on every lane: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial (about 1 ulp).
// For x <= 0 (softmax after subtracting the max); lanes below -87 give a tiny positive number, not 0:
// callers zero the lanes they do not use.
inline Vec exp(Vec x) {
  x = max(x, Vec::set1(-87.f));
  const Vec n = (x * Vec::set1(1.44269504088896341f)).round();
  Vec r = fma(n, Vec::set1(-0.693359375f), x);
  r = fma(n, Vec::set1(2.12194440e-4f), r);
  Vec p = Vec::set1(1.f / 720);
  p = fma(p, r, Vec::set1(1.f / 120));
  p = fma(p, r, Vec::set1(1.f / 24));
  p = fma(p, r, Vec::set1(1.f / 6));
  p = fma(p, r, Vec::set1(0.5f));
  p = fma(p, r, Vec::set1(1.f));
  p = fma(p, r, Vec::set1(1.f));
  return p.ldexp(n);
}

}  // namespace tfs
