// Causal attention of each sequence's new tokens over its paged context, read in place through the
// block table: nothing is padded, and each (sequence, KV head) is one task of the bindings' thread pool.
// Semantics (kernels.reference.paged_attention), for each sequence b in `seqs`, head h and new
// token i (at position seq_len - q_len + i):
//   out[t, h] = softmax(cap(q[t, h] . K[b, first:pos + 1, h / group] * scale)) @ V[b, first:pos + 1, h / group]
// with first = 0, or pos + 1 - window for a sliding window (Mistral, Gemma, ...), and cap(s) = s, or
// softcap * tanh(s / softcap) with a soft cap (Gemma 2). Accumulation is in fp32 whatever the input dtype.
//
// Portable form: the keys and values of a task are first converted into float buffers [context, D]
// (one contiguous vector conversion per cached row), then each query row takes vector dot products,
// a softmax and a weighted sum. Work is O(q_len * context * D) in vector loops, which is why long
// prefills take the matmul path in Python (kernels.tuning.COMPILED_PREFILL_MAX_WORK). The AVX-512
// forms have a register-blocked kernel for head sizes 64 and 128 (attention_avx512.h), which reads only
// a window's keys and caps the scores where asked.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_avx512.h"
#include "convert.h"
#include "exp.h"
#include "ops.h"

namespace cpu_ops {
namespace {

// Strides of the contiguous caches [blocks, block_size, Hkv, D].
struct Layout {
  int64_t group, block_stride, token_stride, kv_head_stride;

  explicit Layout(const AttentionArgs& a)
      : group(a.num_heads / a.num_kv_heads),
        block_stride(a.block_size * a.num_kv_heads * a.head_dim),
        token_stride(a.num_kv_heads * a.head_dim),
        kv_head_stride(a.head_dim) {}
};

// Keys and values of positions [first, ctx) of one (sequence, KV head) as floats, row-major [ctx - first, D].
template <typename T>
void gather_context(const T* k_cache, const T* v_cache, const int32_t* table, int64_t kv_head, int64_t first,
                    int64_t ctx, const AttentionArgs& a, const Layout& l, float* keys, float* values) {
  for (int64_t pos = first; pos < ctx; ++pos) {
    const int64_t offset = table[pos / a.block_size] * l.block_stride + (pos % a.block_size) * l.token_stride +
                           kv_head * l.kv_head_stride;
    to_float(k_cache + offset, keys + (pos - first) * a.head_dim, a.head_dim);
    to_float(v_cache + offset, values + (pos - first) * a.head_dim, a.head_dim);
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
// `softcap` > 0: each score s becomes softcap * tanh(s / softcap).
template <int64_t D>
void attend_one(const float* query, const float* keys, const float* values, int64_t num_keys, int64_t head_dim,
                float softcap, float* scores, float* acc) {
  const int64_t n = D > 0 ? D : head_dim;
  float max_score = -3.4e38f;
  for (int64_t j = 0; j < num_keys; ++j) {
    scores[j] = dot<D>(query, keys + j * n, n);
    if (softcap > 0.f) scores[j] = softcap * std::tanh(scores[j] / softcap);
    max_score = scores[j] > max_score ? scores[j] : max_score;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < num_keys; ++j) {
    scores[j] = vector_exp(scores[j] - max_score);
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

#if defined(__AVX512F__)
// The register-blocked form for head sizes 64 and 128 (fp32 and bf16).
template <typename T, int64_t D>
void attend_tasks_avx512(const AttentionArgs& a, const Layout& l, int64_t begin, int64_t end) {
  const T* q = static_cast<const T*>(a.q);
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  T* out = static_cast<T*>(a.out);
  std::vector<float> scores;
  std::vector<const T*> q_rows(l.group);
  std::vector<T*> out_rows(l.group);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = a.seqs[task / a.num_kv_heads], kv_head = task % a.num_kv_heads;
    const int64_t ctx = a.seq_lens[seq], first_token = a.query_start[seq], q_len = a.query_start[seq + 1] - first_token;
    CacheView cache{a.block_tables + seq * a.max_blocks, a.block_size, l.block_stride, l.token_stride};
    if (task + 1 < end) {  // the next task's first key block, fetched while this task runs
      const int64_t next_seq = a.seqs[(task + 1) / a.num_kv_heads], next_head = (task + 1) % a.num_kv_heads;
      prefetch_block(k_cache + next_head * l.kv_head_stride + a.block_tables[next_seq * a.max_blocks] * l.block_stride,
                     std::min<int64_t>(a.block_size, a.seq_lens[next_seq]), l.token_stride,
                     a.head_dim * static_cast<int64_t>(sizeof(T)));
    }
    scores.resize(4 * ctx);
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t token = first_token + i;
      for (int64_t g = 0; g < l.group; ++g) {
        const int64_t head = kv_head * l.group + g;
        q_rows[g] = q + token * a.q_row_stride + head * a.q_head_stride;
        out_rows[g] = out + token * a.out_row_stride + head * a.out_head_stride;
      }
      const int64_t end = ctx - q_len + i + 1;  // keys [cache.first, end): all, or the window's
      cache.first = a.window > 0 ? std::max<int64_t>(0, end - a.window) : 0;
      attend_group<T, D / 16>(q_rows.data(), out_rows.data(), l.group, a.scale, a.softcap,
                              k_cache + kv_head * l.kv_head_stride,
                              v_cache + kv_head * l.kv_head_stride, cache, end - cache.first, scores.data());
    }
  }
}
#endif

template <typename T, int64_t D>
void attend_tasks_portable(const AttentionArgs& a, const Layout& l, int64_t begin, int64_t end) {
  const T* q = static_cast<const T*>(a.q);
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  T* out = static_cast<T*>(a.out);
  std::vector<float> keys, values, scores, query(a.head_dim), acc(a.head_dim);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = a.seqs[task / a.num_kv_heads], kv_head = task % a.num_kv_heads;
    const int64_t ctx = a.seq_lens[seq], first_token = a.query_start[seq], q_len = a.query_start[seq + 1] - first_token;
    // The first key any new token sees (blocks before it may have been freed and reused).
    const int64_t first = a.window > 0 ? std::max<int64_t>(0, ctx - q_len + 1 - a.window) : 0;
    keys.resize((ctx - first) * a.head_dim);
    values.resize((ctx - first) * a.head_dim);
    scores.resize(ctx - first);
    gather_context(k_cache, v_cache, a.block_tables + seq * a.max_blocks, kv_head, first, ctx, a, l, keys.data(),
                   values.data());
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t token = first_token + i, end = ctx - q_len + i + 1;  // keys [start, end) in the window
      const int64_t start = a.window > 0 ? std::max<int64_t>(first, end - a.window) : 0;
      for (int64_t g = 0; g < l.group; ++g) {
        const int64_t head = kv_head * l.group + g;
        to_float(q + token * a.q_row_stride + head * a.q_head_stride, query.data(), a.head_dim);
#pragma omp simd
        for (int64_t d = 0; d < a.head_dim; ++d) query[d] *= a.scale;
        attend_one<D>(query.data(), keys.data() + (start - first) * a.head_dim,
                      values.data() + (start - first) * a.head_dim, end - start, a.head_dim, a.softcap, scores.data(),
                      acc.data());
        from_float(acc.data(), out + token * a.out_row_stride + head * a.out_head_stride, a.head_dim);
      }
    }
  }
}

template <typename T, int64_t D>
void attend_tasks(const AttentionArgs& a, int64_t begin, int64_t end) {
  const Layout layout(a);
#if defined(__AVX512F__)
  if constexpr (kHasAvx512Attention<T> && (D == 64 || D == 128)) {
    attend_tasks_avx512<T, D>(a, layout, begin, end);
    return;
  }
#endif
  attend_tasks_portable<T, D>(a, layout, begin, end);
}

}  // namespace

bool attention_has_vector_form() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void paged_attention(const AttentionArgs& a, int64_t begin, int64_t end) {
  dispatch_dtype(a.dtype, [&]<typename T>() {
    // Common head sizes get a kernel unrolled for them; others the generic one (D = 0).
    if (a.head_dim == 64) {
      attend_tasks<T, 64>(a, begin, end);
    } else if (a.head_dim == 128) {
      attend_tasks<T, 128>(a, begin, end);
    } else {
      attend_tasks<T, 0>(a, begin, end);
    }
  });
}

}  // namespace cpu_ops
