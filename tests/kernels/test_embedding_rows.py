"""A token embedding looked up from its blocks (a GGUF file's, or a head tied to it): the rows each
quantized projection form reads (`rows`: the compiled CPU ops in every form this CPU runs, PyTorch's
dequantization, the Triton backend's on the blocks' device) are `gguf.quants.dequantize` of those
rows, bit for bit in float32 and rounded once to bf16 or float16, in any order and repeated."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels import cpu_build, cpu_ops
from kernels.linear import DequantizingLinear, PlainLinear, QuantizedLinear
from kernels.quantized import BLOCK_TYPES, QuantizedWeight
from tests.kernels.quant_blocks import random_blocks

TYPES = sorted(BLOCK_TYPES)
VOCAB, HIDDEN = 70, 512  # two K-quant blocks, 16 blocks of 32 per row
IDS = torch.tensor([0, 69, 17, 3, 17, 68, 0])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _by_gguf(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    (part,) = weight.parts
    values = dequantize(part.data.numpy(), GGMLQuantizationType[part.block_type.name]).reshape(VOCAB, HIDDEN)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))[ids]


def _assert_bitwise_equal(rows: torch.Tensor, expected: torch.Tensor) -> None:
    assert rows.dtype == expected.dtype and rows.shape == expected.shape
    as_ints = torch.int32 if rows.dtype == torch.float32 else torch.int16
    assert torch.equal(rows.view(as_ints), expected.view(as_ints)), "not bit-exact"


def _triton_linear(weight: QuantizedWeight):
    pytest.importorskip("triton")
    from kernels.quantized_matmul import TritonQuantizedLinear

    return TritonQuantizedLinear(weight, None, torch.device("cpu"))  # `rows` runs where the blocks are


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["torch", "triton"])
def test_rows_dequantized_in_pytorch_are_ggufs(type_name: str, dtype: torch.dtype, form: str) -> None:
    weight = QuantizedWeight.of([random_blocks(type_name, VOCAB, HIDDEN, seed=4)])
    linear = DequantizingLinear(weight) if form == "torch" else _triton_linear(weight)
    _assert_bitwise_equal(linear.rows(IDS, dtype), _by_gguf(weight, IDS).to(dtype))


@pytest.mark.skipif(cpu_ops.ops() is None, reason="the compiled CPU ops are unavailable")
@pytest.mark.parametrize("form", cpu_build.FORMS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_dequantized_by_the_compiled_ops_are_ggufs(form: str, type_name: str, dtype: torch.dtype) -> None:
    if cpu_ops.unavailable_reason(form) is not None:
        pytest.skip(cpu_ops.unavailable_reason(form))
    weight = QuantizedWeight.of([random_blocks(type_name, VOCAB, HIDDEN, seed=5)])
    with cpu_ops.using_form(form):
        rows = QuantizedLinear(weight).rows(IDS, dtype)
    _assert_bitwise_equal(rows, _by_gguf(weight, IDS).to(dtype))


def test_rows_default_to_float32_for_blocks_and_the_weights_dtype_for_dense() -> None:
    weight = QuantizedWeight.of([random_blocks("Q8_0", VOCAB, HIDDEN, seed=6)])
    assert DequantizingLinear(weight).rows(IDS).dtype == torch.float32
    dense = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    assert torch.equal(PlainLinear(dense).rows(IDS), dense[IDS])

