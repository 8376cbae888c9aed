// CPU kernels of the engine, compiled on first use (kernels.py): paged decode attention, reading keys and
// values in place from the block cache through the block table (no gather, no padding); the KV-cache write;
// a linear kernel for steps of a few rows; and transformers' RMSNorm and rotary embedding, bit-identical.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

#include "vec.h"

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
                          const int64_t* block_tables, const int64_t* context_lens, scalar_t* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, double scale, int64_t sliding_window,
                          double softcap) {
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
      const int64_t* table = block_tables + seq * max_blocks;
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

// The rows of block `b` that a sequence attending to tokens [first, ctx) uses: [lo, hi) within the block.
static inline void block_rows(int64_t first, int64_t ctx, int64_t b, int64_t block_size, int64_t& lo, int64_t& hi) {
  lo = std::max(first, b * block_size) - b * block_size;
  hi = std::min(ctx, (b + 1) * block_size) - b * block_size;
}

// Where a thread's reads will be a few blocks from now: its sequences' blocks in the order it visits them.
// Each block's rows in use are one contiguous range of keys and one of values; the kernel asks for them a
// few lines at a time as it works, so that loads are in flight all the while without flooding the queues.
struct BlockCursor {
  const int64_t *block_tables, *context_lens;
  int64_t max_blocks, block_size, sliding_window, seq, seq_end, block = -1, last_block = -1;

  // Move to the next block; false past the thread's last sequence. Sets the block's row range.
  bool next(int64_t& lo, int64_t& hi, int64_t& block_id) {
    while (block >= last_block) {
      if (block >= 0) ++seq;
      if (seq >= seq_end) return false;
      const int64_t ctx = context_lens[seq];
      const int64_t first = window_start(ctx, sliding_window);
      block = first / block_size - 1;
      last_block = (ctx - 1) / block_size;
      if (block >= last_block) { block = last_block; continue; }  // (an empty sequence)
    }
    ++block;
    const int64_t ctx = context_lens[seq];
    block_rows(window_start(ctx, sliding_window), ctx, block, block_size, lo, hi);
    block_id = block_tables[seq * max_blocks + block];
    return true;
  }
};

// The float32 kernel in vector registers (vec.h: AVX-512, AVX2, NEON), one pass over the context with an
// online softmax (flash-decoding): per chunk of up to Vec::N tokens, a vector of scores per head, a running
// max and sum, values accumulated in registers. Each key and value row is loaded once and used by every query
// head of its KV head. V = head_dim / Vec::N.
template <int V>
static void decode_kernel_vec(const float* q, const float* k_cache, const float* v_cache,
                              const int64_t* block_tables, const int64_t* context_lens, float* out,
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                              int64_t max_blocks, float scale, int64_t sliding_window, float softcap) {
  using tfs::Vec;
  constexpr int64_t L = Vec::N;  // tokens per chunk
  constexpr int64_t D = V * L;
  constexpr int64_t kAhead = 2;  // blocks between the one computed and the one asked for
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  // Split the sequences into one contiguous run per thread with about equal context each.
  const int64_t threads = at::get_num_threads();
  const int64_t num_threads = std::min(threads, num_seqs);
  std::vector<int64_t> bounds{0};
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += context_lens[s];
  int64_t running = 0;
  for (int64_t s = 0; s < num_seqs && static_cast<int64_t>(bounds.size()) < num_threads; ++s) {
    running += context_lens[s];
    if (running * num_threads >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(s + 1);
  }
  while (static_cast<int64_t>(bounds.size()) <= num_threads) bounds.push_back(num_seqs);
  bounds.back() = num_seqs;
  // Sequences [seq_begin, seq_end), KV heads [kv_begin, kv_end) of each (and their query heads).
  auto run = [&](int64_t seq_begin, int64_t seq_end, int64_t kv_begin, int64_t kv_end) {
    std::vector<float> scores(group * L), acc_buf(num_heads * D), m(num_heads), l(num_heads);
    // prefetched a row at a time, all its KV heads: where a thread has only some, the hardware's stride
    // prefetcher follows its part of each row
    const bool prefetch = kv_begin == 0 && kv_end == num_kv_heads;
    BlockCursor cursor{block_tables, context_lens, max_blocks, block_size, sliding_window, seq_begin,
                       prefetch ? seq_end : seq_begin};
    // The prefetch stream: [pf_k, pf_k + pf_bytes) of keys and the same range of values.
    const char *pf_k = nullptr, *pf_v = nullptr;
    int64_t pf_bytes = 0;
    auto refill = [&] {
      int64_t lo, hi, id;
      if (!cursor.next(lo, hi, id)) { pf_bytes = 0; return; }
      pf_k = reinterpret_cast<const char*>(k_cache + id * block_stride + lo * token_stride);
      pf_v = reinterpret_cast<const char*>(v_cache + id * block_stride + lo * token_stride);
      pf_bytes = (hi - lo) * token_stride * static_cast<int64_t>(sizeof(float));
    };
    auto prefetch_lines = [&](int64_t lines) {
      for (; lines > 0 && pf_bytes > 0; --lines, pf_bytes -= 64, pf_k += 64, pf_v += 64) {
        __builtin_prefetch(pf_k);
        __builtin_prefetch(pf_v);
      }
    };
    for (int64_t i = 0; i < kAhead; ++i) { refill(); prefetch_lines(1 << 30); }
    refill();
    const int64_t lines_per_row = (token_stride * static_cast<int64_t>(sizeof(float)) + 63) / 64;

    for (int64_t seq = seq_begin; seq < seq_end; ++seq) {
      const int64_t ctx = context_lens[seq];
      const int64_t first = window_start(ctx, sliding_window);
      const int64_t* table = block_tables + seq * max_blocks;
      const float* q_seq = q + seq * num_heads * D;
      std::fill(acc_buf.begin(), acc_buf.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t last_block = (ctx - 1) / block_size;
      for (int64_t b = first / block_size; b <= last_block; ++b) {
        int64_t block_lo, block_hi;
        block_rows(first, ctx, b, block_size, block_lo, block_hi);
        const float* kb = k_cache + table[b] * block_stride;
        const float* vb = v_cache + table[b] * block_stride;
        for (int64_t lo = block_lo; lo < block_hi; lo += L) {
          const int64_t hi = std::min(block_hi, lo + L);
          for (int64_t kvh = kv_begin; kvh < kv_end; ++kvh) {
            const int64_t h0 = kvh * group;
            // scores[g * L + i]: query head h0 + g against token lo + i; lanes past `hi` stay -inf
            for (int64_t g = 0; g < group; ++g)
              std::fill(scores.begin() + g * L + (hi - lo), scores.begin() + (g + 1) * L,
                        -std::numeric_limits<float>::infinity());
            for (int64_t i = lo; i < hi; ++i) {
              if (prefetch && kvh == 0) {  // one row's worth per row computed keeps the stream kAhead blocks ahead
                if (pf_bytes <= 0) refill();
                prefetch_lines(lines_per_row);
              }
              const float* k = kb + i * token_stride + kvh * D;
              Vec kv[V];
              for (int j = 0; j < V; ++j) kv[j] = Vec::load(k + L * j);
              for (int64_t g = 0; g < group; ++g) {
                const float* qh = q_seq + (h0 + g) * D;
                Vec s = Vec::load(qh) * kv[0];
                for (int j = 1; j < V; ++j) s = fma(Vec::load(qh + L * j), kv[j], s);
                float x = s.sum() * scale;
                if (softcap > 0) x = std::tanh(x / softcap) * softcap;
                scores[g * L + (i - lo)] = x;
              }
            }
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = h0 + g;
              float* pg = scores.data() + g * L;
              const Vec sc = Vec::load(pg);
              const float mx = std::max(m[h], sc.max());
              const float alpha = std::exp(m[h] - mx);  // 0 on the first chunk (m = -inf)
              tfs::exp(sc - Vec::set1(mx)).store(pg);
              std::fill(pg + (hi - lo), pg + L, 0.f);
              l[h] = l[h] * alpha + Vec::load(pg).sum();
              m[h] = mx;
              float* a = acc_buf.data() + h * D;
              Vec av[V];
              const Vec al = Vec::set1(alpha);
              for (int j = 0; j < V; ++j) av[j] = Vec::load(a + L * j) * al;
              for (int64_t i = lo; i < hi; ++i) {
                const float* v = vb + i * token_stride + kvh * D;
                const Vec pi = Vec::set1(pg[i - lo]);
                for (int j = 0; j < V; ++j) av[j] = fma(pi, Vec::load(v + L * j), av[j]);
              }
              for (int j = 0; j < V; ++j) av[j].store(a + L * j);
            }
          }
        }
      }
      float* o = out + seq * num_heads * D;
      for (int64_t h = kv_begin * group; h < kv_end * group; ++h) {
        const Vec inv = Vec::set1(1.f / l[h]);
        for (int j = 0; j < V; ++j) (Vec::load(acc_buf.data() + h * D + L * j) * inv).store(o + h * D + L * j);
      }
    }
  };
  // Fewer sequences than threads (one stream): each sequence's KV heads are shared out among threads as well.
  // Every head is computed the same way whoever computes it, so a sequence's result never depends on that.
  const int64_t kv_parts = num_seqs < threads ? std::min(num_kv_heads, threads / num_seqs) : 1;
  if (kv_parts == 1) {
    at::parallel_for(0, num_threads, 1, [&](int64_t first_part, int64_t last_part) {
      run(bounds[first_part], bounds[last_part], 0, num_kv_heads);
    });
    return;
  }
  at::parallel_for(0, num_seqs * kv_parts, 1, [&](int64_t first_item, int64_t last_item) {
    for (int64_t item = first_item; item < last_item; ++item) {
      const int64_t seq = item / kv_parts, part = item % kv_parts;
      run(seq, seq + 1, part * num_kv_heads / kv_parts, (part + 1) * num_kv_heads / kv_parts);
    }
  });
}

// The vector kernel where it applies (float32, head_dim = Vec::N times 1, 2, 4, 8 or 16); false where not.
static bool decode_vec(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& bt, const torch::Tensor& cl, torch::Tensor& out, double scale,
                       int64_t sliding_window, double softcap) {
  if (q.scalar_type() != torch::kFloat32 || k_cache.scalar_type() != torch::kFloat32) return false;
  auto run = [&](auto v) {
    decode_kernel_vec<decltype(v)::value>(
        q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt.data_ptr<int64_t>(),
        cl.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1), k_cache.size(2), k_cache.size(1),
        bt.size(1), static_cast<float>(scale), sliding_window, static_cast<float>(softcap));
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
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous());
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
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double softcap, c10::optional<torch::Tensor> new_k,
                                     c10::optional<torch::Tensor> new_v, c10::optional<torch::Tensor> slots) {
  if (new_k) write_kv_(*new_k, *new_v, k_cache, v_cache, *slots);
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64);
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  auto out = torch::empty_like(q);
  if (decode_vec(q, k_cache, v_cache, bt, cl, out, scale, sliding_window, softcap)) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
                            q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1), scale,
                            sliding_window, softcap);
  });
  return out;
}

#include "linear.h"
#include "quant.h"
#include "shm.h"

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
      for (; d + tfs::Vec::N <= width; d += tfs::Vec::N) {  // g / (1 + exp(-g)) * u
        const tfs::Vec gv = tfs::Vec::load(g + d);
        alignas(64) float e[tfs::Vec::N], gs[tfs::Vec::N];
        tfs::exp(tfs::Vec::zero() - max(gv, tfs::Vec::set1(-80.f))).store(e);  // exp(-g), g >= -80 (below, silu is ~0)
        gv.store(gs);
        for (int i = 0; i < tfs::Vec::N; ++i) o[d + i] = gs[i] / (1.f + e[i]) * u[d + i];
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
  for (int64_t i = 0; i < rows * hidden; ++i) {
    if (res) xp[i] = xp[i] + res[i];
    sq[i] = xp[i] * xp[i];
  }
  const auto sums = squares.sum(-1);  // [rows]
  const float* sp = sums.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  auto out = torch::empty_like(x);
  float* op = out.data_ptr<float>();
  const float n = static_cast<float>(hidden), e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / std::sqrt(sp[r] / n + e);
    const float* xr = xp + r * hidden;
    float* o = op + r * hidden;
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) o[d] = w[d] * (xr[d] * inv);
  }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL: the server's event loop thread goes on while the engine thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.attr("isa") = tfs::kIsa;  // the vector path compiled: AVX-512, AVX2, NEON or scalar
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", nogil, py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap"), py::arg("new_k") = py::none(), py::arg("new_v") = py::none(),
        py::arg("slots") = py::none());
  m.def("pack_linear_weight", &pack_linear_weight, "Repack a weight into panels of `dtype` for `linear` (CPU)", nogil,
        py::arg("weight"), py::arg("dtype") = py::none());
  m.def("linear", &linear, "x @ W.T + bias with a weight from pack_linear_weight (CPU)", nogil, py::arg("x"),
        py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("repack_blocks", &repack_blocks, "GGUF blocks (Q4_0, Q4_1, Q8_0) in the layout of quant_linear (CPU)", nogil);
  m.def("quant_linear", &quant_linear, "x @ W.T + bias with W from repack_blocks (CPU)", nogil, py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("float_from") = -1);
  m.def("quantize_q8_0", &quantize_q8_0, "A float weight as GGUF Q8_0 blocks (CPU)", nogil);
  m.def("split_qkv_rotary", &split_qkv_rotary, "Split a packed q/k/v projection, rotary on q and k (CPU)", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a packed gate/up projection (CPU)", nogil);
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm, optionally after adding a residual in place (CPU)", nogil,
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("shm_all_reduce_", &shm_all_reduce_, "Sum over the ranks of one machine, in place (shared memory)", nogil);
  m.def("shm_all_gather", &shm_all_gather, "Every rank's rows side by side (shared memory)", nogil);
  m.def("write_kv_", &write_kv_, "Write new keys and values into their cache slots (CPU)", nogil);
  m.def("rotary_embedding_", &rotary_embedding_, "Rotary embedding in place, as transformers computes it (CPU)", nogil);
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "Forbidden tokens of constrained rows to -inf, in place (CPU)",
        nogil);
}
