// Attention on the linear kernel's tiles (linear.h). Two kernels:
// - full_attention: every query over every key of its window, no mask: Whisper's encoder (1500 frames, 6-20 heads
//   of 64), which torch's CPU flash attention ran at about half the speed. A window's head is packed once into
//   panels (its keys as the "weight" of the scores, its values as the weight of the output), then each tile of
//   kTileRows queries computes its scores against every key with the linear kernel's tile, an exact softmax over
//   the whole row (one row of 1500 scores stays in L1/L2: no online rescaling), and the weighted values with the
//   same tile. Rows are independent: a query's result does not depend on the thread or on the other windows.
// - prompt_attention: a prompt's rows, causal over the paged cache, each row in the decode kernel's arithmetic
//   (written down below, before the helpers both kernels share), so that it is the same bits as that row's decode.
#pragma once
#include "torch_api.h"
#include <limits>
#include <memory>
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

// A row of attention over a paged cache, computed the same way by the decode kernel (one query a sequence,
// cpu_ops.cpp) and by the prompt tiles below (many queries of a sequence at once), so a row's bits depend on its
// query and its keys alone, whichever kernel computed it, whatever its batch, chunk or cached prefix:
// - the score of key t: lane-wise products of q and k, Vec::N dimensions at a time (q * k for the first vector,
//   then multiply-adds in order), the lanes summed by `sums` (vec.h) Vec::N keys at a time, times the scale;
// - per partition of kPartition positions (at multiples of kPartition; a sliding window's first one starts at
//   its first key): m_p = its largest score, e_t = exp(s_t - m_p), l_p = the sum of the lane-wise sums of its
//   e's (Vec::N positions at a time from its start), A_p = one chain of multiply-adds e_t * v_t over its
//   positions in order, from 0 (lanes across dimensions);
// - one partition: out = A_0 * (1 / l_0); several: merged in order (merge_partitions, flash-decoding's rescaling).
// Partitions are the decode kernel's unit of work (one long sequence keeps every thread busy); the tiles keep
// them as the order of the sums.
constexpr int64_t kPartition = 128;

// The largest of s[0, n); s[n, padded) becomes -inf. padded: n up to whole vectors.
inline float row_max(float* s, int64_t n, int64_t padded) {
  std::fill(s + n, s + padded, -std::numeric_limits<float>::infinity());
  Vec mv = Vec::set1(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < padded; i += Vec::N) mv = max(mv, Vec::load(s + i));
  return mv.max();
}

// A partition's e's in place (s[n, padded) to 0), from its max; returns l_p. One pass: each vector's e's are
// summed as they are stored; the last, part-filled one with its lanes from n on as 0.
inline float exp_sum(float* s, int64_t n, int64_t padded, float mx) {
  const Vec m = Vec::set1(mx);
  Vec lv = Vec::zero();
  int64_t i = 0;
  for (; i + Vec::N <= n; i += Vec::N) {
    const Vec e = exp(Vec::load(s + i) - m);
    e.store(s + i);
    lv = lv + e;
  }
  if (i < padded) {
    exp(Vec::load(s + i) - m).store(s + i);
    std::fill(s + n, s + padded, 0.f);  // the lanes past n, whatever exp made of them
    lv = lv + Vec::load(s + i);
  }
  return lv.sum();
}

// out[0, d) = sum_p w_p A_p / sum_p w_p l_p with w_p = exp(m_p - max m), partitions in order. m_p, l_p at
// m[p * ml_stride], l[p * ml_stride]; A_p at acc + p * acc_stride. d: whole vectors.
inline void merge_partitions(const float* m, const float* l, int64_t ml_stride, const float* acc, int64_t acc_stride,
                             int64_t parts, int64_t d, float* out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, m[p * ml_stride]);
  float w[256], sum = 0.f;  // 32768 keys; longer contexts take the heap
  std::unique_ptr<float[]> more(parts > 256 ? new float[parts] : nullptr);
  float* ws = more ? more.get() : w;
  for (int64_t p = 0; p < parts; ++p) {
    ws[p] = std::exp(m[p * ml_stride] - mx);
    sum += ws[p] * l[p * ml_stride];
  }
  const Vec inv = Vec::set1(1.f / sum);
  for (int64_t i = 0; i < d; i += Vec::N) {
    Vec a = Vec::zero();
    for (int64_t p = 0; p < parts; ++p) a = fma(Vec::set1(ws[p]), Vec::load(acc + p * acc_stride + i), a);
    (a * inv).store(out + i);
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

#if !TFS_NO_TORCH
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
#endif  // !TFS_NO_TORCH

namespace tfs {

// The scores of R queries (q[r]) against NP panels of kPanelCols keys packed [head_dim][kPanelCols] each (lanes
// across keys), each (query, key) the decode kernel's bits: its lane l sums the products of dimensions l, l + N,
// ... in order (q * k, then multiply-adds), here one chain per l with lanes across keys, and `fold` adds the
// lanes' partials as `sums` does. V = head_dim / Vec::N; the queries' dimensions are broadcast once per l for
// the NP panels, each key vector loaded once for the R queries.
template <int V, int R, int NP>
inline void panel_scores(const float* const* q, const float* kp, int64_t d, float scale, float* const* out) {
  constexpr int L = Vec::N, KV = NP * kPanelVecs;
  constexpr int64_t P = kPanelCols;
  Vec part[R][KV][L];
  for (int l = 0; l < L; ++l) {
    Vec bq[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) bq[r][j] = Vec::set1(q[r][L * j + l]);
    for (int v = 0; v < KV; ++v) {
      const float* panel = kp + (v / kPanelVecs) * d * P + (v % kPanelVecs) * L;
      Vec acc[R];
      Vec k0 = Vec::load(panel + l * P);
      in_register(k0);
      for (int r = 0; r < R; ++r) acc[r] = bq[r][0] * k0;
      for (int j = 1; j < V; ++j) {
        Vec kj = Vec::load(panel + (L * j + l) * P);
        in_register(kj);
        for (int r = 0; r < R; ++r) acc[r] = fma(bq[r][j], kj, acc[r]);
      }
      for (int r = 0; r < R; ++r) part[r][v][l] = acc[r];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < KV; ++v) (fold(part[r][v]) * Vec::set1(scale)).store(out[r] + v * L);
}

// How both prompt kernels share out a call's work. Packing: per (sequence, KV head) its keys and values in panels
// of kPanelCols keys, packed a panel of keys (and their values) a piece, in order (sequence, KV head, panel).
// Tiles: items in order (sequence, head, tile of kTileRows rows). A sequence without rows packs nothing.
struct PromptPlan {
  struct Piece { int64_t s, kvh, p; };  // panel p of sequence s's KV head kvh
  struct Tile { int64_t s, h, r0, p0; int rows; };  // rows r0 ... of sequence s's head h; p0: its first row's position
  int64_t d, num_kv_heads, heads, value_panels;
  const int64_t *key_lens, *q_lens;
  // per sequence (and one past): its first row, its keys padded to panels, where its packed keys and values start,
  // its first piece, its first tile item, its first key's place in slot_offsets
  std::vector<int64_t> row0, tp, packed_at, pieces_at, tiles_at, slots_at;
  std::vector<int64_t> slot_offsets;  // each key's offset in the caches, worked out once for all its KV heads

  PromptPlan(const int64_t* tables, int64_t max_blocks, const int64_t* key_lens, const int64_t* q_lens,
             int64_t num_seqs, int64_t block_size, int64_t num_kv_heads, int64_t heads, int64_t d)
      : d(d), num_kv_heads(num_kv_heads), heads(heads), value_panels((d + kPanelCols - 1) / kPanelCols),
        key_lens(key_lens), q_lens(q_lens), row0(num_seqs + 1, 0), tp(num_seqs), packed_at(num_seqs + 1, 0),
        pieces_at(num_seqs + 1, 0), tiles_at(num_seqs + 1, 0), slots_at(num_seqs + 1, 0) {
    constexpr int64_t P = kPanelCols;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const bool rows = q_lens[s] > 0;
      row0[s + 1] = row0[s] + q_lens[s];
      tp[s] = (key_lens[s] + P - 1) / P * P;
      packed_at[s + 1] = packed_at[s] + (rows ? num_kv_heads * head_size(s) : 0);
      pieces_at[s + 1] = pieces_at[s] + (rows ? num_kv_heads * (tp[s] / P) : 0);
      tiles_at[s + 1] = tiles_at[s] + heads * ((q_lens[s] + kTileRows - 1) / kTileRows);
      slots_at[s + 1] = slots_at[s] + (rows ? key_lens[s] : 0);
    }
    slot_offsets.resize(slots_at[num_seqs]);
    const int64_t token_stride = num_kv_heads * d;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t* table = tables + s * max_blocks;
      for (int64_t t = 0; t < slots_at[s + 1] - slots_at[s]; ++t)
        slot_offsets[slots_at[s] + t] = (table[t / block_size] * block_size + t % block_size) * token_stride;
    }
  }
  int64_t num_pieces() const { return pieces_at.back(); }
  int64_t num_tiles() const { return tiles_at.back(); }
  int64_t packed_size() const { return std::max<int64_t>(packed_at.back(), 1); }
  // elements (floats, bfloat16s) of one (sequence, KV head): keys [tp / P][d * P], then values [value_panels][tp][P]
  int64_t head_size(int64_t s) const { return tp[s] * d + value_panels * tp[s] * kPanelCols; }
  int64_t packed(int64_t s, int64_t kvh) const { return packed_at[s] + kvh * head_size(s); }  // its keys' place
  int64_t key(int64_t s, int64_t t, int64_t kvh) const { return slot_offsets[slots_at[s] + t] + kvh * d; }
  static int64_t seq_of(const std::vector<int64_t>& at, int64_t i) {
    return std::upper_bound(at.begin(), at.end(), i) - at.begin() - 1;
  }
  Piece piece(int64_t i) const {
    const int64_t s = seq_of(pieces_at, i), panels = tp[s] / kPanelCols;
    return {s, (i - pieces_at[s]) / panels, (i - pieces_at[s]) % panels};
  }
  Tile tile(int64_t item) const {
    const int64_t s = seq_of(tiles_at, item), n = q_lens[s], num_tiles = (n + kTileRows - 1) / kTileRows;
    const int64_t h = (item - tiles_at[s]) / num_tiles, r0 = (item - tiles_at[s]) % num_tiles * kTileRows;
    return {s, h, r0, key_lens[s] - n, static_cast<int>(std::min<int64_t>(kTileRows, n - r0))};
  }
};

// Prompt rows of several sequences, causal, through tiles: sequence i has q_lens[i] rows (packed in order) at
// positions key_lens[i] - q_lens[i] ..., over its paged keys up to its last row. Per (sequence, KV head) the keys
// and values are packed into panels once for the call; each tile of kTileRows rows of a head gets its scores a
// panel of keys at a time (panel_scores), each row's partitions' softmax as above, then each partition's weighted
// values from the linear kernel's tile (a row's later keys in the tile weigh exactly 0, adding nothing to its
// chains). V = head_dim / Vec::N.
template <int V, typename C>
inline void prompt_attention(const float* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                             int64_t max_blocks, const int64_t* key_lens, const int64_t* q_lens, int64_t num_seqs,
                             int64_t block_size, int64_t num_kv_heads, float* out, int64_t heads, float scale) {
  constexpr int64_t P = kPanelCols, T = kPartition, L = Vec::N, d = V * L;
  // queries whose dimensions stay broadcast while the panels' keys stream past: about half the registers, and at
  // least two (a key vector then serves two rows: on AVX2 a head of 64 took 7.9 cycles a score alone, 5.7 by twos)
#if TFS_AVX512 || TFS_NEON
  constexpr int kRowsAtOnce = std::max(2, std::min(8, 16 / V));
#else
  constexpr int kRowsAtOnce = std::max(2, std::min(4, 16 / V));
#endif
  static_assert(T % P == 0 && P % L == 0, "partitions are whole panels, panels whole vectors");
  const int64_t group = heads / num_kv_heads, value_panels = (d + P - 1) / P;
  const PromptPlan plan(tables, max_blocks, key_lens, q_lens, num_seqs, block_size, num_kv_heads, heads, d);
  const auto& tp = plan.tp;
  std::unique_ptr<float[]> packed(new float[plan.packed_size()]);
  parallel_chunks(plan.num_pieces(), [&](int64_t piece) {
    const auto [s, kvh, p] = plan.piece(piece);
    float* vp = packed.get() + plan.packed(s, kvh) + tp[s] * d;
    float* kp = packed.get() + plan.packed(s, kvh) + p * d * P;
    std::fill(kp, kp + d * P, 0.f);
    for (int64_t c = 0; c < P; ++c) {
      const int64_t t = p * P + c;
      for (int64_t j = 0; j < value_panels; ++j) {
        float* dst = vp + (j * tp[s] + t) * P;
        const int64_t cols = t < key_lens[s] ? std::min(P, d - j * P) : 0;
        const C* value = v_cache + plan.key(s, t, kvh) + j * P;
        for (int64_t i = 0; i < cols; ++i) dst[i] = static_cast<float>(value[i]);
        std::fill(dst + cols, dst + P, 0.f);
      }
      if (t >= key_lens[s]) continue;
      const C* kr = k_cache + plan.key(s, t, kvh);
      for (int64_t i = 0; i < d; ++i) kp[i * P + c] = static_cast<float>(kr[i]);
    }
  });
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  parallel_claims(plan.num_tiles(), [&](auto& claim) {
    std::vector<float> scores, partials, ml;  // ml: (m_p, l_p) per partition and row
    for (int64_t item = claim(); item >= 0; item = claim()) {
      const auto [s, h, r0, p0, rows] = plan.tile(item);
      const float* kp = packed.get() + plan.packed(s, h / group);
      const float* vp = kp + tp[s] * d;
      const int64_t keys = p0 + r0 + rows, width = (keys + P - 1) / P * P;  // the tile's last row's keys
      const int64_t parts = (keys + T - 1) / T, ldo = value_panels * P;
      scores.resize(kTileRows * width);
      partials.resize(parts * kTileRows * ldo);
      ml.resize(parts * kTileRows * 2);
      for (int64_t t0 = 0; t0 < width; t0 += 2 * P) {  // scores, two panels of keys (or the last one) at a time
        const int first = static_cast<int>(std::max<int64_t>(0, t0 - p0 - r0));  // rows before them see none
        const bool two = t0 + P < width;
        for (int r = first; r < rows; r += kRowsAtOnce) {
          const float* qr[kRowsAtOnce];
          float* o[kRowsAtOnce];
          const int m = std::min(kRowsAtOnce, rows - r);
          for (int i = 0; i < kRowsAtOnce; ++i) {  // a short group repeats its last row (its scores written twice)
            const int ri = r + std::min(i, m - 1);
            qr[i] = q + ((plan.row0[s] + r0 + ri) * heads + h) * d;
            o[i] = scores.data() + ri * width + t0;
          }
          if (two) panel_scores<V, kRowsAtOnce, 2>(qr, kp + t0 * d, d, scale, o);
          else panel_scores<V, kRowsAtOnce, 1>(qr, kp + t0 * d, d, scale, o);
        }
      }
      for (int r = 0; r < rows; ++r) {  // per partition of the row's own keys: m_p, its e's and l_p; later keys 0
        float* sr = scores.data() + r * width;
        const int64_t own = p0 + r0 + r + 1;
        for (int64_t a = 0, p = 0; a < own; a += T, ++p) {
          const int64_t n_p = std::min(own - a, T), padded = (n_p + L - 1) / L * L;
          ml[(p * kTileRows + r) * 2] = row_max(sr + a, n_p, padded);
          ml[(p * kTileRows + r) * 2 + 1] = exp_sum(sr + a, n_p, padded, ml[(p * kTileRows + r) * 2]);
        }
        std::fill(sr + (own + L - 1) / L * L, sr + width, 0.f);
      }
      for (int64_t p = 0; p < parts; ++p) {  // A_p of every row of the tile, per panel of dimensions
        const int64_t a = p * T, len = std::min(T, width - a);
        for (int64_t j = 0; j < value_panels; ++j)
          linear_tile_of<float, 1>(rows, seq, scores.data() + a, len, vp + (j * tp[s] + a) * P, nullptr,
                                   partials.data() + p * kTileRows * ldo + j * P, ldo, P, width);
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t own = p0 + r0 + r + 1, own_parts = (own + T - 1) / T;
        float* o = out + ((plan.row0[s] + r0 + r) * heads + h) * d;
        if (own_parts == 1) {
          const Vec inv = Vec::set1(1.f / ml[r * 2 + 1]);
          for (int64_t i = 0; i < d; i += L) (Vec::load(partials.data() + r * ldo + i) * inv).store(o + i);
        } else {
          merge_partitions(ml.data() + r * 2, ml.data() + r * 2 + 1, kTileRows * 2, partials.data() + r * ldo,
                           kTileRows * ldo, own_parts, d, o);
        }
      }
    }
  });
}

#if TFS_BF16_DOT
// 2^x on 16 lanes for the bfloat16 path's probabilities: 2^n p(x - n), n = round(x), p a degree-4 polynomial fitted
// to 2^f on [-1/2, 1/2] (relative error 2.7e-6, a thousandth of the 2^-9 the probabilities are then rounded to; the
// degree-6 `exp` of vec.h took 20% of this kernel's time). No clamp: scalef takes any n, lanes far below 0 give 0
// (and those far above, inf, which the caller masks).
inline __m512 exp2_lanes(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.5718075e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5918004e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024703e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312179e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999928e-1f));
  return _mm512_scalef_ps(p, n);
}

// The first n of 16 lanes (all for n >= 16, none for n <= 0).
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
}

// Packs panel p (keys p P ...) of one (sequence, KV head) for prompt_attention_bf16: its `real` keys in the cache
// (at key(c), c < real; 0 past them) to kp [d/2][P] pairs (key c's dimensions i, i + 1 side by side), their values
// to vp [value panels][tp / 2][P] pairs (dimension e's keys t, t + 1 side by side). pairs: room for [P][d/2]. The
// keys go a row each through `pairs`, then are turned: scattered 16 pairs at a time, they took 1.8x as long.
// A bfloat16 cache's keys and values are copied as they are (rounding them again would change nothing).
inline __m512i bf16_lanes(__mmask16 m, const float* x) {  // 16 values rounded, each in its lane's low half
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x)));
}
inline __m512i bf16_lanes(__mmask16 m, const c10::BFloat16* x) {
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x));
}
inline __m512i bf16_pairs_of(int64_t n, const float* x) {  // 32 values from x (n of them real) as 16 pairs
  const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(n), x), hi = _mm512_maskz_loadu_ps(first_lanes(n - 16), x + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
inline __m512i bf16_pairs_of(int64_t n, const c10::BFloat16* x) {
  return _mm512_maskz_loadu_epi16(n >= 32 ? ~0u : n <= 0 ? 0u : (1u << n) - 1, x);
}
template <typename Key, typename C>
inline void pack_bf16_panel(const C* k_cache, const C* v_cache, const Key& key, int64_t real, int64_t d,
                            int64_t tp, int64_t p, uint32_t* kp, uint32_t* vp, uint32_t* pairs) {
  constexpr int64_t P = kPanelCols;
  const int64_t d2 = d / 2, value_panels = (d + P - 1) / P;
  if (real < P) {
    std::fill(kp, kp + d2 * P, 0u);
    for (int64_t j = 0; j < value_panels; ++j) {
      uint32_t* rows = vp + (j * tp + p * P) / 2 * P;
      std::fill(rows, rows + P / 2 * P, 0u);
    }
  }
  for (int64_t c = 0; c < real; ++c) {  // key c's dimension pairs: 16 pairs (32 floats) at a time
    const C* kr = k_cache + key(c);
    // rows ahead of their use, key c + 8's and value c's: the cache is paged, no stream for the prefetcher
    const C* ahead = k_cache + key(std::min(c + 8, real - 1));
    const C* value = v_cache + key(c);
    for (int64_t i = 0; i < d; i += 64 / sizeof(C)) __builtin_prefetch(ahead + i), __builtin_prefetch(value + i);
    for (int64_t i = 0; i < d2; i += 16)
      _mm512_mask_storeu_epi32(pairs + c * d2 + i, first_lanes(d2 - i), bf16_pairs_of(d - 2 * i, kr + 2 * i));
  }
  for (int64_t i = 0; i < d2; ++i)  // turned: key c's pair i to kp[i][c]
    for (int64_t c = 0; c < real; ++c) kp[i * P + c] = pairs[c * d2 + i];
  for (int64_t c = 0; c < real; c += 2) {  // keys c, c + 1's values side by side, 16 dimensions at a time
    const C* v0 = v_cache + key(c);
    const C* v1 = c + 1 < real ? v_cache + key(c + 1) : nullptr;
    for (int64_t e = 0; e < value_panels * P; e += 16) {
      const __mmask16 m = first_lanes(d - e);
      const __m512i a = bf16_lanes(m, v0 + e), b = v1 ? bf16_lanes(m, v1 + e) : _mm512_setzero_si512();
      uint32_t* dst = vp + ((e / P) * tp + p * P + c) / 2 * P + e % P;  // panel e / P, pair row (p P + c) / 2
      _mm512_storeu_si512(dst, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// Prompt rows as prompt_attention takes them, through the bfloat16 dot products (linear.h's Bf16DotTiles: twice
// the float32 FMA rate), for an engine that already rounds every linear layer's inputs to bfloat16: q, the keys,
// the values and the probabilities are rounded to bfloat16 (to nearest even), every sum is float32. Per
// (sequence, KV head) the keys are packed as the "weight" of the scores ([panels of 32 keys][d/2][32][2]: each
// key's dimensions i, i + 1 side by side) and the values as the weight of the output ([panels of 32 dims][tp/2]
// [32][2]: each dimension's keys t, t + 1 side by side); each tile of kTileRows rows of a head gets its scores a
// panel of keys at a time, an exact float32 softmax over the row's own keys (a row of 2048 scores is 8 KiB: no
// partitions, no online rescaling; its exponentials from exp2_lanes), its probabilities in bfloat16 pairs (0 past
// its own keys), and the weighted values. A row depends on its query and keys alone (not its tile, chunk or
// thread), but is not the decode kernel's float32 bits: that holds for the float32 prompt_attention only. d: even.
template <typename C>
inline void prompt_attention_bf16(const float* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                                  int64_t max_blocks, const int64_t* key_lens, const int64_t* q_lens, int64_t num_seqs,
                                  int64_t block_size, int64_t num_kv_heads, float* out, int64_t heads, int64_t d,
                                  float scale) {
  using T = Bf16DotTiles;
  constexpr int64_t P = kPanelCols;
  const int64_t d2 = d / 2, group = heads / num_kv_heads;
  const int64_t value_panels = (d + P - 1) / P, key_panel_size = T::panel_size(d);  // bfloat16s per key panel: d P
  const PromptPlan plan(tables, max_blocks, key_lens, q_lens, num_seqs, block_size, num_kv_heads, heads, d);
  const auto& tp = plan.tp;
  // per (sequence, KV head): keys [tp / P][d2][P][2], then values [value_panels][tp / 2][P][2]
  std::unique_ptr<c10::BFloat16[]> packed(new c10::BFloat16[plan.packed_size()]);
  auto packed_keys = [&](int64_t s, int64_t kvh) { return packed.get() + plan.packed(s, kvh); };
  parallel_claims(plan.num_pieces(), [&](auto& claim) {  // one panel of 32 keys and their 32 values a piece
    std::vector<uint32_t> pairs(P * d2);
    for (int64_t piece = claim(); piece >= 0; piece = claim()) {
      const PromptPlan::Piece at = plan.piece(piece);
      const int64_t s = at.s, kvh = at.kvh, p = at.p;
      auto key = [&](int64_t c) { return plan.key(s, p * P + c, kvh); };
      const int64_t real = std::min(P, key_lens[s] - p * P);  // keys of the panel in the cache
      pack_bf16_panel(k_cache, v_cache, key, real, d, tp[s], p,
                      reinterpret_cast<uint32_t*>(packed_keys(s, kvh) + p * key_panel_size),
                      reinterpret_cast<uint32_t*>(packed_keys(s, kvh) + tp[s] / P * key_panel_size), pairs.data());
    }
  });
  constexpr auto seq = std::make_integer_sequence<int, kTileRows>{};
  parallel_claims(plan.num_tiles(), [&](auto& claim) {
    // bfloat16 pairs: the tile's queries [d2][rows], its probabilities [rows][width / 2]
    std::vector<uint32_t> qbuf(kTileRows * d2), probs;
    std::vector<float> scores, obuf(kTileRows * value_panels * P);
    for (int64_t item = claim(); item >= 0; item = claim()) {
      const auto [s, h, r0, p0, rows] = plan.tile(item);
      const c10::BFloat16* kp = packed_keys(s, h / group);
      const c10::BFloat16* vp = kp + tp[s] / P * key_panel_size;
      if (item + 1 < plan.num_tiles()) {  // the next item's queries, ahead: rows heads * d apart, no stream (1.03x)
        const auto next = plan.tile(item + 1);
        for (int r = 0; r < next.rows; ++r)
          for (int64_t i = 0; i < d; i += 16)
            __builtin_prefetch(q + ((plan.row0[next.s] + next.r0 + r) * heads + next.h) * d + i);
      }
      const int64_t keys = p0 + r0 + rows, width = (keys + P - 1) / P * P;  // the tile's last row's keys
      scores.resize(kTileRows * width);
      probs.resize(kTileRows * width / 2);
      for (int r = 0; r < rows; ++r) {  // pairs, the rows interleaved: [d2][rows] (Bf16DotTiles)
        const float* qr = q + ((plan.row0[s] + r0 + r) * heads + h) * d;
        for (int64_t i = 0; i < d2; ++i)
          qbuf[i * rows + r] = c10::BFloat16(qr[2 * i]).x | static_cast<uint32_t>(c10::BFloat16(qr[2 * i + 1]).x) << 16;
      }
      for (int64_t p = 0; p < width / P; ++p)  // scores [rows][width], unscaled
        tiles_of<T, 1>(rows, seq, qbuf.data(), d, kp + p * key_panel_size, nullptr, scores.data() + p * P, width, P);
      float inv[kTileRows];
      for (int r = 0; r < rows; ++r) {  // e = exp(scale (s - max)) over the row's own keys, in bfloat16 pairs
        const float* sr = scores.data() + r * width;
        const int64_t own = p0 + r0 + r + 1;
        Vec mv = Vec::set1(-std::numeric_limits<float>::infinity());
        int64_t i = 0;
        for (; i + Vec::N <= own; i += Vec::N) mv = max(mv, Vec::load(sr + i));
        const __mmask16 tail = first_lanes(own - i);  // own - i < 16 lanes
        mv = {_mm512_mask_max_ps(mv.v, tail, mv.v, _mm512_maskz_loadu_ps(tail, sr + i))};
        const float sc2 = scale * 1.44269504088896341f;  // exp(scale s) = 2^(scale log2(e) s)
        const __m512 sc = _mm512_set1_ps(sc2), shift = _mm512_set1_ps(-sc2 * mv.max());
        __m512 lv = _mm512_setzero_ps();
        auto* pr = reinterpret_cast<uint16_t*>(probs.data() + r * width / 2);
        int64_t a = 0;
        for (; a + 2 * Vec::N <= own; a += 2 * Vec::N) {  // 32 keys: two vectors of e's, one of bfloat16s
          const __m512 e0 = exp2_lanes(_mm512_fmadd_ps(_mm512_loadu_ps(sr + a), sc, shift));
          const __m512 e1 = exp2_lanes(_mm512_fmadd_ps(_mm512_loadu_ps(sr + a + Vec::N), sc, shift));
          lv = _mm512_add_ps(_mm512_add_ps(lv, e0), e1);
          _mm512_storeu_si512(pr + a, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        for (; a < width; a += 2 * Vec::N) {  // the row's last keys, then 0 past them
          __m512 e[2];
          for (int half = 0; half < 2; ++half) {
            const int64_t b = a + half * Vec::N;
            const __m512 x = exp2_lanes(_mm512_fmadd_ps(_mm512_loadu_ps(sr + b), sc, shift));
            e[half] = _mm512_maskz_mov_ps(first_lanes(own - b), x);  // 0 past its keys
            lv = _mm512_add_ps(lv, e[half]);
          }
          _mm512_storeu_si512(pr + a, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(lv);
      }
      for (int64_t j = 0; j < value_panels; ++j)  // sum_t e_t v_t: [rows][d], keys as the inner dimension
        tiles_of<Bf16DotRowTiles, 1>(rows, seq, probs.data(), width, vp + j * tp[s] * P, nullptr,
                                     obuf.data() + j * P, value_panels * P, std::min(P, d - j * P));
      for (int r = 0; r < rows; ++r) {
        float* o = out + ((plan.row0[s] + r0 + r) * heads + h) * d;
        const float* src = obuf.data() + r * value_panels * P;
        for (int64_t i = 0; i < d; ++i) o[i] = src[i] * inv[r];
      }
    }
  });
}
#endif  // TFS_BF16_DOT

}  // namespace tfs

#if !TFS_NO_TORCH
// Prompt rows through the tiles, causal: q [rows, heads, head_dim] float32, sequence i's q_lens[i] rows packed in
// order, at positions key_lens[i] - q_lens[i] ... over the caches [num_blocks, block_size, kv_heads, head_dim]
// through block_tables[i] (their keys and values already written) -> [rows, heads, head_dim]. Each row is the
// same bits as the decode kernel's at its position (the shared arithmetic above). head_dim: Vec::N times 1, 2, 4,
// 8 or 16 (as the decode kernel's vector path). `dot`: through the bfloat16 dot products instead
// (prompt_attention_bf16: bfloat16 inputs, float32 sums), where the build has them (`bf16_dot`).
torch::Tensor paged_prompt_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor key_lens, torch::Tensor q_lens,
                                     double scale, bool dot) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: float32 [rows, heads, d]");
  const auto cache = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == cache &&
              (cache == torch::kFloat32 || cache == torch::kBFloat16), "caches: float32 or bfloat16, contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "heads and head_dim of q and caches");
  const int64_t vectors = q.size(2) / tfs::Vec::N;
  const bool vector_head = q.size(2) % tfs::Vec::N == 0 && (vectors & (vectors - 1)) == 0 && vectors <= 16;
  TORCH_CHECK(dot ? q.size(2) % 2 == 0 : vector_head,
              dot ? "head_dim: even (pairs of bfloat16)" : "head_dim: the vector width times 1, 2, 4, 8 or 16");
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto kl = key_lens.to(torch::kInt64).contiguous();
  auto ql = q_lens.to(torch::kInt64).contiguous();
  const int64_t num_seqs = ql.numel(), block_size = k_cache.size(1);
  TORCH_CHECK(kl.numel() == num_seqs && bt.dim() == 2 && bt.size(0) == num_seqs,
              "one table, key and row count a sequence");
  int64_t rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = ql.data_ptr<int64_t>()[s], keys = kl.data_ptr<int64_t>()[s];
    TORCH_CHECK(n >= 0 && keys >= n && (keys + block_size - 1) / block_size <= bt.size(1), "rows, keys and tables");
    for (int64_t b = 0; b < (keys + block_size - 1) / block_size; ++b) {
      const int64_t blk = bt.data_ptr<int64_t>()[s * bt.size(1) + b];
      TORCH_CHECK(blk >= 0 && blk < k_cache.size(0), "block id out of range");
    }
    rows += n;
  }
  TORCH_CHECK(rows == q.size(0), "q's rows: the sum of q_lens");
  auto out = torch::empty_like(q);
  if (rows == 0) return out;
  tfs::with_cache_data(k_cache, v_cache, [&](const auto* kc, const auto* vc) {
    if (dot) {
#if TFS_BF16_DOT
      tfs::prompt_attention_bf16(q.data_ptr<float>(), kc, vc, bt.data_ptr<int64_t>(), bt.size(1),
                                 kl.data_ptr<int64_t>(), ql.data_ptr<int64_t>(), num_seqs, block_size, k_cache.size(2),
                                 out.data_ptr<float>(), q.size(1), q.size(2), static_cast<float>(scale));
      return;
#else
      TORCH_CHECK(false, "this build has no bfloat16 dot products (bf16_dot is False)");
#endif
    }
    auto run = [&](auto v) {
      tfs::prompt_attention<decltype(v)::value>(q.data_ptr<float>(), kc, vc, bt.data_ptr<int64_t>(), bt.size(1),
                                                kl.data_ptr<int64_t>(), ql.data_ptr<int64_t>(), num_seqs, block_size,
                                                k_cache.size(2), out.data_ptr<float>(), q.size(1),
                                                static_cast<float>(scale));
    };
    switch (vectors) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 8: run(std::integral_constant<int, 8>{}); break;
      default: run(std::integral_constant<int, 16>{}); break;
    }
  });
  return out;
}
#endif  // !TFS_NO_TORCH
