// y = x @ W.T with the weight packed once for this form's microkernel (gemm_tiles.h):
//   float32 on AVX2 + FMA and AVX-512 (`vfmadd`), bf16 on AVX512-BF16 (`vdpbf16ps`) and, widened to
//   float32 in registers, on AVX2 + FMA and AVX-512 (`vfmadd`),
// accumulated in float32 and rounded to the output's dtype once, as the reference (a float32 matmul
// of the same inputs, rounded) does.
//
// Why not the matmul libraries: on the development CPU (AMD Zen 5, one thread) oneDNN's prepacked
// bf16 matmul ran the SmolLM2 projections at 280-400 GFLOP/s for 16-96 rows with the weights out of
// cache (a decode step's case), against an instruction peak of ~505; this kernel runs them at
// 450-465. In float32, MKL's sgemm (what F.linear calls) takes its AVX2 path on AMD CPUs and ran them
// at 85-110 GFLOP/s, a third of the AVX-512 FMA peak (271); figures in kernels/tuning.py.
//
// Column groups (a tile's blocks of 16 output columns) are the tasks of the thread pool, over row
// parts where the groups alone leave threads idle (LinearArgs): within a block of rows whose x stays
// in L2, a group's weights are read once and from cache by its other row tiles, and the next group's
// weights are requested while this one computes, as is a share of the memory the op after the matmul
// reads (`LinearArgs::fetch_runs`). Decode batches are one row block.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "gemm_tiles.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)

namespace cpu_ops {
namespace {

// Column groups [begin, end) over the rows of one part (for_each_tile).
template <int kRows, int kGroup, typename Tile, typename Store>
void part_tiles(const LinearArgs& args, int64_t block_bytes, int64_t steps, int64_t x_row_bytes, RowPart part,
                int64_t begin, int64_t end, Tile& tile, Store& store) {
  const int64_t blocks = args.n / kBlockColumns, groups = (blocks + kGroup - 1) / kGroup, side_total = args.fetch_lines;
  const int64_t max_block_tiles = std::max<int64_t>(1, tuning::kLinearRowBlockBytes / std::max<int64_t>(1, x_row_bytes * kRows));
  const int64_t row_tiles_total = (part.rows + kRows - 1) / kRows;
  const int64_t num_row_blocks = std::max<int64_t>(1, (row_tiles_total + max_block_tiles - 1) / max_block_tiles);
  const int64_t block_rows = (row_tiles_total + num_row_blocks - 1) / num_row_blocks * kRows;  // blocks of even size
  alignas(64) float c[kRows * kGroup * kBlockColumns];
  constexpr int64_t ldc = kGroup * kBlockColumns;
  const int64_t part_end = part.first_row + part.rows;
  for (int64_t first_row = part.first_row; first_row < part_end; first_row += block_rows) {
    const int64_t rows = std::min(block_rows, part_end - first_row), row_tiles = (rows + kRows - 1) / kRows;
    const bool last_row_block = first_row + rows == args.rows;
    RunCursor side = RunCursor::at(args.fetch_runs, last_row_block ? side_total * begin / groups : 0);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first_block = group * kGroup, group_blocks = std::min<int64_t>(kGroup, blocks - first_block);
      const int64_t next_blocks = group + 1 < end ? std::min<int64_t>(kGroup, blocks - first_block - group_blocks) : 0;
      const int64_t upcoming_lines = next_blocks * block_bytes / 64;
      const char* upcoming = static_cast<const char*>(args.packed) + (first_block + group_blocks) * block_bytes;
      const int64_t side_first = side_total * group / groups;
      const int64_t side_lines = last_row_block ? side_total * (group + 1) / groups - side_first : 0;
      for (int64_t rt = 0; rt < row_tiles; ++rt) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRows, rows - rt * kRows));
        const int64_t first_line = rt * upcoming_lines / row_tiles, end_line = (rt + 1) * upcoming_lines / row_tiles;
        const int64_t side_begin = rt * side_lines / row_tiles, side_end = (rt + 1) * side_lines / row_tiles;
        const Prefetcher fetch{upcoming + 64 * first_line, end_line - first_line, steps, 0, side, side_end - side_begin};
        side.advance(side_end - side_begin);
        const int64_t tile_first_row = first_row + rt * kRows;
        tile(tile_rows, static_cast<int>(group_blocks), tile_first_row, first_block, fetch, c);
        for (int r = 0; r < tile_rows; ++r)
          store(tile_first_row + r, first_block * kBlockColumns, c + r * ldc, group_blocks * kBlockColumns);
      }
    }
  }
}

// The shared loop over row parts, row blocks, column groups and row tiles; `start_part(first_row,
// rows)` is told each part's rows before its tiles, `tile(rows, blocks, first_row, first_block, fetch,
// c)` computes one tile into the float buffer c [kRows, kGroup * 16] while `fetch` requests its share
// of the next group's weights and of the runs the next op reads, `store(row, first_column, c_row,
// width)` writes one row of it out. A row block's x (`x_row_bytes` a row, as the tiles read it) stays
// in L2 while every group of the range runs over it: a prefill's x is larger than L2, and each group
// would read all of it from L3 again. The runs are requested in the call's last row block only,
// shared by group index, so each thread's range requests its own part of them.
template <int kRows, int kGroup, typename StartPart, typename Tile, typename Store>
void for_each_tile(const LinearArgs& args, int64_t block_bytes, int64_t steps, int64_t x_row_bytes, int64_t begin,
                   int64_t end, StartPart start_part, Tile tile, Store store) {
  const int64_t blocks = args.n / kBlockColumns, groups = (blocks + kGroup - 1) / kGroup;
  for_each_part(groups, begin, end, [&](int64_t part, int64_t first_group, int64_t end_group) {
    const RowPart rows_of_part = row_part(args.rows, kRows, part, args.row_parts);
    if (rows_of_part.rows == 0) return;
    start_part(rows_of_part.first_row, rows_of_part.rows);
    part_tiles<kRows, kGroup>(args, block_bytes, steps, x_row_bytes, rows_of_part, first_group, end_group, tile, store);
  });
}

#if defined(__AVX512F__)
// 16 rows x 16 k of bf16 bits (rows `ldx` apart) widened to float and transposed: out[e * 16 + m] =
// x[m * ldx + e]. The two-element unpacks leave k 1 and 2 of each 4 swapped, undone by the stores.
inline void widen_transpose_16x16(const uint16_t* x, int64_t ldx, float* out) {
  __m512 r[16], t[16];
  for (int m = 0; m < 16; ++m) {
    const __m256i row = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * ldx));
    r[m] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(row), 16));
  }
  for (int m = 0; m < 16; m += 2) t[m] = _mm512_unpacklo_ps(r[m], r[m + 1]), t[m + 1] = _mm512_unpackhi_ps(r[m], r[m + 1]);
  for (int m = 0; m < 16; m += 4) {
    for (int j = m; j < m + 2; ++j) {
      r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
      r[j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
    }
  }
  for (int m = 0; m < 16; m += 8) {
    for (int j = m; j < m + 4; ++j) t[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88), t[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xdd);
  }
  for (int j = 0; j < 8; ++j) r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88), r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(out + 16 * ((j & ~3) | (j & 1) << 1 | (j >> 1 & 1)), r[j]);
}
#endif

// `rows` rows of x as the tiles take them: as given, or (bf16 widened to float: the tall tile) packed
// once for every column group, each row tile's rows k-major (gemm_tiles.h), the tile of rows
// [r, r + kRows) at x + r * k. The buffer is this thread's and keeps the largest size asked for.
template <typename X, int kRows, typename W>
const X* tile_x(const W* x, int64_t rows, int64_t k) {
  if constexpr (std::is_same_v<X, W>) {
    return x;
  } else {
    static_assert(std::is_same_v<W, uint16_t> && std::is_same_v<X, float>);
    thread_local std::vector<float> packed;
    if (static_cast<int64_t>(packed.size()) < rows * k) packed.resize(rows * k);
    for (int64_t first = 0; first < rows; first += kRows) {
      const int64_t tile_rows = std::min<int64_t>(kRows, rows - first);
      float* panel = packed.data() + first * k;
      int64_t done = 0;  // k's packed
#if defined(__AVX512F__)
      if constexpr (kRows == 16) {
        if (tile_rows == 16)
          for (; done + 16 <= k; done += 16) widen_transpose_16x16(x + first * k + done, k, panel + done * 16);
      }
#endif
      for (int64_t m = 0; m < tile_rows; ++m)
        for (int64_t e = done; e < k; ++e) panel[e * tile_rows + m] = bf16_bits_to_float(x[(first + m) * k + e]);
    }
    return packed.data();
  }
}

// The matmul over weights of W (float, or bf16 bits): x and out of W too, the float32 tile rounded once;
// the tiles take x as X (W, or float for the widened bf16 tiles' packed rows).
template <typename W, int kRows, int kBlocks, typename X = W>
void linear(const LinearArgs& args, int64_t begin, int64_t end) {
  constexpr bool kFloat = std::is_same_v<W, float>;
  const W* packed = static_cast<const W*>(args.packed);
  W* out = static_cast<W*>(args.out);
  const int64_t k = args.k, block_elements = k * kBlockColumns, steps = kFloat ? k : k / 2;
  const X* x = nullptr;  // the current row part's rows as the tiles take them, from its first row
  int64_t part_first_row = 0;
  for_each_tile<kRows, kBlocks>(
      args, block_elements * static_cast<int64_t>(sizeof(W)), steps, k * static_cast<int64_t>(sizeof(X)), begin, end,
      [&](int64_t first_row, int64_t rows) {
        x = tile_x<X, kRows>(static_cast<const W*>(args.x) + first_row * k, rows, k);
        part_first_row = first_row;
      },
      [&](int rows, int blocks, int64_t first_row, int64_t first_block, const Prefetcher& fetch, float* c) {
        const W* b = packed + first_block * block_elements;
        const W* block_starts[kBlocks];
        for (int v = 0; v < blocks; ++v) block_starts[v] = b + v * block_elements;
        const BlockPages<W> weights{block_starts, 1, steps};
        with_blocks(blocks, [&]<int NB>() {
          with_rows<kRows>(rows, [&]<int MR>() {
            if constexpr (kFloat) {
              f32_tile<MR, NB>(x + (first_row - part_first_row) * k, k, weights, steps, fetch, c, kBlocks * kBlockColumns);
            } else {
              bf16_tile<MR, NB>(x + (first_row - part_first_row) * k, k, weights, steps, fetch, c, kBlocks * kBlockColumns);
            }
          });
        });
      },
      [&](int64_t row, int64_t column, const float* c_row, int64_t width) {
        W* out_row = out + row * args.n + column;
        if constexpr (kFloat) {
          std::copy(c_row, c_row + width, out_row);
        } else {
#pragma omp simd
          for (int64_t col = 0; col < width; ++col) out_row[col] = float_to_bf16_bits(c_row[col]);
        }
      });
}

}  // namespace

int64_t f32_linear_groups(const LinearArgs& args) { return (args.n / kBlockColumns + kF32TileBlocks - 1) / kF32TileBlocks; }

void f32_linear(const LinearArgs& args, int64_t begin, int64_t end) { linear<float, kF32TileRows, kF32TileBlocks>(args, begin, end); }

// The tall tile where the batch fills it and a block of its weights stays in L1 over the row tiles
// (the two tiles split the columns into groups of their own).
constexpr bool kHasTallTile = kBf16TallTileRows != kBf16TileRows || kBf16TallTileBlocks != kBf16TileBlocks;

bool takes_tall_tile(const LinearArgs& args) {
  return kHasTallTile && args.rows >= kBf16TallTileRows && args.k <= kBf16TallTileMaxK;
}

int64_t bf16_linear_groups(const LinearArgs& args) {
  const int64_t blocks = takes_tall_tile(args) ? kBf16TallTileBlocks : kBf16TileBlocks;
  return (args.n / kBlockColumns + blocks - 1) / blocks;
}

void bf16_linear(const LinearArgs& args, int64_t begin, int64_t end) {
  if constexpr (kHasTallTile) {
    if (takes_tall_tile(args)) return linear<uint16_t, kBf16TallTileRows, kBf16TallTileBlocks, float>(args, begin, end);
  }
  linear<uint16_t, kBf16TileRows, kBf16TileBlocks>(args, begin, end);
}

}  // namespace cpu_ops

#endif  // __AVX2__ && __FMA__
