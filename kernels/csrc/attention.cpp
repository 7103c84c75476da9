// Causal attention of each sequence's new tokens over its paged context, read in place through the
// block table: nothing is padded, and each (sequence, KV head) is one task for the thread pool.
// Semantics (kernels.reference.paged_attention), for each sequence b in `seqs`, head h and new
// token i (at position seq_len - q_len + i):
//   out[t, h] = softmax(q[t, h] . K[b, :pos + 1, h / group] * scale) @ V[b, :pos + 1, h / group]
// q [T, H, D] and out [T, H, D] with unit stride on D; caches [num_blocks, block_size, Hkv, D]
// contiguous; block_tables [B, max_blocks] int32; seq_lens [B] int32 (new tokens included);
// query_start [B + 1] int32; seqs [n] int64. Accumulation is in fp32 whatever the input dtype.
//
// The keys and values of a task are first converted into float buffers [context, D] (one contiguous
// vector conversion per cached row), then each query row takes vector dot products, a softmax and
// a weighted sum. Work is O(q_len * context * D) in vector loops, which is why long prefills take
// the matmul path in Python (kernels.tuning.COMPILED_PREFILL_MAX_WORK).
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_avx512.h"
#include "convert.h"
#include "exp.h"
#include "cpu_ops.h"

namespace {

using cpu_ops::to_float;
using cpu_ops::from_float;

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_row_stride, q_head_stride, out_row_stride, out_head_stride;
  int64_t block_stride, token_stride, kv_head_stride;
};

// Keys and values of one (sequence, KV head) as floats, row-major [ctx, D].
template <typename T>
void gather_context(const T* k_cache, const T* v_cache, const int32_t* table, int64_t kv_head, int64_t ctx,
                    const Layout& l, float* keys, float* values) {
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const int64_t offset = table[pos / l.block_size] * l.block_stride + (pos % l.block_size) * l.token_stride +
                           kv_head * l.kv_head_stride;
    to_float(k_cache + offset, keys + pos * l.head_dim, l.head_dim);
    to_float(v_cache + offset, values + pos * l.head_dim, l.head_dim);
  }
}

template <int64_t D>
inline float dot(const float* a, const float* b, int64_t head_dim) {
  float total = 0.f;
  const int64_t n = D > 0 ? D : head_dim;  // D > 0: the size is known at compile time (unrolled)
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < n; ++d) total += a[d] * b[d];
  return total;
}

// One query row (already scaled) over keys [0, num_keys): writes the normalised output into `acc`.
template <int64_t D>
void attend_one(const float* query, const float* keys, const float* values, int64_t num_keys, int64_t head_dim,
                float* scores, float* acc) {
  const int64_t n = D > 0 ? D : head_dim;
  float max_score = -3.4e38f;
  for (int64_t j = 0; j < num_keys; ++j) {
    scores[j] = dot<D>(query, keys + j * n, n);
    max_score = scores[j] > max_score ? scores[j] : max_score;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < num_keys; ++j) {
    scores[j] = cpu_ops::vector_exp(scores[j] - max_score);
    total += scores[j];
  }
  const float inv_total = 1.f / total;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] = 0.f;
  for (int64_t j = 0; j < num_keys; ++j) {
    const float weight = scores[j] * inv_total;
    const float* value_row = values + j * n;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) acc[d] += weight * value_row[d];
  }
}

template <typename T, int64_t D>
void attention_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                      const torch::Tensor& query_start, const torch::Tensor& seqs, double scale, torch::Tensor& out) {
  Layout l;
  l.num_heads = q.size(1);
  l.head_dim = q.size(2);
  l.block_size = k_cache.size(1);
  l.num_kv_heads = k_cache.size(2);
  l.group = l.num_heads / l.num_kv_heads;
  l.max_blocks = block_tables.size(1);
  l.q_row_stride = q.stride(0);
  l.q_head_stride = q.stride(1);
  l.out_row_stride = out.stride(0);
  l.out_head_stride = out.stride(1);
  l.block_stride = k_cache.stride(0);
  l.token_stride = k_cache.stride(1);
  l.kv_head_stride = k_cache.stride(2);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int64_t* seq_ptr = seqs.data_ptr<int64_t>();
  const int64_t num_tasks = seqs.size(0) * l.num_kv_heads;
  const float fscale = static_cast<float>(scale);
#if defined(__AVX512F__)
  if constexpr (cpu_ops::kHasAvx512Attention<T> && (D == 64 || D == 128)) {
    at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<const T*> q_rows(l.group);
      std::vector<T*> out_rows(l.group);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = seq_ptr[task / l.num_kv_heads], kv_head = task % l.num_kv_heads;
        const int64_t ctx = lens[seq], first_token = starts[seq], q_len = starts[seq + 1] - first_token;
        const cpu_ops::CacheView cache{tables + seq * l.max_blocks, l.block_size, l.block_stride, l.token_stride};
        if (task + 1 < end) {  // the next task's first key block, fetched while this task runs
          const int64_t next_seq = seq_ptr[(task + 1) / l.num_kv_heads], next_head = (task + 1) % l.num_kv_heads;
          cpu_ops::prefetch_block(k_ptr + next_head * l.kv_head_stride + tables[next_seq * l.max_blocks] * l.block_stride,
                                  std::min<int64_t>(l.block_size, lens[next_seq]), l.token_stride,
                                  l.head_dim * static_cast<int64_t>(sizeof(T)));
        }
        scores.resize(4 * ctx);
        for (int64_t i = 0; i < q_len; ++i) {
          const int64_t token = first_token + i;
          for (int64_t g = 0; g < l.group; ++g) {
            const int64_t head = kv_head * l.group + g;
            q_rows[g] = q_ptr + token * l.q_row_stride + head * l.q_head_stride;
            out_rows[g] = out_ptr + token * l.out_row_stride + head * l.out_head_stride;
          }
          cpu_ops::attend_group<T, D / 16>(q_rows.data(), out_rows.data(), l.group, fscale,
                                           k_ptr + kv_head * l.kv_head_stride, v_ptr + kv_head * l.kv_head_stride,
                                           cache, ctx - q_len + i + 1, scores.data());
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys, values, scores, query(l.head_dim), acc(l.head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = seq_ptr[task / l.num_kv_heads], kv_head = task % l.num_kv_heads;
      const int64_t ctx = lens[seq], first_token = starts[seq], q_len = starts[seq + 1] - first_token;
      keys.resize(ctx * l.head_dim);
      values.resize(ctx * l.head_dim);
      scores.resize(ctx);
      gather_context(k_ptr, v_ptr, tables + seq * l.max_blocks, kv_head, ctx, l, keys.data(), values.data());
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t token = first_token + i, num_keys = ctx - q_len + i + 1;
        for (int64_t g = 0; g < l.group; ++g) {
          const int64_t head = kv_head * l.group + g;
          to_float(q_ptr + token * l.q_row_stride + head * l.q_head_stride, query.data(), l.head_dim);
#pragma omp simd
          for (int64_t d = 0; d < l.head_dim; ++d) query[d] *= fscale;
          attend_one<D>(query.data(), keys.data(), values.data(), num_keys, l.head_dim, scores.data(), acc.data());
          from_float(acc.data(), out_ptr + token * l.out_row_stride + head * l.out_head_stride, l.head_dim);
        }
      }
    }
  });
}

}  // namespace

void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start, torch::Tensor seqs, double scale,
                     torch::Tensor out) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, caches and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && seqs.scalar_type() == at::kLong,
              "block_tables, seq_lens, query_start are int32 and seqs int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start.is_contiguous() &&
                  seqs.is_contiguous(), "index tensors must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    // Common head sizes get a kernel unrolled for them; others the generic one (D = 0).
    if (q.size(2) == 64) {
      attention_kernel<scalar_t, 64>(q, k_cache, v_cache, block_tables, seq_lens, query_start, seqs, scale, out);
    } else if (q.size(2) == 128) {
      attention_kernel<scalar_t, 128>(q, k_cache, v_cache, block_tables, seq_lens, query_start, seqs, scale, out);
    } else {
      attention_kernel<scalar_t, 0>(q, k_cache, v_cache, block_tables, seq_lens, query_start, seqs, scale, out);
    }
  });
}
