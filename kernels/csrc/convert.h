// The 16-bit float types of the kernels and their conversions to and from float, written as plain
// loops over raw bits so the compiler vectorises them for each form (and, for bf16 on AVX-512, as one
// 16-lane vector each way, bit for bit the same), and the rounding the reference implementations
// apply after every bf16/fp16 operation. No PyTorch headers: a form's library is compiled with its
// own instruction-set flags and must share no inline code with the bindings.
#pragma once
#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cpu_ops {

struct bf16 {
  uint16_t bits;
};

struct f16 {
  uint16_t bits;
};

inline float bf16_bits_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even, as c10::BFloat16 does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float value) {
  const uint32_t word = std::bit_cast<uint32_t>(value);
  const uint16_t rounded = static_cast<uint16_t>((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
  return (word & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : rounded;
}

// IEEE half <-> float, round to nearest even (the F16C instructions where the form has them).
inline float f16_bits_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
  return sign ? -magnitude : magnitude;
#endif
}

inline uint16_t float_to_f16_bits(float value) {
#if defined(__F16C__)
  return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
#else
  const uint32_t word = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  const uint32_t magnitude = word & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity (or is infinite)
  if (magnitude < 0x38800000u) {  // a half subnormal or zero: round |value| * 2^24 to an integer
    const float scaled = std::bit_cast<float>(magnitude) * 16777216.f;
    const float rounded = (scaled + 8388608.f) - 8388608.f;  // nearest even, |scaled| < 2^10
    return sign | static_cast<uint16_t>(rounded);
  }
  const uint32_t rebased = magnitude - (112u << 23);  // exponent rebiased from 127 to 15
  return sign | static_cast<uint16_t>((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13);
#endif
}

inline float to_float_one(float v) { return v; }
inline float to_float_one(bf16 v) { return bf16_bits_to_float(v.bits); }
inline float to_float_one(f16 v) { return f16_bits_to_float(v.bits); }

template <typename T>
inline T from_float_one(float v);
template <>
inline float from_float_one<float>(float v) { return v; }
template <>
inline bf16 from_float_one<bf16>(float v) { return bf16{float_to_bf16_bits(v)}; }
template <>
inline f16 from_float_one<f16>(float v) { return f16{float_to_f16_bits(v)}; }

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float_one(src[i]);
}

template <>
inline void to_float<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float_one<T>(src[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 bf16 values widened to float, and 16 floats rounded to bf16 as float_to_bf16_bits does (nearest
// even, any NaN 0x7fc0). `vcvtneps2bf16` rounds the same but flushes subnormals to zero and keeps a
// NaN's sign, so with AVX512-BF16 it converts the vectors with neither (2.5-4% of the LoRA op's warm
// decode time, whose y update this is, on AMD Zen 5) and the integer rounding takes the rest.
inline __m512 bf16x16_to_float(const uint16_t* bits) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void float_to_bf16x16(__m512 values, uint16_t* bits) {
#if defined(__AVX512BF16__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(values, 0xa1) == 0, 1)) {  // no NaN, no subnormal
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
    return;
  }
#endif
  const __m512i word = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(word, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(word, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  // NaN by one compare, and the shift merged with its replacement: two operations fewer than masking
  // and comparing the bits (the LoRA op's accumulation into y ran 2-4% faster, AVX-512 form, Xeon).
  const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  const __m512i rounded = _mm512_mask_srli_epi32(_mm512_set1_epi32(0x7fc0), static_cast<__mmask16>(~nan), biased, 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), _mm512_cvtepi32_epi16(rounded));
}
#endif

// The value a float takes once stored as T (identity for float).
template <typename T>
inline float round_to(float value) { return to_float_one(from_float_one<T>(value)); }

template <>
inline float round_to<float>(float value) { return value; }

}  // namespace cpu_ops
