"""`kernels.reference.dequantize` of every supported block type bit-exact against gguf's own
`gguf.quants.dequantize`, on random valid blocks and on gguf-quantized weights; the quantized matmul
twin equals a float32 matmul of those dequantized weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from kernels import reference
from kernels.quantized import BLOCK_TYPES, QuantizedWeight, quantize_q8_0
from tests.kernels.quant_blocks import QUANTIZABLE, quantized_by_gguf, random_blocks


def _gguf_dequantized(tensor) -> torch.Tensor:
    values = dequantize(tensor.data.numpy(), GGMLQuantizationType[tensor.block_type.name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _assert_bit_exact(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), "not bit-exact"


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_random_blocks_bit_exact_against_gguf(type_name: str, rows: int) -> None:
    cols = 2 * BLOCK_TYPES[type_name].block_elements
    tensor = random_blocks(type_name, rows, cols, seed=rows)
    _assert_bit_exact(reference.dequantize(tensor), _gguf_dequantized(tensor))


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_gguf_quantized_weights_bit_exact(type_name: str) -> None:
    weight = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    tensor = quantized_by_gguf(type_name, weight)
    ours = reference.dequantize(tensor)
    _assert_bit_exact(ours, _gguf_dequantized(tensor))
    assert (ours - weight).abs().max() < 0.3, "the quantized weight approximates the original"


def test_quantized_linear_twin_over_mixed_parts() -> None:
    parts = [random_blocks("Q4_K", 3, 256, seed=1), random_blocks("Q6_K", 2, 256, seed=2),
             random_blocks("Q4_K", 1, 256, seed=3)]
    weight = QuantizedWeight.of(parts)
    assert weight.shape == (6, 256) and len(weight.parts) == 3
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    dense = torch.cat([_gguf_dequantized(part) for part in parts])
    torch.testing.assert_close(reference.quantized_linear(x, weight), x @ dense.T, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows, cols", [(1, 32), (7, 96), (5, 576)])
def test_quantize_q8_0_bit_exact_against_gguf(rows: int, cols: int) -> None:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 0.05
    weight[0, :32] = 0.0  # a block of zeros: scale 0
    ours = quantize_q8_0(weight)
    assert torch.equal(ours.data, quantized_by_gguf("Q8_0", weight).data)
