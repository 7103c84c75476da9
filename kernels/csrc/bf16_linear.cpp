// y = x @ W.T in bf16 with float32 accumulation, on AVX512-BF16 (`vdpbf16ps`), for CPUs without AMX.
//
// Why not oneDNN: on the development CPU (AMD Zen 5) its prepacked bf16 matmul ran the SmolLM2
// projections at 280-400 GFLOP/s for 16-96 rows with the weights out of cache (a decode step's
// case), against an instruction peak of ~505; this kernel runs them at 450-465 (figures against
// oneDNN at 1-2048 rows in kernels/tuning.py).
//
// Layout: W [N, K] is packed once (kernels.linear.pack_linear_weight) into blocks of 16 output
// columns, each running over K in pairs: packed[n_block][k_pair][column (16)][2], so one k-pair of a
// block is one 64-byte vector, the operand `vdpbf16ps` multiplies with a broadcast pair of x.
// The microkernel holds an 8-row x 48-column output tile in 24 float32 registers; a k-pair costs 3
// vector loads and 8 broadcasts for 24 multiply-adds. Column groups (48 columns) are the outer loop:
// a group's weights are read from memory once and from cache by its other row blocks, and the next
// group's weights are requested while this one computes, spread over all its k-pairs, so that
// memory stays busy. Each output element is accumulated in float32 and rounded to bf16 once, as the
// reference (a float32 matmul of the same inputs, rounded) does.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "convert.h"
#include "lora_serve_tuning.h"
#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace cpu_ops {
namespace {

constexpr int kRows = tuning::kBf16LinearTileRows;  // rows of the output tile
constexpr int kVectors = tuning::kBf16LinearTileVectors;  // 16-column vectors of the output tile
static_assert(kRows >= 1 && kRows <= 8 && kVectors >= 1 && kVectors <= 3, "multiply_rows instantiates 1-8 rows, 1-3 vectors");
constexpr int64_t kColumns = 16;  // output columns per packed block

// Lines [first_line, end_line) of `upcoming` are requested, spread evenly over the k-pairs.
template <int MR, int NV>
inline void multiply_tile(const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t b_block_stride, int64_t k_pairs,
                          const char* upcoming, int64_t first_line, int64_t end_line, float* c, int64_t ldc) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t lines = end_line - first_line;
  int64_t line = first_line, credit = 0;  // integer steps, not a division per k-pair
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    for (credit += lines; credit >= k_pairs; credit -= k_pairs) _mm_prefetch(upcoming + 64 * line++, _MM_HINT_T0);
    __m512bh weights[NV];
    for (int v = 0; v < NV; ++v) weights[v] = (__m512bh)_mm512_loadu_si512(b + v * b_block_stride + kp * 2 * kColumns);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, weights[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}

// The tile of `rows` (1..kRows) rows: one instantiation per row count keeps every accumulator in a register.
template <int NV>
void multiply_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t b_block_stride,
                   int64_t k_pairs, const char* upcoming, int64_t first_line, int64_t end_line, float* c, int64_t ldc) {
#define LORA_SERVE_TILE(MR) \
  multiply_tile<MR, NV>(x, ldx, b, b_block_stride, k_pairs, upcoming, first_line, end_line, c, ldc)
  switch (rows) {
    case 8: LORA_SERVE_TILE(8); break;
    case 7: LORA_SERVE_TILE(7); break;
    case 6: LORA_SERVE_TILE(6); break;
    case 5: LORA_SERVE_TILE(5); break;
    case 4: LORA_SERVE_TILE(4); break;
    case 3: LORA_SERVE_TILE(3); break;
    case 2: LORA_SERVE_TILE(2); break;
    default: LORA_SERVE_TILE(1); break;
  }
#undef LORA_SERVE_TILE
}

}  // namespace

int64_t bf16_linear_groups(int64_t n) { return (n / kColumns + kVectors - 1) / kVectors; }

// Column groups [begin, end) of kVectors blocks of 16 output columns.
void bf16_linear(const LinearArgs& args, int64_t begin, int64_t end) {
  const int64_t rows = args.rows, k = args.k, n = args.n;
  const int64_t k_pairs = k / 2, blocks = n / kColumns;
  const int64_t row_tiles = (rows + kRows - 1) / kRows, block_stride = k_pairs * 2 * kColumns;
  alignas(64) float tile[kRows * kVectors * 16];
  for (int64_t group = begin; group < end; ++group) {
    const int64_t first_block = group * kVectors, vectors = std::min<int64_t>(kVectors, blocks - first_block);
    const uint16_t* b_group = args.packed + first_block * block_stride;
    const int64_t next_vectors = group + 1 < end ? std::min<int64_t>(kVectors, blocks - first_block - vectors) : 0;
    const char* upcoming = reinterpret_cast<const char*>(b_group + vectors * block_stride);
    const int64_t upcoming_lines = next_vectors * block_stride * 2 / 64;
    for (int64_t rt = 0; rt < row_tiles; ++rt) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kRows, rows - rt * kRows));
      const int64_t first_line = rt * upcoming_lines / row_tiles, end_line = (rt + 1) * upcoming_lines / row_tiles;
      const uint16_t* x_rows = args.x + rt * kRows * k;
      constexpr int64_t ldc = kVectors * 16;
      if (vectors == 3)
        multiply_rows<3>(tile_rows, x_rows, k, b_group, block_stride, k_pairs, upcoming, first_line, end_line, tile, ldc);
      else if (vectors == 2)
        multiply_rows<2>(tile_rows, x_rows, k, b_group, block_stride, k_pairs, upcoming, first_line, end_line, tile, ldc);
      else
        multiply_rows<1>(tile_rows, x_rows, k, b_group, block_stride, k_pairs, upcoming, first_line, end_line, tile, ldc);
      for (int r = 0; r < tile_rows; ++r) {
        uint16_t* out_row = args.out + (rt * kRows + r) * n + first_block * kColumns;
#pragma omp simd
        for (int64_t col = 0; col < vectors * 16; ++col) out_row[col] = float_to_bf16_bits(tile[r * ldc + col]);
      }
    }
  }
}

}  // namespace cpu_ops

#endif  // __AVX512BF16__
