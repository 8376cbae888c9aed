// CPU kernels of the engine, compiled on first use (kernels.py): paged decode attention, reading keys and
// values in place from the block cache through the block table (no gather, no padding); the KV-cache write;
// a linear kernel for steps of a few rows; and transformers' RMSNorm and rotary embedding, bit-identical.
#include "torch_api.h"
#include <algorithm>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <utility>
#include <limits>
#include <memory>
#include <vector>

#include "vec.h"
#include "full_attention.h"

// The first token a sequence of `ctx` tokens attends to: all of them, or the last `sliding_window`.
static inline int64_t window_start(int64_t ctx, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
}

// Ask for the slot `ahead` tokens on while this one is computed: the cache is read cold, and two threads
// alone do not keep enough loads in flight to use the memory bandwidth.
template <typename scalar_t>
static inline void prefetch_slot(const scalar_t* cache, const int64_t* table, int64_t t, int64_t end,
                                 int64_t block_size, int64_t block_stride, int64_t token_stride) {
  if (t >= end) return;
  const char* p = reinterpret_cast<const char*>(cache + table[t / block_size] * block_stride +
                                                (t % block_size) * token_stride);
  const int64_t bytes = token_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

template <typename scalar_t>
static inline float dot(const float* a, const scalar_t* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * static_cast<float>(b[d]);
  return acc;
}

// One sequence per work item: its blocks are read front to back, all KV heads of a slot at once, so every
// block (block_size * num_kv_heads * head_dim values) is one contiguous stream for the prefetcher.
template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int64_t* block_tables, const int64_t* context_lens, const int64_t* table_rows,
                          scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, int64_t max_blocks, double scale,
                          int64_t sliding_window, double softcap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;      // between consecutive slots of a block
  const int64_t block_stride = block_size * token_stride;     // between blocks
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(num_heads * head_dim), acc(num_heads * head_dim);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t ctx = context_lens[seq];
      const int64_t first = window_start(ctx, sliding_window);
      const int64_t n = ctx - first;
      scores.assign(num_heads * n, 0.f);  // [num_heads, n]
      const scalar_t* q_seq = q + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = static_cast<float>(q_seq[i]) * scale;
      const int64_t* table = block_tables + (table_rows ? table_rows[seq] : seq) * max_blocks;
      constexpr int64_t ahead = 4;
      for (int64_t t = first; t < std::min(first + ahead, ctx); ++t)
        prefetch_slot(k_cache, table, t, ctx, block_size, block_stride, token_stride);
      for (int64_t t = first; t < ctx; ++t) {
        prefetch_slot(k_cache, table, t + ahead, ctx, block_size, block_stride, token_stride);
        if (t + ahead - n >= first)  // the first values, for the loop below
          prefetch_slot(v_cache, table, t + ahead - n, ctx, block_size, block_stride, token_stride);
        const scalar_t* k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          float s = dot(qf.data() + h * head_dim, k + (h / group) * head_dim, head_dim);
          if (softcap > 0) s = std::tanh(s / softcap) * softcap;
          scores[h * n + (t - first)] = s;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* row = scores.data() + h * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, row[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) { row[i] = std::exp(row[i] - mx); sum += row[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) row[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < ctx; ++t) {
        prefetch_slot(v_cache, table, t + ahead, ctx, block_size, block_stride, token_stride);
        const scalar_t* v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * n + (t - first)];
          const scalar_t* vh = v + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(vh[d]);
        }
      }
      scalar_t* o = out + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) o[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

// The float32 kernel in vector registers (vec.h: AVX-512, AVX2, NEON), in the arithmetic every float32 attention
// row shares (full_attention.h: the prompt tiles compute the same bits). The unit of work is one KV head of one
// partition of a sequence's context (flash-decoding's split: one long sequence keeps every thread busy; cut at
// fixed positions, so a sequence's result does not depend on its batch or on the thread count), in two passes
// over its rows: the scores of Vec::N tokens at a time for each query head of the KV head (Vec::N independent
// dot products, summed across lanes at once: no dependent chain of multiply-adds per token), the partition's
// softmax, then the values weighted in registers. A sequence of several partitions has them merged in order at
// the end. V = head_dim / Vec::N. C: the caches' element, float or bfloat16 (a bfloat16 cache's keys and values
// widened exactly in registers: the same float32 arithmetic on the values it holds).
template <int V, typename C>
static void decode_kernel_vec(const float* q, const C* k_cache, const C* v_cache,
                              const int64_t* block_tables, const int64_t* context_lens, const int64_t* table_rows,
                              float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                              float softcap) {
  using tfs::Vec;
  constexpr int64_t L = Vec::N;  // tokens per chunk
  constexpr int64_t D = V * L;
  constexpr int64_t P = tfs::kPartition;
  static_assert(P % L == 0, "partitions are whole chunks");
  constexpr int64_t kAhead = 2 * L;  // tokens between the chunk computed and the rows asked for
  constexpr int64_t kLines = (D * static_cast<int64_t>(sizeof(C)) + 63) / 64;  // cache lines per head row
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;

  // Partitions: the ones of sequence s are [part_begin[s], part_begin[s + 1]); part_seq maps back.
  std::vector<int64_t> part_begin(num_seqs + 1, 0), part_seq;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = context_lens[s], first = window_start(ctx, sliding_window);
    const int64_t parts = ctx > first ? (ctx - 1) / P - first / P + 1 : 0;
    part_begin[s + 1] = part_begin[s] + parts;
    part_seq.insert(part_seq.end(), parts, s);
  }
  const int64_t num_parts = part_begin[num_seqs];
  // Each partition's softmax max, sum and weighted values per query head, for sequences of several.
  std::unique_ptr<float[]> part_m(new float[num_parts * num_heads]), part_l(new float[num_parts * num_heads]);
  std::unique_ptr<float[]> part_acc(new float[num_parts * num_heads * D]);
  auto rows_of = [&](int64_t part, int64_t& seq, int64_t& a, int64_t& b) {
    seq = part_seq[part];
    const int64_t ctx = context_lens[seq], first = window_start(ctx, sliding_window);
    const int64_t p = first / P + (part - part_begin[seq]);
    a = std::max(first, p * P);
    b = std::min(ctx, (p + 1) * P);
  };

  auto item = [&](int64_t part, int64_t kvh, float* scores) {
    int64_t seq, a, b;
    rows_of(part, seq, a, b);
    const int64_t n = b - a, padded = (n + L - 1) / L * L;
    const int64_t* table = block_tables + (table_rows ? table_rows[seq] : seq) * max_blocks;
    // Row offsets of the partition's tokens in the caches (one division per partition, not per row).
    int64_t rows[P];
    for (int64_t t = a, blk = a / block_size, off = a % block_size; t < b; ++t) {
      rows[t - a] = table[blk] * block_stride + off * token_stride + kvh * D;
      if (++off == block_size) { off = 0; ++blk; }
    }
    auto row = [&](const C* cache, int64_t t) { return cache + rows[t - a]; };
    auto prefetch = [&](int64_t t) {
      const char* pk = reinterpret_cast<const char*>(row(k_cache, t));
      const char* pv = reinterpret_cast<const char*>(row(v_cache, t));
      for (int64_t line = 0; line < kLines; ++line) {
        __builtin_prefetch(pk + 64 * line);
        __builtin_prefetch(pv + 64 * line);
      }
    };
    for (int64_t t = a; t < std::min(b, a + kAhead); ++t) prefetch(t);
    const float* q_seq = q + (seq * num_heads + kvh * group) * D;
    for (int64_t t0 = a; t0 < b; t0 += L) {
      for (int64_t t = t0 + kAhead; t < std::min(b, t0 + kAhead + L); ++t) prefetch(t);
      const C* k[L];
      for (int64_t i = 0; i < L; ++i) k[i] = row(k_cache, std::min(t0 + i, b - 1));
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = q_seq + g * D;
        Vec acc[L];
        const Vec q0 = Vec::load(qh);
        for (int64_t i = 0; i < L; ++i) acc[i] = q0 * Vec::load(k[i]);
        for (int j = 1; j < V; ++j) {
          const Vec qj = Vec::load(qh + L * j);
          for (int64_t i = 0; i < L; ++i) acc[i] = fma(qj, Vec::load(k[i] + L * j), acc[i]);
        }
        (tfs::sums(acc) * Vec::set1(scale)).store(scores + g * P + (t0 - a));
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      float* s = scores + g * P;
      if (softcap > 0)
        for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / softcap) * softcap;
      const float mx = tfs::row_max(s, n, padded);
      const float l = tfs::exp_sum(s, n, padded, mx);
      const bool alone = part_begin[seq + 1] - part_begin[seq] == 1;
      float* o = alone ? out + (seq * num_heads + h) * D : part_acc.get() + (part * num_heads + h) * D;
      const float inv = alone ? 1.f / l : 1.f;
      for (int j0 = 0; j0 < V; j0 += 8) {  // at most 8 vectors of values in registers at a time
        const int jn = std::min(V - j0, 8);
        Vec acc[8];
        for (int j = 0; j < jn; ++j) acc[j] = Vec::zero();
        for (int64_t t = a; t < b; ++t) {
          const C* v = row(v_cache, t) + L * j0;
          const Vec p = Vec::set1(s[t - a]);
          for (int j = 0; j < jn; ++j) acc[j] = fma(p, Vec::load(v + L * j), acc[j]);
        }
        for (int j = 0; j < jn; ++j) (acc[j] * Vec::set1(inv)).store(o + L * (j0 + j));
      }
      if (!alone) {
        part_m[part * num_heads + h] = mx;
        part_l[part * num_heads + h] = l;
      }
    }
  };

  // Items in order (partition, KV head), each claimed by whichever thread is free (tfs::parallel_claims).
  tfs::parallel_claims(num_parts * num_kv_heads, [&](auto& claim) {
    std::vector<float> scores(group * P);
    for (int64_t i = claim(); i >= 0; i = claim()) item(i / num_kv_heads, i % num_kv_heads, scores.data());
  });

  // Sequences of several partitions: their results merged in partition order.
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t p0 = part_begin[seq], p1 = part_begin[seq + 1];
    if (p1 - p0 < 2) continue;
    for (int64_t h = 0; h < num_heads; ++h)
      tfs::merge_partitions(part_m.get() + p0 * num_heads + h, part_l.get() + p0 * num_heads + h, num_heads,
                            part_acc.get() + (p0 * num_heads + h) * D, num_heads * D, p1 - p0, D,
                            out + (seq * num_heads + h) * D);
  }
}

// The vector kernel where it applies (float32 queries over float32 or bfloat16 caches, head_dim = Vec::N times 1,
// 2, 4, 8 or 16); false where not.
static bool decode_vec(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& bt, const torch::Tensor& cl, const int64_t* table_rows, torch::Tensor& out,
                       double scale, int64_t sliding_window, double softcap) {
  const auto cache = k_cache.scalar_type();
  if (q.scalar_type() != torch::kFloat32 || (cache != torch::kFloat32 && cache != torch::kBFloat16) ||
      v_cache.scalar_type() != cache)
    return false;
  auto run = [&](auto v) {
    tfs::with_cache_data(k_cache, v_cache, [&](const auto* k, const auto* vc) {
      decode_kernel_vec<decltype(v)::value>(
          q.data_ptr<float>(), k, vc, bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), table_rows, out.data_ptr<float>(),
          q.size(0), q.size(1), k_cache.size(2), k_cache.size(1), bt.size(1), static_cast<float>(scale), sliding_window,
          static_cast<float>(softcap));
    });
    return true;
  };
  const int64_t head_dim = q.size(2);
  if (head_dim % tfs::Vec::N) return false;
  switch (head_dim / tfs::Vec::N) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 8: return run(std::integral_constant<int, 8>{});
    case 16: return run(std::integral_constant<int, 16>{});
    default: return false;
  }
}

// Write a step's new keys and values into their cache slots. k, v: [num_tokens, num_kv_heads, head_dim];
// caches: [num_blocks, block_size, num_kv_heads, head_dim]; slots: [num_tokens] int64.
// Float32 keys and values go into bfloat16 caches rounded to the nearest (even on ties, as torch rounds).
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous());
  if (k.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(v.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kBFloat16);
    write_kv_(k.to(torch::kBFloat16), v.to(torch::kBFloat16), k_cache, v_cache, slots);
    return;
  }
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type());
  const int64_t num_tokens = k.size(0);
  const int64_t row_bytes = k.numel() / std::max<int64_t>(num_tokens, 1) * k.element_size();
  const int64_t num_slots = k_cache.numel() * k_cache.element_size() / row_bytes;
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of range");
    std::memcpy(kc + sp[t] * row_bytes, kp + t * row_bytes, row_bytes);
    std::memcpy(vc + sp[t] * row_bytes, vp + t * row_bytes, row_bytes);
  }
}

// q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64 -> [num_seqs, num_heads, head_dim].
// With new_k, new_v and slots, first writes the step's keys and values into the cache (write_kv_).
// With table_rows ([num_seqs] int64), query row i reads block_tables[table_rows[i]]: a prompt's rows, one query
// each, attend over their sequence's blocks up to their own context_lens, each as a decode of that row would.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double softcap, c10::optional<torch::Tensor> new_k,
                                     c10::optional<torch::Tensor> new_v, c10::optional<torch::Tensor> slots,
                                     c10::optional<torch::Tensor> table_rows) {
  if (new_k) write_kv_(*new_k, *new_v, k_cache, v_cache, *slots);
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64);
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  TORCH_CHECK(cl.numel() == q.size(0), "one context length per query row");
  torch::Tensor rows;
  const int64_t* rp = nullptr;
  if (table_rows) {
    rows = table_rows->contiguous();
    TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.numel() == q.size(0), "table_rows: int64, one per row");
    rp = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < bt.size(0), "table row out of range");
  } else {
    TORCH_CHECK(bt.size(0) == q.size(0), "one block table per query row");
  }
  auto out = torch::empty_like(q);
  if (decode_vec(q, k_cache, v_cache, bt, cl, rp, out, scale, sliding_window, softcap)) return out;
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "caches of another type than q: only float32 q over bfloat16 caches, head_dim = vec_width times 1, 2, 4, "
              "8 or 16");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), rp, out.data_ptr<scalar_t>(), q.size(0),
                            q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1), scale,
                            sliding_window, softcap);
  });
  return out;
}

#include "quant.h"
#include "shm.h"
#include "peak.h"

// One head's `x * cos + rotate_half(x) * sin`, every product rounded before the sum; `in` may be `out`.
static inline void rotate_half_row(const float* in, float* out, const float* ct, const float* st, int64_t half) {
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = in[d], x2 = in[d + half];
    const float a = x1 * ct[d], b = x2 * st[d];
    const float a2 = x2 * ct[d + half], b2 = x1 * st[d + half];
    out[d] = a - b;
    out[d + half] = a2 + b2;
  }
}

// In place, transformers' rotary embedding `x * cos + rotate_half(x) * sin` on float32 queries and keys,
// every product rounded before the sum (the extension is built with -ffp-contract=off), so the result is
// bit-identical to its separate ops. q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads,
// head_dim], cos and sin: [num_tokens, head_dim].
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous(), "q and k must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "float32 only");
  auto c = cos.contiguous();
  auto s = sin.contiguous();
  const int64_t num_tokens = q.size(0), head_dim = q.size(2), half = head_dim / 2;
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  for (auto* x : {&q, &k}) {
    float* xp = x->data_ptr<float>();
    const int64_t heads = x->size(1);
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = cp + t * head_dim;
        const float* st = sp + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          float* row = xp + (t * heads + h) * head_dim;
          rotate_half_row(row, row, ct, st, half);
        }
      }
    });
  }
}

// The packed query/key/value projection's output split into contiguous q, k and v, with the rotary
// embedding applied to q and k on the way (as rotary_embedding_ computes it, bit for bit): one pass instead of
// a split, three copies and the rotary op. qkv: float32 [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim].
std::vector<torch::Tensor> split_qkv_rotary(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads,
                                            torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32, "qkv: contiguous float32");
  auto c = cos.contiguous();
  auto s = sin.contiguous();
  const int64_t num_tokens = qkv.size(0), head_dim = c.size(-1), half = head_dim / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width");
  auto q = torch::empty({num_tokens, num_heads, head_dim}, qkv.options());
  auto k = torch::empty({num_tokens, num_kv_heads, head_dim}, qkv.options());
  auto v = torch::empty({num_tokens, num_kv_heads, head_dim}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + t * head_dim;
      const float* st = sp + t * head_dim;
      const float* row = src + t * width;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const float* in = row + h * head_dim;
        float* out = h < num_heads ? qp + (t * num_heads + h) * head_dim
                                   : kp + (t * num_kv_heads + h - num_heads) * head_dim;
        rotate_half_row(in, out, ct, st, half);
      }
      std::memcpy(vp + t * num_kv_heads * head_dim, row + (num_heads + num_kv_heads) * head_dim,
                  num_kv_heads * head_dim * sizeof(float));
    }
  });
  return {q, k, v};
}

// silu(gate) * up over the packed gate/up projection's output: x float32 [rows, 2 * width] -> [rows, width].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: contiguous float32");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto out = torch::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * 2 * width;
      const float* u = g + width;
      float* o = op + r * width;
      int64_t d = 0;
      for (; d + tfs::Vec::N <= width; d += tfs::Vec::N) {  // g / (1 + exp(-g)) * u, every op rounded as below
        const tfs::Vec gv = tfs::Vec::load(g + d);
        const tfs::Vec e = tfs::exp(tfs::Vec::zero() - max(gv, tfs::Vec::set1(-80.f)));  // exp(-g), g >= -80
        (gv / (tfs::Vec::set1(1.f) + e) * tfs::Vec::load(u + d)).store(o + d);
      }
      for (; d < width; ++d) o[d] = g[d] / (1.f + std::exp(-std::max(g[d], -80.f))) * u[d];
    }
  });
  return out;
}

// transformers' RMSNorm on float32 rows, bit-identical: the mean of squares is torch's own sum (same
// reduction order) divided by the width, then rsqrt as 1 / sqrt and two rounded products, as its separate
// ops compute them. With `residual`, first x += residual in place (the decoder's skip connection), so one
// call does the add and the norm. x: [num_tokens, hidden]; returns the normalised rows.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: contiguous float32 [rows, hidden]");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32, "weight: contiguous float32");
  const int64_t rows = x.size(0), hidden = x.size(1);
  float* xp = x.data_ptr<float>();
  auto squares = torch::empty_like(x);
  float* sq = squares.data_ptr<float>();
  const float* res = residual ? residual->data_ptr<float>() : nullptr;
  if (res) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual: like x");
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(hidden, 1));  // a prompt's rows in parallel
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin * hidden; i < end * hidden; ++i) {
      if (res) xp[i] = xp[i] + res[i];
      sq[i] = xp[i] * xp[i];
    }
  });
  const auto sums = squares.sum(-1);  // [rows]
  const float* sp = sums.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  auto out = torch::empty_like(x);
  float* op = out.data_ptr<float>();
  const float n = static_cast<float>(hidden), e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inv = 1.f / std::sqrt(sp[r] / n + e);
      const float* xr = xp + r * hidden;
      float* o = op + r * hidden;
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) o[d] = w[d] * (xr[d] * inv);
    }
  });
  return out;
}

// Constrained decoding: every token a row's grammar forbids goes to -inf, in place. bitmask [num_masks, words]
// int32, bit j of word w allowing token 32 w + j (llguidance's layout); mask i applies to logits row rows[i].
// Grammars mostly allow few tokens, so most words are 0: a fill, not 32 tests.
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.is_contiguous() && logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "logits: contiguous float32 [num_rows, vocab]");
  TORCH_CHECK(bitmask.is_contiguous() && bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32,
              "bitmask: contiguous int32 [num_masks, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong && rows.size(0) == bitmask.size(0),
              "rows: int64 [num_masks]");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_rows = logits.size(0);
  TORCH_CHECK(words * 32 >= vocab, "bitmask too short for the vocabulary");
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(row_index[i] >= 0 && row_index[i] < num_rows, "row out of range");
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  float* lp = logits.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + row_index[i] * vocab;
      const int32_t* mask = mp + i * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = static_cast<uint32_t>(mask[w]);
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        if (bits == 0) {
          std::fill(row + base, row + base + n, neg_inf);
          continue;
        }
        for (int64_t j = 0; j < n; ++j)
          if (!((bits >> j) & 1u)) row[base + j] = neg_inf;
      }
    }
  });
}

// A Llama-family decoder's layers over one decode step, in one call: per layer the RMSNorm (adding the last
// block's output), the stacked q/k/v projection split with the rotary embedding, the cache write and paged
// decode attention, the output projection, the second RMSNorm, the stacked gate/up projection, SiLU-and-mul and
// the down projection. The same kernels in the same order as the lean forward's Python loop (lean.py), so the
// same bits, without its nine Python calls a layer (at one sequence, a step of SmolLM2-135M is 270 of them).
struct StackLinear {
  torch::Tensor packed;
  int64_t qtype = 0;  // GGUF block type (quant_linear), 0: panels (linear)
  int64_t out_features = 0;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x, int64_t float_from) const {
    return qtype ? quant_linear(x, packed, qtype, out_features, bias, float_from, false)  // decode rows only
                 : linear(x, packed, out_features, bias);
  }
};

struct StackLayer {
  StackLinear qkv, o, gate_up, down;
  torch::Tensor norm1, norm2;
  double scaling;
  int64_t window;  // sliding window, -1: none
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, double eps)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps) {}

  // Each projection is (packed weight, GGUF type or 0, out_features, bias or None), as EngineLinear holds it.
  void add_layer(py::tuple qkv, py::tuple o, py::tuple gate_up, py::tuple down, torch::Tensor norm1,
                 torch::Tensor norm2, double scaling, int64_t window) {
    layers_.push_back({linear_of(qkv), linear_of(o), linear_of(gate_up), linear_of(down), norm1, norm2, scaling,
                       window});
  }

  // x: the step's embeddings [num_tokens, hidden], all decode tokens, added to in place. caches: each layer's
  // (keys, values). Returns (x, residual): the last layer's input stream and output, for the final norm.
  std::vector<torch::Tensor> forward(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& caches,
                                     torch::Tensor cos, torch::Tensor sin, torch::Tensor block_tables,
                                     torch::Tensor key_lens, torch::Tensor slot_mapping, int64_t float_from) const {
    TORCH_CHECK(!layers_.empty() && caches.size() == layers_.size(), "one (keys, values) pair per layer");
    const int64_t num_tokens = x.size(0);
    c10::optional<torch::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      auto h = rms_norm(x, l.norm1, eps_, residual);
      auto qkv = split_qkv_rotary(l.qkv(h, float_from), num_heads_, num_kv_heads_, cos, sin);
      auto o = paged_decode_attention(qkv[0], caches[i][0], caches[i][1], block_tables, key_lens, l.scaling, l.window,
                                      0.0, qkv[1], qkv[2], slot_mapping, c10::nullopt);
      residual = l.o(o.view({num_tokens, -1}), float_from);
      h = rms_norm(x, l.norm2, eps_, residual);
      residual = l.down(silu_and_mul(l.gate_up(h, float_from)), float_from);
    }
    return {x, *residual};
  }

 private:
  static StackLinear linear_of(const py::tuple& t) {
    TORCH_CHECK(t.size() == 4, "a projection is (packed, qtype, out_features, bias)");
    StackLinear l;
    l.packed = t[0].cast<torch::Tensor>();
    l.qtype = t[1].cast<int64_t>();
    l.out_features = t[2].cast<int64_t>();
    if (!t[3].is_none()) l.bias = t[3].cast<torch::Tensor>();
    return l;
  }

  int64_t num_heads_, num_kv_heads_;
  double eps_;
  std::vector<StackLayer> layers_;
};

// The sampler's fast top-p road (engine/sampler.py: _nucleus_candidates, then _sample_among) for every row in one
// call, to the bit: a row's tokens above `floor`, in token order; when their float32 mass (summed in that order, as
// index_add_ does) exceeds the row's top_p, they are sorted descending (stable: ties in token order), zeroed past
// the nucleus (float32 mass before a token, from a cumulative sum kept in double as torch's CPU cumsum keeps it,
// > top_p), and the token whose share of the float64 running sum holds u * total is the row's; else -1 (the
// caller's other roads). Some twenty torch ops a step, each slow on the caches a decode step has just flushed
// (0.6 ms at one sequence of SmolLM2, against 0.2 ms warm), become one.
torch::Tensor nucleus_sample(torch::Tensor probs, torch::Tensor top_p, torch::Tensor u, double floor) {
  TORCH_CHECK(probs.is_contiguous() && probs.dim() == 2 && probs.scalar_type() == torch::kFloat32,
              "probs: contiguous float32 [rows, vocab]");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == rows && top_p.scalar_type() == torch::kFloat32, "top_p: float32 [rows]");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kDouble, "u: float64 [rows]");
  const torch::Tensor top_p_c = top_p.contiguous(), u_c = u.contiguous();
  const float* pp = probs.data_ptr<float>();
  const float* tp = top_p_c.data_ptr<float>();
  const double* up = u_c.data_ptr<double>();
  torch::Tensor out = torch::empty({rows}, torch::kInt64);
  int64_t* op = out.data_ptr<int64_t>();
  const float fl = static_cast<float>(floor);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> cand;
    std::vector<double> cdf;
    for (int64_t r = begin; r < end; ++r) {
      const float* p = pp + r * vocab;
      cand.clear();
      float mass = 0.f;
      for (int64_t t = 0; t < vocab; ++t) {
        if (p[t] > fl) {
          cand.emplace_back(p[t], t);
          mass += p[t];
        }
      }
      if (!(mass > tp[r])) {
        op[r] = -1;
        continue;
      }
      std::stable_sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      const int64_t n = static_cast<int64_t>(cand.size());
      cdf.assign(n, 0.0);
      double before = 0.0, total = 0.0;  // the nucleus's cumulative sum (double, as cumsum) and the draw's
      for (int64_t i = 0; i < n; ++i) {
        const float v = cand[i].first;
        before += static_cast<double>(v);
        const float mass_before = static_cast<float>(before) - v;
        const float kept = mass_before > tp[r] ? 0.f : v;
        total += static_cast<double>(kept);
        cdf[i] = total;
      }
      const double point = up[r] * cdf[n - 1];
      int64_t i = std::upper_bound(cdf.begin(), cdf.end(), point) - cdf.begin();  // the first cdf > point
      op[r] = cand[std::min(i, n - 1)].second;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL: the server's event loop thread goes on while the engine thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.attr("isa") = tfs::kIsa;  // the vector path compiled: AVX-512, AVX2, NEON or scalar
#if TFS_BF16_DOT
  m.attr("bf16_dot") = true;  // bfloat16 panels can go through the CPU's bfloat16 dot products (linear.h)
#else
  m.attr("bf16_dot") = false;
#endif
  // the instructions that multiply each weight format (the banner and /metrics say it)
  const std::string fma = std::string(tfs::kIsa) + " float32 FMA";
  py::dict paths;
  paths["float32"] = fma;
  paths["float16"] = fma + " (widened)";
#if TFS_BF16_DOT
  paths["bfloat16"] = "AVX512-BF16 dot products";
#else
  paths["bfloat16"] = fma + " (widened)";
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  paths["int8"] = "AVX512-VNNI int8 dot products";
#elif defined(__AVXVNNI__)
  paths["int8"] = "AVX-VNNI int8 dot products";
#elif TFS_AVX2 || TFS_AVX512
  paths["int8"] = "AVX2 int8 multiply-adds";
#else
  paths["int8"] = std::string(tfs::kIsa) + " int8 (compiler-vectorised)";
#endif
  m.attr("matmul_paths") = paths;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  m.attr("vnni") = "AVX512-VNNI";  // the int8 dot products of the block kernels (quant_lanes.h); "" without
#elif defined(__AVXVNNI__)
  m.attr("vnni") = "AVX-VNNI";
#else
  m.attr("vnni") = "";
#endif
#if TFS_AMX
  m.attr("amx") = true;  // AMX tile code is in this build (amx.h); amx.py decides at run time whether it runs
  m.def("amx_probe", &tfs::amx_probe, "AMX tiles against float64 sums of the same bfloat16 products: the largest "
        "relative error (one thread; SIGILL without AMX or tile permission: run it in a child process)");
  m.def("amx_tile_config", [](int64_t tail) {  // what ldtilecfg loads for in_features of `tail` odd pairs (tests)
    const tfs::TileConfig cfg = tfs::amx_config(tail);
    return py::bytes(reinterpret_cast<const char*>(&cfg), sizeof(cfg));
  }, "The 64-byte AMX tile configuration the bfloat16 tiles load (no tile instruction runs)", py::arg("tail"));
#else
  m.attr("amx") = false;
#endif
  m.def("use_amx", [](bool on) {
#if TFS_AMX
    tfs::g_use_amx.store(on);
#endif
    return tfs::g_use_amx.load();
  }, "bfloat16 linear layers through AMX tiles from now on (after amx.py's checks); whether they are", py::arg("on"));
  m.def("amx_active", [] { return tfs::g_use_amx.load(); }, "Whether bfloat16 linear layers go through AMX tiles");
  m.def("unit_peak_gops", &tfs::unit_peak_gops, "GOP/s of a unit (float32, bfloat16 or int8) in registers on all of "
        "torch's threads over about `seconds` (peak.h); 0 where the build lacks it", nogil, py::arg("unit"),
        py::arg("seconds") = 0.3);
  m.attr("vec_width") = tfs::Vec::N;  // floats per vector: decode attention's vector path takes head_dim = N * 2^i <= 16 N
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", nogil, py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("new_k") = py::none(), py::arg("new_v") = py::none(),
        py::arg("slots") = py::none(), py::arg("table_rows") = py::none());
  m.def("paged_prompt_attention", &paged_prompt_attention,
        "Prompt rows of several sequences through tiles, each row the decode kernel's bits (CPU)", nogil, py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("key_lens"), py::arg("q_lens"),
        py::arg("scale"), py::arg("dot") = false);
  m.def("pack_linear_weight", &pack_linear_weight, "Repack a weight into panels of `dtype` for `linear` (CPU)", nogil,
        py::arg("weight"), py::arg("dtype") = py::none(), py::arg("dot") = false);
  m.def("linear", &linear, "x @ W.T + bias with a weight from pack_linear_weight (CPU)", nogil, py::arg("x"),
        py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("full_attention", &full_attention, "Attention without a mask over windows of rows, e.g. Whisper's encoder (CPU)",
        nogil, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("t_len"), py::arg("heads"), py::arg("scale"));
  m.def("repack_blocks", &repack_blocks, "GGUF blocks (Q4_0 .. Q8_0, Q2_K .. Q6_K) in the layout of quant_linear (CPU)",
        nogil, py::arg("blocks"), py::arg("qtype"));
  m.def("repack_block_parts", &repack_block_parts, "Several layers' GGUF blocks, stacked by output features, in the "
        "layout of quant_linear (CPU)", nogil, py::arg("parts"), py::arg("qtype"));
  m.def("quant_linear", &quant_linear, "x @ W.T + bias with W from repack_blocks (CPU)", nogil, py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("float_from") = -1, py::arg("dot") = false);
  m.def("dequantize_rows", &dequantize_rows, "Rows of a repacked weight as GGUF dequantizes them (CPU)", nogil,
        py::arg("packed"), py::arg("qtype"), py::arg("out_features"), py::arg("ids"));
  m.def("quantize_q8_0", &quantize_q8_0, "A float weight as GGUF Q8_0 blocks (CPU)", nogil);
  m.def("split_qkv_rotary", &split_qkv_rotary, "Split a packed q/k/v projection, rotary on q and k (CPU)", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a packed gate/up projection (CPU)", nogil);
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm, optionally after adding a residual in place (CPU)", nogil,
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("shm_all_reduce_", &shm_all_reduce_, "Sum over the ranks of one machine, in place (shared memory)", nogil);
  m.def("shm_all_gather", &shm_all_gather, "Every rank's rows side by side (shared memory)", nogil);
  m.def("write_kv_", &write_kv_, "Write new keys and values into their cache slots (CPU)", nogil);
  m.def("rotary_embedding_", &rotary_embedding_, "Rotary embedding in place, as transformers computes it (CPU)", nogil);
  // module-local: a process may load two builds of these kernels (this CPU's and the generic x86-64 one)
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local())
      .def(py::init<int64_t, int64_t, double>(), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, "A decode step through every layer (CPU)", nogil);
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "Forbidden tokens of constrained rows to -inf, in place (CPU)",
        nogil);
  m.def("nucleus_sample", &nucleus_sample, "The sampler's top-p road over each row's likeliest tokens (CPU)", nogil);
}
