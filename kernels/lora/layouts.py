"""How a backend holds adapter weights: in pages of `PAGE_ROWS` rank rows, one page pool per adapted
module (q_proj, ..., down_proj) spanning every layer, so an adapter of rank r on a module occupies
ceil(r / 16) pages of that module's pool wherever the pool found them, and nothing else: there is no
slot, no padding to a maximum rank, no count of adapters. The adapter pool
(lora_runtime.adapters.pages) allocates the pages; the backend's layout (`Backend.lora_layout`) says
what a page holds:

- `RowPages` (PyTorch and Triton backends): a [L, P, 16, in] (16 rank rows of A, in contiguous),
  b [L, P, 16, out] (the same 16 rank rows of B, transposed: out contiguous).
- `TiledPages` (compiled CPU backend): the register-tile layout of the CPU matmuls
  (kernels/csrc/lora.cpp): a [L, P, in * 16], a page of A stored [in][16] (bf16: [in / 2][16][2]),
  the block of 16 output columns the shrink computes; b [L, P, out * 16], a page of B stored as
  out / 16 blocks of [16 rank rows][16 columns] (bf16: [8 row pairs][16][2]), which the expand reads
  as k-steps of its tiles, page after page.

Rows of an adapter's last page past its rank are zero, so they add exactly nothing; a layer the
adapter does not adapt holds zeros in its pages. `write` and `read` take a module's whole pool
(every layer) and `pages`, the adapter's page ids in rank order; pools are allocated uninitialised,
since only pages that were written are ever read.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAGE_ROWS = 16  # rank rows per page: the width of the CPU shrink's output block


def pages_for_rank(rank: int) -> int:
    return -(-rank // PAGE_ROWS)


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """One adapted module's input and output widths."""

    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class RowPages:
    dtype: torch.dtype

    def allocate(self, num_layers: int, num_pages: int, shape: ModuleShape, device) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.empty(num_layers, num_pages, PAGE_ROWS, shape.in_features, dtype=self.dtype, device=device)
        b = torch.empty(num_layers, num_pages, PAGE_ROWS, shape.out_features, dtype=self.dtype, device=device)
        return a, b

    def tile(self, lora_a: torch.Tensor, lora_b: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's factors lora_a [L, rank, in], lora_b [L, out, rank] (zeros where a layer is
        not adapted) as `num_pages` pages: contiguous (a [L, n, 16, in], b [L, n, 16, out]) on the CPU."""
        rows_a, rows_b = _padded_rows(num_pages, lora_a, lora_b, self.dtype)
        num_layers = rows_a.shape[0]
        return rows_a.view(num_layers, num_pages, PAGE_ROWS, -1), rows_b.view(num_layers, num_pages, PAGE_ROWS, -1)

    def write(self, a: torch.Tensor, b: torch.Tensor, pages: Sequence[int], lora_a: torch.Tensor,
              lora_b: torch.Tensor) -> None:
        """`tile` the factors into `pages`."""
        write_tiles(a, b, pages, *self.tile(lora_a, lora_b, len(pages)))

    def read(self, a: torch.Tensor, b: torch.Tensor, pages: Sequence[int], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lora_a [L, rank, in], lora_b [L, out, rank]) as stored in `pages`."""
        num_layers, index = a.shape[0], _index(pages, a.device)
        rows_a = a.index_select(1, index).reshape(num_layers, -1, a.shape[-1])[:, :rank]
        rows_b = b.index_select(1, index).reshape(num_layers, -1, b.shape[-1])[:, :rank]
        return rows_a, rows_b.transpose(1, 2)


@dataclass(frozen=True, slots=True)
class TiledPages:
    dtype: torch.dtype  # float32 or bfloat16

    @staticmethod
    def fits(shape: ModuleShape, dtype: torch.dtype) -> bool:
        """Whether the tiles cover the module: output columns in whole blocks of 16 (and pairs of
        in_features for bf16)."""
        pairs = dtype != torch.bfloat16 or shape.in_features % 2 == 0
        return pairs and shape.out_features % PAGE_ROWS == 0

    def allocate(self, num_layers: int, num_pages: int, shape: ModuleShape, device) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.empty(num_layers, num_pages, shape.in_features * PAGE_ROWS, dtype=self.dtype, device=device)
        b = torch.empty(num_layers, num_pages, shape.out_features * PAGE_ROWS, dtype=self.dtype, device=device)
        return a, b

    def tile(self, lora_a: torch.Tensor, lora_b: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `RowPages.tile`, in this layout: (a [L, n, in * 16], b [L, n, out * 16])."""
        rows_a, rows_b = _padded_rows(num_pages, lora_a, lora_b, self.dtype)
        num_layers, in_features, out_features = rows_a.shape[0], rows_a.shape[2], rows_b.shape[2]
        return (self._a_tiles(rows_a).reshape(num_layers, num_pages, in_features * PAGE_ROWS),
                self._b_tiles(rows_b).reshape(num_layers, num_pages, out_features * PAGE_ROWS))

    def write(self, a: torch.Tensor, b: torch.Tensor, pages: Sequence[int], lora_a: torch.Tensor,
              lora_b: torch.Tensor) -> None:
        write_tiles(a, b, pages, *self.tile(lora_a, lora_b, len(pages)))

    def read(self, a: torch.Tensor, b: torch.Tensor, pages: Sequence[int], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_layers, num_pages = a.shape[0], len(pages)
        in_features, out_features = a.shape[-1] // PAGE_ROWS, b.shape[-1] // PAGE_ROWS
        index = _index(pages, a.device)
        a_pages, b_pages = a.index_select(1, index), b.index_select(1, index)
        if self.dtype == torch.bfloat16:
            rows_a = a_pages.view(num_layers, num_pages, in_features // 2, PAGE_ROWS, 2).permute(0, 1, 3, 2, 4)
            blocks = b_pages.view(num_layers, num_pages, out_features // PAGE_ROWS, PAGE_ROWS // 2, PAGE_ROWS, 2)
            rows_b = blocks.permute(0, 1, 3, 5, 2, 4)  # [layer, page, row pair, row in pair, block, column]
        else:
            rows_a = a_pages.view(num_layers, num_pages, in_features, PAGE_ROWS).permute(0, 1, 3, 2)
            blocks = b_pages.view(num_layers, num_pages, out_features // PAGE_ROWS, PAGE_ROWS, PAGE_ROWS)
            rows_b = blocks.permute(0, 1, 3, 2, 4)
        rows_a = rows_a.reshape(num_layers, num_pages * PAGE_ROWS, in_features)[:, :rank]
        rows_b = rows_b.reshape(num_layers, num_pages * PAGE_ROWS, out_features)[:, :rank]
        return rows_a, rows_b.transpose(1, 2)

    def _a_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """[L, pages * 16, in] -> a view [L, pages, ...]: each page's 16 rows in-major (bf16: pairs of in)."""
        num_layers, num_pages, in_features = rows.shape[0], rows.shape[1] // PAGE_ROWS, rows.shape[2]
        if self.dtype == torch.bfloat16:
            return rows.view(num_layers, num_pages, PAGE_ROWS, in_features // 2, 2).permute(0, 1, 3, 2, 4)
        return rows.view(num_layers, num_pages, PAGE_ROWS, in_features).permute(0, 1, 3, 2)

    def _b_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """[L, pages * 16, out] (rank rows of B.T) -> a view [L, pages, ...]: per block of 16 columns,
        the page's 16 rows row-major (bf16: rows in pairs, [8][16][2])."""
        num_layers, num_pages, out_features = rows.shape[0], rows.shape[1] // PAGE_ROWS, rows.shape[2]
        blocks = out_features // PAGE_ROWS
        if self.dtype == torch.bfloat16:
            return rows.view(num_layers, num_pages, PAGE_ROWS // 2, 2, blocks, PAGE_ROWS).permute(0, 1, 4, 2, 5, 3)
        return rows.view(num_layers, num_pages, PAGE_ROWS, blocks, PAGE_ROWS).permute(0, 1, 3, 2, 4)


def _index(pages: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.int64, device=device)


def write_tiles(a: torch.Tensor, b: torch.Tensor, pages: Sequence[int], a_tiles: torch.Tensor,
                b_tiles: torch.Tensor) -> None:
    """Pages made by a layout's `tile` into the pools `a`, `b` at `pages`: a plain copy per page and
    layer-run (with the transfer to the pools' device), the layout's work done by `tile` already."""
    for pool, tiles in ((a, a_tiles), (b, b_tiles)):
        for i, page in enumerate(pages):
            pool[:, page].copy_(tiles[:, i].view(pool.shape[0], *pool.shape[2:]))


def _padded_rows(num_pages: int, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A's rank rows [L, pages * 16, in] and B's transposed [L, pages * 16, out], zero past the rank."""
    num_layers, rank, in_features = lora_a.shape
    assert rank <= num_pages * PAGE_ROWS and lora_b.shape[::2] == (num_layers, rank)
    rows_a = torch.zeros(num_layers, num_pages * PAGE_ROWS, in_features, dtype=dtype)
    rows_b = torch.zeros(num_layers, num_pages * PAGE_ROWS, lora_b.shape[1], dtype=dtype)
    rows_a[:, :rank] = lora_a
    rows_b[:, :rank] = lora_b.transpose(1, 2)
    return rows_a, rows_b


LoraLayout = RowPages | TiledPages
