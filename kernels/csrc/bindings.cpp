#include "cpu_ops.h"

// Whether this build has the AVX-512 attention (the thresholds in kernels/tuning.py depend on it).
static bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512);
  m.def("paged_attention", &paged_attention);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_store_kv", &rotary_store_kv);
  m.def("max_logsumexp", &max_logsumexp);
  m.def("lora_segments", &lora_segments);
  m.def("amx_ready", &amx_ready);
  m.def("amx_linear", &amx_linear);
  m.def("avx512_bf16_ready", &avx512_bf16_ready);
  m.def("avx512_bf16_linear", &avx512_bf16_linear);
}
