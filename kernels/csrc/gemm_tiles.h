// Register-tile microkernels of the compiled matmuls: an output tile of MR rows x NB blocks of 16
// columns held in registers, computed over the whole K from a weight packed in blocks of 16 output
// columns, and stored as float32 into `c` (the caller rounds or accumulates it). While a tile
// computes, lines [first_line, end_line) of `upcoming` (the next column group's weights) are
// requested, spread evenly over K, so that memory stays busy while the arithmetic runs.
//
// Packed layouts, per block of 16 output columns:
//   float32: packed[n_block][k][16]               one k is one 64-byte row of the block
//   bf16:    packed[n_block][k_pair][16][2]       one pair of k is one 64-byte vector (`vdpbf16ps`)
// A block's k-steps may lie in several pages (`BlockPages`): the LoRA op's B holds each adapter's
// rank rows in pages of 16 wherever the adapter pool put them.
// Forms: float32 on AVX-512 (zmm: MR x NB accumulators) and on AVX2 + FMA (ymm: MR x 2NB), bf16 on
// AVX512-BF16 (`vdpbf16ps`) and on AVX-512 and AVX2 + FMA (widened to float32); the generic form has
// the portable tiles (plain loops the compiler vectorises as it can),
// which the LoRA op uses where no intrinsic tile exists. Which tile shapes each form's matmuls use is
// in kernels/tuning.py.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "kernel_table.h"
#include "lora_serve_tuning.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace cpu_ops {

constexpr int64_t kBlockColumns = 16;  // output columns per packed block

// This form's tile shapes (rows x blocks of 16 columns), from kernels/tuning.py.
#if defined(__AVX512F__)
constexpr int kF32TileRows = tuning::kF32LinearTileRowsAvx512, kF32TileBlocks = tuning::kF32LinearTileBlocksAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kF32TileRows = tuning::kF32LinearTileRowsAvx2, kF32TileBlocks = tuning::kF32LinearTileBlocksAvx2;
#else
constexpr int kF32TileRows = tuning::kPortableTileRows, kF32TileBlocks = tuning::kPortableTileBlocks;
#endif
// bf16: the tile of the matmuls and the LoRA op, and the matmul's tile for batches of at least
// kBf16TallTileRows rows over at most kBf16TallTileMaxK inputs (the same tile where the form has no
// other).
#if defined(__AVX512BF16__)
constexpr int kBf16TileRows = tuning::kBf16LinearTileRows, kBf16TileBlocks = tuning::kBf16LinearTileBlocks;
constexpr int kBf16TallTileRows = kBf16TileRows, kBf16TallTileBlocks = kBf16TileBlocks;
constexpr int64_t kBf16TallTileMaxK = 0;
#elif defined(__AVX512F__)
constexpr int kBf16TileRows = tuning::kBf16FmaTileRowsAvx512, kBf16TileBlocks = tuning::kBf16FmaTileBlocksAvx512;
constexpr int kBf16TallTileRows = tuning::kBf16FmaTallTileRowsAvx512;
constexpr int kBf16TallTileBlocks = tuning::kBf16FmaTallTileBlocksAvx512;
constexpr int64_t kBf16TallTileMaxK = tuning::kBf16FmaTallTileMaxKAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kBf16TileRows = tuning::kBf16FmaTileRowsAvx2, kBf16TileBlocks = tuning::kBf16FmaTileBlocksAvx2;
constexpr int kBf16TallTileRows = kBf16TileRows, kBf16TallTileBlocks = kBf16TileBlocks;
constexpr int64_t kBf16TallTileMaxK = 0;
#else
constexpr int kBf16TileRows = tuning::kPortableTileRows, kBf16TileBlocks = tuning::kPortableTileBlocks;
constexpr int kBf16TallTileRows = kBf16TileRows, kBf16TallTileBlocks = kBf16TileBlocks;
constexpr int64_t kBf16TallTileMaxK = 0;
#endif
static_assert(kF32TileRows >= 1 && kF32TileRows <= 16 && kF32TileBlocks >= 1 && kF32TileBlocks <= 3 &&
                  kBf16TileRows >= 1 && kBf16TileRows <= 16 && kBf16TileBlocks >= 1 && kBf16TileBlocks <= 3 &&
                  kBf16TallTileRows >= kBf16TileRows && kBf16TallTileRows <= 16 && kBf16TallTileBlocks >= 1 &&
                  kBf16TallTileBlocks <= 3,
              "the tiles instantiate 1-16 rows and 1-3 blocks");

// The k-steps of a tile's NB blocks: `num_pages` runs of `page_steps` k-steps each (the last one may
// be shorter), block v of page j starting at blocks[j * NB + v], its k-step i at + i * 16 elements
// (+ i * 32 for bf16 pairs). A plain packed weight is one page.
template <typename W>
struct BlockPages {
  const W* const* blocks;
  int64_t num_pages;
  int64_t page_steps;
};

// The rows of part `part` of `parts` of a matmul's rows: an even split of its tiles of `tile_rows`
// rows (LinearArgs::row_parts), so that every part but the last holds whole tiles.
struct RowPart {
  int64_t first_row, rows;
};

inline RowPart row_part(int64_t rows, int64_t tile_rows, int64_t part, int64_t parts) {
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  const int64_t first = tiles * part / parts * tile_rows;
  const int64_t last = std::min(rows, tiles * (part + 1) / parts * tile_rows);
  return {first, std::max<int64_t>(0, last - first)};
}

// Calls body(part, first_group, end_group) for each row part that tasks [begin, end) touch (task
// t = part * groups + group, LinearArgs), with the part's range of column groups.
template <typename Body>
inline void for_each_part(int64_t groups, int64_t begin, int64_t end, Body body) {
  for (int64_t part = begin / groups; part * groups < end; ++part)
    body(part, std::max(begin, part * groups) - part * groups, std::min(end, (part + 1) * groups) - part * groups);
}

// A position in a list of runs (LinearArgs::fetch_runs) whose lines are requested one by one, into
// L2: the op after the matmul reads them, the matmul's own tiles must keep L1. Each tile gets its own
// copy, at its share's first line: nothing in a tile's loop writes through a pointer.
struct RunCursor {
  const FetchRun* run = nullptr;
  int64_t line = 0;

  // The cursor at line `index` of the runs (index < their total lines).
  static RunCursor at(const FetchRun* runs, int64_t index) {
    RunCursor cursor{runs, 0};
    cursor.advance(index);
    return cursor;
  }

  void advance(int64_t lines) {
    for (line += lines; run != nullptr && line > 0 && line >= run->lines;) line -= (run++)->lines;
  }

  __attribute__((always_inline)) inline void fetch_one() {
    __builtin_prefetch(run->start + 64 * line, 0, 2);
    if (++line == run->lines) ++run, line = 0;
  }
};

// Requests `lines` lines from `next` (into L1: the matmul's next weights) and `side_lines` lines of
// `side` over `steps` steps, each credit carrying its remainder: integer steps, not a division per
// step. 0 lines: nothing to fetch.
struct Prefetcher {
  const char* next = nullptr;
  int64_t lines = 0, steps = 1, credit = 0;
  RunCursor side{};
  int64_t side_lines = 0, side_credit = 0;

  __attribute__((always_inline)) inline void step() {
    for (credit += lines; credit >= steps; credit -= steps, next += 64) __builtin_prefetch(next, 0, 3);
    for (side_credit += side_lines; side_credit >= steps; side_credit -= steps) side.fetch_one();
  }
};

#if defined(__AVX512F__)
template <int MR, int NB>
inline void f32_tile(const float* x, int64_t ldx, const BlockPages<float>& b, int64_t k, Prefetcher fetch, float* c,
                     int64_t ldc) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t page = 0, kk = 0; page < b.num_pages; ++page) {
    const float* w[NB];
    for (int v = 0; v < NB; ++v) w[v] = b.blocks[page * NB + v];
    for (const int64_t page_end = std::min(k, kk + b.page_steps); kk < page_end; ++kk) {
      fetch.step();
      __m512 weights[NB];
      for (int v = 0; v < NB; ++v) weights[v] = _mm512_loadu_ps(w[v]);
      for (int v = 0; v < NB; ++v) w[v] += kBlockColumns;
      for (int m = 0; m < MR; ++m) {
        const __m512 a = _mm512_set1_ps(x[m * ldx + kk]);
        for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_fmadd_ps(a, weights[v], acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NB; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int MR, int NB>
inline void f32_tile(const float* x, int64_t ldx, const BlockPages<float>& b, int64_t k, Prefetcher fetch, float* c,
                     int64_t ldc) {
  __m256 acc[MR][2 * NB];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NB; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t page = 0, kk = 0; page < b.num_pages; ++page) {
    const float* w[NB];
    for (int v = 0; v < NB; ++v) w[v] = b.blocks[page * NB + v];
    for (const int64_t page_end = std::min(k, kk + b.page_steps); kk < page_end; ++kk) {
      fetch.step();
      __m256 weights[2 * NB];
      for (int v = 0; v < 2 * NB; ++v) weights[v] = _mm256_loadu_ps(w[v / 2] + 8 * (v % 2));
      for (int v = 0; v < NB; ++v) w[v] += kBlockColumns;
      for (int m = 0; m < MR; ++m) {
        // Not _mm256_broadcast_ss(pointer): GCC then stored every accumulator to the stack each step
        // in the LoRA op's tiles (the op ran 1.4x slower on AVX2).
        const __m256 a = _mm256_set1_ps(x[m * ldx + kk]);
        for (int v = 0; v < 2 * NB; ++v) acc[m][v] = _mm256_fmadd_ps(a, weights[v], acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NB; ++v) _mm256_storeu_ps(c + m * ldc + 8 * v, acc[m][v]);
}
#else
template <int MR, int NB>
inline void f32_tile(const float* x, int64_t ldx, const BlockPages<float>& b, int64_t k, Prefetcher fetch, float* c,
                     int64_t ldc) {
  float acc[MR][NB * kBlockColumns] = {};
  for (int64_t page = 0, kk = 0; page < b.num_pages; ++page) {
    for (int64_t step = 0; step < b.page_steps && kk < k; ++step, ++kk) {
      fetch.step();
      for (int v = 0; v < NB; ++v) {
        const float* w = b.blocks[page * NB + v] + step * kBlockColumns;
        for (int m = 0; m < MR; ++m) {
          const float a = x[m * ldx + kk];
#pragma omp simd
          for (int col = 0; col < kBlockColumns; ++col) acc[m][v * kBlockColumns + col] += a * w[col];
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(c + m * ldc, acc[m], sizeof(acc[m]));
}
#endif

// Rows of bf16 bits widened to float, kWidenPairs pairs at a time: the widened bf16 tiles' input
// (below), and their callers'.
constexpr int64_t kWidenPairs = 32;

// Rows of x whose pairs [32 j, 32 j + 32) lie at data + j * rows * 2 * kWidenPairs, row after row,
// 2 * kWidenPairs floats each (row m's pair kp at + m * 2 * kWidenPairs + 2 * (kp % kWidenPairs)).
// A tile reads them as MR = rows: the tile that takes them has exactly the rows that were widened.
struct WidenedRows {
  const float* data;
};

// Pairs [first_pair, first_pair + pairs) (at most kWidenPairs) of `rows` rows of bf16 bits into one
// chunk of rows widened to float.
inline void widen_rows(const uint16_t* x, int64_t ldx, int rows, int64_t first_pair, int64_t pairs, float* xf) {
  for (int m = 0; m < rows; ++m) {
    const uint16_t* row = x + m * ldx + 2 * first_pair;
#pragma omp simd
    for (int64_t e = 0; e < 2 * pairs; ++e) xf[m * 2 * kWidenPairs + e] = bf16_bits_to_float(row[e]);
  }
}

// Floats `widen_row_tile` writes for `rows` rows of k_pairs pairs.
inline int64_t widened_rows_size(int rows, int64_t k_pairs) {
  return (k_pairs + kWidenPairs - 1) / kWidenPairs * rows * 2 * kWidenPairs;
}

// `rows` rows of bf16 bits (x [rows, 2 * k_pairs], rows `ldx` apart) as `WidenedRows` into out.
inline WidenedRows widen_row_tile(const uint16_t* x, int64_t ldx, int rows, int64_t k_pairs, float* out) {
  for (int64_t first = 0; first < k_pairs; first += kWidenPairs)
    widen_rows(x, ldx, rows, first, std::min(kWidenPairs, k_pairs - first), out + first * rows * 2);
  return WidenedRows{out};
}

#if defined(__AVX512BF16__)
// x holds bf16 bits; k_pairs = K / 2, and the pages' steps are pairs too.
constexpr bool kBf16TileWidens = false;
template <int MR, int NB>
inline void bf16_tile(const uint16_t* x, int64_t ldx, const BlockPages<uint16_t>& b, int64_t k_pairs, Prefetcher fetch,
                      float* c, int64_t ldc) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t page = 0, kp = 0; page < b.num_pages; ++page) {
    const uint16_t* w[NB];
    for (int v = 0; v < NB; ++v) w[v] = b.blocks[page * NB + v];
    for (const int64_t page_end = std::min(k_pairs, kp + b.page_steps); kp < page_end; ++kp) {
      fetch.step();
      __m512bh weights[NB];
      for (int v = 0; v < NB; ++v) weights[v] = (__m512bh)_mm512_loadu_si512(w[v]);
      for (int v = 0; v < NB; ++v) w[v] += 2 * kBlockColumns;
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, weights[v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NB; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// bf16 weights, float32 arithmetic, in the forms without `vdpbf16ps`: a bf16 is the top half of its
// float32, so a vector of 16 column pairs widens exactly into the even k's 16 columns (a shift) and
// the odd k's (a mask), each multiplied by `vfmadd`. Each multiplier is one broadcast load of x
// widened to float, at a constant offset. The tiles take x (X) as one of:
// - `const float*`: the tile's rows widened and packed k-major by the caller, once for every column
//   group (x[k * MR + m]; ldx unused): the matmuls' tall tile;
// - `WidenedRows`: the tile's rows widened by the caller, once for every column group, in chunks of
//   kWidenPairs pairs (`widen_row_tile`; ldx unused): the LoRA op, whose every column group of the
//   expand reads the same few rows;
// - `const uint16_t*`: bf16 bits, widened here, kWidenPairs pairs at a time, into a buffer of rows.
constexpr bool kBf16TileWidens = true;

// Runs body(xk, row_stride, pair_stride) for each k-pair kp of `b`'s pages in turn, w[v] at block v's
// pair kp once body advances it: row m's multipliers of pair kp are xk[m * row_stride] (even k) and
// xk[m * row_stride + pair_stride] (odd k), the strides compile-time constants.
template <int MR, int NB, typename X, typename Body>
__attribute__((always_inline)) inline void for_each_widened_pair(X x, int64_t ldx, const BlockPages<uint16_t>& b,
                                                                 int64_t k_pairs, const uint16_t* (&w)[NB], Body body) {
  static_assert(std::is_same_v<X, const float*> || std::is_same_v<X, WidenedRows> || std::is_same_v<X, const uint16_t*>);
  constexpr std::integral_constant<int64_t, 2 * kWidenPairs> row_chunk{};
  constexpr std::integral_constant<int64_t, 1> one{};
  for (int64_t page = 0, kp = 0; page < b.num_pages; ++page) {
    for (int v = 0; v < NB; ++v) w[v] = b.blocks[page * NB + v];
    const int64_t page_end = std::min(k_pairs, kp + b.page_steps);
    if constexpr (std::is_same_v<X, const float*>) {
      for (; kp < page_end; ++kp) body(x + 2 * MR * kp, one, std::integral_constant<int64_t, MR>{});
    } else if constexpr (std::is_same_v<X, WidenedRows>) {
      while (kp < page_end) {
        const int64_t chunk = kp / kWidenPairs, chunk_end = std::min(page_end, (chunk + 1) * kWidenPairs);
        const float* xk = x.data + chunk * MR * 2 * kWidenPairs + 2 * (kp - chunk * kWidenPairs);
        for (; kp < chunk_end; ++kp, xk += 2) body(xk, row_chunk, one);
      }
    } else {
      alignas(64) float xf[MR * 2 * kWidenPairs];
      while (kp < page_end) {
        const int64_t first = kp, chunk_end = std::min(page_end, kp + kWidenPairs);
        widen_rows(x, ldx, MR, first, chunk_end - first, xf);
        for (; kp < chunk_end; ++kp) body(xf + 2 * (kp - first), row_chunk, one);
      }
    }
  }
}

#if defined(__AVX512F__)
template <int MR, int NB, typename X>
inline void bf16_tile(X x, int64_t ldx, const BlockPages<uint16_t>& b, int64_t k_pairs, Prefetcher fetch,
                      float* c, int64_t ldc) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* w[NB];
  for_each_widened_pair<MR, NB>(x, ldx, b, k_pairs, w, [&](const float* xk, auto row_stride, auto pair_stride) __attribute__((always_inline)) {
    fetch.step();
    __m512 widened[NB];
    for (int v = 0; v < NB; ++v) widened[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w[v]), 16));
    for (int m = 0; m < MR; ++m) {
      const __m512 a0 = _mm512_set1_ps(xk[m * row_stride]);
      for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_fmadd_ps(a0, widened[v], acc[m][v]);
    }
    for (int v = 0; v < NB; ++v) widened[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w[v]), high));
    for (int m = 0; m < MR; ++m) {
      const __m512 a1 = _mm512_set1_ps(xk[m * row_stride + pair_stride]);
      for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_fmadd_ps(a1, widened[v], acc[m][v]);
    }
    for (int v = 0; v < NB; ++v) w[v] += 2 * kBlockColumns;
  });
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NB; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}
#else
// AVX2: each block's 16 columns are two vectors of 8 (ymm), widened to four.
template <int MR, int NB, typename X>
inline void bf16_tile(X x, int64_t ldx, const BlockPages<uint16_t>& b, int64_t k_pairs, Prefetcher fetch,
                      float* c, int64_t ldc) {
  __m256 acc[MR][2 * NB];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NB; ++v) acc[m][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* w[NB];
  for_each_widened_pair<MR, NB>(x, ldx, b, k_pairs, w, [&](const float* xk, auto row_stride, auto pair_stride) __attribute__((always_inline)) {
    fetch.step();
    __m256 even[2 * NB], odd[2 * NB];
    for (int v = 0; v < 2 * NB; ++v) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[v / 2] + 16 * (v % 2)));
      even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      odd[v] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
    }
    for (int v = 0; v < NB; ++v) w[v] += 2 * kBlockColumns;
    for (int m = 0; m < MR; ++m) {
      const __m256 a0 = _mm256_set1_ps(xk[m * row_stride]), a1 = _mm256_set1_ps(xk[m * row_stride + pair_stride]);
      for (int v = 0; v < 2 * NB; ++v) acc[m][v] = _mm256_fmadd_ps(a1, odd[v], _mm256_fmadd_ps(a0, even[v], acc[m][v]));
    }
  });
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NB; ++v) _mm256_storeu_ps(c + m * ldc + 8 * v, acc[m][v]);
}
#endif
#else
constexpr bool kBf16TileWidens = false;
template <int MR, int NB>
inline void bf16_tile(const uint16_t* x, int64_t ldx, const BlockPages<uint16_t>& b, int64_t k_pairs, Prefetcher fetch,
                      float* c, int64_t ldc) {
  float acc[MR][NB * kBlockColumns] = {};
  float w[2 * kBlockColumns];
  for (int64_t page = 0, kp = 0; page < b.num_pages; ++page) {
    for (int64_t step = 0; step < b.page_steps && kp < k_pairs; ++step, ++kp) {
      fetch.step();
      for (int v = 0; v < NB; ++v) {
        const uint16_t* pairs = b.blocks[page * NB + v] + step * 2 * kBlockColumns;
#pragma omp simd
        for (int e = 0; e < 2 * kBlockColumns; ++e) w[e] = bf16_bits_to_float(pairs[e]);
        for (int m = 0; m < MR; ++m) {
          const float a0 = bf16_bits_to_float(x[m * ldx + 2 * kp]), a1 = bf16_bits_to_float(x[m * ldx + 2 * kp + 1]);
#pragma omp simd
          for (int col = 0; col < kBlockColumns; ++col) acc[m][v * kBlockColumns + col] += a0 * w[2 * col] + a1 * w[2 * col + 1];
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(c + m * ldc, acc[m], sizeof(acc[m]));
}
#endif

// Calls `tile.template operator()<MR>()` with MR = rows (1..kMaxRows, the caller's tile rows): one
// instantiation per row count keeps every accumulator of a partial tile in a register too.
template <int kMaxRows, typename Tile>
inline void with_rows(int rows, Tile&& tile) {
  if constexpr (kMaxRows <= 1) {
    tile.template operator()<1>();
  } else if (rows >= kMaxRows) {
    tile.template operator()<kMaxRows>();
  } else {
    with_rows<kMaxRows - 1>(rows, tile);
  }
}

// Calls `group.template operator()<NB>()` with NB = blocks (1..3).
template <typename Group>
inline void with_blocks(int blocks, Group&& group) {
  switch (blocks) {
    case 3: group.template operator()<3>(); break;
    case 2: group.template operator()<2>(); break;
    default: group.template operator()<1>(); break;
  }
}

}  // namespace cpu_ops
