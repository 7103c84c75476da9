// Fused per-token ops of the Llama block: RMS norm (with the residual add), SiLU-and-multiply, and
// rotary embedding fused with the KV-cache write. Each reproduces the roundings of the reference
// (kernels/reference.py, itself HF transformers' order of operations): a bf16 result is rounded
// wherever the reference stores an intermediate bf16 tensor, so the outputs match it to the bit
// except where the exponential differs in its last float bit.
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "convert.h"
#include "exp.h"
#include "cpu_ops.h"

namespace {

using cpu_ops::from_float;
using cpu_ops::round_to;
using cpu_ops::to_float;

constexpr int64_t kRowsPerTask = 16;

// row <- weight * T(row * rsqrt(mean(row^2) + eps)), in floats; `weight` already converted.
template <typename T>
void normalise_row(float* row, const float* weight, int64_t hidden, float eps) {
  float sum_squares = 0.f;
#pragma omp simd reduction(+ : sum_squares)
  for (int64_t i = 0; i < hidden; ++i) sum_squares += row[i] * row[i];
  const float inv_rms = 1.f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) row[i] = round_to<T>(row[i] * inv_rms) * weight[i];
}

template <typename T>
void norm_kernel(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& weight,
                 double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  std::vector<float> weight_f(hidden);
  to_float(weight.data_ptr<T>(), weight_f.data(), hidden);
  const T* x_ptr = x.data_ptr<T>();
  T* residual_ptr = residual ? residual->data_ptr<T>() : nullptr;
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden), other(hidden);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x_ptr + r * hidden, row.data(), hidden);
      if (residual_ptr) {  // residual <- T(residual + x); the norm reads the sum
        T* res = residual_ptr + r * hidden;
        to_float(res, other.data(), hidden);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) row[i] = round_to<T>(row[i] + other[i]);
        from_float(row.data(), res, hidden);
      }
      normalise_row<T>(row.data(), weight_f.data(), hidden, static_cast<float>(eps));
      from_float(row.data(), out_ptr + r * hidden, hidden);
    }
  });
}

template <typename T>
void silu_mul_kernel(torch::Tensor& out, const torch::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  const T* in_ptr = gate_up.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(width), up(width);
    for (int64_t r = begin; r < end; ++r) {
      to_float(in_ptr + r * 2 * width, gate.data(), width);
      to_float(in_ptr + r * 2 * width + width, up.data(), width);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) gate[i] = round_to<T>(gate[i] / (1.f + cpu_ops::vector_exp(-gate[i]))) * up[i];
      from_float(gate.data(), out_ptr + r * width, width);
    }
  });
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
void rotary_store_kernel(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                         const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                         const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0), head_dim = cos.size(1);
  const int64_t rotated_heads = num_heads + num_kv_heads;
  const int64_t block_size = k_cache.size(1);
  const int64_t kv_row = num_kv_heads * head_dim;  // one token's keys (or values) in the cache
  T* qkv_ptr = qkv.data_ptr<T>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  const int64_t* slot_ptr = slot_mapping.data_ptr<int64_t>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  T* k_ptr = k_cache.data_ptr<T>();
  T* v_ptr = v_cache.data_ptr<T>();
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_f(head_dim), sin_f(head_dim), head(head_dim), rotated(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      to_float(cos_ptr + pos_ptr[t] * head_dim, cos_f.data(), head_dim);
      to_float(sin_ptr + pos_ptr[t] * head_dim, sin_f.data(), head_dim);
      T* row = qkv_ptr + t * row_stride;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        to_float(row + h * head_dim, head.data(), head_dim);
        rotate_head<T>(head.data(), cos_f.data(), sin_f.data(), rotated.data(), head_dim);
        from_float(head.data(), row + h * head_dim, head_dim);
      }
      const int64_t slot = slot_ptr[t];
      if (slot < 0) continue;  // padding: rotated, not stored
      const int64_t offset = (slot / block_size) * k_cache.stride(0) + (slot % block_size) * k_cache.stride(1);
      std::copy(row + num_heads * head_dim, row + rotated_heads * head_dim, k_ptr + offset);
      std::copy(row + rotated_heads * head_dim, row + rotated_heads * head_dim + kv_row, v_ptr + offset);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous [rows, width] tensor");
}

}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.numel() == x.size(1), "shapes of out, x and weight disagree");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_kernel<scalar_t>(out, x, nullptr, weight.contiguous(), eps);
  });
}

void add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  check_rows(residual, "residual");
  TORCH_CHECK(out.sizes() == x.sizes() && residual.sizes() == x.sizes() && weight.numel() == x.size(1),
              "shapes of out, x, residual and weight disagree");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(), "one dtype expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_kernel<scalar_t>(out, x, &residual, weight.contiguous(), eps);
  });
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1), "gate_up must be [rows, 2 * width]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "one dtype expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_and_mul", [&] {
    silu_mul_kernel<scalar_t>(out, gate_up);
  });
}

void rotary_store_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, (H + 2 * Hkv) * D] with unit column stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos and sin: [positions, D]");
  const int64_t head_dim = cos.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width disagrees");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
              "caches must be contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0),
              "positions and slot_mapping: contiguous int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type(), "one dtype expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_store_kv", [&] {
    rotary_store_kernel<scalar_t>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads);
  });
}
