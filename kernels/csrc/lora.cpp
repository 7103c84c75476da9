// Multi-adapter LoRA on CPU over paged adapter weights, one run of tokens sharing an adapter entry (a
// segment) at a time: for each token t of a segment of entry e and each slice i of a fused projection
// (q/k/v, gate/up), with r = the entry's rank there (kernels.reference.add_lora):
//   y[t, cols_i] += T((x[t] @ A_e.T) @ B_e.T)
// Both products are matmuls of the segment's rows on the register tiles of the projections' matmuls
// (gemm_tiles.h), over the tiled pages of kernels/lora/layouts.py, wherever the adapter pool put them:
//   the shrink computes ceil(r / 16) pages of A, each one block of 16 output columns, the pages of
//   every slice side by side in one matmul (the slices share x);
//   the expand reads B's r rank rows as k-steps, 16 (bf16: 8 pairs) per page, page after page
//   (`BlockPages`); rows of the last page past r are zero.
// A long segment (a prefill) runs in chunks of up to kChunkRows rows: every row tile's shrink, then the
// expand column group by column group, each group's runs of B read once for all the chunk's row tiles
// rather than all of B once per row tile (from L2, or beyond once B outgrows it).
// The pages come from memory: a decode step reads each adapter's pages once, every layer, and they
// outgrow the caches between steps. Each segment requests the next one's pages while it computes (a
// page is a few KB to a few tens, too short a run for the hardware's prefetcher to reach full speed
// on its own). AMD Zen 5, bf16, one thread: W's LoRA overhead +23% -> +19% against the projections'
// matmuls fetching the pages instead, the op's one-token segments (118 adapters in a decode step)
// 12% faster than with neither.
// The delta is accumulated in float32 and added to y with one rounding, as the reference does. Weights
// are float32 (any x and y dtype) or bf16 (bf16 x and y, the engine's bf16 model: `vdpbf16ps` on
// AVX512-BF16, widened elsewhere).
#include <algorithm>
#include <memory>
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
constexpr int64_t kChunkRows = tuning::kLoraChunkRows;
// k-steps of one page of B: 16 rank rows, or 8 pairs of them for bf16.
template <typename W>
constexpr int64_t kPageSteps = std::is_same_v<W, float> ? kBlockColumns : kBlockColumns / 2;

// One tile of the shrink or expand: rows x (blocks * 16) of the weights `b` into c [rows, blocks * 16]
// (ldc), from x rows of `ldx` elements; `k` as the weight's element type counts it (pairs for bf16).
template <typename W>
void tile(int rows, int blocks, const W* x, int64_t ldx, const BlockPages<W>& b, int64_t k, float* c, int64_t ldc,
          const Prefetcher& fetch) {
  with_blocks(blocks, [&]<int NB>() {
    with_rows(rows, [&]<int MR>() {
      if constexpr (std::is_same_v<W, float>) {
        f32_tile<MR, NB>(x, ldx, b, k, fetch, c, ldc);
      } else {
        const BlockPages<uint16_t> bits{reinterpret_cast<const uint16_t* const*>(b.blocks), b.num_pages, b.page_steps};
        bf16_tile<MR, NB>(reinterpret_cast<const uint16_t*>(x), ldx, bits, k, fetch, c, ldc);
      }
    });
  });
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// bf16 y a block of 16 columns at a time (`width` is whole blocks): GCC vectorised the loop above 32
// columns at a time and left a 48-column tile's last 16 to scalar code, and for a low rank this pass
// costs more than the tile's arithmetic.
template <>
void accumulate<bf16>(bf16* y, int64_t ldy, int rows, const float* c, int64_t ldc, int64_t width) {
  for (int r = 0; r < rows; ++r) {
    uint16_t* y_row = reinterpret_cast<uint16_t*>(y + r * ldy);
    const float* c_row = c + r * ldc;
    for (int64_t col = 0; col < width; col += kBlockColumns)
      float_to_bf16x16(_mm512_add_ps(bf16x16_to_float(y_row + col), _mm512_loadu_ps(c_row + col)), y_row + col);
  }
}
#endif

// The pages of the next segment's A or B, requested a share per tile over the tiles of this segment's
// shrink or expand, so that the reads overlap this segment's arithmetic.
struct AheadFetch {
  std::vector<FetchRun> runs;
  int64_t lines = 0, tiles = 0, tile = 0;
  RunCursor cursor{};

  void clear() { runs.clear(), lines = 0, tiles = 0, tile = 0; }

  void add(const void* start, int64_t bytes) {
    runs.push_back({static_cast<const char*>(start), (bytes + 63) / 64});
    lines += runs.back().lines;
  }

  void spread_over(int64_t num_tiles) { tiles = num_tiles, tile = 0, cursor = RunCursor{runs.data(), 0}; }

  // The prefetcher of the next tile, which runs `steps` k-steps.
  Prefetcher next_tile(int64_t steps) {
    if (tile >= tiles || lines == 0) return Prefetcher{};
    const int64_t share = lines * (tile + 1) / tiles - lines * tile / tiles;
    ++tile;
    const Prefetcher fetch{nullptr, 0, std::max<int64_t>(steps, 1), 0, cursor, share};
    cursor.advance(share);
    return fetch;
  }
};

// The segments of one call, with per-call scratch: x rows as W (converted where x is not W), the
// shrunk rows of every slice side by side (float, then as W for the expand), one output tile and the
// tiles' page pointers.
template <typename T, typename W>
struct SegmentRunner {
  const LoraArgs& args;
  int64_t max_pages = max_pages_of(args);
  int64_t ld_shrunk = total_pages_of(args) * kBlockColumns;
  std::unique_ptr<W[]> x_rows = scratch<W>(std::is_same_v<T, W> ? 0 : kMaxRows * args.hidden_in);
  std::unique_ptr<float[]> shrunk = scratch<float>(kChunkRows * ld_shrunk);
  std::unique_ptr<W[]> shrunk_w = scratch<W>(std::is_same_v<W, float> ? 0 : kChunkRows * ld_shrunk);
  std::unique_ptr<float[]> c = scratch<float>(kMaxRows * kMaxGroup * kBlockColumns);
  std::unique_ptr<const W*[]> blocks = scratch<const W*>(std::max(max_pages, total_pages_of(args)) * kMaxGroup);
  AheadFetch ahead_a, ahead_b;

  // Uninitialised: every element is written before it is read (zeroing x's scratch alone took 7-10% of
  // W's decode batch, pages in cache).
  template <typename E>
  static std::unique_ptr<E[]> scratch(int64_t size) {
    return std::make_unique_for_overwrite<E[]>(static_cast<size_t>(size));
  }

  static int64_t max_pages_of(const LoraArgs& args) {
    int64_t most = 1;
    for (int64_t i = 0; i < args.num_slices; ++i) most = std::max(most, args.slices[i].max_pages);
    return most;
  }

  static int64_t total_pages_of(const LoraArgs& args) {
    int64_t total = 1;
    for (int64_t i = 0; i < args.num_slices; ++i) total += args.slices[i].max_pages;
    return total;
  }

  // Segment `segment` of the range ending at `end`.
  void run(int64_t segment, int64_t end) {
    const int64_t* seg = args.segments + 3 * segment;  // start, length, entry
    fetch_ahead(segment + 1 < end ? seg[5] : -1, std::min(kChunkRows, seg[1]), seg[2]);
    for (int64_t first = seg[0]; first < seg[0] + seg[1]; first += kChunkRows)
      chunk(first, std::min(kChunkRows, seg[0] + seg[1] - first), seg[2]);
  }

  // Spreads the pages of entry `next` (none if -1) over the tiles of the first chunk (`rows` rows) of
  // this segment, of entry `entry`: its A over the shrink, its B over the expand.
  void fetch_ahead(int64_t next, int64_t rows, int64_t entry) {
    ahead_a.clear(), ahead_b.clear();
    if (next < 0) return;
    const int64_t row_tiles = (rows + kRows<W> - 1) / kRows<W>;
    int64_t shrink_pages = 0, expand_tiles = 0;
    for (int64_t i = 0; i < args.num_slices; ++i) {
      const LoraSlice& slice = args.slices[i];
      const int64_t page_elements[2] = {args.hidden_in * kBlockColumns, slice.out_features * kBlockColumns};
      const int64_t* pages = slice.page_table + next * slice.max_pages;
      for (int64_t page = 0; page < (slice.ranks[next] + kBlockColumns - 1) / kBlockColumns; ++page) {
        ahead_a.add(static_cast<const W*>(slice.a_pages) + pages[page] * page_elements[0], page_elements[0] * sizeof(W));
        ahead_b.add(static_cast<const W*>(slice.b_pages) + pages[page] * page_elements[1], page_elements[1] * sizeof(W));
      }
      if (slice.ranks[entry] == 0) continue;
      shrink_pages += (slice.ranks[entry] + kBlockColumns - 1) / kBlockColumns;
      expand_tiles += (slice.out_features / kBlockColumns + kGroup<W> - 1) / kGroup<W>;
    }
    ahead_a.spread_over(row_tiles * ((shrink_pages + kGroup<W> - 1) / kGroup<W>));
    ahead_b.spread_over(row_tiles * expand_tiles);
  }

  // The shrink of every slice first, their pages side by side as the blocks of one matmul (x is
  // shared: wider tiles for the small ranks), row tile by row tile, then each slice's expand from its
  // own columns.
  void chunk(int64_t first, int64_t count, int64_t entry) {
    int64_t total_pages = 0;
    for (int64_t row = 0; row < count; row += kRows<W>) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kRows<W>, count - row));
      total_pages = shrink(tile_rows, x_as_weights(first + row, tile_rows), entry, shrunk.get() + row * ld_shrunk);
    }
    const W* s = shrunk_as_weights(count, total_pages);
    for (int64_t i = 0, offset = 0; i < args.num_slices; ++i) {
      const LoraSlice& slice = args.slices[i];
      const int64_t rank = slice.ranks[entry];
      if (rank == 0) continue;
      const int64_t num_pages = (rank + kBlockColumns - 1) / kBlockColumns;
      expand(count, s + offset, static_cast<const W*>(slice.b_pages), slice.page_table + entry * slice.max_pages, num_pages,
             rank, slice.out_features, static_cast<T*>(args.y) + first * args.total_out + slice.column);
      offset += num_pages * kBlockColumns;
    }
  }

  // out [rows, pages * 16] (ld_shrunk) = x_rows @ A.T over the entry's pages of every slice in slice
  // order, each page one block of 16 columns, kGroup pages a tile. Returns the number of pages.
  int64_t shrink(int rows, const W* x, int64_t entry, float* out) {
    const int64_t page_elements = args.hidden_in * kBlockColumns;
    const int64_t k = std::is_same_v<W, float> ? args.hidden_in : args.hidden_in / 2;
    int64_t total = 0;
    for (int64_t i = 0; i < args.num_slices; ++i) {
      const LoraSlice& slice = args.slices[i];
      const int64_t num_pages = (slice.ranks[entry] + kBlockColumns - 1) / kBlockColumns;
      const int64_t* pages = slice.page_table + entry * slice.max_pages;
      for (int64_t page = 0; page < num_pages; ++page)
        blocks[total++] = static_cast<const W*>(slice.a_pages) + pages[page] * page_elements;
    }
    for (int64_t first = 0; first < total; first += kGroup<W>) {
      const int group = static_cast<int>(std::min<int64_t>(kGroup<W>, total - first));
      tile(rows, group, x, args.hidden_in, BlockPages<W>{blocks.get() + first, 1, k}, k, out + first * kBlockColumns,
           ld_shrunk, ahead_a.next_tile(k));
    }
    return total;
  }

  // y[rows, 0:out] += s @ B.T, kGroup blocks of 16 columns a tile, B's rank rows paged, a column group's
  // tiles for every row tile in turn. Each group reads a short run of every page, too short for the
  // hardware's prefetcher to follow, so the next group's runs are fetched before this one starts
  // (AVX512-BF16, 118 one-token segments: 14 -> 25 GB/s).
  void expand(int64_t rows, const W* s, const W* b_pages, const int64_t* pages, int64_t num_pages, int64_t rank,
              int64_t out_features, T* y) {
    const int64_t page_elements = out_features * kBlockColumns;
    const int64_t k = std::is_same_v<W, float> ? rank : (rank + 1) / 2;  // rows past the rank are zero
    constexpr int64_t block_elements = kBlockColumns * kBlockColumns;
    constexpr int64_t ldc = kGroup<W> * kBlockColumns;
    fetch_runs(b_pages, pages, num_pages, page_elements, 0, std::min(ldc, out_features));
    for (int64_t col = 0; col < out_features; col += ldc) {
      const int group = static_cast<int>(std::min<int64_t>(kGroup<W>, (out_features - col) / kBlockColumns));
      for (int64_t page = 0; page < num_pages; ++page)
        for (int v = 0; v < group; ++v)
          blocks[page * group + v] = b_pages + pages[page] * page_elements + (col / kBlockColumns + v) * block_elements;
      fetch_runs(b_pages, pages, num_pages, page_elements, col + ldc, std::min(col + 2 * ldc, out_features));
      for (int64_t row = 0; row < rows; row += kRows<W>) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRows<W>, rows - row));
        tile(tile_rows, group, s + row * ld_shrunk, ld_shrunk, BlockPages<W>{blocks.get(), num_pages, kPageSteps<W>}, k,
             c.get(), ldc, ahead_b.next_tile(k));
        accumulate(y + row * args.total_out + col, args.total_out, tile_rows, c.get(), ldc, group * kBlockColumns);
      }
    }
  }

  // Prefetches columns [begin, end) of every page of B (each page stores 16 columns a block).
  static void fetch_runs(const W* b_pages, const int64_t* pages, int64_t num_pages, int64_t page_elements,
                         int64_t begin, int64_t end) {
    const int64_t first_byte = begin * kBlockColumns * static_cast<int64_t>(sizeof(W));
    const int64_t last_byte = end * kBlockColumns * static_cast<int64_t>(sizeof(W));
    for (int64_t page = 0; page < num_pages; ++page) {
      const char* run = reinterpret_cast<const char*>(b_pages + pages[page] * page_elements);
      for (int64_t byte = first_byte; byte < last_byte; byte += 64) __builtin_prefetch(run + byte, 0, 3);
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
        from_float(row.data(), x_rows.get() + r * args.hidden_in, args.hidden_in);
      }
      return x_rows.get();
    }
  }

  // The shrunk rows as the expand's input type (rounded to bf16 for bf16 weights, as PEFT's bf16
  // adapters round their intermediate).
  const W* shrunk_as_weights(int64_t count, int64_t num_pages) {
    if constexpr (std::is_same_v<W, float>) {
      return shrunk.get();
    } else {
      for (int64_t r = 0; r < count; ++r)
        from_float(shrunk.get() + r * ld_shrunk, shrunk_w.get() + r * ld_shrunk, num_pages * kBlockColumns);
      return shrunk_w.get();
    }
  }
};

// bf16 weights run with bf16 activations only (the bindings check it).
template <typename T>
void run_segments(const LoraArgs& args, int64_t begin, int64_t end) {
  if (args.weight_dtype == DType::f32) {
    SegmentRunner<T, float> runner{args};
    for (int64_t s = begin; s < end; ++s) runner.run(s, end);
  } else if constexpr (std::is_same_v<T, bf16>) {
    SegmentRunner<bf16, bf16> runner{args};
    for (int64_t s = begin; s < end; ++s) runner.run(s, end);
  }
}

}  // namespace

void lora_segments(const LoraArgs& args, int64_t begin, int64_t end) {
  dispatch_dtype(args.dtype, [&]<typename T>() { run_segments<T>(args, begin, end); });
}

}  // namespace cpu_ops
