// Per-row maximum, its first index and the log of the sum of exponentials of a [rows, vocab]
// matrix: what greedy decoding and the chosen token's logprob need, in two passes over each row
// while it sits in cache, with no [rows, vocab] temporaries. 16-bit rows are widened to float one
// row at a time (exactly), so the model's logits need no float copy of the whole batch.
// Semantics: s = scores.float(); values, indices = s.max(-1); log_normaliser = values + log(sum(exp(s - values))).
#include <cmath>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "exp.h"
#include "lora_serve_tuning.h"
#include "ops.h"

namespace cpu_ops {
namespace {

struct RowSummary {
  float best;
  int64_t best_index;
  float log_normaliser;
};

// The first index holding `value` (the last index when none does, as for a NaN maximum): a
// vectorised test per chunk finds the chunk, a scalar scan the position within it.
int64_t first_index_of(const float* row, int64_t vocab, float value) {
  constexpr int64_t kChunk = tuning::kFirstIndexChunk;
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
  for (int64_t i = 0; i < vocab; ++i) total += vector_exp(row[i] - best);
  return {best, best_index, best + std::log(total)};
}

template <typename T>
void summarise_rows(const MaxLogSumExpArgs& a, int64_t begin, int64_t end) {
  const int64_t vocab = a.vocab;
  const T* in = static_cast<const T*>(a.scores);
  std::vector<float> widened(std::is_same_v<T, float> ? 0 : vocab);
  for (int64_t r = begin; r < end; ++r) {
    const float* row;
    if constexpr (std::is_same_v<T, float>) {
      row = in + r * vocab;
    } else {
      to_float(in + r * vocab, widened.data(), vocab);
      row = widened.data();
    }
    const RowSummary summary = summarise_row(row, vocab);
    a.values[r] = summary.best;
    a.indices[r] = summary.best_index;
    a.log_normaliser[r] = summary.log_normaliser;
  }
}

}  // namespace

void max_logsumexp(const MaxLogSumExpArgs& a, int64_t begin, int64_t end) {
  dispatch_dtype(a.dtype, [&]<typename T>() { summarise_rows<T>(a, begin, end); });
}

}  // namespace cpu_ops
