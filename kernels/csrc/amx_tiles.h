// The AMX tile configuration of the AMX matmul and the AMX peak probe: palette 1, eight tiles of
// 16 rows x 64 bytes. Tile state is per thread: each thread loads it before using tiles.
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>

#include <cstdint>

namespace cpu_ops {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Eight 16 x 64-byte tiles, configured for the calling thread.
inline void configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace cpu_ops
#endif
