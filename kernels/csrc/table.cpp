// The kernel table of one instruction-set form: the only symbol its library exports. The build
// (setup.py) compiles every source of csrc/ but bindings.cpp once per form, with the form's flags,
// its name in LORA_SERVE_FORM and the digest of the sources in LORA_SERVE_SOURCE_DIGEST.
#include "lora_serve_tuning.h"
#include "ops.h"

#if !defined(LORA_SERVE_FORM) || !defined(LORA_SERVE_SOURCE_DIGEST)
#error "the build defines LORA_SERVE_FORM and LORA_SERVE_SOURCE_DIGEST"
#endif

namespace {

cpu_ops::KernelTable make_table() {
  cpu_ops::KernelTable table{};
  table.abi_version = cpu_ops::kAbiVersion;
  table.form = LORA_SERVE_FORM;
  table.source_digest = LORA_SERVE_SOURCE_DIGEST;
  table.constants = cpu_ops::tuning::kConstants;
  table.num_constants = sizeof(cpu_ops::tuning::kConstants) / sizeof(cpu_ops::tuning::kConstants[0]);
  table.vector_attention = cpu_ops::attention_has_vector_form();
  table.rms_norm = &cpu_ops::rms_norm;
  table.silu_and_mul = &cpu_ops::silu_and_mul;
  table.rotary_store_kv = &cpu_ops::rotary_store_kv;
  table.paged_attention = &cpu_ops::paged_attention;
  table.attention_combine = &cpu_ops::attention_combine;
  table.max_logsumexp = &cpu_ops::max_logsumexp;
  table.lora_segments = &cpu_ops::lora_segments;
#if defined(__AVX2__) && defined(__FMA__)
  table.f32_linear = &cpu_ops::f32_linear;
  table.f32_linear_groups = &cpu_ops::f32_linear_groups;
  table.bf16_linear = &cpu_ops::bf16_linear;
  table.bf16_linear_groups = &cpu_ops::bf16_linear_groups;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  table.amx_linear = &cpu_ops::amx_linear;
  table.amx_linear_groups = &cpu_ops::amx_linear_groups;
#endif
  table.peak_flops = &cpu_ops::peak_flops;
  table.peak_read = &cpu_ops::peak_read;
  table.quantized_linear = &cpu_ops::quantized_linear;
  table.quantized_int8_dot = &cpu_ops::quantized_int8_dot;
  table.dequantize_rows = &cpu_ops::dequantize_rows;
  table.quantized_linear_widened = &cpu_ops::quantized_linear_widened;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
  table.quantized_linear_amx = &cpu_ops::quantized_linear_amx;
#endif
  return table;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const cpu_ops::KernelTable* lora_serve_kernel_table() {
  static const cpu_ops::KernelTable table = make_table();
  return &table;
}
