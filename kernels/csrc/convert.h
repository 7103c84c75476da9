// Row conversions between the tensor dtypes and float, written as plain loops over raw bits so the
// compiler vectorises them (c10's scalar conversions do not), and the rounding the reference
// implementations apply after every bf16/fp16 operation.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <bit>

namespace cpu_ops {

inline float bf16_bits_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// Round to nearest even, as c10::BFloat16 does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float value) {
  const uint32_t word = std::bit_cast<uint32_t>(value);
  const uint16_t rounded = static_cast<uint16_t>((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
  return (word & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : rounded;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(bits[i]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void from_float<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = float_to_bf16_bits(src[i]);
}

// The value a float takes once stored as T (identity for float).
template <typename T>
inline float round_to(float value) { return static_cast<float>(static_cast<T>(value)); }

template <>
inline float round_to<float>(float value) { return value; }

template <>
inline float round_to<c10::BFloat16>(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

}  // namespace cpu_ops
