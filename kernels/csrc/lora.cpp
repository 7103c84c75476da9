// Multi-adapter LoRA on CPU, one run of tokens sharing an adapter slot (a segment) at a time: for each
// token t of a segment of slot s and each slice i of a fused projection (q/k/v, gate/up), with
// r = slice_ranks[s * num_slices + i] (kernels.reference.add_lora):
//   y[t, cols_i] += T(((x[t] @ A[s, i, :r].T) * scale[s]) @ B[s, cols_i, :r].T)
// Both products are matmuls of the segment's rows on the register tiles of the projections' matmuls
// (gemm_tiles.h), over weights kept in the tiled layout of kernels/lora/layouts.py:
//   A: per slot, blocks of 16 rank rows, each [hidden_in][16] (bf16: [hidden_in / 2][16][2]);
//   B: per slot, blocks of 16 output columns, each [max_rank][16] (bf16: [max_rank / 2][16][2]).
// The shrink computes ceil(r / 16) blocks of A per slice, the expand r rank rows of B (rows past r are
// zero), so an adapter costs its own rank, not the pool's max_rank. The delta is accumulated in float32
// and added to y with one rounding, as the reference does. Weights are float32 (any x and y dtype)
// or bf16 (bf16 x and y, the engine's bf16 model: `vdpbf16ps` on AVX512-BF16, widened elsewhere).
#include <algorithm>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "gemm_tiles.h"
#include "ops.h"

namespace cpu_ops {
namespace {

// This form's register tile for the weights' type W (float, or bf16).
template <typename W>
constexpr int kRows = std::is_same_v<W, float> ? kF32TileRows : kBf16TileRows;
template <typename W>
constexpr int kGroup = std::is_same_v<W, float> ? kF32TileBlocks : kBf16TileBlocks;
constexpr int kMaxRows = 8, kMaxGroup = 3;  // the scratch covers any tile

// One tile of the shrink or expand: rows x (blocks * 16) of `b` into c [rows, blocks * 16] (ldc),
// from x rows of `ldx` elements; `k` as the weight's element type counts it (pairs for bf16).
template <typename W>
void tile(int rows, int blocks, const W* x, int64_t ldx, const W* b, int64_t block_stride, int64_t k, float* c,
          int64_t ldc) {
  with_blocks(blocks, [&]<int NB>() {
    with_rows(rows, [&]<int MR>() {
      if constexpr (std::is_same_v<W, float>) {
        f32_tile<MR, NB>(x, ldx, b, block_stride, k, Prefetcher{}, c, ldc);
      } else {
        bf16_tile<MR, NB>(reinterpret_cast<const uint16_t*>(x), ldx, reinterpret_cast<const uint16_t*>(b), block_stride,
                          k, Prefetcher{}, c, ldc);
      }
    });
  });
}

// The shrink of one slice: shrunk [rows, r16] = x_rows @ A_slice.T, in groups of kGroup blocks.
template <typename W>
void shrink(int rows, const W* x, int64_t ldx, const W* a_slice, int64_t hidden_in, int64_t rank16, float* shrunk,
            int64_t ld_shrunk) {
  const int64_t block_stride = hidden_in * kBlockColumns;
  const int64_t k = std::is_same_v<W, float> ? hidden_in : hidden_in / 2;
  for (int64_t first = 0; first < rank16 / kBlockColumns; first += kGroup<W>) {
    const int blocks = static_cast<int>(std::min<int64_t>(kGroup<W>, rank16 / kBlockColumns - first));
    tile(rows, blocks, x, ldx, a_slice + first * block_stride, block_stride, k, shrunk + first * kBlockColumns, ld_shrunk);
  }
}

// y[rows, cols] += T(c), one rounding.
template <typename T>
void accumulate(T* y, int64_t ldy, int rows, const float* c, int64_t ldc, int64_t width) {
  for (int r = 0; r < rows; ++r) {
    T* y_row = y + r * ldy;
    const float* c_row = c + r * ldc;
#pragma omp simd
    for (int64_t col = 0; col < width; ++col) y_row[col] = from_float_one<T>(to_float_one(y_row[col]) + c_row[col]);
  }
}

// The expand of one slice over its columns [first_col, end_col): y += s_slice @ B_slice.T.
template <typename T, typename W>
void expand(int rows, const W* s, int64_t lds, const W* b_slot, int64_t max_rank, int64_t rank, int64_t first_col,
            int64_t end_col, T* y, int64_t ldy, float* c) {
  const int64_t block_stride = max_rank * kBlockColumns;
  const int64_t k = std::is_same_v<W, float> ? rank : (rank + 1) / 2;  // B's rows past the rank are zero
  constexpr int64_t ldc = kGroup<W> * kBlockColumns;
  for (int64_t col = first_col; col < end_col; col += ldc) {
    const int blocks = static_cast<int>(std::min<int64_t>(kGroup<W>, (end_col - col) / kBlockColumns));
    tile(rows, blocks, s, lds, b_slot + (col / kBlockColumns) * block_stride, block_stride, k, c, ldc);
    accumulate(y + col, ldy, rows, c, ldc, blocks * kBlockColumns);
  }
}

// The segments of one call, with per-call scratch: x rows as W (converted where x is not W), the
// shrunk rows (float, then as W for the expand) and one output tile.
template <typename T, typename W>
struct SegmentRunner {
  const LoraArgs& args;
  const W* a_tiles = static_cast<const W*>(args.a_tiles);
  const W* b_tiles = static_cast<const W*>(args.b_tiles);
  int64_t a_slot_stride = args.num_slices * args.max_rank * args.hidden_in;
  int64_t b_slot_stride = args.total_out * args.max_rank;
  int64_t ld_shrunk = args.num_slices * args.max_rank;
  std::vector<W> x_rows = std::vector<W>(kMaxRows * args.hidden_in);
  std::vector<float> shrunk = std::vector<float>(kMaxRows * ld_shrunk);
  std::vector<W> shrunk_w = std::vector<W>(std::is_same_v<W, float> ? 0 : kMaxRows * ld_shrunk);
  std::vector<float> c = std::vector<float>(kMaxRows * kMaxGroup * kBlockColumns);

  void run(int64_t segment) {
    const int64_t* seg = args.segments + 3 * segment;  // start, length, slot
    for (int64_t first = seg[0]; first < seg[0] + seg[1]; first += kRows<W>)
      rows(first, static_cast<int>(std::min<int64_t>(kRows<W>, seg[0] + seg[1] - first)), seg[2]);
  }

  void rows(int64_t first, int count, int64_t slot) {
    const W* x = x_as_weights(first, count);
    const float scale = args.scales ? static_cast<float>(args.scales[slot]) : 1.f;
    for (int64_t i = 0; i < args.num_slices; ++i) {
      const int64_t rank = std::min(args.slice_ranks[slot * args.num_slices + i], args.max_rank);
      if (rank == 0) continue;
      const int64_t rank16 = (rank + kBlockColumns - 1) / kBlockColumns * kBlockColumns;
      float* s = shrunk.data() + i * args.max_rank;
      shrink(count, x, args.hidden_in, a_tiles + slot * a_slot_stride + i * args.max_rank * args.hidden_in,
             args.hidden_in, rank16, s, ld_shrunk);
      expand<T, W>(count, shrunk_as_weights(count, i, rank16, scale), ld_shrunk, b_tiles + slot * b_slot_stride,
                   args.max_rank, rank, args.slice_offsets[i], args.slice_offsets[i + 1],
                   static_cast<T*>(args.y) + first * args.total_out, args.total_out, c.data());
    }
  }

  const W* x_as_weights(int64_t first, int count) {
    const T* x = static_cast<const T*>(args.x) + first * args.hidden_in;
    if constexpr (std::is_same_v<T, W>) {
      return x;
    } else {
      std::vector<float> row(args.hidden_in);
      for (int r = 0; r < count; ++r) {
        to_float(x + r * args.hidden_in, row.data(), args.hidden_in);
        from_float(row.data(), x_rows.data() + r * args.hidden_in, args.hidden_in);
      }
      return x_rows.data();
    }
  }

  // Slice i's shrunk rows scaled, as the expand's input type (rounded to bf16 for bf16 weights, as
  // PEFT's bf16 adapters round their intermediate).
  const W* shrunk_as_weights(int count, int64_t i, int64_t rank16, float scale) {
    for (int r = 0; r < count; ++r) {
      float* row = shrunk.data() + r * ld_shrunk + i * args.max_rank;
#pragma omp simd
      for (int64_t j = 0; j < rank16; ++j) row[j] *= scale;
      if constexpr (!std::is_same_v<W, float>) from_float(row, shrunk_w.data() + r * ld_shrunk + i * args.max_rank, rank16);
    }
    if constexpr (std::is_same_v<W, float>) {
      return shrunk.data() + i * args.max_rank;
    } else {
      return shrunk_w.data() + i * args.max_rank;
    }
  }
};

// bf16 weights run with bf16 activations only (the bindings check it).
template <typename T>
void run_segments(const LoraArgs& args, int64_t begin, int64_t end) {
  if (args.weight_dtype == DType::f32) {
    SegmentRunner<T, float> runner{args};
    for (int64_t s = begin; s < end; ++s) runner.run(s);
  } else if constexpr (std::is_same_v<T, bf16>) {
    SegmentRunner<bf16, bf16> runner{args};
    for (int64_t s = begin; s < end; ++s) runner.run(s);
  }
}

}  // namespace

void lora_segments(const LoraArgs& args, int64_t begin, int64_t end) {
  dispatch_dtype(args.dtype, [&]<typename T>() { run_segments<T>(args, begin, end); });
}

}  // namespace cpu_ops
