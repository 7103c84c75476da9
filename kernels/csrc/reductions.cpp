// Per-row maximum, its first index and the log of the sum of exponentials of a [rows, vocab] float
// matrix: what greedy decoding and the chosen token's logprob need, in two passes over each row
// while it sits in cache, with no [rows, vocab] temporaries.
// Semantics: values, indices = scores.max(-1); log_normaliser = values + log(sum(exp(scores - values))).
#include <ATen/Parallel.h>
#include <cmath>

#include "cpu_ops.h"
#include "exp.h"

void max_logsumexp(torch::Tensor scores, torch::Tensor values, torch::Tensor indices, torch::Tensor log_normaliser) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && scores.scalar_type() == at::kFloat,
              "scores must be a contiguous float32 [rows, vocab] tensor");
  TORCH_CHECK(scores.size(1) > 0, "scores need at least one column");
  const int64_t rows = scores.size(0), vocab = scores.size(1);
  TORCH_CHECK(values.numel() == rows && indices.numel() == rows && log_normaliser.numel() == rows &&
                  values.scalar_type() == at::kFloat && log_normaliser.scalar_type() == at::kFloat &&
                  indices.scalar_type() == at::kLong,
              "outputs: float32 values and log_normaliser, int64 indices, one per row");
  const float* in = scores.data_ptr<float>();
  float* value_ptr = values.data_ptr<float>();
  int64_t* index_ptr = indices.data_ptr<int64_t>();
  float* norm_ptr = log_normaliser.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * vocab;
      float best = row[0];
#pragma omp simd reduction(max : best)
      for (int64_t i = 0; i < vocab; ++i) best = row[i] > best ? row[i] : best;
      int64_t best_index = 0;
      while (best_index < vocab - 1 && !(row[best_index] == best)) ++best_index;  // first occurrence
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < vocab; ++i) total += cpu_ops::vector_exp(row[i] - best);
      value_ptr[r] = best;
      index_ptr[r] = best_index;
      norm_ptr[r] = best + std::log(total);
    }
  });
}
