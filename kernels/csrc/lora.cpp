// Multi-adapter LoRA on CPU, one run of tokens sharing an adapter slot (a segment) at a time
// (segments [n, 3]: start, length, slot; scales per slot, or null = 1; slice_ranks per slot and
// slice ([S * num_slices], so a slice an adapter does not target costs nothing), or null = the
// padded max rank):
//   y[t, cols_i] += T((x[t] @ A[s, slice i, :rank_i].T) @ B[s, cols_i, :rank_i].T * scale[s])
// for every token t of a segment with slot s, slice i of a fused projection (kernels.reference.add_lora).
// x and y are float32 or bfloat16, the adapter weights float32 (the engine keeps its CPU pool in
// fp32: tiny bf16 matmuls cost more than fp32 ones here). B must have its output dimension
// contiguous (the pool stores B as [slots, rank, out] and passes the [slots, out, rank] view), so
// the expand is rank vector multiply-adds along each output row, with no horizontal sums.
// Each segment's delta is formed in fp32 and added to y with one rounding, as the reference does.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "lora_serve_tuning.h"
#include "ops.h"

namespace cpu_ops {
namespace {

// Tokens of a segment computed together, so each row of A and B is read from memory once per block;
// output columns per expand chunk, so the chunk of B and the block's deltas stay in L1 (rank 16,
// 64 tokens over 8 adapters: chunks of 256 took 128 us against 179 us for chunks of 512).
constexpr int64_t kTokenBlock = tuning::kLoraTokenBlock;
constexpr int64_t kColumnChunk = tuning::kLoraColumnChunk;
constexpr int64_t kMaxSlices = 8;  // fused projections have 1 (o, down), 2 (gate/up) or 3 (q/k/v)

template <typename T>
void lora_kernel(const LoraArgs& args, int64_t begin, int64_t end) {
  const int64_t hidden_in = args.hidden_in, total_out = args.total_out;
  const int64_t num_slices = args.num_slices, max_rank = args.max_rank;
  const int64_t a_row_stride = args.a_row_stride, b_rank_stride = args.b_rank_stride;
  const int64_t* offsets = args.slice_offsets;
  const T* x_ptr = static_cast<const T*>(args.x);
  T* y_ptr = static_cast<T*>(args.y);
  std::vector<float> x_rows(kTokenBlock * hidden_in), deltas(kTokenBlock * total_out), y_row(total_out);
  std::vector<float> shrunk(kTokenBlock * num_slices * max_rank);
  for (int64_t s = begin; s < end; ++s) {
      const int64_t* segment = args.segments + 3 * s;  // start, length, slot
      const int64_t start = segment[0], length = segment[1], slot = segment[2];
      int64_t ranks[kMaxSlices];
      for (int64_t i = 0; i < num_slices; ++i)
        ranks[i] = args.slice_ranks ? std::min(args.slice_ranks[slot * num_slices + i], max_rank) : max_rank;
      const float scale = args.scales ? static_cast<float>(args.scales[slot]) : 1.f;
      const float* a_slot = args.lora_a + slot * args.a_slot_stride;
      const float* b_slot = args.lora_b + slot * args.b_slot_stride;
      for (int64_t first = start; first < start + length; first += kTokenBlock) {
        const int64_t block = std::min(kTokenBlock, start + length - first);
        for (int64_t t = 0; t < block; ++t) to_float(x_ptr + (first + t) * hidden_in, &x_rows[t * hidden_in], hidden_in);
        // Shrink: each row of A against four tokens at a time (four independent sums per load of A).
        for (int64_t i = 0; i < num_slices; ++i) {
          for (int64_t r = 0; r < ranks[i]; ++r) {
            const float* a_row = a_slot + (i * max_rank + r) * a_row_stride;
            float* out = &shrunk[i * max_rank + r];
            const int64_t out_stride = num_slices * max_rank;
            int64_t t = 0;
            for (; t + 4 <= block; t += 4) {
              const float* x0 = &x_rows[t * hidden_in];
              const float* x1 = x0 + hidden_in;
              const float* x2 = x1 + hidden_in;
              const float* x3 = x2 + hidden_in;
              float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
              for (int64_t k = 0; k < hidden_in; ++k) {
                const float a = a_row[k];
                s0 += x0[k] * a;
                s1 += x1[k] * a;
                s2 += x2[k] * a;
                s3 += x3[k] * a;
              }
              out[t * out_stride] = s0 * scale;
              out[(t + 1) * out_stride] = s1 * scale;
              out[(t + 2) * out_stride] = s2 * scale;
              out[(t + 3) * out_stride] = s3 * scale;
            }
            for (; t < block; ++t) {
              const float* x_row = &x_rows[t * hidden_in];
              float total = 0.f;
#pragma omp simd reduction(+ : total)
              for (int64_t k = 0; k < hidden_in; ++k) total += x_row[k] * a_row[k];
              out[t * out_stride] = total * scale;
            }
          }
        }
        // Expand: four rank rows at a time per pass over a token's delta (one load and store of
        // the delta per four multiply-adds), by chunks of columns so the chunk of B serves every
        // token of the block from L1.
        std::fill(deltas.begin(), deltas.begin() + block * total_out, 0.f);
        for (int64_t i = 0; i < num_slices; ++i) {
          for (int64_t chunk = offsets[i]; chunk < offsets[i + 1]; chunk += kColumnChunk) {
            const int64_t chunk_end = std::min(chunk + kColumnChunk, offsets[i + 1]);
            for (int64_t t = 0; t < block; ++t) {
              const float* w = &shrunk[(t * num_slices + i) * max_rank];
              float* delta = &deltas[t * total_out];
              int64_t r = 0;
              const int64_t rank = ranks[i];
              for (; r + 4 <= rank; r += 4) {
                const float* b0 = b_slot + r * b_rank_stride;
                const float* b1 = b0 + b_rank_stride;
                const float* b2 = b1 + b_rank_stride;
                const float* b3 = b2 + b_rank_stride;
#pragma omp simd
                for (int64_t c = chunk; c < chunk_end; ++c)
                  delta[c] += w[r] * b0[c] + w[r + 1] * b1[c] + w[r + 2] * b2[c] + w[r + 3] * b3[c];
              }
              for (; r < rank; ++r) {
                const float* b_row = b_slot + r * b_rank_stride;
#pragma omp simd
                for (int64_t c = chunk; c < chunk_end; ++c) delta[c] += w[r] * b_row[c];
              }
            }
          }
        }
        for (int64_t t = 0; t < block; ++t) {
          T* y_t = y_ptr + (first + t) * total_out;
          const float* delta = &deltas[t * total_out];
          if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
            for (int64_t c = 0; c < total_out; ++c) y_t[c] += delta[c];
          } else {
            to_float(y_t, y_row.data(), total_out);
#pragma omp simd
            for (int64_t c = 0; c < total_out; ++c) y_row[c] += delta[c];
            from_float(y_row.data(), y_t, total_out);
          }
        }
      }
  }
}


}  // namespace

void lora_segments(const LoraArgs& args, int64_t begin, int64_t end) {
  dispatch_dtype(args.dtype, [&]<typename T>() { lora_kernel<T>(args, begin, end); });
}

}  // namespace cpu_ops
