// Multi-adapter LoRA on CPU, one run of tokens sharing an adapter slot (a segment) at a time
// (segments [n, 3]: start, length, slot; scales per slot, empty = 1; slot_ranks per slot, or per
// slot and slice ([S * num_slices], so a slice an adapter does not target costs nothing), or empty
// = the padded max rank):
//   y[t, cols_i] += T((x[t] @ A[s, slice i, :rank_i].T) @ B[s, cols_i, :rank_i].T * scale[s])
// for every token t of a segment with slot s, slice i of a fused projection (kernels.reference.add_lora).
// x and y are float32 or bfloat16, the adapter weights float32 (the engine keeps its CPU pool in
// fp32: tiny bf16 matmuls cost more than fp32 ones here). B must have its output dimension
// contiguous (the pool stores B as [slots, rank, out] and passes the [slots, out, rank] view), so
// the expand is rank vector multiply-adds along each output row, with no horizontal sums.
// Each segment's delta is formed in fp32 and added to y with one rounding, as the reference does.
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "cpu_ops.h"

namespace {

using cpu_ops::from_float;
using cpu_ops::to_float;

// Tokens of a segment computed together, so each row of A and B is read from memory once per block;
// output columns per expand chunk, so the chunk of B and the block's deltas stay in L1 (rank 16,
// 64 tokens over 8 adapters: chunks of 256 took 128 us against 179 us for chunks of 512).
constexpr int64_t kTokenBlock = 8;
constexpr int64_t kColumnChunk = 256;
constexpr int64_t kMaxSlices = 8;  // fused projections have 1 (o, down), 2 (gate/up) or 3 (q/k/v)

template <typename T>
void lora_kernel(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
                 const torch::Tensor& segments, const std::vector<int64_t>& slot_ranks,
                 const std::vector<int64_t>& offsets, const std::vector<double>& scales) {
  const int64_t hidden_in = x.size(1), total_out = y.size(1);
  const int64_t num_slices = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t max_rank = lora_a.size(1) / num_slices;
  const bool ranks_per_slice = static_cast<int64_t>(slot_ranks.size()) == lora_a.size(0) * num_slices && num_slices > 1;
  const int64_t a_slot_stride = lora_a.stride(0), a_row_stride = lora_a.stride(1);
  const int64_t b_slot_stride = lora_b.stride(0), b_rank_stride = lora_b.stride(2);
  const T* x_ptr = x.data_ptr<T>();
  T* y_ptr = y.data_ptr<T>();
  const float* a_ptr = lora_a.data_ptr<float>();
  const float* b_ptr = lora_b.data_ptr<float>();
  const int64_t* seg = segments.data_ptr<int64_t>();  // [n, 3]: start, length, slot
  at::parallel_for(0, segments.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x_rows(kTokenBlock * hidden_in), deltas(kTokenBlock * total_out), y_row(total_out);
    std::vector<float> shrunk(kTokenBlock * num_slices * max_rank);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t start = seg[3 * s], length = seg[3 * s + 1], slot = seg[3 * s + 2];
      int64_t ranks[kMaxSlices];
      for (int64_t i = 0; i < num_slices; ++i) {
        const int64_t known = ranks_per_slice ? slot_ranks[slot * num_slices + i] : slot_ranks.empty() ? max_rank : slot_ranks[slot];
        ranks[i] = std::min(known, max_rank);
      }
      const float scale = scales.empty() ? 1.f : static_cast<float>(scales[slot]);
      const float* a_slot = a_ptr + slot * a_slot_stride;
      const float* b_slot = b_ptr + slot * b_slot_stride;
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
  });
}

}  // namespace

void lora_segments(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor segments,
                   std::vector<int64_t> slot_ranks, std::vector<int64_t> slice_offsets, std::vector<double> scales) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.is_contiguous() && y.is_contiguous() && x.size(0) == y.size(0),
              "x [T, in] and y [T, out] must be contiguous with the same rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat, "adapter weights must be float32");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.stride(2) == 1 && lora_a.size(2) == x.size(1), "lora_a must be [S, R, in], rows contiguous");
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.stride(1) == 1 && lora_b.size(1) == y.size(1) && lora_b.size(0) == lora_a.size(0),
              "lora_b must be [S, out, R] with the output dimension contiguous");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.scalar_type() == at::kLong && segments.is_contiguous(),
              "segments must be int64 [n, 3] (start, length, slot)");
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(num_slices >= 1 && slice_offsets.front() == 0 && slice_offsets.back() == y.size(1),
              "slice_offsets must run from 0 to y's width");
  TORCH_CHECK(lora_a.size(1) == num_slices * lora_b.size(2), "lora_a rows must be num_slices * lora_b's rank");
  const auto num_slots = static_cast<size_t>(lora_a.size(0));
  TORCH_CHECK(num_slices <= kMaxSlices, "at most 8 slices");
  TORCH_CHECK(slot_ranks.empty() || slot_ranks.size() == num_slots || slot_ranks.size() == num_slots * num_slices,
              "slot_ranks: one per slot, one per slot and slice, or empty");
  TORCH_CHECK(scales.empty() || scales.size() == num_slots, "scales: one per slot, or empty");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "lora_segments", [&] {
    lora_kernel<scalar_t>(y, x, lora_a, lora_b, segments, slot_ranks, slice_offsets, scales);
  });
}
