// Causal attention of each sequence's new tokens over its paged context, read in place through the
// block table: nothing is padded, and each (sequence, KV head) is one task of the bindings' thread pool,
// or, for a decode token with many keys and threads to spare, several: one per chunk of its keys, each
// with its chunk's maximum score and sum of exponentials, merged by `attention_combine` (split-K).
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

// One query row (already scaled) over keys [0, num_keys): writes the normalised output into `acc`, or,
// where `partial` is not null, the unnormalised output into `acc` and the scores' maximum and sum of
// exponentials into partial[0] and partial[1]. `softcap` > 0: each score s becomes softcap * tanh(s / softcap).
template <int64_t D>
void attend_one(const float* query, const float* keys, const float* values, int64_t num_keys, int64_t head_dim,
                float softcap, float* scores, float* acc, float* partial) {
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
  const float inv_total = partial != nullptr ? 1.f : 1.f / total;
  if (partial != nullptr) partial[0] = max_score, partial[1] = total;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] = 0.f;
  for (int64_t j = 0; j < num_keys; ++j) {
    const float weight = scores[j] * inv_total;
    const float* value_row = values + j * n;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) acc[d] += weight * value_row[d];
  }
}

// One task of AttentionArgs::tasks, and the keys [first, end) its new token i reads: its causal
// prefix, narrowed by a sliding window and by the task's chunk of keys.
struct Task {
  int64_t seq, kv_head, key_begin, key_end, partial;
  int64_t ctx, first_token, q_len;

  Task(const AttentionArgs& a, int64_t index) {
    const int64_t* t = a.tasks + 5 * index;
    seq = t[0], kv_head = t[1], key_begin = t[2], key_end = t[3], partial = t[4];
    ctx = a.seq_lens[seq], first_token = a.query_start[seq], q_len = a.query_start[seq + 1] - first_token;
  }

  int64_t end(int64_t i) const { return std::min(ctx - q_len + i + 1, key_end); }

  int64_t first(const AttentionArgs& a, int64_t i) const {
    const int64_t causal_end = ctx - q_len + i + 1;
    return std::max(a.window > 0 ? std::max<int64_t>(0, causal_end - a.window) : 0, key_begin);
  }

  // The partial results of the task's heads (slot `partial`), or null: it writes `out`.
  float* partials(const AttentionArgs& a, int64_t group) const {
    return partial < 0 ? nullptr : a.partials + partial * group * (a.head_dim + 2);
  }
};

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
  for (int64_t index = begin; index < end; ++index) {
    const Task task(a, index);
    CacheView cache{a.block_tables + task.seq * a.max_blocks, a.block_size, l.block_stride, l.token_stride};
    if (index + 1 < end) {  // the next task's first key block, fetched while this task runs
      const Task next(a, index + 1);
      const int64_t next_first = next.first(a, 0);
      prefetch_block(k_cache + next.kv_head * l.kv_head_stride +
                         a.block_tables[next.seq * a.max_blocks + next_first / a.block_size] * l.block_stride,
                     std::clamp<int64_t>(next.end(0) - next_first, 0, a.block_size),
                     l.token_stride, a.head_dim * static_cast<int64_t>(sizeof(T)));
    }
    scores.resize(4 * task.ctx);
    for (int64_t i = 0; i < task.q_len; ++i) {
      const int64_t token = task.first_token + i;
      for (int64_t g = 0; g < l.group; ++g) {
        const int64_t head = task.kv_head * l.group + g;
        q_rows[g] = q + token * a.q_row_stride + head * a.q_head_stride;
        out_rows[g] = out + token * a.out_row_stride + head * a.out_head_stride;
      }
      cache.first = task.first(a, i);  // keys [cache.first, end): all, the window's or the chunk's
      attend_group<T, D / 16>(q_rows.data(), out_rows.data(), l.group, a.scale, a.softcap,
                              k_cache + task.kv_head * l.kv_head_stride, v_cache + task.kv_head * l.kv_head_stride,
                              cache, task.end(i) - cache.first, scores.data(), task.partials(a, l.group));
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
  for (int64_t index = begin; index < end; ++index) {
    const Task task(a, index);
    // The keys any new token sees (blocks before the first may have been freed and reused).
    const int64_t first = task.first(a, 0), last = task.end(task.q_len - 1);
    keys.resize((last - first) * a.head_dim);
    values.resize((last - first) * a.head_dim);
    scores.resize(last - first);
    gather_context(k_cache, v_cache, a.block_tables + task.seq * a.max_blocks, task.kv_head, first, last, a, l,
                   keys.data(), values.data());
    float* partials = task.partials(a, l.group);
    for (int64_t i = 0; i < task.q_len; ++i) {
      const int64_t token = task.first_token + i, start = task.first(a, i);  // keys [start, end(i))
      for (int64_t g = 0; g < l.group; ++g) {
        const int64_t head = task.kv_head * l.group + g;
        to_float(q + token * a.q_row_stride + head * a.q_head_stride, query.data(), a.head_dim);
#pragma omp simd
        for (int64_t d = 0; d < a.head_dim; ++d) query[d] *= a.scale;
        float* partial = partials != nullptr ? partials + g * (a.head_dim + 2) : nullptr;
        attend_one<D>(query.data(), keys.data() + (start - first) * a.head_dim,
                      values.data() + (start - first) * a.head_dim, task.end(i) - start, a.head_dim, a.softcap,
                      scores.data(), partial != nullptr ? partial : acc.data(),
                      partial != nullptr ? partial + a.head_dim : nullptr);
        if (partial == nullptr) from_float(acc.data(), out + token * a.out_row_stride + head * a.out_head_stride, a.head_dim);
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

// Splits [begin, end): out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c over each head's chunks
// c in key order, M their largest maximum (the softmax of all the keys, from its chunks' pieces).
template <typename T>
void combine_splits(const AttentionArgs& a, int64_t begin, int64_t end) {
  const Layout l(a);
  const int64_t slot_size = a.head_dim + 2;
  std::vector<float> sums(a.head_dim);
  for (int64_t index = begin; index < end; ++index) {
    const int64_t* split = a.splits + 4 * index;
    const int64_t token = split[0], kv_head = split[1], first_slot = split[2], chunks = split[3];
    for (int64_t g = 0; g < l.group; ++g) {
      const float* slot = a.partials + (first_slot * l.group + g) * slot_size;
      const int64_t chunk_stride = l.group * slot_size;
      float max_score = -3.4e38f, total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) max_score = std::max(max_score, slot[c * chunk_stride + a.head_dim]);
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* chunk = slot + c * chunk_stride;
        const float weight = vector_exp(chunk[a.head_dim] - max_score);
        total += weight * chunk[a.head_dim + 1];
#pragma omp simd
        for (int64_t d = 0; d < a.head_dim; ++d) sums[d] += weight * chunk[d];
      }
      const float inv_total = 1.f / total;
#pragma omp simd
      for (int64_t d = 0; d < a.head_dim; ++d) sums[d] *= inv_total;
      const int64_t head = kv_head * l.group + g;
      from_float(sums.data(), static_cast<T*>(a.out) + token * a.out_row_stride + head * a.out_head_stride, a.head_dim);
    }
  }
}

}  // namespace

void attention_combine(const AttentionArgs& a, int64_t begin, int64_t end) {
  dispatch_dtype(a.dtype, [&]<typename T>() { combine_splits<T>(a, begin, end); });
}

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
