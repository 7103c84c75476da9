"""The compiled matmul over quantized blocks (kernels/csrc/quantized.cpp) in every form this CPU runs,
with and without VNNI's int8 dot products, against its twin `kernels.reference.quantized_linear`
within the error of quantizing x per 32 elements to int8; the compiled dequantization bit-exact
against `kernels.reference.dequantize`; the widened matmul of larger bf16 batches (weights widened to
bf16 inside the tiles) against the float32 matmul of the same bf16-rounded weights; the AMX-INT8 matmul
(skipped where the CPU or the build lacks it) within the same bound as the int8 one; `QuantizedLinear`
over mixed parts, all its paths; and the split over threads equal to one thread's result bit for bit."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import cpu_build, cpu_ops, reference, tuning
from kernels.linear import QuantizedLinear
from kernels.quantized import BLOCK_TYPES, QuantizedTensor, QuantizedWeight
from tests.kernels.quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(cpu_ops.ops() is None, reason="the compiled CPU ops are unavailable")

TYPES = sorted(BLOCK_TYPES)
K = 768  # three K-quant blocks, 24 blocks of 32
ODD_BLOCKS_K = 800  # 25 blocks of 32: the AVX-512 kernels' last step is half a step
ODD_COLUMNS = 7


def _x(rows: int, k: int = K, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[0, 32:64] = 0.0  # a block of zeros: its scale is 0
    x[-1, :32] *= 100.0  # a block of outliers
    return x.to(dtype)


def quantization_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """|y - y_twin| bound [M, N]: x's element error at most amax(its block) / 254 (rounding to int8
    steps of amax / 127), times |w| summed per block; plus float32 rounding of the sums."""
    dense = torch.cat([reference.dequantize(part) for part in weight.parts])  # [N, K]
    x32 = x.float()
    step = x32.abs().unflatten(1, (-1, 32)).amax(-1) / 254.0  # [M, K / 32]
    weight_sums = dense.abs().unflatten(1, (-1, 32)).sum(-1)  # [N, K / 32]
    magnitude = x32.abs() @ dense.abs().T
    return step @ weight_sums.T * 1.001 + 1e-5 * magnitude + 1e-6


@contextlib.contextmanager
def _path(form: str, vnni: bool):
    if cpu_ops.unavailable_reason(form) is not None:
        pytest.skip(cpu_ops.unavailable_reason(form))
    with cpu_ops.using_form(form) as ops, (contextlib.nullcontext(ops) if vnni else cpu_ops.without_vnni()):
        yield ops


def _compiled(ops, x: torch.Tensor, tensor: QuantizedTensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], tensor.rows, dtype=x.dtype)
    ops.quantized_linear(out, x, tensor.data, tensor.block_type.ggml_type)
    return out


def assert_within_the_bound(ours: torch.Tensor, x: torch.Tensor, tensor: QuantizedTensor) -> None:
    """`ours` within x's quantization bound of the twin, a bound that is itself tight."""
    weight = QuantizedWeight.of([tensor])
    twin = reference.quantized_linear(x, weight)
    error = (ours - twin).abs()
    bound = quantization_bound(x, weight)
    assert (error <= bound).all(), f"error {error.max():.3g} beyond the bound where {(error - bound).max():.3g}"
    assert bound.max() < 0.02 * (x.abs() @ reference.dequantize(tensor).abs().T).max(), "the bound is a tight one"


@pytest.mark.parametrize("form", cpu_build.FORMS)
@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 16])
@pytest.mark.parametrize("k", [K, ODD_BLOCKS_K])
def test_int8_matmul_within_the_quantization_bound(form: str, vnni: bool, type_name: str, rows: int, k: int) -> None:
    if k % BLOCK_TYPES[type_name].block_elements:
        pytest.skip(f"{type_name} rows are whole blocks of {BLOCK_TYPES[type_name].block_elements}")
    tensor = random_blocks(type_name, ODD_COLUMNS, k, seed=rows)
    x = _x(rows, k=k, seed=rows)
    with _path(form, vnni) as ops:
        ours = _compiled(ops, x, tensor)
    assert_within_the_bound(ours, x, tensor)


@pytest.mark.parametrize("form", cpu_build.FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_rounded_once(form: str, dtype: torch.dtype) -> None:
    tensor = random_blocks("Q4_K", 33, K, seed=4)
    x = _x(5, dtype=dtype, seed=4)
    with _path(form, True) as ops:
        ours = _compiled(ops, x, tensor)
    assert ours.dtype == dtype
    weight = QuantizedWeight.of([tensor])
    twin = reference.quantized_linear(x.float(), weight)
    rounding = twin.abs() * torch.finfo(dtype).eps
    assert ((ours.float() - twin).abs() <= quantization_bound(x, weight) + rounding).all()


@pytest.mark.parametrize("form", cpu_build.FORMS)
def test_every_int8_path_names_itself(form: str) -> None:
    with _path(form, True) as ops:
        with_vnni = ops.quantized_int8_dot()
        with cpu_ops.without_vnni():
            without = ops.quantized_int8_dot()
    assert without in ("widening", "portable")
    assert with_vnni in ("avx512_vnni", "avx_vnni", without)


@pytest.mark.parametrize("form", cpu_build.FORMS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rows_as_the_reference(form: str, type_name: str, dtype: torch.dtype) -> None:
    tensor = random_blocks(type_name, 5, K, seed=9)
    out = torch.empty(tensor.rows, K, dtype=dtype)
    with _path(form, True) as ops:
        ops.dequantize_rows(out, tensor.data, tensor.block_type.ggml_type)
    expected = reference.dequantize(tensor).to(dtype)
    assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), "not bit-exact"


@contextlib.contextmanager
def _amx_int8():
    if cpu_ops.unavailable_reason("amx") is not None:
        pytest.skip(cpu_ops.unavailable_reason("amx"))
    with cpu_ops.using_form("amx") as ops:
        if not ops.has_quantized_amx():
            pytest.skip("this CPU has no AMX-INT8")
        yield ops


def _amx(ops, x: torch.Tensor, tensor: QuantizedTensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], tensor.rows, dtype=x.dtype)
    ops.quantized_linear_amx(out, x, tensor.data, tensor.block_type.ggml_type)
    return out


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 47, 70])
@pytest.mark.parametrize("columns", [3, 37])  # less than a group of 32; a group and 5 more
@pytest.mark.parametrize("k", [256, K, ODD_BLOCKS_K])
def test_amx_int8_matmul_within_the_quantization_bound(type_name: str, rows: int, columns: int, k: int) -> None:
    if k % BLOCK_TYPES[type_name].block_elements:
        pytest.skip(f"{type_name} rows are whole blocks of {BLOCK_TYPES[type_name].block_elements}")
    tensor = random_blocks(type_name, columns, k, seed=rows + columns)
    x = _x(rows, k=k, seed=rows)
    with _amx_int8() as ops:
        ours = _amx(ops, x, tensor)
    assert_within_the_bound(ours, x, tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_int8_16_bit_activations_rounded_once(dtype: torch.dtype) -> None:
    tensor = random_blocks("Q5_K", 40, K, seed=3)
    x = _x(21, dtype=dtype, seed=3)
    with _amx_int8() as ops:
        ours = _amx(ops, x, tensor)
    assert ours.dtype == dtype
    weight = QuantizedWeight.of([tensor])
    twin = reference.quantized_linear(x.float(), weight)
    rounding = twin.abs() * torch.finfo(dtype).eps
    assert ((ours.float() - twin).abs() <= quantization_bound(x, weight) + rounding).all()


def test_amx_int8_refused_where_absent() -> None:
    if cpu_ops.unavailable_reason("avx512") is not None:
        pytest.skip(cpu_ops.unavailable_reason("avx512"))
    tensor = random_blocks("Q8_0", 2, 64)
    with cpu_ops.using_form("avx512") as ops:
        assert not ops.has_quantized_amx()
        with pytest.raises(RuntimeError, match="AMX-INT8"):
            _amx(ops, torch.randn(16, 64), tensor)


def _widened(ops, x: torch.Tensor, tensor: QuantizedTensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], tensor.rows, dtype=x.dtype)
    ops.quantized_linear_widened(out, x, tensor.data, tensor.block_type.ggml_type)
    return out


@pytest.mark.parametrize("form", cpu_build.FORMS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [17, 40])
@pytest.mark.parametrize("k", [K, ODD_BLOCKS_K])
def test_widened_matmul_as_the_float32_matmul_of_bf16_weights(form: str, type_name: str, rows: int, k: int) -> None:
    if k % BLOCK_TYPES[type_name].block_elements:
        pytest.skip(f"{type_name} rows are whole blocks of {BLOCK_TYPES[type_name].block_elements}")
    tensor = random_blocks(type_name, 37, k, seed=rows)  # a whole group of 32 rows and 5 more
    x = _x(rows, k=k, seed=rows, dtype=torch.bfloat16)
    with _path(form, True) as ops:
        ours = _widened(ops, x, tensor)
    dense = reference.dequantize(tensor).bfloat16().float()
    twin = x.float() @ dense.T
    bound = twin.abs() * 2.0**-8 + 1e-5 * (x.float().abs() @ dense.abs().T) + 1e-6  # one bf16 rounding, float32 sums
    assert ((ours.float() - twin).abs() <= bound).all()


@pytest.mark.parametrize("path", ["int8", "widened", "amx_int8"])
def test_two_threads_equal_one_bit_for_bit(path: str) -> None:
    tensor = random_blocks("Q6_K", 301, K, seed=2)
    x = _x(4 if path == "int8" else 40, seed=2, dtype=torch.bfloat16 if path == "widened" else torch.float32)
    ops = cpu_ops.ops()
    if path == "amx_int8" and not ops.has_quantized_amx():
        pytest.skip("the active form or this CPU has no AMX-INT8 matmul")
    multiply = {"int8": _compiled, "widened": _widened, "amx_int8": _amx}[path]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = multiply(ops, x, tensor)
        torch.set_num_threads(2)
        parallel = multiply(ops, x, tensor)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)


def _multiplies_int8(rows: int, type_names: list[str]) -> bool:
    """Whether QuantizedLinear takes an int8 path (dot products or AMX-INT8 tiles) at `rows` here for
    every one of the types."""
    has_amx = cpu_ops.ops().has_quantized_amx()
    return all(rows <= tuning.QUANTIZED_INT8_MAX_ROWS
               or (has_amx and tuning.quantized_amx_rows(name)[0] <= rows <= tuning.quantized_amx_rows(name)[1])
               for name in type_names)


@pytest.mark.parametrize("rows", [2, tuning.QUANTIZED_INT8_MAX_ROWS + 7, 40, tuning.QUANTIZED_AMX_ROWS_Q8_0[1] + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_over_mixed_parts_with_bias(rows: int, dtype: torch.dtype) -> None:
    parts = [random_blocks("Q4_K", 3, 512, seed=1), random_blocks("Q6_K", 5, 512, seed=2),
             random_blocks("Q8_0", 1, 512, seed=3)]
    weight = QuantizedWeight.of(parts)
    bias = torch.randn(9, generator=torch.Generator().manual_seed(5)).to(dtype)
    x = _x(rows, k=512, seed=6, dtype=dtype)
    ours = QuantizedLinear(weight, bias)(x).float()
    product = reference.quantized_linear(x.float(), weight)
    twin = product + bias.float()
    rounding = (product.abs() + twin.abs()) * torch.finfo(dtype).eps  # the product's and the sum's
    if _multiplies_int8(rows, ["Q4_K", "Q6_K", "Q8_0"]):
        assert ((ours - twin).abs() <= quantization_bound(x, weight) + rounding).all()
    elif dtype == torch.float32:  # widened: the float32 matmul of the same weights
        torch.testing.assert_close(ours, twin, rtol=1e-5, atol=1e-4)
    else:  # widened to bf16 in the tiles: the weights rounded once more, then the sum, and the bias added
        dense = torch.cat([reference.dequantize(part) for part in parts])
        magnitude = x.float().abs() @ dense.abs().T
        assert ((ours - twin).abs() <= 2 * rounding + magnitude * 2.0**-8 + 1e-5).all()


def test_bad_blocks_refused() -> None:
    ops = cpu_ops.ops()
    tensor = random_blocks("Q8_0", 2, 64)
    with pytest.raises(RuntimeError, match="row bytes"):
        ops.quantized_linear(torch.empty(1, 2), torch.randn(1, 96), tensor.data, 8)
    with pytest.raises(RuntimeError, match="GGML type"):
        ops.quantized_linear(torch.empty(1, 2), torch.randn(1, 64), tensor.data, 1)
