"""Builders of GGML-quantized test weights: random valid blocks written as bytes (every type), and
gguf's own quantizer where it has one."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quantize

from kernels.quantized import BLOCK_TYPES, QuantizedTensor

# Where each type's f16 scales sit in its block (byte offsets); every other byte is free.
HALF_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")  # the types gguf 0.19 quantizes (the K-quants it only reads)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> QuantizedTensor:
    """Random bytes in every block position, its f16 scales finite normals of `scale` spread."""
    block = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    num_blocks = rows * cols // block.block_elements
    data = rng.integers(0, 256, size=(num_blocks, block.block_bytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[type_name]:
        halves = (rng.standard_normal(num_blocks) * scale).astype(np.float16)
        data[:, offset : offset + 2] = halves.view(np.uint8).reshape(num_blocks, 2)
    return QuantizedTensor(block, torch.from_numpy(data.reshape(rows, -1)), cols)


def quantized_by_gguf(type_name: str, weight: torch.Tensor) -> QuantizedTensor:
    """`weight` [rows, cols] quantized by gguf's own `gguf.quants.quantize`."""
    data = quantize(weight.float().numpy(), GGMLQuantizationType[type_name])
    return QuantizedTensor(BLOCK_TYPES[type_name], torch.from_numpy(np.ascontiguousarray(data)), weight.shape[1])
