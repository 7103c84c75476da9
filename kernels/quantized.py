"""Quantized projection weights, kept in GGML's block layouts as a GGUF file stores them.

A `QuantizedTensor` is one 2-D weight `[rows, cols]` of one block type: `data` is uint8
`[rows, cols // block_elements * block_bytes]`, each row its blocks in order along `cols` (so any
selection of whole rows, such as the un-permuting of llama.cpp's q/k rows, is a selection of data
rows, and needs no dequantizing). A `QuantizedWeight` is a projection's rows as such parts, one after
the other (a fused q/k/v may mix types: a Q4_K_M file keeps v in Q6_K and q/k in Q4_K).

The block formats (bytes of one block, in order; `f16` scales are IEEE half):
- Q8_0 (32 elements, 34 bytes): `d: f16`, `q: int8[32]`; x = d * q.
- Q4_0 (32, 18): `d: f16`, `q: uint8[16]` (element i < 16 the low nibble of byte i, element 16 + i
  its high nibble); x = d * (q - 8).
- Q4_1 (32, 20): `d: f16`, `m: f16`, nibbles as Q4_0; x = d * q + m.
- Q4_K (256, 144): `d: f16`, `dmin: f16`, 8 six-bit scales and 8 six-bit mins packed in 12 bytes,
  `q: uint8[128]` (sub-block 2j the low nibbles of bytes 32j..32j+31, 2j + 1 their high nibbles);
  x = d * scale[s] * q - dmin * min[s] for sub-block s of 32 elements.
- Q5_K (256, 176): as Q4_K with `qh: uint8[32]` before `q`, bit s of qh[i] the fifth bit of
  element i of sub-block s.
- Q6_K (256, 210): `ql: uint8[128]`, `qh: uint8[64]`, `scales: int8[16]`, `d: f16`; 6-bit q - 32,
  x = d * scales[s] * (q - 32) for sub-block s of 16 elements.
Their dequantization, in PyTorch, is `kernels.reference.dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockType:
    """A GGML block type: `block_elements` weights stored in `block_bytes` bytes."""

    name: str
    ggml_type: int  # its number in GGUF files (gguf.GGMLQuantizationType)
    block_elements: int
    block_bytes: int


BLOCK_TYPES: dict[str, BlockType] = {
    block.name: block
    for block in (
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q4_K", 12, 256, 144),
        BlockType("Q5_K", 13, 256, 176),
        BlockType("Q6_K", 14, 256, 210),
    )
}


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A weight `[rows, cols]` as blocks of `block_type`: data uint8 `[rows, row_bytes]`."""

    block_type: BlockType
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2, "blocks are rows of bytes"
        assert self.cols % self.block_type.block_elements == 0, "rows are whole blocks"
        assert self.data.shape[1] == self.cols // self.block_type.block_elements * self.block_type.block_bytes

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.data.numel() // self.block_type.block_bytes

    def select_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (1-D int64), in that order."""
        return QuantizedTensor(self.block_type, self.data.index_select(0, index), self.cols)


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A projection's weight `[sum of the parts' rows, cols]`: its parts' rows one after the other,
    adjacent parts of one block type joined into one."""

    parts: tuple[QuantizedTensor, ...]

    @classmethod
    def of(cls, parts: list[QuantizedTensor]) -> QuantizedWeight:
        assert parts and len({part.cols for part in parts}) == 1, "every part has the same columns"
        joined = [parts[0]]
        for part in parts[1:]:
            last = joined[-1]
            if part.block_type == last.block_type:
                joined[-1] = QuantizedTensor(last.block_type, torch.cat([last.data, part.data]), last.cols)
            else:
                joined.append(part)
        return cls(tuple(joined))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.rows for part in self.parts), self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self.parts)

    def selected_rows(self, ids: torch.Tensor) -> QuantizedTensor:
        """The rows `ids` (int64, on the blocks' device), in that order, of a weight of one part (a
        token embedding, or a head tied to it: one tensor of one type)."""
        (part,) = self.parts
        return part.select_rows(ids.reshape(-1))


def quantize_q8_0(weight: torch.Tensor) -> QuantizedTensor:
    """`weight` [rows, cols] (cols a multiple of 32) as Q8_0 blocks, as gguf's `gguf.quants.quantize`
    writes them: per 32 elements d = amax / 127 in float32, q = x / d rounded half away from zero
    (computed as x * (1 / d)), d stored as f16."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(-1, 32)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    scaled = blocks * inverse
    quants = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    data = torch.cat([scale.to(torch.float16).view(torch.uint8), quants.view(torch.uint8)], dim=1)
    return QuantizedTensor(BLOCK_TYPES["Q8_0"], data.reshape(rows, -1), cols)
