// y = x @ W.T at every batch size, in bf16 with float32 accumulation, on Intel AMX tiles.
//
// Why not oneDNN: for 64 rows its prepacked bf16 matmul ran the SmolLM2 projections at ~300 GFLOP/s
// whether the weights were in cache or not, a third of what the same library reaches at 2048 rows;
// a decode step was bound by that, not by reading the weights. This kernel keeps the tile unit busy
// at small row counts by loading the next k-step's tiles as soon as the tiles they replace are
// consumed, and keeps memory busy by fetching the next column block's weights while it computes
// (figures in kernels/tuning.py). It serves prefill-sized batches too (x in chunks that stay in L2),
// so that each projection is held once, in this layout, not also in oneDNN's.
//
// Layout: W [N, K] is packed once (kernels.linear.pack_linear_weight) into blocks of 32 output
// columns; each block runs over K in steps of 32 and holds two 16-column B tiles per step in the
// tiles' pair-interleaved form: packed[n_block][k_step][half][k_pair (16)][column (16)][2].
// Each 32 x 32 output block accumulates in four float32 tiles (2 row tiles x 2 column tiles) and is
// rounded to bf16 once, as the reference (a float32 matmul of the same inputs, rounded) does.
#include <algorithm>
#include <cstdint>

#include "convert.h"
#include "gemm_tiles.h"
#include "ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"

namespace cpu_ops {
namespace {

constexpr int64_t kBlock = 32;  // rows (two A tiles) and columns (two B tiles) per output block
constexpr int64_t kKStep = 32;  // bf16 elements of K per tile row (64 bytes)
constexpr int64_t kPackedStep = 2 * 16 * 32;  // bf16 elements of the two B tiles of one k-step

// Tiles 0-3: the output block's accumulators (row tile i, column tile j at 2 * i + j); 4-5: the two
// row tiles of x; 6-7: the two column tiles of W.
// While it multiplies, the block requests its share of the next column block's weights and of the
// next op's runs into cache, spread evenly over its k-steps (`fetch`, gemm_tiles.h).
void multiply_block(const uint16_t* a, const uint16_t* b, int64_t k_steps, Prefetcher fetch, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + kPackedStep / 2, 64);
  _tile_loadd(5, a + kPackedStep / 2, 64);
  for (int64_t ks = 0; ks < k_steps; ++ks) {
    fetch.step();
    const bool more = ks + 1 < k_steps;
    const uint16_t* next_a = a + (ks + 1) * kPackedStep;
    const uint16_t* next_b = b + (ks + 1) * kPackedStep;
    // Each load follows the last product that reads the tile it replaces.
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (more) _tile_loadd(4, next_a, 64);
    _tile_dpbf16ps(2, 5, 6);
    if (more) _tile_loadd(6, next_b, 64);
    _tile_dpbf16ps(3, 5, 7);
    if (more) {
      _tile_loadd(5, next_a + kPackedStep / 2, 64);
      _tile_loadd(7, next_b + kPackedStep / 2, 64);
    }
  }
  _tile_stored(0, c, kBlock * 4);
  _tile_stored(1, c + 16, kBlock * 4);
  _tile_stored(2, c + 16 * kBlock, kBlock * 4);
  _tile_stored(3, c + 16 * kBlock + 16, kBlock * 4);
}

// Column blocks [first_block, end_block) over the row blocks [first_rb, end_rb) of a part: each
// column block's weights (K x 32, from L2) over every row block of the chunk (its x, from L2).
// `last_chunk`: the call's last rows, which request the next op's runs.
void column_blocks_over_chunk(const LinearArgs& args, int64_t first_rb, int64_t end_rb, int64_t first_block,
                              int64_t end_block, bool last_chunk) {
  const int64_t n = args.n, k_steps = args.k / kKStep, row_blocks = end_rb - first_rb;
  const uint16_t* x = static_cast<const uint16_t*>(args.x);
  const uint16_t* packed = static_cast<const uint16_t*>(args.packed);
  uint16_t* out = static_cast<uint16_t*>(args.out);
  alignas(64) float block[kBlock * kBlock];
  const int64_t groups = n / kBlock, side_total = last_chunk ? args.fetch_lines : 0;
  RunCursor side = RunCursor::at(args.fetch_runs, side_total * first_block / groups);
  for (int64_t nb = first_block; nb < end_block; ++nb) {
    const int64_t side_first = side_total * nb / groups, side_lines = side_total * (nb + 1) / groups - side_first;
    const uint16_t* b_block = packed + nb * k_steps * kPackedStep;
    // The next column block's weights are fetched while this one computes, spread over all its
    // row blocks, so that memory is busy the whole time (prefetching only a few k-steps ahead
    // left it idle through the later row blocks: 53-56 ms against 45-48 ms for the 30 layers).
    const char* upcoming = reinterpret_cast<const char*>(b_block + k_steps * kPackedStep);
    const int64_t upcoming_lines = nb + 1 < end_block ? k_steps * kPackedStep * 2 / 64 : 0;
    for (int64_t i = 0; i < row_blocks; ++i) {
      const int64_t rb = first_rb + i;
      const int64_t side_begin = i * side_lines / row_blocks, side_end = (i + 1) * side_lines / row_blocks;
      const int64_t first_line = i * upcoming_lines / row_blocks, end_line = (i + 1) * upcoming_lines / row_blocks;
      multiply_block(x + rb * k_steps * kPackedStep, b_block, k_steps,
                     Prefetcher{upcoming + 64 * first_line, end_line - first_line, k_steps, 0, side, side_end - side_begin},
                     block);
      side.advance(side_end - side_begin);
      const int64_t valid_rows = std::min(kBlock, args.rows - rb * kBlock);
      for (int64_t r = 0; r < valid_rows; ++r) {
        uint16_t* out_row = out + (rb * kBlock + r) * n + nb * kBlock;
#pragma omp simd
        for (int64_t col = 0; col < kBlock; ++col) out_row[col] = float_to_bf16_bits(block[r * kBlock + col]);
      }
    }
  }
}

// Column blocks [first_block, end_block) over the rows of one part (amx_linear), a chunk of row
// blocks at a time: a chunk's x stays in L2 while every column block runs over it. Over the whole
// part at once, a prefill's x (512 rows of 2048 inputs: 2 MB) was read from L3 by each column block,
// and the kernel ran at 0.6x oneDNN's rate; a chunk re-reads the weights once per chunk instead.
void column_blocks(const LinearArgs& args, RowPart part, int64_t first_block, int64_t end_block) {
  const int64_t chunk_blocks = std::max<int64_t>(1, tuning::kAmxLinearRowBlockBytes / (kBlock * args.k * 2));
  const int64_t first_rb = part.first_row / kBlock, end_rb = (part.first_row + part.rows + kBlock - 1) / kBlock;
  const bool last_part = part.first_row + part.rows == args.rows;
  for (int64_t rb = first_rb; rb < end_rb; rb += chunk_blocks) {
    const int64_t chunk_end = std::min(end_rb, rb + chunk_blocks);
    column_blocks_over_chunk(args, rb, chunk_end, first_block, end_block, last_part && chunk_end == end_rb);
  }
}

}  // namespace

int64_t amx_linear_groups(const LinearArgs& args) { return args.n / kBlock; }

// Tasks [begin, end) (LinearArgs): column blocks of 32 output columns over row parts in blocks of 32
// rows. x is packed by the bindings in whole blocks of 32 rows (padded with zero rows), each block's
// k-steps in turn, each step its 32 rows of 32 inputs: x_tiles[row_block][k_step][32][32], so that an
// A tile is 1 KB read in order (rows K apart would fall in a few L1 sets when K * 2 is a multiple of
// 4 KB). Only `rows` rows of out are written. The process must have been granted the tile state (the bindings ask Linux for it
// when they detect AMX).
void amx_linear(const LinearArgs& args, int64_t begin, int64_t end) {
  configure_full_tiles();  // tile state is per thread: configure it in each range
  for_each_part(args.n / kBlock, begin, end, [&](int64_t part, int64_t first_block, int64_t end_block) {
    const RowPart rows = row_part(args.rows, kBlock, part, args.row_parts);
    if (rows.rows > 0) column_blocks(args, rows, first_block, end_block);
  });
  _tile_release();
}

}  // namespace cpu_ops

#endif  // __AMX_TILE__ && __AMX_BF16__
