"""How a backend holds the adapter weights it multiplies: the adapter pool (lora_runtime.adapters.slots)
allocates and writes its tensors through the layout its backend chose (`Backend.lora_layout`).

For each fused projection (slices: q/k/v, gate/up, or one module) and each slot:
- `DenseLoraLayout` (PyTorch and Triton backends): lora_a [S, num_slices * R, in] (slice i's rank rows
  at i*R), lora_b [S, total_out, R] as a view of [S, R, total_out] storage (the output dimension
  contiguous). This is the layout `kernels.reference.add_lora` reads.
- `TiledLoraLayout` (compiled CPU backend): the same values in the register-tile layout of the CPU
  matmuls (kernels/csrc/lora.cpp): a_tiles [S, num_slices * R / 16, in * 16], blocks of 16 rank
  rows each stored [in][16] (bf16: [in / 2][16][2]); b_tiles [S, total_out / 16, R * 16], blocks of 16
  output columns each stored [R][16] (bf16: [R / 2][16][2]); R rounded up to a multiple of 16.
Ranks below R are zero-padded and a module an adapter does not adapt stays zero, so padded parts add
exactly nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 16  # rank rows per block of A, output columns per block of B


@dataclass(frozen=True, slots=True)
class LoraProjection:
    """The shape of one fused projection's adapter weights."""

    in_features: int
    slice_offsets: tuple[int, ...]  # [num_slices + 1] output column boundaries

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    @property
    def total_out(self) -> int:
        return self.slice_offsets[-1]


@dataclass(frozen=True, slots=True)
class DenseLoraLayout:
    dtype: torch.dtype

    def rank_rows(self, max_rank: int) -> int:
        return max_rank

    def allocate(self, num_slots: int, max_rank: int, projection: LoraProjection, device) -> tuple[torch.Tensor, torch.Tensor]:
        lora_a = torch.zeros(num_slots, max_rank * projection.num_slices, projection.in_features, dtype=self.dtype, device=device)
        lora_b = torch.zeros(num_slots, max_rank, projection.total_out, dtype=self.dtype, device=device).transpose(1, 2)
        return lora_a, lora_b

    def write(self, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int, slice_idx: int, projection: LoraProjection,
              a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice `slice_idx` of `slot`: a [rank, in] and b [out_i, rank] (already scaled)."""
        rank, row = a.shape[0], slice_idx * lora_b.shape[2]
        lora_a[slot, row : row + rank].copy_(a)
        lora_b[slot, projection.slice_offsets[slice_idx] : projection.slice_offsets[slice_idx + 1], :rank].copy_(b)

    def dense(self, lora_a: torch.Tensor, lora_b: torch.Tensor, projection: LoraProjection) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as `kernels.reference.add_lora` reads them."""
        return lora_a, lora_b


@dataclass(frozen=True, slots=True)
class TiledLoraLayout:
    dtype: torch.dtype  # float32 or bfloat16

    @staticmethod
    def fits(projection: LoraProjection, dtype: torch.dtype) -> bool:
        """Whether the tiles cover the projection: slices in whole blocks of 16 columns (and pairs of
        in_features for bf16)."""
        pairs = dtype != torch.bfloat16 or projection.in_features % 2 == 0
        return pairs and all(offset % TILE == 0 for offset in projection.slice_offsets)

    def rank_rows(self, max_rank: int) -> int:
        return -(-max_rank // TILE) * TILE

    def allocate(self, num_slots: int, max_rank: int, projection: LoraProjection, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rank_rows(max_rank)
        a_tiles = torch.zeros(num_slots, projection.num_slices * rows // TILE, projection.in_features * TILE,
                              dtype=self.dtype, device=device)
        b_tiles = torch.zeros(num_slots, projection.total_out // TILE, rows * TILE, dtype=self.dtype, device=device)
        return a_tiles, b_tiles

    def write(self, a_tiles: torch.Tensor, b_tiles: torch.Tensor, slot: int, slice_idx: int, projection: LoraProjection,
              a: torch.Tensor, b: torch.Tensor) -> None:
        rows = b_tiles.shape[2] // TILE
        rank = a.shape[0]
        padded_a = torch.zeros(rows, projection.in_features, dtype=self.dtype)
        padded_a[:rank] = a
        first_block = slice_idx * rows // TILE
        a_tiles[slot, first_block : first_block + rows // TILE] = self._tiles(padded_a).to(a_tiles.device)
        start, end = projection.slice_offsets[slice_idx : slice_idx + 2]
        padded_b = torch.zeros(end - start, rows, dtype=self.dtype)
        padded_b[:, :rank] = b
        b_tiles[slot, start // TILE : end // TILE] = self._tiles(padded_b).to(b_tiles.device)

    def _tiles(self, matrix: torch.Tensor) -> torch.Tensor:
        """[n, k] (n a multiple of 16) -> [n / 16, k * 16]: per block of 16 rows of n, k-major with the
        16 adjacent (bf16: pairs of k interleaved, [k / 2][16][2])."""
        n, k = matrix.shape
        if self.dtype == torch.bfloat16:
            return matrix.view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).reshape(n // TILE, k * TILE)
        return matrix.view(n // TILE, TILE, k).permute(0, 2, 1).reshape(n // TILE, k * TILE)

    def _untile(self, tiles: torch.Tensor, k: int) -> torch.Tensor:
        """[S, blocks, k * 16] -> [S, blocks * 16, k], the inverse of `_tiles` per slot."""
        slots, blocks = tiles.shape[:2]
        if self.dtype == torch.bfloat16:
            return tiles.view(slots, blocks, k // 2, TILE, 2).permute(0, 1, 3, 2, 4).reshape(slots, blocks * TILE, k)
        return tiles.view(slots, blocks, k, TILE).permute(0, 1, 3, 2).reshape(slots, blocks * TILE, k)

    def dense(self, a_tiles: torch.Tensor, b_tiles: torch.Tensor, projection: LoraProjection) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as `kernels.reference.add_lora` reads them: [S, num_slices * R, in], [S, total_out, R]."""
        rows = b_tiles.shape[2] // TILE
        return self._untile(a_tiles, projection.in_features), self._untile(b_tiles, rows)


LoraLayout = DenseLoraLayout | TiledLoraLayout
