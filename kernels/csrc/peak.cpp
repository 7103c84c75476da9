// One core's multiply-add peak, from loops that do nothing else: the roofline's "instruction peak"
// (benchmarks/instruction_peak.py), the rate no implementation of the model's arithmetic can beat.
// Each probe runs independent chains of the form's widest multiply-add, enough of them to hide the
// instruction's latency, seeded at run time so the compiler can neither fold the chains nor merge them:
//   f32_fma:  vfmadd on 256-bit (AVX2) or 512-bit (AVX-512) float32 vectors, 2 FLOPs per lane;
//   bf16_dot: vdpbf16ps (AVX512-BF16), 64 FLOPs per instruction;
//   amx_bf16: tdpbf16ps on 16x16 tiles (AMX), 16 * 16 * 32 * 2 FLOPs per instruction.
// And one core's read rate (`peak_read`, the roofline's bandwidth): a buffer read as interleaved
// sequential streams with the form's widest loads, each line folded into its stream's accumulator.
#include <chrono>
#include <cstring>

#include "amx_tiles.h"
#include "lora_serve_tuning.h"
#include "ops.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cpu_ops {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

#if defined(__AVX512F__)
constexpr int kChains = tuning::kPeakChainsAvx512;
double fma_f32(int64_t iterations, double seed) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(seed * (c + 1)));
  const __m512 x = _mm512_set1_ps(static_cast<float>(seed)), y = _mm512_set1_ps(static_cast<float>(1e-3 * seed));
  const auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], x, y);
  }
  const double seconds = seconds_since(start);
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  volatile float sink = _mm512_reduce_add_ps(sum);  // the chains' results are used
  (void)sink;
  return static_cast<double>(iterations) * kChains * 32 / seconds;
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kChains = tuning::kPeakChainsAvx2;
double fma_f32(int64_t iterations, double seed) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(seed * (c + 1)));
  const __m256 x = _mm256_set1_ps(static_cast<float>(seed)), y = _mm256_set1_ps(static_cast<float>(1e-3 * seed));
  const auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], x, y);
  }
  const double seconds = seconds_since(start);
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  volatile float sink = lanes[0];
  (void)sink;
  return static_cast<double>(iterations) * kChains * 16 / seconds;
}
#else
double fma_f32(int64_t, double) { return 0.0; }
#endif

#if defined(__AVX512BF16__)
double bf16_dot(int64_t iterations, double seed) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(seed * (c + 1)));
  const __m512bh x = (__m512bh)_mm512_set1_ps(static_cast<float>(seed));
  const __m512bh y = (__m512bh)_mm512_set1_ps(static_cast<float>(1e-3 * seed));
  const auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
  }
  const double seconds = seconds_since(start);
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return static_cast<double>(iterations) * kChains * 64 / seconds;
}
#else
double bf16_dot(int64_t, double) { return 0.0; }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Four accumulator tiles (0-3) fed by two A tiles (4, 5) and two B tiles (6, 7): four independent
// chains, as the AMX matmul's inner loop runs them.
double amx_bf16(int64_t iterations, double seed) {
  configure_full_tiles();
  alignas(64) uint16_t operand[16 * 32];
  const uint16_t bits = float_to_bf16_bits(static_cast<float>(1e-3 * seed));
  for (uint16_t& value : operand) value = bits;
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double seconds = seconds_since(start);
  alignas(64) float sink_tile[16 * 16];
  _tile_stored(0, sink_tile, 64);
  volatile float sink = sink_tile[0];
  (void)sink;
  _tile_release();
  return static_cast<double>(iterations) * 4 * 16 * 16 * 32 * 2 / seconds;
}
#else
double amx_bf16(int64_t, double) { return 0.0; }
#endif

// One 64-byte line folded into an accumulator with the form's widest loads (xor: one cheap operation
// a load, and the loads cannot be dropped since the result is used).
#if defined(__AVX512F__)
using Line = __m512i;
inline Line zero_line() { return _mm512_setzero_si512(); }
inline Line fold_line(Line acc, const char* line) { return _mm512_xor_si512(acc, _mm512_load_si512(line)); }
inline uint64_t line_bits(Line acc) { return static_cast<uint64_t>(_mm512_reduce_or_epi64(acc)); }
#elif defined(__AVX2__)
using Line = __m256i;
inline Line zero_line() { return _mm256_setzero_si256(); }
inline Line fold_line(Line acc, const char* line) {
  const __m256i both = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(line)),
                                        _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 32)));
  return _mm256_xor_si256(acc, both);
}
inline uint64_t line_bits(Line acc) { return static_cast<uint64_t>(_mm256_extract_epi64(acc, 0) | _mm256_extract_epi64(acc, 3)); }
#else
using Line = uint64_t;
inline Line zero_line() { return 0; }
inline Line fold_line(Line acc, const char* line) {
  uint64_t words[8];
  std::memcpy(words, line, sizeof(words));
  for (const uint64_t word : words) acc ^= word;
  return acc;
}
inline uint64_t line_bits(Line acc) { return acc; }
#endif

// Seconds to read `bytes` (whole lines, 64-byte aligned) as `Streams` contiguous shares read side by
// side, a line of each in turn.
template <int Streams>
double read_seconds(const char* data, int64_t bytes) {
  const int64_t share = bytes / Streams / 64 * 64;
  Line acc[Streams];
  for (Line& a : acc) a = zero_line();
  const auto start = Clock::now();
  for (int64_t offset = 0; offset < share; offset += 64) {
#pragma GCC unroll 8
    for (int s = 0; s < Streams; ++s) acc[s] = fold_line(acc[s], data + s * share + offset);
  }
  const double seconds = seconds_since(start);
  uint64_t bits = 0;
  for (const Line& a : acc) bits |= line_bits(a);
  volatile uint64_t sink = bits;  // the loads' results are used
  (void)sink;
  return seconds * bytes / (share * Streams);  // as if the lines a share's rounding left out were read too
}

}  // namespace

double peak_read(const void* data, int64_t bytes, int64_t streams) {
  const char* lines = static_cast<const char*>(data);
  switch (streams) {
    case 1: return bytes / read_seconds<1>(lines, bytes);
    case 2: return bytes / read_seconds<2>(lines, bytes);
    case 4: return bytes / read_seconds<4>(lines, bytes);
    case 8: return bytes / read_seconds<8>(lines, bytes);
    default: return 0.0;
  }
}

double peak_flops(const char* kind, int64_t iterations, double seed) {
  if (std::strcmp(kind, "f32_fma") == 0) return fma_f32(iterations, seed);
  if (std::strcmp(kind, "bf16_dot") == 0) return bf16_dot(iterations, seed);
  if (std::strcmp(kind, "amx_bf16") == 0) return amx_bf16(iterations, seed);
  return 0.0;
}

}  // namespace cpu_ops
