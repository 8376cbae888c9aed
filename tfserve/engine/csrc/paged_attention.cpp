// Paged decode attention on CPU: one query token per sequence, keys and values read in place from the
// block cache through the block table (no gather, no padding). Grouped-query heads share each key read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

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
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
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

// q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64 -> [num_seqs, num_heads, head_dim]
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64);
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
                            q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1), scale,
                            sliding_window, softcap);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
