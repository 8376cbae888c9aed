// Attention of every query over every key of its window, no mask: Whisper's encoder (1500 frames, 6-20 heads of
// 64), which torch's CPU flash attention ran at about half the speed of our GEMM tiles. A window's head is packed
// once into panels (its keys as the "weight" of the scores, its values as the weight of the output), then each
// tile of kTileRows queries computes its scores against every key with the linear kernel's tile (linear.h), an
// exact softmax over the whole row (one row of 1500 scores stays in L1/L2: no online rescaling), and the
// weighted values with the same tile. Rows are independent: a query's result does not depend on the thread or
// on the other windows.
#pragma once
#include "torch_api.h"
#include <limits>
#include <vector>
#include "linear.h"
#include "vec.h"

namespace tfs {

// Packs one (window, head): keys -> kp [panels(T)][D][P] (scores = q @ kp), values -> vp [panels(D)][Tp][P]
// (out = probs @ vp), zero past T and D. rows: the window's first row of k and v; ld: their row stride.
inline void pack_head(const float* k, const float* v, int64_t ld, int64_t t_len, int64_t d, int64_t tp,
                      float* kp, float* vp) {
  constexpr int64_t P = kPanelCols;
  const int64_t key_panels = tp / P, value_panels = (d + P - 1) / P;
  std::fill(kp, kp + key_panels * d * P, 0.f);
  std::fill(vp, vp + value_panels * tp * P, 0.f);
  for (int64_t t = 0; t < t_len; ++t) {
    const float* kr = k + t * ld;
    const float* vr = v + t * ld;
    float* kdst = kp + (t / P) * d * P + t % P;
    for (int64_t i = 0; i < d; ++i) kdst[i * P] = kr[i];
    for (int64_t j = 0; j < value_panels; ++j)
      std::memcpy(vp + (j * tp + t) * P, vr + j * P, std::min(P, d - j * P) * sizeof(float));
  }
}

// q, k, v: [windows * t_len, ld] rows (head h at columns h * d ...), out: [windows * t_len, heads * d].
inline void full_attention(const float* q, const float* k, const float* v, int64_t ld, float* out,
                           int64_t windows, int64_t t_len, int64_t heads, int64_t d, float scale) {
  constexpr int64_t P = kPanelCols;
  const int64_t tp = (t_len + P - 1) / P * P;  // keys padded to whole panels (and whole vectors)
  const int64_t key_panels = tp / P, value_panels = (d + P - 1) / P;
  const int64_t kp_size = key_panels * d * P, vp_size = value_panels * tp * P;
  const int64_t heads_all = windows * heads;
  std::unique_ptr<float[]> packed(new float[heads_all * (kp_size + vp_size)]);
  parallel_chunks(heads_all, [&](int64_t wh) {
    const int64_t w = wh / heads, h = wh % heads;
    float* kp = packed.get() + wh * (kp_size + vp_size);
    pack_head(k + w * t_len * ld + h * d, v + w * t_len * ld + h * d, ld, t_len, d, tp, kp, kp + kp_size);
  });
  const int64_t num_tiles = (t_len + kTileRows - 1) / kTileRows;
  const int64_t width = heads * d;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  // items in order (window, head, tile): consecutive claims share a head's panels in the caches
  parallel_claims(heads_all * num_tiles, [&](auto& claim) {
    std::vector<float> qbuf(kTileRows * d), scores(kTileRows * tp), obuf(kTileRows * value_panels * P);
    for (int64_t item = claim(); item >= 0; item = claim()) {
      const int64_t wh = item / num_tiles, tile = item % num_tiles, w = wh / heads, h = wh % heads;
      const float* kp = packed.get() + wh * (kp_size + vp_size);
      const float* vp = kp + kp_size;
      const int64_t r0 = tile * kTileRows;
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, t_len - r0));
      for (int r = 0; r < rows; ++r) {  // q * scale (as transformers scales q before its attention)
        const float* qr = q + (w * t_len + r0 + r) * ld + h * d;
        for (int64_t i = 0; i < d; ++i) qbuf[r * d + i] = qr[i] * scale;
      }
      for (int64_t p = 0; p < key_panels; ++p)
        linear_tile_of<float, 1>(rows, seq, qbuf.data(), d, kp + p * d * P, nullptr, scores.data() + p * P, tp, P);
      for (int r = 0; r < rows; ++r) {  // exact softmax over the row (the padded keys out), unnormalised
        float* s = scores.data() + r * tp;
        std::fill(s + t_len, s + tp, neg_inf);
        Vec mv = Vec::set1(neg_inf);
        for (int64_t i = 0; i < tp; i += Vec::N) mv = max(mv, Vec::load(s + i));
        const Vec mx = Vec::set1(mv.max());
        for (int64_t i = 0; i < tp; i += Vec::N) exp(Vec::load(s + i) - mx).store(s + i);
        std::fill(s + t_len, s + tp, 0.f);  // exp's far tail is tiny, not 0
      }
      for (int64_t j = 0; j < value_panels; ++j)
        linear_tile_of<float, 1>(rows, seq, scores.data(), tp, vp + j * tp * P, nullptr, obuf.data() + j * P,
                                 value_panels * P, P);
      for (int r = 0; r < rows; ++r) {
        const float* s = scores.data() + r * tp;
        Vec lv = Vec::zero();
        for (int64_t i = 0; i < tp; i += Vec::N) lv = lv + Vec::load(s + i);
        const float inv = 1.f / lv.sum();
        float* o = out + (w * t_len + r0 + r) * width + h * d;
        const float* src = obuf.data() + r * value_panels * P;
        for (int64_t i = 0; i < d; ++i) o[i] = src[i] * inv;
      }
    }
  });
}

}  // namespace tfs

// Attention without a mask over windows of t_len rows each: q, k, v [windows * t_len, >= heads * head_dim]
// float32 (rows may be strided: the columns of a stacked q/k/v projection), head h in columns h * head_dim ...
// -> [windows * t_len, heads * head_dim], softmax(scale * q k^T) v per window and head.
torch::Tensor full_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t t_len, int64_t heads,
                             double scale) {
  TORCH_CHECK(q.dim() == 2 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v: [rows, columns], alike");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "q, k, v: float32");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1, "q, k, v: rows of consecutive columns");
  TORCH_CHECK(q.stride(0) == k.stride(0) && q.stride(0) == v.stride(0), "q, k, v: one row stride");
  TORCH_CHECK(t_len > 0 && q.size(0) % t_len == 0, "rows: a whole number of windows of t_len");
  TORCH_CHECK(heads > 0 && q.size(1) % heads == 0, "columns: heads * head_dim");
  const int64_t d = q.size(1) / heads;
  auto out = torch::empty({q.size(0), q.size(1)}, q.options());
  tfs::full_attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0),
                      out.data_ptr<float>(), q.size(0) / t_len, t_len, heads, d, static_cast<float>(scale));
  return out;
}
