// Multi-adapter LoRA on CPU over paged adapter weights, one run of tokens sharing an adapter entry (a
// segment, or a task: the bindings cut heavy segments into tasks of rows and of column parts) at a
// time: for each token t of a segment of entry e and each slice i of a fused projection
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
// outgrow the caches between steps. The op requests them itself, a fixed distance ahead of its tiles
// (`StreamFetch`; the distance is kernels/tuning.py's `lora_fetch_lead_bytes*`): a page is a few KB to
// a few tens, and a call reads 4-6 pools at once, too short and too many runs for the hardware's
// prefetcher to reach full speed on its own (the read rates with and without the requests are in
// docs/benchmarks.md).
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
constexpr int kMaxRows = std::max(kF32TileRows, kBf16TileRows);  // the scratch covers any tile
constexpr int kMaxGroup = std::max(kF32TileBlocks, kBf16TileBlocks);
constexpr int64_t kChunkRows = tuning::kLoraChunkRows;
#if defined(__AVX512F__)
constexpr int64_t kFetchLeadLines = tuning::kLoraFetchLeadBytesAvx512 / 64;
#else
constexpr int64_t kFetchLeadLines = tuning::kLoraFetchLeadBytes / 64;
#endif
// k-steps of one page of B: 16 rank rows, or 8 pairs of them for bf16.
template <typename W>
constexpr int64_t kPageSteps = std::is_same_v<W, float> ? kBlockColumns : kBlockColumns / 2;

// Rows as a tile takes them: of the weights' type (bf16 as bits, widened by the tile where the form
// widens bf16 to float).
template <typename W>
using TileRows = std::conditional_t<std::is_same_v<W, float>, const float*, const uint16_t*>;

template <typename W>
TileRows<W> tile_rows_of(const W* rows) {
  return reinterpret_cast<TileRows<W>>(rows);
}

// The expand's rows as its tiles take them: where the form widens bf16 to float (gemm_tiles.h), widened
// once for all the column groups, which all read the same few shrunk rows: widening them in every
// tile took 9% of W's decode calls on gate_up and 13% of its prefill calls (pages in cache, the
// shrink's widening included; AVX-512 form, Xeon). The shrink's rows stay widened tile by tile:
// one to four column groups read them, and its x widened once (1536 inputs: 48 KB a row tile, past
// L1) ran the down projection slower.
template <typename W>
using ExpandRows = std::conditional_t<!std::is_same_v<W, float> && kBf16TileWidens, WidenedRows, TileRows<W>>;

// One tile of the shrink or expand: rows x (blocks * 16) of the weights `b` into c [rows, blocks * 16]
// (ldc), from x rows of `ldx` elements; `k` as the weight's element type counts it (pairs for bf16).
template <typename W, typename X>
void tile(int rows, int blocks, X x, int64_t ldx, const BlockPages<W>& b, int64_t k, float* c, int64_t ldc,
          const Prefetcher& fetch) {
  with_blocks(blocks, [&]<int NB>() {
    with_rows<kRows<W>>(rows, [&]<int MR>() {
      if constexpr (std::is_same_v<W, float>) {
        f32_tile<MR, NB>(x, ldx, b, k, fetch, c, ldc);
      } else {
        const BlockPages<uint16_t> bits{reinterpret_cast<const uint16_t* const*>(b.blocks), b.num_pages, b.page_steps};
        bf16_tile<MR, NB>(x, ldx, bits, k, fetch, c, ldc);
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

// The pages of the call's segments, requested as the tiles consume them: a run per page, in the order
// the segments read them (a segment's A pages of every slice, then its B pages), and each tile asks
// for its own new lines plus enough to keep kFetchLeadLines requested ahead of what the tiles have
// read, so that the reads stream at an even rate under the arithmetic whatever the segments' ranks.
struct StreamFetch {
  std::vector<FetchRun> runs;
  int64_t total = 0, fetched = 0, consumed = 0, lead = 0;
  RunCursor cursor{};

  void add(const void* start, int64_t bytes) {
    runs.push_back({static_cast<const char*>(start), (bytes + 63) / 64});
    total += runs.back().lines;
  }

  void start(int64_t lead_lines) { lead = lead_lines, cursor = RunCursor{runs.data(), 0}; }

  // The prefetcher of a tile of `steps` k-steps that reads `new_lines` lines not read before.
  Prefetcher next_tile(int64_t new_lines, int64_t steps) {
    consumed += new_lines;
    const int64_t share = std::max<int64_t>(0, std::min(total, consumed + lead) - fetched);
    if (share == 0) return Prefetcher{};
    fetched += share;
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
  // Columns [first, end) of a slice's output.
  struct Columns {
    int64_t first, end;
  };

  // Part `index` of `count` of the slices' columns (LoraArgs::tasks).
  struct Part {
    int64_t index, count;
  };

  const LoraArgs& args;
  int64_t max_pages = max_pages_of(args);
  int64_t ld_shrunk = total_pages_of(args) * kBlockColumns;
  std::unique_ptr<W[]> x_rows = scratch<W>(std::is_same_v<T, W> ? 0 : kMaxRows * args.hidden_in);
  std::unique_ptr<float[]> shrunk = scratch<float>(kChunkRows * ld_shrunk);
  std::unique_ptr<W[]> shrunk_w = scratch<W>(std::is_same_v<W, float> ? 0 : kChunkRows * ld_shrunk);
  std::unique_ptr<float[]> c = scratch<float>(kMaxRows * kMaxGroup * kBlockColumns);
  std::unique_ptr<const W*[]> blocks = scratch<const W*>(std::max(max_pages, total_pages_of(args)) * kMaxGroup);
  // Where the expand's rows are widened (ExpandRows): each row tile of a chunk's shrunk rows of one slice.
  static constexpr bool kWidens = std::is_same_v<ExpandRows<W>, WidenedRows>;
  static constexpr int64_t kChunkTiles = (kChunkRows + kRows<W> - 1) / kRows<W>;
  int64_t widened_tile_floats = kWidens ? widened_rows_size(kRows<W>, max_pages * kPageSteps<W>) : 0;
  std::unique_ptr<float[]> shrunk_widened = scratch<float>(kChunkTiles * widened_tile_floats);
  StreamFetch stream;
  std::vector<Columns> part_columns = std::vector<Columns>(static_cast<size_t>(args.num_slices));  // the task's

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

  // Requests the pages of tasks [begin, end) as `run` consumes them: per task, the pages of A of
  // every slice it touches (the shrink), then its columns of their pages of B (the expand).
  void stream_pages(int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t* t = args.tasks + 5 * task;  // start, length, entry, part, parts
      set_part_columns(Part{t[3], t[4]});
      for (int64_t i = 0; i < args.num_slices; ++i)
        if (touches(i)) add_pages(args.slices[i], t[2], args.slices[i].a_pages, args.hidden_in, {0, args.hidden_in});
      for (int64_t i = 0; i < args.num_slices; ++i)
        add_pages(args.slices[i], t[2], args.slices[i].b_pages, args.slices[i].out_features, part_columns[i]);
    }
    stream.start(kFetchLeadLines);
  }

  // Each slice's columns in `part`, into part_columns: the parts are an even split of the column
  // groups of the expand's tile (kGroup blocks of 16) of every slice in slice order, so that a part
  // touches few slices and shrinks only theirs.
  void set_part_columns(Part part) {
    constexpr int64_t group_columns = kGroup<W> * kBlockColumns;
    int64_t total = 0;
    for (int64_t i = 0; i < args.num_slices; ++i) total += (args.slices[i].out_features + group_columns - 1) / group_columns;
    const int64_t first = total * part.index / part.count, end = total * (part.index + 1) / part.count;
    for (int64_t i = 0, start = 0; i < args.num_slices; ++i) {
      const int64_t out_features = args.slices[i].out_features, groups = (out_features + group_columns - 1) / group_columns;
      const int64_t lo = std::clamp<int64_t>(first - start, 0, groups), hi = std::clamp<int64_t>(end - start, 0, groups);
      part_columns[i] = {std::min(out_features, lo * group_columns), std::min(out_features, hi * group_columns)};
      start += groups;
    }
  }

  bool touches(int64_t slice) const { return part_columns[slice].first < part_columns[slice].end; }

  // Columns `columns` of the pages of `entry` in one pool of `slice` (A's or B's, of `width` x 16
  // elements a page, 16 elements a column).
  void add_pages(const LoraSlice& slice, int64_t entry, const void* pool, int64_t width, Columns columns) {
    const int64_t elements = width * kBlockColumns;
    const int64_t* pages = slice.page_table + entry * slice.max_pages;
    const int64_t offset = columns.first * kBlockColumns, count = (columns.end - columns.first) * kBlockColumns;
    if (count == 0) return;
    for (int64_t page = 0; page < (slice.ranks[entry] + kBlockColumns - 1) / kBlockColumns; ++page)
      stream.add(static_cast<const W*>(pool) + pages[page] * elements + offset, count * sizeof(W));
  }

  // Task `task`.
  void run(int64_t task) {
    const int64_t* t = args.tasks + 5 * task;  // start, length, entry, part, parts
    set_part_columns(Part{t[3], t[4]});
    for (int64_t first = t[0]; first < t[0] + t[1]; first += kChunkRows)
      chunk(first, std::min(kChunkRows, t[0] + t[1] - first), t[2], first == t[0]);
  }

  // The shrink of every slice the task touches first, their pages side by side as the blocks of one
  // matmul (x is shared: wider tiles for the small ranks), row tile by row tile, then each slice's
  // expand from its own columns, over the task's columns of its output (part_columns).
  void chunk(int64_t first, int64_t count, int64_t entry, bool first_chunk) {
    int64_t total_pages = 0;
    for (int64_t row = 0; row < count; row += kRows<W>) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kRows<W>, count - row));
      total_pages = shrink(tile_rows, x_as_weights(first + row, tile_rows), entry, shrunk.get() + row * ld_shrunk,
                           first_chunk && row == 0);
    }
    const W* s = shrunk_as_weights(count, total_pages);
    for (int64_t i = 0, offset = 0; i < args.num_slices; ++i) {
      const LoraSlice& slice = args.slices[i];
      const int64_t rank = slice.ranks[entry];
      if (rank == 0 || !touches(i)) continue;
      const int64_t num_pages = (rank + kBlockColumns - 1) / kBlockColumns;
      expand(count, s + offset, static_cast<const W*>(slice.b_pages), slice.page_table + entry * slice.max_pages, num_pages,
             rank, slice.out_features, part_columns[i],
             static_cast<T*>(args.y) + first * args.total_out + slice.column, first_chunk);
      offset += num_pages * kBlockColumns;
    }
  }

  // out [rows, pages * 16] (ld_shrunk) = x_rows @ A.T over the entry's pages of every slice the task
  // touches, in slice order, each page one block of 16 columns, kGroup pages a tile. Returns the
  // number of pages.
  int64_t shrink(int rows, const W* x, int64_t entry, float* out, bool first_reads) {
    const int64_t page_elements = args.hidden_in * kBlockColumns;
    const int64_t k = std::is_same_v<W, float> ? args.hidden_in : args.hidden_in / 2;
    int64_t total = 0;
    for (int64_t i = 0; i < args.num_slices; ++i) {
      const LoraSlice& slice = args.slices[i];
      const int64_t num_pages = touches(i) ? (slice.ranks[entry] + kBlockColumns - 1) / kBlockColumns : 0;
      const int64_t* pages = slice.page_table + entry * slice.max_pages;
      for (int64_t page = 0; page < num_pages; ++page)
        blocks[total++] = static_cast<const W*>(slice.a_pages) + pages[page] * page_elements;
    }
    for (int64_t first = 0; first < total; first += kGroup<W>) {
      const int group = static_cast<int>(std::min<int64_t>(kGroup<W>, total - first));
      tile<W>(rows, group, tile_rows_of(x), args.hidden_in, BlockPages<W>{blocks.get() + first, 1, k}, k,
              out + first * kBlockColumns, ld_shrunk,
              stream.next_tile(first_reads ? group * page_elements * int64_t{sizeof(W)} / 64 : 0, k));
    }
    return total;
  }

  // y[rows, columns] += s @ B.T over `columns` of the slice's `out_features`, kGroup blocks of 16
  // columns a tile, B's rank rows paged, a column group's tiles for every row tile in turn. Each group reads a short run of every page, too short for the
  // hardware's prefetcher to follow, so the next group's runs are fetched before this one starts
  // (AVX512-BF16, 118 one-token segments: 14 -> 25 GB/s).
  void expand(int64_t rows, const W* s, const W* b_pages, const int64_t* pages, int64_t num_pages, int64_t rank,
              int64_t out_features, Columns columns, T* y, bool first_reads) {
    const int64_t page_elements = out_features * kBlockColumns;
    const int64_t k = std::is_same_v<W, float> ? rank : (rank + 1) / 2;  // rows past the rank are zero
    constexpr int64_t block_elements = kBlockColumns * kBlockColumns;
    constexpr int64_t ldc = kGroup<W> * kBlockColumns;
    if (columns.first == columns.end) return;
    fetch_runs(b_pages, pages, num_pages, page_elements, columns.first, std::min(columns.first + ldc, columns.end));
    ExpandRows<W> row_tiles[kChunkTiles];
    for (int64_t row = 0; row < rows; row += kRows<W>)
      row_tiles[row / kRows<W>] = expand_rows(s + row * ld_shrunk, static_cast<int>(std::min<int64_t>(kRows<W>, rows - row)),
                                              k, shrunk_widened.get() + row / kRows<W> * widened_tile_floats);
    for (int64_t col = columns.first; col < columns.end; col += ldc) {
      const int group = static_cast<int>(std::min<int64_t>(kGroup<W>, (columns.end - col) / kBlockColumns));
      for (int64_t page = 0; page < num_pages; ++page)
        for (int v = 0; v < group; ++v)
          blocks[page * group + v] = b_pages + pages[page] * page_elements + (col / kBlockColumns + v) * block_elements;
      fetch_runs(b_pages, pages, num_pages, page_elements, col + ldc, std::min(col + 2 * ldc, columns.end));
      for (int64_t row = 0; row < rows; row += kRows<W>) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRows<W>, rows - row));
        const int64_t new_lines = first_reads && row == 0 ? group * num_pages * block_elements * int64_t{sizeof(W)} / 64 : 0;
        tile<W>(tile_rows, group, row_tiles[row / kRows<W>], ld_shrunk,
                BlockPages<W>{blocks.get(), num_pages, kPageSteps<W>}, k, c.get(), ldc, stream.next_tile(new_lines, k));
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

  // `count` shrunk rows of k steps as the expand's tiles take them, widened into `widened` where they
  // are widened.
  ExpandRows<W> expand_rows(const W* rows, int count, int64_t k, float* widened) const {
    if constexpr (kWidens) {
      return widen_row_tile(tile_rows_of(rows), ld_shrunk, count, k, widened);
    } else {
      return tile_rows_of(rows);
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
    runner.stream_pages(begin, end);
    for (int64_t s = begin; s < end; ++s) runner.run(s);
  } else if constexpr (std::is_same_v<T, bf16>) {
    SegmentRunner<bf16, bf16> runner{args};
    runner.stream_pages(begin, end);
    for (int64_t s = begin; s < end; ++s) runner.run(s);
  }
}

}  // namespace

void lora_segments(const LoraArgs& args, int64_t begin, int64_t end) {
  dispatch_dtype(args.dtype, [&]<typename T>() { run_segments<T>(args, begin, end); });
}

}  // namespace cpu_ops
