"""The Triton matmul over quantized blocks (kernels/quantized_matmul.py), on the test device (the
interpreter on CPU tensors, compiled on CUDA: tests/device.py), against its twin
`kernels.reference.quantized_linear` and against gguf's own `gguf.quants.dequantize` and a float32
torch matmul, over odd shapes: 1, 3 and 17 rows of x (17: two row tiles), 17 and 40 output columns
(not multiples of the 32-column tile), reductions that end inside a 64-column step (96 = 3 blocks
of 32). And the Triton backend's `linear` of a `QuantizedWeight` mixing types, with a bias.

Tolerance: in float32 the kernel sums the same products as the twin in another order, so
|y - twin| <= 1e-5 * (|x| @ |W|.T) + 1e-6. With 16-bit x the weight tiles are rounded to x's dtype
(the tensor cores' inputs) and y once: 2 ulp of the dtype times that magnitude."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

import kernels
from kernels import reference
from kernels.quantized import BLOCK_TYPES, QuantizedTensor, QuantizedWeight
from kernels.quantized_matmul import TritonQuantizedLinear, quantized_matmul
from tests.device import ON_GPU, TEST_DEVICE
from tests.kernels.quant_blocks import QUANTIZABLE, quantized_by_gguf, random_blocks

TYPES = sorted(BLOCK_TYPES)
RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}
# Every type in each dtype on a GPU; 16-bit x on a few types under the (slow) interpreter.
SIXTEEN_BIT_TYPES = TYPES if ON_GPU else ["Q4_K", "Q8_0"]


def _cols(type_name: str) -> int:
    """Three blocks: 96 columns (a 64-column step and half of one) or 768 for the K-quants."""
    return 3 * BLOCK_TYPES[type_name].block_elements


def _x(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _run(x: torch.Tensor, tensor: QuantizedTensor) -> torch.Tensor:
    """The kernel on the test device; the result back on CPU."""
    out = torch.empty(x.shape[0], tensor.rows, dtype=x.dtype, device=TEST_DEVICE)
    on_device = QuantizedTensor(tensor.block_type, tensor.data.to(TEST_DEVICE), tensor.cols)
    quantized_matmul(x.to(TEST_DEVICE), on_device, out)
    return out.cpu()


def _assert_within(y: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """|y - expected| within the bound of the module docstring; dense the float32 weight [N, K]."""
    magnitude = x.float().abs() @ dense.abs().T
    bound = RELATIVE[x.dtype] * magnitude + 1e-6
    error = (y.float() - expected.float()).abs()
    assert y.dtype == x.dtype and y.shape == expected.shape
    worst = (error - bound).argmax()
    assert (error <= bound).all(), f"error {error.flatten()[worst].item()} > bound {bound.flatten()[worst].item()}"


def _gguf_dense(tensor: QuantizedTensor) -> torch.Tensor:
    values = dequantize(tensor.data.numpy(), GGMLQuantizationType[tensor.block_type.name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("out_features", [17, 40])
def test_matches_twin_float32(type_name: str, rows: int, out_features: int) -> None:
    tensor = random_blocks(type_name, out_features, _cols(type_name), seed=rows + out_features)
    x = _x(rows, tensor.cols, torch.float32, seed=rows)
    expected = reference.quantized_linear(x, QuantizedWeight((tensor,)))
    _assert_within(_run(x, tensor), expected, x, reference.dequantize(tensor))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("type_name", SIXTEEN_BIT_TYPES)
def test_matches_twin_sixteen_bit(type_name: str, dtype: torch.dtype) -> None:
    tensor = random_blocks(type_name, 17, _cols(type_name), seed=5)
    x = _x(3, tensor.cols, dtype, seed=6)
    expected = reference.quantized_linear(x, QuantizedWeight((tensor,)))
    _assert_within(_run(x, tensor), expected, x, reference.dequantize(tensor))


@pytest.mark.parametrize("type_name", TYPES)
def test_random_blocks_against_gguf_dequantize(type_name: str) -> None:
    """An oracle outside this library: gguf's dequantization of the same bytes, then torch's matmul."""
    tensor = random_blocks(type_name, 17, _cols(type_name), seed=11)
    dense = _gguf_dense(tensor)
    x = _x(3, tensor.cols, torch.float32, seed=12)
    _assert_within(_run(x, tensor), x @ dense.T, x, dense)


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_gguf_quantized_weights_against_gguf_dequantize(type_name: str) -> None:
    """Blocks written by gguf's own quantizer (real scales, not random bytes)."""
    tensor = quantized_by_gguf(type_name, torch.randn(40, 96, generator=torch.Generator().manual_seed(13)))
    dense = _gguf_dense(tensor)
    x = _x(17, tensor.cols, torch.float32, seed=14)
    _assert_within(_run(x, tensor), x @ dense.T, x, dense)


def test_backend_linear_of_mixed_parts_with_bias() -> None:
    """A Q4_K_M-style fused projection (Q4_K rows, then Q6_K, then Q4_K) through the Triton backend,
    its blocks and bias in host memory as the GGUF reader leaves them: each part written into its
    columns of the output on the test device, the bias added."""
    cols = 256
    parts = [random_blocks("Q4_K", 17, cols, seed=1), random_blocks("Q6_K", 16, cols, seed=2),
             random_blocks("Q4_K", 3, cols, seed=3)]  # fmt: skip
    weight = QuantizedWeight.of(parts)
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(4))
    linear = kernels.backend_for(TEST_DEVICE, "triton").linear(weight, bias)
    assert isinstance(linear, TritonQuantizedLinear)
    x = _x(3, cols, torch.float32, seed=5)
    y = linear(x.to(TEST_DEVICE)).cpu()
    expected = reference.quantized_linear(x, weight) + bias
    dense = torch.cat([reference.dequantize(part) for part in weight.parts])
    _assert_within(y, expected, x, dense)


def test_no_rows() -> None:
    tensor = random_blocks("Q8_0", 17, 64)
    assert _run(torch.empty(0, 64), tensor).shape == (0, 17)
