// Per-row maximum, its first index and the log of the sum of exponentials of a [rows, vocab]
// matrix: what greedy decoding and the chosen token's logprob need, in two passes over each row
// while it sits in cache, with no [rows, vocab] temporaries. bf16/fp16 rows are widened to float
// one row at a time (exactly), so the model's logits need no float copy of the whole batch.
// Semantics: s = scores.float(); values, indices = s.max(-1); log_normaliser = values + log(sum(exp(s - values))).
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "convert.h"
#include "cpu_ops.h"
#include "exp.h"

namespace {

struct RowSummary {
  float best;
  int64_t best_index;
  float log_normaliser;
};

// The first index holding `value` (the last index when none does, as for a NaN maximum): a
// vectorised test per chunk finds the chunk, a scalar scan the position within it.
int64_t first_index_of(const float* row, int64_t vocab, float value) {
  constexpr int64_t kChunk = 64;
  int64_t start = 0;
  for (; start + kChunk <= vocab; start += kChunk) {
    int found = 0;
#pragma omp simd reduction(| : found)
    for (int64_t i = start; i < start + kChunk; ++i) found |= row[i] == value;
    if (found) break;
  }
  while (start < vocab - 1 && !(row[start] == value)) ++start;
  return start;
}

RowSummary summarise_row(const float* row, int64_t vocab) {
  float best = row[0];
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < vocab; ++i) best = row[i] > best ? row[i] : best;
  const int64_t best_index = first_index_of(row, vocab, best);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < vocab; ++i) total += cpu_ops::vector_exp(row[i] - best);
  return {best, best_index, best + std::log(total)};
}

template <typename T>
void max_logsumexp_kernel(const torch::Tensor& scores, float* value_ptr, int64_t* index_ptr, float* norm_ptr) {
  const int64_t rows = scores.size(0), vocab = scores.size(1);
  const T* in = scores.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<T, float> ? 0 : vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* row;
      if constexpr (std::is_same_v<T, float>) {
        row = in + r * vocab;
      } else {
        cpu_ops::to_float(in + r * vocab, widened.data(), vocab);
        row = widened.data();
      }
      const RowSummary summary = summarise_row(row, vocab);
      value_ptr[r] = summary.best;
      index_ptr[r] = summary.best_index;
      norm_ptr[r] = summary.log_normaliser;
    }
  });
}

}  // namespace

void max_logsumexp(torch::Tensor scores, torch::Tensor values, torch::Tensor indices, torch::Tensor log_normaliser) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous(), "scores must be a contiguous [rows, vocab] tensor");
  TORCH_CHECK(scores.size(1) > 0, "scores need at least one column");
  const int64_t rows = scores.size(0);
  TORCH_CHECK(values.numel() == rows && indices.numel() == rows && log_normaliser.numel() == rows &&
                  values.scalar_type() == at::kFloat && log_normaliser.scalar_type() == at::kFloat &&
                  indices.scalar_type() == at::kLong,
              "outputs: float32 values and log_normaliser, int64 indices, one per row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "max_logsumexp", [&] {
    max_logsumexp_kernel<scalar_t>(scores, values.data_ptr<float>(), indices.data_ptr<int64_t>(),
                                   log_normaliser.data_ptr<float>());
  });
}
