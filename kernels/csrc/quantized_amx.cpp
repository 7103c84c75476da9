// y = x @ W.T over weights in GGML's block layouts on AMX-INT8 tiles (`tdpbssd`), for batches of rows
// where the int8 dot products of quantized.cpp re-read each weight row once per pass of 8 rows and
// the widened tiles (quantized_tiles.cpp) pay for widening every weight to bf16.
//
// The same arithmetic as quantized.cpp's int8 path, hence its error bound: x quantized per block of
// 32 to int8 (quantize_x_block), the weights as int8 with a float scale per 16 and an offset per 32
// (unpack_quantized_row). A tile product spans one scale group of K (kStep: 32 elements, or 16 for
// Q6_K, whose scales are per 16), so that each int32 sum of the tile is one group's, and is scaled in
// float32 by the weight row's scale times x's block scale and summed over the groups; the offsets add
// offset * d * sum(q) per block, as in quantized.cpp.
//
// Operands: 32 weight rows (a task) as the row operand, 16 rows a tile, straight from their rows (no
// transposition): Q8_0's from the blocks themselves (a block is one step: its f16 scale, then 32
// int8), every other type's unpacked first into an L2 buffer; x packed once per call (per thread) as
// the column operand, blocks of 16 rows with each 4 consecutive elements of a row together:
// x_packed[row_block][k / 4][16][4]. The int32 tiles [16 weight rows][16 x rows] are stored and
// scaled into a float32 block [32 weight rows][32 x rows], written transposed into out once. Figures
// (benchmarks/quantized.py --kernels) and the row thresholds that follow from them: kernels/tuning.py.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <immintrin.h>

#include "amx_tiles.h"

namespace cpu_ops {
namespace {

constexpr int64_t kGroupRows = 32;  // weight rows unpacked together: a task
constexpr int64_t kRowBlock = 16;  // x rows per packed block (a tile's columns)
constexpr int64_t kXBlock = 32;  // x's quantization block
constexpr int32_t kQ8_0 = 8, kQ6_K = 14;  // GGML types: Q6_K's scales are per 16 elements
constexpr int64_t kQ8_0Bytes = 34;  // a Q8_0 block: an f16 scale, then 32 int8

// Bytes from one unpacked weight row to the next: k and a line more, so that a tile's 16 rows do not
// all fall in one L1 set when k is a multiple of 4 KiB.
int64_t unpacked_stride(int64_t k) { return k + 64; }

// x [rows, k] quantized per block of 32, as tiles' column operands: q [row_blocks][k / 4][16][4],
// and per block of 32 its 16 rows' scales and scaled sums [row_blocks][k / 32][16] (rows past x's
// zero, so their products and sums are zero).
struct PackedX {
  std::vector<int8_t> q;
  std::vector<float> scales, scaled_sums;
};

template <typename T>
void pack_x(const T* x, int64_t rows, int64_t k, int64_t row_blocks, PackedX& packed) {
  const int64_t num_blocks = k / kXBlock;
  packed.q.assign(row_blocks * kRowBlock * k, 0);
  packed.scales.assign(row_blocks * num_blocks * kRowBlock, 0.f);
  packed.scaled_sums.assign(row_blocks * num_blocks * kRowBlock, 0.f);
  int8_t q[kXBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row_block = r / kRowBlock, lane = r % kRowBlock;
    int8_t* block_q = packed.q.data() + row_block * kRowBlock * k + lane * 4;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t at = (row_block * num_blocks + b) * kRowBlock + lane;
      packed.scales[at] = quantize_x_block(x + r * k + b * kXBlock, q, packed.scaled_sums[at]);
      for (int64_t group = 0; group < kXBlock / 4; ++group)
        std::memcpy(block_q + (b * kXBlock / 4 + group) * kRowBlock * 4, q + 4 * group, 4);
    }
  }
}

// Weight rows [first, first + kGroupRows) unpacked (rows past n zero); returns how many are weight rows.
struct UnpackedGroup {
  std::vector<int8_t> q;  // [kGroupRows][unpacked_stride(k)]
  std::vector<float> scales;  // [kGroupRows][k / 16]
  std::vector<float> offsets;  // [kGroupRows][k / 32]
};

int64_t unpack_group(const QuantizedLinearArgs& args, int64_t first, UnpackedGroup& group) {
  const int64_t count = std::min(kGroupRows, args.n - first), stride = unpacked_stride(args.k);
  const int64_t row_bytes = quantized_row_bytes(args.ggml_type, args.k);
  for (int64_t c = 0; c < count; ++c)
    unpack_quantized_row(args.ggml_type, args.blocks + (first + c) * row_bytes, args.k, group.q.data() + c * stride,
                         group.scales.data() + c * (args.k / 16), group.offsets.data() + c * (args.k / kXBlock));
  std::memset(group.q.data() + count * stride, 0, (kGroupRows - count) * stride);
  std::fill(group.scales.begin() + count * (args.k / 16), group.scales.end(), 0.f);
  std::fill(group.offsets.begin() + count * (args.k / kXBlock), group.offsets.end(), 0.f);
  return count;
}

// Tiles 0-3: int32 sums [16 weight rows][16 x rows] (weight tile i, x block j at 2 i + j); 4-5: the
// two weight tiles of a step (16 rows of kStep int8); 6-7: x's two row blocks of that step (kStep / 4
// rows of 16 x 4 int8).
template <int64_t kStep>
void configure_int8_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t >= 6 ? kStep / 4 : 16;
    config.bytes_per_row[t] = t == 4 || t == 5 ? kStep : 64;
  }
  _tile_loadconfig(&config);
}

// acc[16 weight rows][32 x rows] (row stride 32) += sums[n][m] * weight_scales[n] * x_scales[m]
// (+ offsets[n] * scaled_sums[m] where the type has offsets): one int32 tile of one step.
template <bool kOffsets>
inline void scale_tile(const int32_t* sums, const float* weight_scales, const float* x_scales, const float* offsets,
                       int64_t offset_stride, const float* scaled_sums, float* acc) {
  const __m512 x_scale = _mm512_loadu_ps(x_scales);
  [[maybe_unused]] __m512 x_sums;
  if constexpr (kOffsets) x_sums = _mm512_loadu_ps(scaled_sums);
  for (int n = 0; n < 16; ++n) {
    const __m512 products = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 16 * n));
    __m512 total = _mm512_fmadd_ps(products, _mm512_mul_ps(x_scale, _mm512_set1_ps(weight_scales[n])),
                                   _mm512_loadu_ps(acc + 2 * kRowBlock * n));
    if constexpr (kOffsets) total = _mm512_fmadd_ps(_mm512_set1_ps(offsets[n * offset_stride]), x_sums, total);
    _mm512_storeu_ps(acc + 2 * kRowBlock * n, total);
  }
}

// The group's 32 weight rows as the tiles read them: step s's row-operand tiles at q + s * step_bytes,
// rows `stride` apart. Unpacked (UnpackedGroup), or, for a whole group of Q8_0 rows, the blocks as
// they are: a Q8_0 block is one step's 32 int8 after its f16 scale, so its tiles load straight from
// the blocks and nothing is unpacked (unpacking, a pass through L2, cost as much as the multiplying).
struct Weights {
  const int8_t* q;
  int64_t stride, step_bytes;
  const float* scales;  // unpacked: [32][k / 16]; null for Q8_0 blocks (their f16 scales are read)
  const float* offsets;  // [32][k / 32]

  // The scales of the 32 rows at `step` (of kStep elements), gathered 16 rows at a time (one at a
  // time, they cost half as much as the scaling they feed).
  template <int64_t kStep>
  void step_scales(int64_t step, int64_t k, float* out) const {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int half = 0; half < 2; ++half) {
      const __m512i rows = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * half));
      __m512 values;
      if (scales == nullptr) {  // each f16 in the low half of the dword gathered from 2 bytes before the step
        const __m512i words = _mm512_i32gather_epi32(_mm512_mullo_epi32(rows, _mm512_set1_epi32(static_cast<int32_t>(stride))),
                                                     q + step * step_bytes - 2, 1);
        values = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
      } else {
        values = _mm512_i32gather_ps(_mm512_mullo_epi32(rows, _mm512_set1_epi32(static_cast<int32_t>(k / 16))),
                                     scales + step * kStep / 16, 4);
      }
      _mm512_storeu_ps(out + 16 * half, values);
    }
  }
};

// The int32 sums of one step into sums[2 i + j] (weight tile i, x row block rb + j of kBlocks).
template <int kBlocks>
inline void multiply_step(const int8_t* weights, int64_t stride, const int8_t* x_q, int64_t block_elements,
                          int32_t (*sums)[16 * 16]) {
  _tile_loadd(4, weights, stride);
  _tile_loadd(5, weights + 16 * stride, stride);
  _tile_loadd(6, x_q, 64);
  _tile_zero(0);
  _tile_zero(2);
  _tile_dpbssd(0, 4, 6);
  _tile_dpbssd(2, 5, 6);
  if constexpr (kBlocks == 2) {
    _tile_loadd(7, x_q + block_elements, 64);
    _tile_zero(1);
    _tile_zero(3);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(1, sums[1], 64);
    _tile_stored(3, sums[3], 64);
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(2, sums[2], 64);
}

// Lines of the next group's blocks requested into L2 while this one multiplies, a share each step,
// so that its unpacking reads L2 rather than memory (unpacking first, then multiplying, left memory
// idle through the multiplications: they took as long as the unpacking that read the weights).
struct Upcoming {
  const char* next;
  int64_t lines_per_step, lines_left;

  void step() {
    for (int64_t line = 0; line < std::min(lines_per_step, lines_left); ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T1);
    const int64_t done = std::min(lines_per_step, lines_left);
    next += 64 * done;
    lines_left -= done;
  }
};

// The float32 sums acc [32 weight rows][32 x rows] of the group's weight rows with the x rows of
// row blocks rb and rb + 1 (kBlocks of them: 1 or 2), over every step of K. The tiles of step s + 1
// run before the scaling of step s, so that the tile unit and the vector units overlap (in step
// order, each step waited for its own tile stores).
template <int64_t kStep, bool kOffsets, int kBlocks>
void multiply_blocks(const Weights& weights, const PackedX& x, int64_t k, int64_t rb, Upcoming& upcoming, float* acc) {
  alignas(64) int32_t sums[2][4][16 * 16];
  alignas(64) float weight_scales[kGroupRows];
  const int64_t stride = weights.stride, offset_stride = k / kXBlock;
  const int64_t num_blocks = k / kXBlock, block_elements = kRowBlock * k, steps = k / kStep;
  const int8_t* x_q = x.q.data() + rb * block_elements;
  std::fill(acc, acc + kGroupRows * 2 * kRowBlock, 0.f);
  multiply_step<kBlocks>(weights.q, stride, x_q, block_elements, sums[0]);
  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps)
      multiply_step<kBlocks>(weights.q + (step + 1) * weights.step_bytes, stride, x_q + (step + 1) * kStep * kRowBlock,
                             block_elements, sums[(step + 1) % 2]);
    upcoming.step();
    weights.step_scales<kStep>(step, k, weight_scales);
    const int64_t element = step * kStep, block = element / kXBlock;
    const bool adds_offsets = kOffsets && element % kXBlock == 0;  // once per block (kStep is 32 then)
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < kBlocks; ++j) {
        const int64_t x_at = ((rb + j) * num_blocks + block) * kRowBlock;
        const float* offsets = weights.offsets + 16 * i * offset_stride + block;
        float* acc_tile = acc + 16 * i * 2 * kRowBlock + 16 * j;
        if (adds_offsets)
          scale_tile<true>(sums[step % 2][2 * i + j], weight_scales + 16 * i, x.scales.data() + x_at, offsets,
                           offset_stride, x.scaled_sums.data() + x_at, acc_tile);
        else
          scale_tile<false>(sums[step % 2][2 * i + j], weight_scales + 16 * i, x.scales.data() + x_at, offsets,
                            offset_stride, x.scaled_sums.data() + x_at, acc_tile);
      }
    }
  }
}

// out[first_row + m, first_column + n] = acc[n][m] for the group's `columns` weight rows and the
// x rows of the two row blocks that exist.
template <typename T>
void store_transposed(const float* acc, int64_t columns, int64_t first_row, const QuantizedLinearArgs& args,
                      int64_t first_column) {
  T* out = static_cast<T*>(args.out);
  const int64_t rows = std::min(2 * kRowBlock, args.rows - first_row);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < columns; ++n)
      out[(first_row + m) * args.out_stride + first_column + n] = from_float_one<T>(acc[n * 2 * kRowBlock + m]);
}

template <int64_t kStep, bool kOffsets>
void multiply_group(const Weights& group, const PackedX& x, int64_t row_blocks, int64_t columns,
                    const QuantizedLinearArgs& args, int64_t first_column, Upcoming upcoming) {
  alignas(64) float acc[kGroupRows * 2 * kRowBlock];
  for (int64_t rb = 0; rb < row_blocks; rb += 2) {
    if (rb + 1 < row_blocks)
      multiply_blocks<kStep, kOffsets, 2>(group, x, args.k, rb, upcoming, acc);
    else
      multiply_blocks<kStep, kOffsets, 1>(group, x, args.k, rb, upcoming, acc);
    dispatch_dtype(args.dtype, [&]<typename T>() { store_transposed<T>(acc, columns, rb * kRowBlock, args, first_column); });
  }
}

template <int64_t kStep, bool kOffsets>
void multiply_groups(const QuantizedLinearArgs& args, const PackedX& x, int64_t row_blocks, int64_t begin, int64_t end) {
  thread_local UnpackedGroup group;
  group.q.resize(kGroupRows * unpacked_stride(args.k));
  group.scales.resize(kGroupRows * args.k / 16);
  group.offsets.resize(kGroupRows * args.k / kXBlock);
  configure_int8_tiles<kStep>();
  const int64_t row_bytes = quantized_row_bytes(args.ggml_type, args.k);
  const int64_t group_steps = (row_blocks + 1) / 2 * (args.k / kStep);
  for (int64_t g = begin; g < end; ++g) {
    const int64_t first = g * kGroupRows, columns = std::min(kGroupRows, args.n - first);
    const bool direct = args.ggml_type == kQ8_0 && columns == kGroupRows;
    Weights weights{reinterpret_cast<const int8_t*>(args.blocks + first * row_bytes) + 2, row_bytes, kQ8_0Bytes,
                    nullptr, group.offsets.data()};
    if (!direct) {
      unpack_group(args, first, group);
      weights = {group.q.data(), unpacked_stride(args.k), kStep, group.scales.data(), group.offsets.data()};
    }
    const int64_t next_first = (g + 1) * kGroupRows, next_rows = std::clamp<int64_t>(args.n - next_first, 0, kGroupRows);
    const int64_t next_lines = g + 1 < end ? (next_rows * row_bytes + 63) / 64 : 0;
    const Upcoming upcoming{reinterpret_cast<const char*>(args.blocks + next_first * row_bytes),
                            (next_lines + group_steps - 1) / group_steps, next_lines};
    multiply_group<kStep, kOffsets>(weights, x, row_blocks, columns, args, first, upcoming);
  }
  _tile_release();
}

}  // namespace

// Tasks [begin, end): groups of 32 output columns (QuantizedLinearArgs). x is quantized and packed
// once per task range (one range a thread); each group of weight rows is unpacked once, into L2, for
// all rows of x. The process must have been granted the tile state, and the CPU must have AMX-INT8
// (the bindings check both).
void quantized_linear_amx(const QuantizedLinearArgs& args, int64_t begin, int64_t end) {
  thread_local PackedX x;
  const int64_t row_blocks = (args.rows + kRowBlock - 1) / kRowBlock;
  dispatch_dtype(args.dtype, [&]<typename T>() { pack_x(static_cast<const T*>(args.x), args.rows, args.k, row_blocks, x); });
  if (args.ggml_type == kQ6_K)
    multiply_groups<16, false>(args, x, row_blocks, begin, end);
  else if (quantized_has_offsets(args.ggml_type))
    multiply_groups<32, true>(args, x, row_blocks, begin, end);
  else
    multiply_groups<32, false>(args, x, row_blocks, begin, end);
}

}  // namespace cpu_ops

#endif  // __AMX_TILE__ && __AMX_INT8__ && __AVX512F__
