// y = x @ W.T for prefill-sized batches of bf16 x over weights in GGML's block layouts: the weights
// are widened to bf16 32 rows (output columns) at a time into a buffer that stays in L2 and are
// multiplied there, on AMX tiles where the form has them, else by the bf16 register tiles of
// gemm_tiles.h; each block is read and widened once per call, nothing of the weight's bf16 size is
// written to memory, and no library matmul repacks it.
//
// The operands' roles are swapped against the dense matmuls: a group's widened rows [32, k],
// row-major as `dequantize_row` writes them, are the tiles' row operand, and x, packed once per call
// (per thread) into the dense weights' pair-interleaved blocks of 16 (x_packed[row_block][k / 2][16][2]),
// their column operand; so no weight is transposed, only x. Each output tile [columns, rows] is
// written transposed into out [rows, n], rounded once to bf16. The weights are rounded to bf16 once
// (kernels.reference.dequantize, rounded), the sums kept in float32.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "convert.h"
#include "gemm_tiles.h"
#include "ops.h"

namespace cpu_ops {
namespace {

constexpr int64_t kGroupRows = 32;  // weight rows widened together: a task
constexpr int64_t kRowBlock = 16;  // rows of x per packed block (an AMX tile's columns)

// Elements from one widened weight row to the next: k and a line more, so that a tile's 16 rows
// (k a power of two: 4 KiB or more apart) do not all fall in one L1 set (the AMX tiles' loads of
// them missed L1: the widened matmul spent a fifth of its time there).
int64_t widened_stride(int64_t k) { return k + 32; }

// x [rows, k] bf16 bits as packed blocks of 16 rows, `row_blocks` of them (rows past `rows` zero).
void pack_rows(const uint16_t* x, int64_t rows, int64_t k, int64_t row_blocks, std::vector<uint16_t>& packed) {
  packed.assign(row_blocks * kRowBlock * k, 0);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* lane = packed.data() + r / kRowBlock * kRowBlock * k + r % kRowBlock * 2;
    const uint16_t* row = x + r * k;
    for (int64_t pair = 0; pair < k / 2; ++pair) std::memcpy(lane + pair * 2 * kRowBlock, row + 2 * pair, 4);
  }
}

// Weight rows [first, first + kGroupRows) as bf16 rows [kGroupRows, widened_stride(k)] (rows past n
// zero); returns how many are weight rows.
int64_t widen_group(const QuantizedLinearArgs& args, int64_t row_bytes, int64_t first, uint16_t* rows) {
  const int64_t count = std::min(kGroupRows, args.n - first), stride = widened_stride(args.k);
  for (int64_t c = 0; c < count; ++c)
    dequantize_row(args.ggml_type, args.blocks + (first + c) * row_bytes, args.k, DType::bf16, rows + c * stride);
  std::memset(rows + count * stride, 0, (kGroupRows - count) * stride * sizeof(uint16_t));
  return count;
}

// out[row, first_column + m] = tile[m * ldc + j] for the tile's columns m < columns and its rows
// j < 16 * row_blocks (x's row first_row + j), those past x's rows left out.
void store_transposed(const float* tile, int64_t ldc, int64_t columns, int64_t first_row, int64_t tile_rows,
                      const QuantizedLinearArgs& args, int64_t first_column) {
  uint16_t* out = static_cast<uint16_t*>(args.out);
  const int64_t rows = std::min(tile_rows, args.rows - first_row);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t m = 0; m < columns; ++m)
      out[(first_row + j) * args.out_stride + first_column + m] = float_to_bf16_bits(tile[m * ldc + j]);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kRowBlockAlign = 2;  // the AMX tiles take x 32 rows at a time

// Tiles 0-3: the output [32 columns, 32 rows] (weight tile i, row block j at 2 i + j); 4-5: the two
// weight tiles of a k-step (16 rows of 32 bf16 each), 6-7: x's two row blocks of that k-step.
void multiply_group(const uint16_t* weights, const std::vector<uint16_t>& x_packed, int64_t row_blocks,
                    int64_t columns, const QuantizedLinearArgs& args, int64_t first_column) {
  alignas(64) float tile[kGroupRows * 2 * kRowBlock];
  const int64_t k = args.k, block_elements = kRowBlock * k, stride = widened_stride(k);
  for (int64_t rb = 0; rb < row_blocks; rb += 2) {
    const uint16_t* x_block = x_packed.data() + rb * block_elements;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < k / 32; ++step) {
      _tile_loadd(4, weights + 32 * step, stride * 2);
      _tile_loadd(5, weights + 16 * stride + 32 * step, stride * 2);
      _tile_loadd(6, x_block + 16 * 32 * step, 64);
      _tile_loadd(7, x_block + block_elements + 16 * 32 * step, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, tile, 2 * kRowBlock * 4);
    _tile_stored(1, tile + kRowBlock, 2 * kRowBlock * 4);
    _tile_stored(2, tile + 16 * 2 * kRowBlock, 2 * kRowBlock * 4);
    _tile_stored(3, tile + 16 * 2 * kRowBlock + kRowBlock, 2 * kRowBlock * 4);
    store_transposed(tile, 2 * kRowBlock, columns, rb * kRowBlock, 2 * kRowBlock, args, first_column);
  }
}

struct TileState {  // tile state is per thread: configured and released by each task range
  TileState() { configure_full_tiles(); }
  ~TileState() { _tile_release(); }
};
#else
constexpr int64_t kRowBlockAlign = 1;

// The register tiles: up to kBf16TileRows weight rows by up to kBf16TileBlocks row blocks of x.
void multiply_group(const uint16_t* weights, const std::vector<uint16_t>& x_packed, int64_t row_blocks,
                    int64_t columns, const QuantizedLinearArgs& args, int64_t first_column) {
  alignas(64) float tile[16 * 3 * kBlockColumns];
  const int64_t k = args.k, stride = widened_stride(k);
  for (int64_t m0 = 0; m0 < columns; m0 += kBf16TileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBf16TileRows, columns - m0));
    for (int64_t rb = 0; rb < row_blocks; rb += kBf16TileBlocks) {
      const int blocks = static_cast<int>(std::min<int64_t>(kBf16TileBlocks, row_blocks - rb));
      const uint16_t* starts[3];
      for (int v = 0; v < blocks; ++v) starts[v] = x_packed.data() + (rb + v) * kRowBlock * k;
      const BlockPages<uint16_t> pages{starts, 1, k / 2};
      with_blocks(blocks, [&]<int NB>() {
        with_rows<kBf16TileRows>(rows, [&]<int MR>() {
          bf16_tile<MR, NB>(weights + m0 * stride, stride, pages, k / 2, Prefetcher{}, tile, NB * kBlockColumns);
        });
      });
      store_transposed(tile, blocks * kBlockColumns, rows, rb * kRowBlock, blocks * kRowBlock, args, first_column + m0);
    }
  }
}

struct TileState {};
#endif

}  // namespace

// Tasks [begin, end): groups of 32 output columns (QuantizedLinearArgs, x and out bf16).
void quantized_linear_widened(const QuantizedLinearArgs& args, int64_t begin, int64_t end) {
  thread_local std::vector<uint16_t> x_packed, weights;
  const int64_t blocks_needed = (args.rows + kRowBlock - 1) / kRowBlock;
  const int64_t row_blocks = (blocks_needed + kRowBlockAlign - 1) / kRowBlockAlign * kRowBlockAlign;
  pack_rows(static_cast<const uint16_t*>(args.x), args.rows, args.k, row_blocks, x_packed);
  weights.resize(kGroupRows * widened_stride(args.k));
  const int64_t row_bytes = quantized_row_bytes(args.ggml_type, args.k);
  [[maybe_unused]] const TileState tiles;
  for (int64_t group = begin; group < end; ++group) {
    const int64_t columns = widen_group(args, row_bytes, group * kGroupRows, weights.data());
    multiply_group(weights.data(), x_packed, row_blocks, columns, args, group * kGroupRows);
  }
}

}  // namespace cpu_ops
