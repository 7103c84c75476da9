// Matmuls over weights kept in GGML's block layouts (kernels/quantized.py: Q8_0, Q4_0, Q4_1, Q4_K,
// Q5_K, Q6_K), and their widening to float32 or bf16 rows.
//
// `quantized_linear` (decode-sized batches): each weight row is unpacked once into signed int8
// values, a float scale for each 16 of them and a float offset for each 32 (w = scale * q + offset,
// the form every type shares), in L1; x is quantized per block of 32 to int8 (scale amax / 127, as
// Q8_0 is) once per call; each block's 32 products are int8 dot products summed in int32, scaled in
// float32. The error is x's quantization only: at most (amax of x's block / 254) * sum(|w|) over
// the block, per block (tests/kernels/test_quantized_linear.py holds the kernels to that bound).
// The dot product of 32 int8 pairs: `vpdpbusd` (AVX512-VNNI, or its VEX twin AVX-VNNI) multiplies
// four pairs into each int32 lane in one instruction; without VNNI, `vpmaddubsw` + `vpmaddwd` (two);
// the generic form plain loops. VNNI is no compile flag of any form (not every AVX-512 CPU has it:
// Skylake-SP lacks it; not every AVX2 CPU has AVX-VNNI), so the bindings read it from `cpuid` and
// say so in the args; the instruction is written as inline assembly, so no form needs its flag.
//
// `dequantize_rows` (prefill-sized batches): rows widened to float32 exactly as
// kernels.reference.dequantize computes them (bit for bit), or rounded once to bf16, for the
// library matmul that follows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace cpu_ops {
namespace {

constexpr int64_t kXBlock = 32;  // x's quantization block, and the unit of every unpacked weight block

// GGML type numbers (kernels/quantized.py BLOCK_TYPES).
enum GgmlType : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct BlockShape {
  int64_t elements, bytes;
};

BlockShape block_shape(int32_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    default: return {256, 210};  // Q6_K (the bindings refuse any other type)
  }
}

bool has_offsets(int32_t type) { return type == kQ4_1 || type == kQ4_K || type == kQ5_K; }

float half_at(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return f16_bits_to_float(bits);
}

// One weight row unpacked: w[j] = scales[j / 16] * q[j] + offsets[j / 32], each float product as
// the reference computes it (a type's step d * scale is one float32 product, then times q).
struct UnpackedRow {
  int8_t* q;  // [k]
  float* scales;  // [k / 16]
  float* offsets;  // [k / 32]
};

// The 32-element sub-block `s` of a GGML block: 32 quants into q, its scale into the two 16-halves
// and its offset. Each type's layout: kernels/quantized.py.
void unpack_q8_0(const uint8_t* block, UnpackedRow row) {
  const float d = half_at(block);
  std::memcpy(row.q, block + 2, 32);
  row.scales[0] = row.scales[1] = d;
  row.offsets[0] = 0.f;
}

// `count` packed bytes' low nibbles into q[0, count), their high nibbles into q[count, 2 count), each
// minus `bias` (count: 16 or 32).
inline void split_nibbles(const uint8_t* packed, int count, int8_t bias, int8_t* q) {
#if defined(__AVX2__)
  const __m128i mask = _mm_set1_epi8(15), shift = _mm_set1_epi8(bias);
  for (int i = 0; i < count; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_sub_epi8(_mm_and_si128(bytes, mask), shift));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + count + i),
                     _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), shift));
  }
#else
  for (int i = 0; i < count; ++i) {
    q[i] = static_cast<int8_t>((packed[i] & 15) - bias);
    q[i + count] = static_cast<int8_t>((packed[i] >> 4) - bias);
  }
#endif
}

void unpack_q4_0(const uint8_t* block, UnpackedRow row) {
  split_nibbles(block + 2, 16, 8, row.q);
  row.scales[0] = row.scales[1] = half_at(block);
  row.offsets[0] = 0.f;
}

void unpack_q4_1(const uint8_t* block, UnpackedRow row) {
  split_nibbles(block + 4, 16, 0, row.q);
  row.scales[0] = row.scales[1] = half_at(block);
  row.offsets[0] = half_at(block + 2);
}

// The 6-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K block from its 12 packed bytes.
void k_scale_min(const uint8_t* packed, int s, int& scale, int& min) {
  if (s < 4) {
    scale = packed[s] & 63;
    min = packed[s + 4] & 63;
  } else {
    scale = (packed[s + 4] & 15) | ((packed[s - 4] >> 2) & 0x30);
    min = (packed[s + 4] >> 4) | ((packed[s] >> 2) & 0x30);
  }
}

// Q4_K and Q5_K (kHigh: the fifth bits in qh, bytes 16..47, before the nibbles).
template <bool kHigh>
void unpack_k(const uint8_t* block, UnpackedRow row) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* high = block + 16;
  const uint8_t* nibbles = block + (kHigh ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    int scale, min;
    k_scale_min(block + 4, s, scale, min);
    int8_t* q = row.q + 32 * s;
    if (s % 2 == 0) split_nibbles(nibbles + 16 * s, 32, 0, q);  // sub-blocks s and s + 1
    if constexpr (kHigh) {
      for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q[i] | (((high[i] >> s) & 1) << 4));
    }
    row.scales[2 * s] = row.scales[2 * s + 1] = d * static_cast<float>(scale);
    row.offsets[s] = -(dmin * static_cast<float>(min));
  }
}

// Q6_K: element j = 128 h + r takes its low 4 bits from ql[64 h + r % 64] (high nibble for r >= 64)
// and its top 2 from qh[32 h + r % 32] (bits 2 (r / 32)), minus 32; scale d * scales[j / 16].
void unpack_q6_k(const uint8_t* block, UnpackedRow row) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const float d = half_at(block + 208);
  for (int h = 0; h < 2; ++h) {
    for (int quarter = 0; quarter < 4; ++quarter) {  // r = 32 quarter + e: each a contiguous run
      const uint8_t* low = ql + 64 * h + 32 * (quarter % 2);
      const uint8_t* top = qh + 32 * h;
      const int low_shift = 4 * (quarter / 2), top_shift = 2 * quarter;
      int8_t* q = row.q + 128 * h + 32 * quarter;
#if defined(__AVX2__)
      // 16-bit shifts then byte masks: the bits a byte takes from its neighbour are masked off.
      const __m256i lows = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low));
      const __m256i tops = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top));
      const __m256i low_bits = _mm256_and_si256(_mm256_srl_epi16(lows, _mm_cvtsi32_si128(low_shift)), _mm256_set1_epi8(15));
      const __m256i top_bits = _mm256_and_si256(_mm256_srl_epi16(tops, _mm_cvtsi32_si128(top_shift)), _mm256_set1_epi8(3));
      const __m256i values = _mm256_or_si256(low_bits, _mm256_slli_epi16(top_bits, 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_sub_epi8(values, _mm256_set1_epi8(32)));
#else
      for (int e = 0; e < 32; ++e)
        q[e] = static_cast<int8_t>((((low[e] >> low_shift) & 15) | (((top[e] >> top_shift) & 3) << 4)) - 32);
#endif
    }
  }
  for (int s = 0; s < 16; ++s) row.scales[s] = d * static_cast<float>(static_cast<int8_t>(block[192 + s]));
  for (int s = 0; s < 8; ++s) row.offsets[s] = 0.f;
}

// The blocks of one row, each unpacked by kUnpack (the type chosen once per row, not per block).
template <void (*kUnpack)(const uint8_t*, UnpackedRow), int64_t kElements, int64_t kBytes>
void unpack_blocks(const uint8_t* blocks, int64_t k, UnpackedRow row) {
  for (int64_t b = 0; b < k / kElements; ++b) {
    const int64_t first = b * kElements;
    kUnpack(blocks + b * kBytes, {row.q + first, row.scales + first / 16, row.offsets + first / 32});
  }
}

// Unpacks the `k` weights of one row of blocks.
void unpack_row(int32_t type, const uint8_t* blocks, int64_t k, UnpackedRow row) {
  switch (type) {
    case kQ8_0: return unpack_blocks<unpack_q8_0, 32, 34>(blocks, k, row);
    case kQ4_0: return unpack_blocks<unpack_q4_0, 32, 18>(blocks, k, row);
    case kQ4_1: return unpack_blocks<unpack_q4_1, 32, 20>(blocks, k, row);
    case kQ4_K: return unpack_blocks<unpack_k<false>, 256, 144>(blocks, k, row);
    case kQ5_K: return unpack_blocks<unpack_k<true>, 256, 176>(blocks, k, row);
    default: return unpack_blocks<unpack_q6_k, 256, 210>(blocks, k, row);
  }
}

// The elements of x's rows (and of an unpacked weight row) a kernel step multiplies: two blocks of
// 32 on AVX-512 (a zmm), one elsewhere.
#if defined(__AVX512BW__)
constexpr int64_t kXStep = 64;
#else
constexpr int64_t kXStep = 32;
#endif
constexpr int64_t kLanesPerStep = kXStep / 4;  // int32 lanes of a step's dot products, 4 products each

// x [rows, k] quantized per block of 32: q = round(x / d) with d = amax / 127, and d * sum(q) (what a
// block's offset multiplies). q and d are stored step-major, so that a pass over some rows finds
// each row's part of a step at a fixed offset from the first's: q [steps, rows, kXStep], d once per
// int32 lane [steps, rows, kLanesPerStep] (loaded as a vector beside the lanes it scales). A row of
// an odd number of blocks ends in half a step, padded with zeros (q and d).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> lane_scales;
  std::vector<float> scaled_sums;  // [rows, k / 32]
};

// Rows of QuantizedRows from one row on: row r's part of step s at q + s * rows * kXStep + r * kXStep
// (and lane_scales + (s * rows + r) * kLanesPerStep).
struct QuantizedRowsView {
  const int8_t* q;
  const float* lane_scales;
  int64_t rows, steps;  // rows: of the whole QuantizedRows (its step stride)
};

int64_t num_steps(int64_t k) { return (k + kXStep - 1) / kXStep; }

template <typename T>
void quantize_block(const T* x, int8_t* q, float* lane_scales, float& scaled_sum) {
  const float scale = quantize_x_block(x, q, scaled_sum);
  for (int i = 0; i < kXBlock / 4; ++i) lane_scales[i] = scale;
}

void quantize_rows(const QuantizedLinearArgs& args, QuantizedRows& out) {
  const int64_t num_blocks = args.k / kXBlock, steps = num_steps(args.k);
  out.q.assign(steps * args.rows * kXStep, 0);
  out.lane_scales.assign(steps * args.rows * kLanesPerStep, 0.f);
  out.scaled_sums.resize(args.rows * num_blocks);
  dispatch_dtype(args.dtype, [&]<typename T>() {
    const T* x = static_cast<const T*>(args.x);
    for (int64_t r = 0; r < args.rows; ++r) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t element = b * kXBlock, at = (element / kXStep * args.rows + r) * kXStep + element % kXStep;
        quantize_block(x + r * args.k + element, out.q.data() + at, out.lane_scales.data() + at / 4,
                       out.scaled_sums[r * num_blocks + b]);
      }
    }
  });
}

// sum over the row's blocks of its offsets times x's scaled sums: the offsets' share of the dot.
float offsets_dot(const float* offsets, const float* scaled_sums, int64_t num_blocks) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t b = 0; b < num_blocks; ++b) total += offsets[b] * scaled_sums[b];
  return total;
}

// The dots of one unpacked weight row with `rows` quantized x rows, without the offsets' share.
[[maybe_unused]] void portable_rows(const UnpackedRow& w, const QuantizedRowsView& x, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float total = 0.f;
    for (int64_t s = 0; s < x.steps; ++s) {
      const int8_t* xq = x.q + (s * x.rows + r) * kXStep;
      for (int h = 0; h < kXStep / 16; ++h) {
        const float x_scale = x.lane_scales[(s * x.rows + r) * kLanesPerStep + 4 * h];
        const int8_t* wq = w.q + s * kXStep + 16 * h;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < 16; ++i) sum += static_cast<int32_t>(wq[i]) * static_cast<int32_t>(xq[16 * h + i]);
        total += x_scale * (w.scales[s * kXStep / 16 + h] * static_cast<float>(sum));
      }
    }
    out[r] = total;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Which int8 dot product instruction the row dot uses.
enum class Int8Dot { widening, avx_vnni, avx512_vnni };
#endif

#if defined(__AVX512BW__)
// Lane i of a step's 64 products: the sum of products 4i..4i+3 of magnitude = |w| and signed_x = x
// with w's sign (`vpdpbusd` and `vpmaddubsw` take one unsigned operand; |q| <= 128 fits u8, and
// 2 * 128 * 127 fits vpmaddubsw's saturating int16 sums).
template <Int8Dot kDot>
inline __m512i dot64(__m512i magnitude, __m512i signed_x) {
  if constexpr (kDot == Int8Dot::avx512_vnni) {
    __m512i sums = _mm512_setzero_si512();
    asm("vpdpbusd %2, %1, %0" : "+v"(sums) : "v"(magnitude), "v"(signed_x));
    return sums;
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_x), _mm512_set1_epi16(1));
  }
}

// One step of R rows into acc[r]: w's magnitude, signs and scales made once for the R rows; each
// lane's int32 sum times its weight scale (one of 16 elements) times x's block scale.
template <Int8Dot kDot, int R>
__attribute__((always_inline)) inline void step64(const int8_t* w_q, const float* w_scales, const int8_t* x_q,
                                                  const float* x_scales, __m512 (&acc)[R]) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane -> its 16
  const __m512i wq = _mm512_loadu_si512(w_q);
  const __m512i magnitude = _mm512_abs_epi8(wq);
  const __mmask64 negative = _mm512_movepi8_mask(wq);
  const __m512 scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(w_scales)));
  for (int r = 0; r < R; ++r) {
    const __m512i xq = _mm512_loadu_si512(x_q + r * kXStep);
    const __m512i signed_x = _mm512_mask_sub_epi8(xq, negative, _mm512_setzero_si512(), xq);
    const __m512 sums = _mm512_cvtepi32_ps(dot64<kDot>(magnitude, signed_x));
    acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(scales, _mm512_loadu_ps(x_scales + r * kLanesPerStep)), acc[r]);
  }
}

// The dots over R rows, steps in pairs so that each row has two sums in flight.
template <Int8Dot kDot, int R>
void wide_rows_dot(const UnpackedRow& w, const QuantizedRowsView& x, float* out) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const int8_t* w_q = w.q;
  const float* w_scales = w.scales;
  const int8_t* x_q = x.q;
  const float* x_scales = x.lane_scales;
  const int64_t q_stride = x.rows * kXStep, scale_stride = x.rows * kLanesPerStep;
  int64_t s = 0;
  for (; s + 1 < x.steps; s += 2) {
    step64<kDot, R>(w_q, w_scales, x_q, x_scales, even);
    step64<kDot, R>(w_q + kXStep, w_scales + kXStep / 16, x_q + q_stride, x_scales + scale_stride, odd);
    w_q += 2 * kXStep;
    w_scales += 2 * kXStep / 16;
    x_q += 2 * q_stride;
    x_scales += 2 * scale_stride;
  }
  if (s < x.steps) step64<kDot, R>(w_q, w_scales, x_q, x_scales, even);
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

constexpr int64_t kRowsPerPass = 8;  // 16 accumulators of the 32 zmm registers

template <Int8Dot kDot>
void wide_rows(const UnpackedRow& w, const QuantizedRowsView& x, int64_t rows, float* out) {
  switch (rows) {
    case 1: return wide_rows_dot<kDot, 1>(w, x, out);
    case 2: return wide_rows_dot<kDot, 2>(w, x, out);
    case 3: return wide_rows_dot<kDot, 3>(w, x, out);
    case 4: return wide_rows_dot<kDot, 4>(w, x, out);
    case 5: return wide_rows_dot<kDot, 5>(w, x, out);
    case 6: return wide_rows_dot<kDot, 6>(w, x, out);
    case 7: return wide_rows_dot<kDot, 7>(w, x, out);
    default: return wide_rows_dot<kDot, 8>(w, x, out);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: as dot64 over one block of 32 (without AVX-512 VNNI's EVEX form).
template <Int8Dot kDot>
inline __m256i dot32(__m256i magnitude, __m256i signed_x) {
  if constexpr (kDot == Int8Dot::avx_vnni) {
    __m256i sums = _mm256_setzero_si256();
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(sums) : "x"(magnitude), "x"(signed_x));
    return sums;
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
  }
}

inline float sum_lanes(__m256 v) {
  __m128 lanes = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lanes = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));
  return _mm_cvtss_f32(_mm_add_ss(lanes, _mm_movehdup_ps(lanes)));
}

// One block of R rows into acc[r], as step64.
template <Int8Dot kDot, int R>
__attribute__((always_inline)) inline void block_rows(const int8_t* w_q, const float* w_scales, const int8_t* x_q,
                                                      const float* x_scales, __m256 (&acc)[R]) {
  const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_q));
  const __m256i magnitude = _mm256_sign_epi8(wq, wq);
  const __m256 halves = _mm256_set_m128(_mm_set1_ps(w_scales[1]), _mm_set1_ps(w_scales[0]));
  for (int r = 0; r < R; ++r) {
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_q + r * kXStep));
    const __m256 sums = _mm256_cvtepi32_ps(dot32<kDot>(magnitude, _mm256_sign_epi8(xb, wq)));
    acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(halves, _mm256_loadu_ps(x_scales + r * kLanesPerStep)), acc[r]);
  }
}

// The dots over R rows, blocks in pairs so that each row has two sums in flight.
template <Int8Dot kDot, int R>
void vector_rows_dot(const UnpackedRow& w, const QuantizedRowsView& x, float* out) {
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  const int8_t* w_q = w.q;
  const float* w_scales = w.scales;
  const int8_t* x_q = x.q;
  const float* x_scales = x.lane_scales;
  const int64_t q_stride = x.rows * kXStep, scale_stride = x.rows * kLanesPerStep;
  int64_t s = 0;
  for (; s + 1 < x.steps; s += 2) {
    block_rows<kDot, R>(w_q, w_scales, x_q, x_scales, even);
    block_rows<kDot, R>(w_q + kXStep, w_scales + 2, x_q + q_stride, x_scales + scale_stride, odd);
    w_q += 2 * kXStep;
    w_scales += 4;
    x_q += 2 * q_stride;
    x_scales += 2 * scale_stride;
  }
  if (s < x.steps) block_rows<kDot, R>(w_q, w_scales, x_q, x_scales, even);
  for (int r = 0; r < R; ++r) out[r] = sum_lanes(_mm256_add_ps(even[r], odd[r]));
}

constexpr int64_t kRowsPerPass = 4;  // 8 accumulators of the 16 ymm registers

template <Int8Dot kDot>
void vector_rows(const UnpackedRow& w, const QuantizedRowsView& x, int64_t rows, float* out) {
  switch (rows) {
    case 1: return vector_rows_dot<kDot, 1>(w, x, out);
    case 2: return vector_rows_dot<kDot, 2>(w, x, out);
    case 3: return vector_rows_dot<kDot, 3>(w, x, out);
    default: return vector_rows_dot<kDot, 4>(w, x, out);
  }
}
#else
constexpr int64_t kRowsPerPass = 4;
#endif

// The dots of a weight row with up to kRowsPerPass x rows (out[r]), without the offsets' share.
using RowsDot = void (*)(const UnpackedRow&, const QuantizedRowsView&, int64_t rows, float* out);

// The best rows dot of this form on this CPU (args.has_avx_vnni / has_avx512_vnni, from cpuid); an
// AVX-512 CPU with AVX-VNNI but not AVX512-VNNI widens (its zmm steps have no VEX dot product).
RowsDot choose_rows_dot(const QuantizedLinearArgs& args) {
#if defined(__AVX512BW__)
  if (args.has_avx512_vnni) return &wide_rows<Int8Dot::avx512_vnni>;
  return &wide_rows<Int8Dot::widening>;
#elif defined(__AVX2__) && defined(__FMA__)
  if (args.has_avx_vnni) return &vector_rows<Int8Dot::avx_vnni>;
  return &vector_rows<Int8Dot::widening>;
#else
  (void)args;
  return &portable_rows;
#endif
}

}  // namespace

const char* quantized_int8_dot(const QuantizedLinearArgs& args) {
#if defined(__AVX512BW__)
  return args.has_avx512_vnni ? "avx512_vnni" : "widening";
#elif defined(__AVX2__) && defined(__FMA__)
  return args.has_avx_vnni ? "avx_vnni" : "widening";
#else
  (void)args;
  return "portable";
#endif
}

// Tasks [begin, end): output columns, one weight row each (QuantizedLinearArgs). x is quantized once
// per task range (one range a thread); each weight row is unpacked once, into L1, for all rows of x.
void quantized_linear(const QuantizedLinearArgs& args, int64_t begin, int64_t end) {
  thread_local QuantizedRows x;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scales, offsets;
  quantize_rows(args, x);
  const int64_t steps = num_steps(args.k), num_blocks = args.k / kXBlock;
  q.assign(steps * kXStep, 0);  // the padding of half a step stays zero: unpacking writes k of them
  scales.assign(steps * kXStep / 16, 0.f);
  offsets.resize(num_blocks);
  const UnpackedRow row{q.data(), scales.data(), offsets.data()};
  const int64_t row_bytes = quantized_row_bytes(args.ggml_type, args.k);
  const RowsDot rows_dot = choose_rows_dot(args);
  const bool adds_offsets = has_offsets(args.ggml_type);
  dispatch_dtype(args.dtype, [&]<typename T>() {
    T* out = static_cast<T*>(args.out);
    float sums[kRowsPerPass];
    for (int64_t column = begin; column < end; ++column) {
      unpack_row(args.ggml_type, args.blocks + column * row_bytes, args.k, row);
      for (int64_t first = 0; first < args.rows; first += kRowsPerPass) {
        const int64_t rows = std::min(kRowsPerPass, args.rows - first);
        const QuantizedRowsView view{x.q.data() + first * kXStep, x.lane_scales.data() + first * kLanesPerStep,
                                     args.rows, steps};
        rows_dot(row, view, rows, sums);
        for (int64_t r = 0; r < rows; ++r) {
          const float offset =
              adds_offsets ? offsets_dot(row.offsets, x.scaled_sums.data() + (first + r) * num_blocks, num_blocks) : 0.f;
          out[(first + r) * args.out_stride + column] = from_float_one<T>(sums[r] + offset);
        }
      }
    }
  });
}

int64_t quantized_row_bytes(int32_t ggml_type, int64_t k) {
  const BlockShape shape = block_shape(ggml_type);
  return k / shape.elements * shape.bytes;
}

void unpack_quantized_row(int32_t ggml_type, const uint8_t* blocks, int64_t k, int8_t* q, float* scales, float* offsets) {
  unpack_row(ggml_type, blocks, k, {q, scales, offsets});
}

bool quantized_has_offsets(int32_t ggml_type) { return has_offsets(ggml_type); }

template <typename T>
float quantize_x_block(const T* x, int8_t* q, float& scaled_sum) {
  float values[kXBlock], amax = 0.f;
  to_float(x, values, kXBlock);
  for (int i = 0; i < kXBlock; ++i) amax = std::max(amax, std::fabs(values[i]));
  const float scale = amax / 127.f;
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < kXBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
    sum += q[i];
  }
  scaled_sum = scale * static_cast<float>(sum);
  return scale;
}

template float quantize_x_block<float>(const float*, int8_t*, float&);
template float quantize_x_block<bf16>(const bf16*, int8_t*, float&);
template float quantize_x_block<f16>(const f16*, int8_t*, float&);

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The unpacked row's weights rounded to bf16, 16 at a time: the same float products and sums as
// dequantize_row's float path.
void widen_to_bf16(const UnpackedRow& row, int64_t k, bool adds_offsets, uint16_t* out) {
  for (int64_t g = 0; g < k / 16; ++g) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.q + 16 * g));
    __m512 values = _mm512_mul_ps(_mm512_set1_ps(row.scales[g]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    if (adds_offsets) values = _mm512_add_ps(values, _mm512_set1_ps(row.offsets[g / 2]));
    float_to_bf16x16(values, out + 16 * g);
  }
}
#endif

}  // namespace

void dequantize_row(int32_t ggml_type, const uint8_t* blocks, int64_t k, DType dtype, void* out) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scales, offsets, values;
  q.resize(k);
  scales.resize(k / 16);
  offsets.resize(k / kXBlock);
  unpack_row(ggml_type, blocks, k, {q.data(), scales.data(), offsets.data()});
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (dtype == DType::bf16) {
    widen_to_bf16({q.data(), scales.data(), offsets.data()}, k, has_offsets(ggml_type), static_cast<uint16_t*>(out));
    return;
  }
#endif
  values.resize(k);
  // The reference's order: scale * q, then the offset added (Q4_1: + m; K-quants: - dmin * min);
  // none added to the other types, whose zero products keep their sign there.
  for (int64_t g = 0; g < k / 16; ++g) {
    const float scale = scales[g];
#pragma omp simd
    for (int64_t i = 0; i < 16; ++i) values[16 * g + i] = scale * static_cast<float>(q[16 * g + i]);
  }
  if (has_offsets(ggml_type)) {
    for (int64_t b = 0; b < k / kXBlock; ++b) {
      const float offset = offsets[b];
#pragma omp simd
      for (int64_t i = 0; i < kXBlock; ++i) values[kXBlock * b + i] += offset;
    }
  }
  dispatch_dtype(dtype, [&]<typename T>() { from_float(values.data(), static_cast<T*>(out), k); });
}

// Rows [begin, end) of out [rows, k] (float32 or bf16) = the rows of blocks, as
// kernels.reference.dequantize (rounded once to bf16).
void dequantize_rows(const DequantizeArgs& args, int64_t begin, int64_t end) {
  const int64_t row_bytes = quantized_row_bytes(args.ggml_type, args.k);
  const int64_t element_bytes = args.dtype == DType::f32 ? 4 : 2;
  for (int64_t r = begin; r < end; ++r)
    dequantize_row(args.ggml_type, args.blocks + r * row_bytes, args.k, args.dtype,
                   static_cast<char*>(args.out) + r * args.k * element_bytes);
}

}  // namespace cpu_ops
