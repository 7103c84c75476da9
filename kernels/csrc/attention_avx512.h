// The AVX-512 form of the attention task of attention.cpp, for head sizes 64 and 128 in fp32 or
// bf16: keys and values are read from the cache and widened in registers (no float copies; bf16 keys
// on AVX512-BF16 are multiplied as stored pairs), the queries of up to four heads that share the KV
// head stay in registers across the keys, and so do the output accumulators. Against the portable
// loops, which convert every cached row into a float buffer first and accumulate through memory, it
// runs about half the instructions per key.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "convert.h"
#include "exp.h"

namespace cpu_ops {

template <typename T>
inline __m512 load16(const T* p);

template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }

template <>
inline __m512 load16<bf16>(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    from_float(tmp, p, 16);  // round to nearest even, as everywhere else
  }
}

template <typename T>
constexpr bool kHasAvx512Attention = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

// Walks positions [first, first + num_keys) of one sequence's cache through its block table (first > 0:
// a sliding window's keys), visiting each as (position - first, row). The rows of the
// next block are prefetched while this one is used: blocks are scattered pages, which the hardware
// prefetcher does not follow, and the step is bound by reading the cache.
template <typename T>
inline void prefetch_block(const T* block_base, int64_t count, int64_t token_stride, int64_t head_bytes) {
  const char* bytes = reinterpret_cast<const char*>(block_base);
  for (int64_t o = 0; o < count; ++o)
    for (int64_t line = 0; line < head_bytes; line += 64)
      _mm_prefetch(bytes + o * token_stride * static_cast<int64_t>(sizeof(T)) + line, _MM_HINT_T0);
}

template <typename T, typename Visit>
inline void for_each_cached_row(const T* base, const int32_t* table, int64_t block_size, int64_t block_stride,
                                int64_t token_stride, int64_t head_bytes, int64_t first, int64_t num_keys, Visit visit) {
  const int64_t end = first + num_keys;
  for (int64_t pos = first, block = first / block_size; pos < end; ++block) {
    const int64_t offset = pos % block_size;  // non-zero only in a window's first block
    const T* row = base + table[block] * block_stride;
    const int64_t count = std::min(block_size - offset, end - pos);
    if (pos + count < end)
      prefetch_block(base + table[block + 1] * block_stride, std::min(block_size, end - pos - count), token_stride,
                     head_bytes);
    for (int64_t o = offset; o < offset + count; ++o, ++pos) visit(pos - first, row + o * token_stride);
  }
}

struct CacheView {
  const int32_t* table;
  int64_t block_size, block_stride, token_stride;
  int64_t first = 0;  // the first position read (a sliding window's oldest key)
};

// The sums of 16 vectors' lanes, r[j] = sum(v[j]), as one vector: a tree of in-lane, then 128-bit
// lane, shuffles and adds (about 3 instructions a sum, against about 9 for a reduction each).
inline __m512 sum_lanes_of_16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of vectors 4i .. 4i + 3
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The products of H queries with one key row, a vector of partial sums per query (16 lanes to add):
// float32 multiply-adds over the widened rows, or `vdpbf16ps` over bf16 rows as stored (AVX512-BF16:
// half the instructions, and no widening of the key).
template <typename T, int NV, int H>
struct QueryProducts {
  __m512 query[H][NV];

  explicit QueryProducts(const T* const* q) {
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < NV; ++v) query[h][v] = load16(q[h] + 16 * v);
  }

  void multiply(const T* key_row, __m512 (*products)[16], int slot) const {
    __m512 key[NV];
    for (int v = 0; v < NV; ++v) key[v] = load16(key_row + 16 * v);
    for (int h = 0; h < H; ++h) {
      __m512 acc = _mm512_mul_ps(query[h][0], key[0]);
      for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(query[h][v], key[v], acc);
      products[h][slot] = acc;
    }
  }
};

#if defined(__AVX512BF16__)
template <int NV, int H>
struct QueryProducts<bf16, NV, H> {
  static constexpr int kPairVectors = NV / 2;  // 32 bf16 values a vector
  __m512bh query[H][kPairVectors];

  explicit QueryProducts(const bf16* const* q) {
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < kPairVectors; ++v) query[h][v] = (__m512bh)_mm512_loadu_si512(q[h] + 32 * v);
  }

  void multiply(const bf16* key_row, __m512 (*products)[16], int slot) const {
    __m512bh key[kPairVectors];
    for (int v = 0; v < kPairVectors; ++v) key[v] = (__m512bh)_mm512_loadu_si512(key_row + 32 * v);
    for (int h = 0; h < H; ++h) {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[h][0], key[0]);
      for (int v = 1; v < kPairVectors; ++v) acc = _mm512_dpbf16_ps(acc, query[h][v], key[v]);
      products[h][slot] = acc;
    }
  }
};
#endif

// softcap * tanh(v / softcap) lane by lane (Gemma 2's cap of attention scores), as 1 - 2 / (exp(2x) + 1)
// with the library's vectorised exponential (clamped, so it saturates to +-1).
inline __m512 soft_cap(__m512 v, float softcap) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
#pragma omp simd
  for (int j = 0; j < 16; ++j) lanes[j] = softcap * (1.f - 2.f / (vector_exp(2.f * lanes[j] / softcap) + 1.f));
  return _mm512_load_ps(lanes);
}

// H query heads of one token (rows q[h], outputs out[h]) over keys [cache.first, cache.first + num_keys).
// `scores` holds H * num_keys floats. `partial` not null (a chunk of a split decode token's keys):
// head h's unnormalised sums, maximum score and sum of exponentials go to partial + h * (D + 2)
// instead of out[h].
template <typename T, int NV, int H>
void attend_heads(const T* const* q, T* const* out, float scale, float softcap, const T* k_base, const T* v_base,
                  const CacheView& cache, int64_t num_keys, float* scores, float* partial) {
  const QueryProducts<T, NV, H> queries(q);
  const __m512 scale_v = _mm512_set1_ps(scale);
  constexpr int64_t head_bytes = 16 * NV * static_cast<int64_t>(sizeof(T));
  // The values' first block is fetched while the keys are read.
  prefetch_block(v_base + cache.table[cache.first / cache.block_size] * cache.block_stride,
                 std::min(cache.block_size, num_keys),
                 cache.token_stride, head_bytes);
  // Each key's products stay a vector until 16 keys have them, then 16 scores are summed at once,
  // and their maximum is kept as a vector too (a scalar pass over the scores afterwards is a chain of
  // dependent `vmaxss`: GCC does not vectorise a float max reduction without -ffast-math).
  __m512 products[H][16], max_scores[H];
  for (int h = 0; h < H; ++h) max_scores[h] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto sum_keys = [&](int64_t first, int count) {
    const __mmask16 keys = static_cast<__mmask16>((1u << count) - 1);
    for (int h = 0; h < H; ++h) {
      for (int j = count; j < 16; ++j) products[h][j] = _mm512_setzero_ps();
      __m512 sums = _mm512_mul_ps(sum_lanes_of_16(products[h]), scale_v);
      if (softcap > 0.f) sums = soft_cap(sums, softcap);
      _mm512_mask_storeu_ps(scores + h * num_keys + first, keys, sums);
      max_scores[h] = _mm512_mask_max_ps(max_scores[h], keys, max_scores[h], sums);
    }
  };
  for_each_cached_row(k_base, cache.table, cache.block_size, cache.block_stride, cache.token_stride, head_bytes,
                      cache.first, num_keys,
                      [&](int64_t pos, const T* key_row) {
                        queries.multiply(key_row, products, static_cast<int>(pos % 16));
                        if (pos % 16 == 15) sum_keys(pos - 15, 16);
                      });
  if (num_keys % 16) sum_keys(num_keys - num_keys % 16, static_cast<int>(num_keys % 16));
  float inv_total[H], max_of[H], total_of[H];
  for (int h = 0; h < H; ++h) {
    float* s = scores + h * num_keys;
    const float max_score = _mm512_reduce_max_ps(max_scores[h]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < num_keys; ++j) {
      s[j] = vector_exp(s[j] - max_score);
      total += s[j];
    }
    inv_total[h] = 1.f / total;
    max_of[h] = max_score;
    total_of[h] = total;
  }
  __m512 acc[H][NV];
  for (int h = 0; h < H; ++h)
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
  for_each_cached_row(v_base, cache.table, cache.block_size, cache.block_stride, cache.token_stride, head_bytes,
                      cache.first, num_keys,
                      [&](int64_t pos, const T* value_row) {
                        __m512 value[NV];
                        for (int v = 0; v < NV; ++v) value[v] = load16(value_row + 16 * v);
                        for (int h = 0; h < H; ++h) {
                          const __m512 weight = _mm512_set1_ps(scores[h * num_keys + pos]);
                          for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(weight, value[v], acc[h][v]);
                        }
                      });
  for (int h = 0; h < H; ++h) {
    if (partial != nullptr) {
      float* slot = partial + h * (16 * NV + 2);
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(slot + 16 * v, acc[h][v]);
      slot[16 * NV] = max_of[h];
      slot[16 * NV + 1] = total_of[h];
      continue;
    }
    const __m512 inv = _mm512_set1_ps(inv_total[h]);
    for (int v = 0; v < NV; ++v) store16(out[h] + 16 * v, _mm512_mul_ps(acc[h][v], inv));
  }
}

// All heads of a group for one token, in chunks that keep queries and accumulators in registers
// (4 heads of 64 or 2 heads of 128: 16 registers each for queries and for accumulators).
template <typename T, int NV>
void attend_group(const T* const* q, T* const* out, int64_t group, float scale, float softcap, const T* k_base,
                  const T* v_base,
                  const CacheView& cache, int64_t num_keys, float* scores, float* partial) {
  constexpr int kMaxHeads = 16 / NV;
  for (int64_t h = 0; h < group; h += kMaxHeads) {
    float* heads_partial = partial != nullptr ? partial + h * (16 * NV + 2) : nullptr;
    switch (std::min<int64_t>(kMaxHeads, group - h)) {
      case 1:
        attend_heads<T, NV, 1>(q + h, out + h, scale, softcap, k_base, v_base, cache, num_keys, scores, heads_partial);
        break;
      case 2:
        attend_heads<T, NV, 2>(q + h, out + h, scale, softcap, k_base, v_base, cache, num_keys, scores, heads_partial);
        break;
      case 3:
        if constexpr (kMaxHeads >= 3)
          attend_heads<T, NV, 3>(q + h, out + h, scale, softcap, k_base, v_base, cache, num_keys, scores, heads_partial);
        break;
      default:
        if constexpr (kMaxHeads >= 4)
          attend_heads<T, NV, 4>(q + h, out + h, scale, softcap, k_base, v_base, cache, num_keys, scores, heads_partial);
        break;
    }
  }
}

}  // namespace cpu_ops
#endif
