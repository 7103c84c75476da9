// Fused per-token ops of the Llama block: RMS norm (with the residual add), SiLU-and-multiply, and
// rotary embedding fused with the KV-cache write. Each reproduces the roundings of the reference
// (kernels/reference.py, itself HF transformers' order of operations): a 16-bit result is rounded
// wherever the reference stores an intermediate 16-bit tensor, so the outputs match it to the bit
// except where the exponential differs in its last float bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "convert.h"
#include "exp.h"
#include "ops.h"

namespace cpu_ops {
namespace {

// out <- weight * T(h * rsqrt(mean(h^2) + eps)) per row, with h = x, or with a residual: residual <-
// T(residual + x) and h that sum. h is formed once in floats, read straight from the 16-bit inputs
// (no widened copies of them), and its sum of squares and normalisation read it back from L1.
template <typename T>
void norm_rows(const NormArgs& a, int64_t begin, int64_t end) {
  const int64_t hidden = a.hidden;
  std::vector<float> weight(hidden), h_buffer(hidden);
  to_float(static_cast<const T*>(a.weight), weight.data(), hidden);
  float* h = h_buffer.data();
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * hidden;
    if (a.residual) {
      T* res = static_cast<T*>(a.residual) + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) h[i] = round_to<T>(to_float_one(x[i]) + to_float_one(res[i]));
      from_float(h, res, hidden);
    } else {
      to_float(x, h, hidden);
    }
    float sum_squares = 0.f;
#pragma omp simd reduction(+ : sum_squares)
    for (int64_t i = 0; i < hidden; ++i) sum_squares += h[i] * h[i];
    const float inv_rms = 1.f / std::sqrt(sum_squares / static_cast<float>(hidden) + a.eps);
    T* out = static_cast<T*>(a.out) + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) out[i] = from_float_one<T>(round_to<T>(h[i] * inv_rms) * weight[i]);
  }
}

template <typename T>
void silu_rows(const SiluArgs& a, int64_t begin, int64_t end) {
  const int64_t width = a.width;
  std::vector<float> decay_buffer(width);
  float* decay = decay_buffer.data();
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(a.gate_up) + r * 2 * width;
    const T* up = gate + width;
    T* out = static_cast<T*>(a.out) + r * width;
    // Two loops: in one, compilers split the division by the outcomes of the exponential's clamps.
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) decay[i] = vector_exp(-to_float_one(gate[i]));
#pragma omp simd
    for (int64_t i = 0; i < width; ++i)
      out[i] = from_float_one<T>(round_to<T>(to_float_one(gate[i]) / (1.f + decay[i])) * to_float_one(up[i]));
  }
}

// Rotate one head in place: x*cos + rotate_half(x)*sin, rounding each product and the sum to T.
template <typename T>
void rotate_head(float* x, const float* cos, const float* sin, float* rotated, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -x[i + half];
    rotated[i + half] = x[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < head_dim; ++i) x[i] = round_to<T>(round_to<T>(x[i] * cos[i]) + round_to<T>(rotated[i] * sin[i]));
}

template <typename T>
void rotary_tokens(const RotaryArgs& a, int64_t begin, int64_t end) {
  const int64_t head_dim = a.head_dim, rotated_heads = a.num_heads + a.num_kv_heads;
  const int64_t kv_row = a.num_kv_heads * head_dim;  // one token's keys (or values) in the cache
  const int64_t block_stride = a.block_size * kv_row;
  T* qkv = static_cast<T*>(a.qkv);
  const T* cos = static_cast<const T*>(a.cos);
  const T* sin = static_cast<const T*>(a.sin);
  T* k_cache = static_cast<T*>(a.k_cache);
  T* v_cache = static_cast<T*>(a.v_cache);
  std::vector<float> cos_f(head_dim), sin_f(head_dim), head(head_dim), rotated(head_dim);
  for (int64_t t = begin; t < end; ++t) {
    to_float(cos + a.positions[t] * head_dim, cos_f.data(), head_dim);
    to_float(sin + a.positions[t] * head_dim, sin_f.data(), head_dim);
    T* row = qkv + t * a.row_stride;
    for (int64_t h = 0; h < rotated_heads; ++h) {
      to_float(row + h * head_dim, head.data(), head_dim);
      rotate_head<T>(head.data(), cos_f.data(), sin_f.data(), rotated.data(), head_dim);
      from_float(head.data(), row + h * head_dim, head_dim);
    }
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;  // padding: rotated, not stored
    const int64_t offset = (slot / a.block_size) * block_stride + (slot % a.block_size) * kv_row;
    std::copy(row + a.num_heads * head_dim, row + rotated_heads * head_dim, k_cache + offset);
    std::copy(row + rotated_heads * head_dim, row + rotated_heads * head_dim + kv_row, v_cache + offset);
  }
}

}  // namespace

void rms_norm(const NormArgs& a, int64_t begin, int64_t end) { dispatch_dtype(a.dtype, [&]<typename T>() { norm_rows<T>(a, begin, end); }); }

void silu_and_mul(const SiluArgs& a, int64_t begin, int64_t end) {
  dispatch_dtype(a.dtype, [&]<typename T>() { silu_rows<T>(a, begin, end); });
}

void rotary_store_kv(const RotaryArgs& a, int64_t begin, int64_t end) {
  dispatch_dtype(a.dtype, [&]<typename T>() { rotary_tokens<T>(a, begin, end); });
}

}  // namespace cpu_ops
