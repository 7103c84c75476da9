// An exponential the compiler vectorises inside `omp simd` loops (glibc's vector expf is only
// declared under -ffast-math, which we do not use: it would change every float op of the library).
// Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial; within 2 ulp of expf.
// Inputs are clamped to [-87.3, 88]: below, it returns ~1e-38 where expf returns smaller values
// or 0, and above, exp(88); no softmax (inputs <= 0) or sigmoid of ours can tell these apart.
#pragma once
#include <cmath>
#include <cstdint>
#include <bit>

namespace cpu_ops {

inline float vector_exp(float x) {
  // Comparisons rather than fmin/fmax, which do not vectorise (their NaN rule); NaN stays NaN.
  x = x < -87.3365447505531f ? -87.3365447505531f : x;
  x = x > 88.f ? 88.f : x;  // keeps 2^k finite
  // Round to nearest by the 1.5 * 2^23 trick.
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;  // 2^k
  return y * std::bit_cast<float>(bits);
}

}  // namespace cpu_ops
