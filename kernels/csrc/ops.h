// The kernels of one instruction-set form, as table.cpp collects them into the form's KernelTable.
#pragma once
#include "convert.h"
#include "kernel_table.h"

namespace cpu_ops {

// Calls `body.template operator()<T>()` with T the C++ type of `dtype`.
template <typename Body>
inline void dispatch_dtype(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::f32: body.template operator()<float>(); break;
    case DType::bf16: body.template operator()<bf16>(); break;
    case DType::f16: body.template operator()<f16>(); break;
  }
}

void rms_norm(const NormArgs& args, int64_t begin, int64_t end);
void silu_and_mul(const SiluArgs& args, int64_t begin, int64_t end);
void rotary_store_kv(const RotaryArgs& args, int64_t begin, int64_t end);
void paged_attention(const AttentionArgs& args, int64_t begin, int64_t end);
void attention_combine(const AttentionArgs& args, int64_t begin, int64_t end);
void max_logsumexp(const MaxLogSumExpArgs& args, int64_t begin, int64_t end);
void lora_segments(const LoraArgs& args, int64_t begin, int64_t end);

// Present in the forms that have the instructions (null in the table elsewhere).
void f32_linear(const LinearArgs& args, int64_t begin, int64_t end);
int64_t f32_linear_groups(const LinearArgs& args);
void bf16_linear(const LinearArgs& args, int64_t begin, int64_t end);
int64_t bf16_linear_groups(const LinearArgs& args);
void amx_linear(const LinearArgs& args, int64_t begin, int64_t end);
int64_t amx_linear_groups(const LinearArgs& args);
bool attention_has_vector_form();
double peak_flops(const char* kind, int64_t iterations, double seed);
double peak_read(const void* data, int64_t bytes, int64_t streams);
void quantized_linear(const QuantizedLinearArgs& args, int64_t begin, int64_t end);
const char* quantized_int8_dot(const QuantizedLinearArgs& args);
void dequantize_rows(const DequantizeArgs& args, int64_t begin, int64_t end);
void quantized_linear_widened(const QuantizedLinearArgs& args, int64_t begin, int64_t end);
// Shared by quantized.cpp and quantized_tiles.cpp: bytes of a row of k weights of `ggml_type`, and one
// such row widened into out [k] of `dtype` (float32: kernels.reference.dequantize bit for bit; 16-bit
// types: that rounded once).
int64_t quantized_row_bytes(int32_t ggml_type, int64_t k);
void dequantize_row(int32_t ggml_type, const uint8_t* blocks, int64_t k, DType dtype, void* out);
// Shared by quantized.cpp and quantized_amx.cpp: one row of k weights unpacked (w[j] = scales[j / 16] *
// q[j] + offsets[j / 32]; q [k], scales [k / 16], offsets [k / 32]), whether the type has offsets, and
// 32 elements of x quantized to int8 as the int8 matmuls do (q = round(x / d), d = amax / 127; returns
// d, and d * sum(q) in scaled_sum).
void unpack_quantized_row(int32_t ggml_type, const uint8_t* blocks, int64_t k, int8_t* q, float* scales, float* offsets);
bool quantized_has_offsets(int32_t ggml_type);
template <typename T>
float quantize_x_block(const T* x, int8_t* q, float& scaled_sum);
void quantized_linear_amx(const QuantizedLinearArgs& args, int64_t begin, int64_t end);

}  // namespace cpu_ops
