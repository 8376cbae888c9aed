// The CPU kernels without torch, on whatever ISA this is built for: natively on x86 (AVX-512, AVX2, plain C++), and
// for aarch64 (NEON) with a cross compiler, run under qemu-aarch64 (tests/engine/test_neon_kernels.py builds both).
//   - every GGUF block type (Q4_0 .. Q8_0, Q2_K .. Q6_K) from random file blocks: repacked, then the decode road
//     (int8 activations; one row, and tiles of several) against a float64 reference, a row the same alone and in a
//     batch; the prompt road (dequantized panels, float32) and dequantize_rows bit for bit. The reference decodes
//     the file's bytes as ggml's dequantize_row_* do (ggml-quants.c), sharing nothing with quant_types.h.
//   - float32, float16 and bfloat16 panels (linear.h) bit for bit against one chain of fused multiply-adds;
//   - full_attention and prompt_attention (full_attention.h) against float64 attention; `sums` and `fold` (vec.h)
//     the same bits; exp within 2 ulp.
// Built as the kernels are (kernels.py: -ffp-contract=off, no math errno) with -DTFS_NO_TORCH=1 and the shim/
// headers for c10::Half, c10::BFloat16 and at::parallel_for. Prints a line per failure and "N passed, N failed".
#include <cinttypes>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "quant.h"
#include "full_attention.h"

using tfs::QType;

namespace {

int num_passed = 0, num_failed = 0;

void check(bool ok, const std::string& what, const std::string& detail = "") {
  if (ok) {
    ++num_passed;
  } else {
    ++num_failed;
    std::printf("FAIL %s %s\n", what.c_str(), detail.c_str());
  }
}

std::mt19937 rng(1234);
float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(rng() >> 8) * (1.f / 16777216.f); }
uint8_t byte() { return static_cast<uint8_t>(rng() >> 24); }

float half_value(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
uint16_t half_bits(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return h; }
float half_at(const uint8_t* p) { return half_value(half_bits(p)); }
// A float16 scale of either sign, 2^-12 .. 2^-5, now and then 0 or subnormal.
uint16_t random_scale() {
  const uint32_t r = rng();
  if (r % 29 == 0) return 0;
  if (r % 31 == 0) return static_cast<uint16_t>((r >> 8) & 0x83FF);
  return static_cast<uint16_t>(((r >> 16) & 1) << 15 | (3 + (r >> 17) % 8) << 10 | ((r >> 4) & 1023));
}

// ---- The file format, as ggml's dequantize_row_* reads it -----------------------------------------------------
// Per weight: w, what ggml's dequantize gives (float32, each product rounded as there), and w split as the decode
// road counts it: a (times the int8 activations) + c (times the exact activations: a block's minimum, Q4_0's -8 d).
struct Ref {
  int inputs, bytes;
  std::vector<int> halves;  // byte offsets of the block's float16 scales
};

Ref ref_of(QType t) {
  switch (t) {
    case QType::Q4_0: return {32, 18, {0}};         // d, qs[16]
    case QType::Q4_1: return {32, 20, {0, 2}};      // d, m, qs[16]
    case QType::Q5_0: return {32, 22, {0}};         // d, qh[4], qs[16]
    case QType::Q5_1: return {32, 24, {0, 2}};      // d, m, qh[4], qs[16]
    case QType::Q8_0: return {32, 34, {0}};         // d, qs[32] (int8)
    case QType::Q2_K: return {256, 84, {80, 82}};   // scales[16], qs[64], d, dmin
    case QType::Q3_K: return {256, 110, {108}};     // hmask[32], qs[64], scales[12], d
    case QType::Q4_K: return {256, 144, {0, 2}};    // d, dmin, scales[12], qs[128]
    case QType::Q5_K: return {256, 176, {0, 2}};    // d, dmin, scales[12], qh[32], qs[128]
    case QType::Q6_K: return {256, 210, {208}};     // ql[128], qh[64], scales[16] (int8), d
  }
  return {0, 0, {}};
}

void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {  // ggml's get_scale_min_k4
  if (j < 4) {
    d = q[j] & 63, m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

const std::set<QType> min_types = {QType::Q4_1, QType::Q5_1, QType::Q2_K, QType::Q4_K, QType::Q5_K};

void decode(QType t, const uint8_t* b, float* w, double* a, double* c) {
  auto put = [&](int i, float scale, int u, float min) {  // w = scale * u (+ min, where the type has one)
    const float p = scale * static_cast<float>(u);
    w[i] = min_types.count(t) ? p + min : p, a[i] = static_cast<double>(scale) * u, c[i] = min;
  };
  switch (t) {
    case QType::Q4_0: {
      const float d = half_at(b);
      for (int j = 0; j < 16; ++j) {
        const int x0 = b[2 + j] & 15, x1 = b[2 + j] >> 4;
        w[j] = static_cast<float>(x0 - 8) * d, w[j + 16] = static_cast<float>(x1 - 8) * d;
        a[j] = static_cast<double>(d) * x0, a[j + 16] = static_cast<double>(d) * x1;
        c[j] = c[j + 16] = -8.0 * d;
      }
      break;
    }
    case QType::Q4_1: {
      const float d = half_at(b), m = half_at(b + 2);
      for (int j = 0; j < 16; ++j) put(j, d, b[4 + j] & 15, m), put(j + 16, d, b[4 + j] >> 4, m);
      break;
    }
    case QType::Q5_0: case QType::Q5_1: {
      const bool q51 = t == QType::Q5_1;
      const float d = half_at(b), m = q51 ? half_at(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (q51 ? 4 : 2), 4);
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int x0 = (qs[j] & 15) | (((qh >> j) << 4) & 16), x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 16);
        if (q51) {
          put(j, d, x0, m), put(j + 16, d, x1, m);
        } else {
          put(j, d, x0 - 16, 0.f), put(j + 16, d, x1 - 16, 0.f);
        }
      }
      break;
    }
    case QType::Q8_0: {
      const float d = half_at(b);
      for (int j = 0; j < 32; ++j) put(j, d, static_cast<int8_t>(b[2 + j]), 0.f);
      break;
    }
    case QType::Q2_K: {
      const float d = half_at(b + 80), dmin = half_at(b + 82);
      const uint8_t* q = b + 16;
      int is = 0, y = 0;
      for (int n = 0; n < 256; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
          for (int half = 0; half < 2; ++half) {
            const uint8_t sc = b[is++];
            const float dl = d * static_cast<float>(sc & 15), ml = dmin * static_cast<float>(sc >> 4);
            for (int l = 0; l < 16; ++l) put(y++, dl, (q[l + 16 * half] >> shift) & 3, -ml);
          }
      break;
    }
    case QType::Q3_K: {
      const uint8_t *hm = b, *q = b + 32, *s = b + 96;
      const float d = half_at(b + 108);
      int8_t scales[16];
      for (int j = 0; j < 16; ++j) {
        const int low = j < 8 ? s[j] & 15 : s[j - 8] >> 4, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        scales[j] = static_cast<int8_t>((low | high << 4) - 32);
      }
      int is = 0, y = 0;
      uint8_t m = 1;
      for (int n = 0; n < 256; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2, m <<= 1)
          for (int half = 0; half < 2; ++half) {
            const float dl = d * static_cast<float>(scales[is++]);
            for (int l = 16 * half; l < 16 * half + 16; ++l)
              put(y++, dl, ((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4), 0.f);
          }
      break;
    }
    case QType::Q4_K: case QType::Q5_K: {
      const bool q5 = t == QType::Q5_K;
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (q5 ? 48 : 16);
      int is = 0, y = 0;
      uint8_t u1 = 1, u2 = 2;
      for (int j = 0; j < 256; j += 64, ql += 32, is += 2, u1 <<= 2, u2 <<= 2) {
        uint8_t sc, m;
        scale_min_k4(is, scales, sc, m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, sc, m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; ++l) put(y++, d1, (ql[l] & 15) + (q5 && (qh[l] & u1) ? 16 : 0), -m1);
        for (int l = 0; l < 32; ++l) put(y++, d2, (ql[l] >> 4) + (q5 && (qh[l] & u2) ? 16 : 0), -m2);
      }
      break;
    }
    case QType::Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          put(n + l, d * sc[is], q1, 0.f), put(n + l + 32, d * sc[is + 2], q2, 0.f);
          put(n + l + 64, d * sc[is + 4], q3, 0.f), put(n + l + 96, d * sc[is + 6], q4, 0.f);
        }
      break;
    }
  }
}

// Activations per block of 32 to int8 as the decode road promises: d = max|x| / 127, q = round(x / d), half to even.
void quantize_ref(const float* x, int8_t* q, float& d) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  d = amax / 127.f;
  const float inv = d ? 1.f / d : 0.f;
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
}

bool same_bits(const float* a, const float* b, int64_t n, std::string& detail) {
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, 4) != 0) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "at %" PRId64 ": %.9g, expected %.9g", i, a[i], b[i]);
      detail = buf;
      return false;
    }
  return true;
}

template <QType T>
void check_type(const char* name) {
  using namespace tfs;
  const Ref ref = ref_of(T);
  const int64_t n = 29, k = 512, nbk = k / ref.inputs, groups = (n + kGroup - 1) / kGroup;  // a partial group
  check(Spec<T>::kFileBytes == ref.bytes && Spec<T>::kInputs == ref.inputs, std::string(name) + " block size");
  std::vector<uint8_t> file(n * nbk * ref.bytes);
  for (uint8_t& v : file) v = byte();
  for (int64_t b = 0; b < n * nbk; ++b)
    for (int off : ref.halves) {
      const uint16_t h = random_scale();
      std::memcpy(file.data() + b * ref.bytes + off, &h, 2);
    }
  std::vector<float> w(n * k);
  std::vector<double> wa(n * k), wc(n * k);
  for (int64_t b = 0; b < n * nbk; ++b)
    decode(T, file.data() + b * ref.bytes, &w[b * ref.inputs], &wa[b * ref.inputs], &wc[b * ref.inputs]);
  std::vector<uint8_t> packed(groups * nbk * kGroupBytes<T>, 0xA5);
  repack<T>(file.data(), packed.data(), n, nbk);
  std::string detail;

  // dequantize_rows: every row, in a scrambled order
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = (7 * i + 3) % n;
  std::vector<float> rows(n * k), expected(n * k);
  dequantize_rows<T>(packed.data(), ids.data(), n, k, rows.data());
  for (int64_t i = 0; i < n; ++i) std::memcpy(expected.data() + i * k, w.data() + ids[i] * k, k * sizeof(float));
  check(same_bits(rows.data(), expected.data(), n * k, detail), std::string(name) + " dequantize_rows", detail);

  const int64_t max_rows = 11;
  std::vector<float> x(max_rows * k);
  for (float& v : x) v = uniform(-1.f, 1.f);
  for (int j = 0; j < 32; ++j) x[3 * k + 64 + j] = 0.f;  // a block of zeros: d = 0

  // the activations' int8 blocks, as the reference has them
  std::vector<int8_t> q(max_rows * k);
  std::vector<float> xd(max_rows * k / 32);
  for (int64_t i = 0; i < max_rows * k / 32; ++i) quantize_ref(x.data() + 32 * i, q.data() + 32 * i, xd[i]);
  QuantRows xq;
  quantize_rows(x.data(), max_rows, k, xq);
  bool q_same = std::memcmp(xq.q.data(), q.data(), q.size()) == 0 &&
                std::memcmp(xq.d.data(), xd.data(), xd.size() * sizeof(float)) == 0;
  for (int64_t i = 0; i < max_rows * k / 16 && q_same; ++i) {
    int32_t qs = 0;
    double s = 0;
    for (int j = 0; j < 16; ++j) qs += q[16 * i + j], s += x[16 * i + j];
    q_same = xq.q16[i] == qs && std::fabs(xq.s16[i] - s) <= 1e-5;
  }
  check(q_same, std::string(name) + " quantize_rows");

  // the decode road: 1 row (GEMV) and tiles of several; a row's result the same alone as in any batch
  std::vector<float> y1(k), y(max_rows * n);
  for (int64_t m : {1, 2, 3, 5, 8, 11}) {
    quant_linear<T>(packed.data(), xq, y.data(), m, k, n);
    double worst = 0;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t col = 0; col < n; ++col) {
        double sum = 0, size = 0;
        for (int64_t i = 0; i < k; ++i) {
          const double xi = static_cast<double>(xd[(r * k + i) / 32]) * q[r * k + i];
          const double t0 = wa[col * k + i] * xi, t1 = wc[col * k + i] * x[r * k + i];
          sum += t0 + t1, size += std::fabs(t0) + std::fabs(t1);
        }
        worst = std::max(worst, std::fabs(y[r * n + col] - sum) / (size + 1e-30));
      }
    char buf[64];
    std::snprintf(buf, sizeof buf, "rows %" PRId64 ": error %.3g of the terms' size", m, worst);
    check(worst < 1e-5, std::string(name) + " quant_linear", buf);
    if (m == 1) {
      std::memcpy(y1.data(), y.data(), n * sizeof(float));
    } else {
      check(same_bits(y.data(), y1.data(), n, detail), std::string(name) + " quant_linear row 0 alone and in a batch",
            detail);
    }
  }

  // the prompt road: the exactly dequantized weight times x in float32, one fused chain per output
  for (int64_t m : {1, 3, 11}) {
    dequant_linear<T>(packed.data(), x.data(), y.data(), m, k, n);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t col = 0; col < n; ++col) {
        float acc = 0.f;
        for (int64_t i = 0; i < k; ++i) acc = std::fma(x[r * k + i], w[col * k + i], acc);
        expected[r * n + col] = acc;
      }
    check(same_bits(y.data(), expected.data(), m * n, detail),
          std::string(name) + " dequant_linear rows " + std::to_string(m), detail);
  }
}

// Float panels of W: y = x @ W.T + bias, bit for bit one fused chain per output from the bias.
template <typename W>
void check_panels(const char* name, uint16_t (*bits)()) {
  using namespace tfs;
  const int64_t n = 3 * kPanelCols + 3, k = 67, panels = (n + kPanelCols - 1) / kPanelCols;
  std::vector<W> w(n * k), packed(panels * k * kPanelCols);
  std::vector<float> wf(n * k);
  for (int64_t i = 0; i < n * k; ++i) {
    if constexpr (std::is_same_v<W, float>) {
      w[i] = uniform(-1.f, 1.f);
    } else {
      w[i].x = bits();
    }
    wf[i] = static_cast<float>(w[i]);
  }
  pack_panels<W>(w.data(), packed.data(), n, k);
  std::vector<float> bias(panels * kPanelCols, 0.f), x(30 * k), y(30 * n), expected(30 * n);
  for (int64_t c = 0; c < n; ++c) bias[c] = uniform(-1.f, 1.f);
  for (float& v : x) v = uniform(-1.f, 1.f);
  std::string detail;
  for (int64_t m : {1, 2, 3, 5, 13, 30}) {
    linear_panels<FloatTiles<W>>(x.data(), packed.data(), bias.data(), y.data(), m, k, n, panels);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        float acc = bias[c];
        for (int64_t i = 0; i < k; ++i) acc = std::fma(x[r * k + i], wf[c * k + i], acc);
        expected[r * n + c] = acc;
      }
    check(same_bits(y.data(), expected.data(), m * n, detail), std::string(name) + " panels rows " + std::to_string(m),
          detail);
  }
}
uint16_t half_weight() { return static_cast<uint16_t>((rng() & 0x8000) | (9 + rng() % 7) << 10 | (rng() & 1023)); }
uint16_t bf16_weight() { return static_cast<uint16_t>((rng() & 0x8000) | (118 + rng() % 9) << 7 | (rng() & 127)); }

// Softmax(scale q k^T) v of one query over keys [0, num_keys), in float64.
void attend_ref(const float* q, int64_t d, int64_t num_keys, float scale, const float* const* keys,
                const float* const* values, double* out) {
  std::vector<double> s(num_keys);
  double mx = -1e300, sum = 0;
  for (int64_t t = 0; t < num_keys; ++t) {
    double dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * keys[t][i];
    s[t] = dot * scale, mx = std::max(mx, s[t]);
  }
  for (int64_t t = 0; t < num_keys; ++t) sum += s[t] = std::exp(s[t] - mx);
  for (int64_t i = 0; i < d; ++i) {
    double o = 0;
    for (int64_t t = 0; t < num_keys; ++t) o += s[t] * values[t][i];
    out[i] = o / sum;
  }
}

void check_full_attention(int64_t d) {
  const int64_t windows = 2, t_len = 37, heads = 3, ld = heads * d + 5;  // strided rows, as a stacked q/k/v
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> q(windows * t_len * ld), k(q.size()), v(q.size()), out(windows * t_len * heads * d);
  for (auto* a : {&q, &k, &v})
    for (float& f : *a) f = uniform(-2.f, 2.f);
  tfs::full_attention(q.data(), k.data(), v.data(), ld, out.data(), windows, t_len, heads, d, scale);
  double worst = 0;
  std::vector<double> o(d);
  std::vector<const float*> keys(t_len), values(t_len);
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < t_len; ++t)
        keys[t] = &k[(w * t_len + t) * ld + h * d], values[t] = &v[(w * t_len + t) * ld + h * d];
      for (int64_t r = 0; r < t_len; ++r) {
        attend_ref(&q[(w * t_len + r) * ld + h * d], d, t_len, scale, keys.data(), values.data(), o.data());
        const float* row = &out[(w * t_len + r) * heads * d + h * d];
        for (int64_t i = 0; i < d; ++i) worst = std::max(worst, std::fabs(row[i] - o[i]));
      }
    }
  check(worst < 2e-5, "full_attention head_dim " + std::to_string(d), "error " + std::to_string(worst));
}

template <int V>
void check_prompt_attention() {
  using tfs::Vec;
  const int64_t d = V * Vec::N, heads = 4, kv_heads = 2, block_size = 16, max_blocks = 12, num_seqs = 3;
  const int64_t key_lens[num_seqs] = {150, 37, 5}, q_lens[num_seqs] = {21, 37, 2};  // 150: two partitions
  const int64_t num_blocks = num_seqs * max_blocks;
  std::vector<int64_t> tables(num_seqs * max_blocks);
  for (int64_t i = 0; i < num_blocks; ++i) tables[i] = (i * 17 + 5) % num_blocks;  // scattered blocks
  std::vector<float> kc(num_blocks * block_size * kv_heads * d), vc(kc.size());
  for (auto* a : {&kc, &vc})
    for (float& f : *a) f = uniform(-2.f, 2.f);
  int64_t rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) rows += q_lens[s];
  std::vector<float> q(rows * heads * d), out(q.size());
  for (float& f : q) f = uniform(-2.f, 2.f);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  tfs::prompt_attention<V>(q.data(), kc.data(), vc.data(), tables.data(), max_blocks, key_lens, q_lens, num_seqs,
                           block_size, kv_heads, out.data(), heads, scale);
  double worst = 0;
  std::vector<double> o(d);
  std::vector<const float*> keys(150), values(150);
  for (int64_t s = 0, row = 0; s < num_seqs; ++s)
    for (int64_t j = 0; j < q_lens[s]; ++j, ++row)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t num_keys = key_lens[s] - q_lens[s] + j + 1, kvh = h / (heads / kv_heads);
        for (int64_t t = 0; t < num_keys; ++t) {
          const int64_t slot = tables[s * max_blocks + t / block_size] * block_size + t % block_size;
          const int64_t at = (slot * kv_heads + kvh) * d;
          keys[t] = &kc[at], values[t] = &vc[at];
        }
        attend_ref(&q[(row * heads + h) * d], d, num_keys, scale, keys.data(), values.data(), o.data());
        for (int64_t i = 0; i < d; ++i) worst = std::max(worst, std::fabs(out[(row * heads + h) * d + i] - o[i]));
      }
  check(worst < 2e-5, "prompt_attention head_dim " + std::to_string(d), "error " + std::to_string(worst));
}

void check_vec() {
  using tfs::Vec;
  constexpr int N = Vec::N;
  // sums (across lanes) and fold (across vectors of turned partials) the same bits: a prompt's scores those of a decode
  float a[N][N];
  for (auto& row : a)
    for (float& f : row) f = uniform(-1.f, 1.f) * std::ldexp(1.f, static_cast<int>(rng() % 20) - 10);
  Vec va[N], vp[N];
  float turned[N][N];
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < N; ++l) turned[l][i] = a[i][l];
  for (int i = 0; i < N; ++i) va[i] = Vec::load(a[i]), vp[i] = Vec::load(turned[i]);
  float s[N], f[N];
  tfs::sums(va).store(s);
  tfs::fold(vp).store(f);
  std::string detail;
  check(same_bits(f, s, N, detail), "fold and sums the same bits", detail);
  double sum_error = 0;
  for (int i = 0; i < N; ++i) {
    double t = 0, size = 0;
    for (int l = 0; l < N; ++l) t += a[i][l], size += std::fabs(a[i][l]);
    sum_error = std::max(sum_error, (std::fabs(s[i] - t) + std::fabs(va[i].sum() - t)) / size);
  }
  check(sum_error < 1e-6, "sums and Vec::sum", std::to_string(sum_error));

  // exp over the softmax's range, lanes each their own value
  double worst = 0;
  for (int i = 0; i < 4000; ++i) {
    float x[N], e[N];
    for (int l = 0; l < N; ++l) x[l] = -87.f * static_cast<float>(i * N + l) / (4000.f * N);
    tfs::exp(Vec::load(x)).store(e);
    for (int l = 0; l < N; ++l) worst = std::max(worst, std::fabs(e[l] / std::exp(static_cast<double>(x[l])) - 1));
  }
  check(worst < 2.4e-7, "exp within 2 ulp", std::to_string(worst));
  float m[2 * N], z[2 * N];  // max, round, float16 and bfloat16 loads
  for (int l = 0; l < 2 * N; ++l) m[l] = uniform(-100.f, 100.f);
  m[N / 2] = 2.5f, m[N / 2 + 1] = -0.5f;
  (Vec::load(m) + Vec::zero()).round().store(z);
  bool ok = Vec::load(m).max() == *std::max_element(m, m + N);
  for (int l = 0; l < N; ++l) ok = ok && z[l] == std::nearbyint(m[l]);
  check(ok, "Vec max and round (half to even)");
  c10::Half h[N];
  c10::BFloat16 bf[N];
  for (int l = 0; l < N; ++l) h[l].x = half_weight(), bf[l].x = bf16_weight();
  h[0].x = 0x0001, h[1 % N].x = 0x83FF;  // subnormals
  Vec::load(h).store(z), Vec::load(bf).store(z + N);
  ok = true;
  for (int l = 0; l < N; ++l) ok = ok && z[l] == static_cast<float>(h[l]) && z[N + l] == static_cast<float>(bf[l]);
  check(ok, "Vec float16 and bfloat16 loads");
}

}  // namespace

int main() {
  std::printf("isa %s, %d floats a vector, block lanes: %s\n", tfs::kIsa, tfs::Vec::N,
#if TFS_AVX2 || TFS_AVX512
              "256-bit registers"
#else
              "plain C++ arrays"
#endif
  );
  check_type<QType::Q4_0>("Q4_0");
  check_type<QType::Q4_1>("Q4_1");
  check_type<QType::Q5_0>("Q5_0");
  check_type<QType::Q5_1>("Q5_1");
  check_type<QType::Q8_0>("Q8_0");
  check_type<QType::Q2_K>("Q2_K");
  check_type<QType::Q3_K>("Q3_K");
  check_type<QType::Q4_K>("Q4_K");
  check_type<QType::Q5_K>("Q5_K");
  check_type<QType::Q6_K>("Q6_K");
  check_panels<float>("float32", nullptr);
  check_panels<c10::Half>("float16", half_weight);
  check_panels<c10::BFloat16>("bfloat16", bf16_weight);
  check_full_attention(32);
  check_full_attention(20);
  check_prompt_attention<1>();
  check_prompt_attention<32 / tfs::Vec::N>();
  check_prompt_attention<64 / tfs::Vec::N>();  // NEON: 16 vectors, the most the vector paths take
  check_vec();
  std::printf("%d passed, %d failed\n", num_passed, num_failed);
  return num_failed ? 1 : 0;
}
