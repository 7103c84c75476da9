"""The compiled AMX matmul (kernels/csrc/amx_linear.cpp) against its twin `reference.linear`.

Both accumulate bf16 products in float32 and round once; only the order of the float32 sums
differs. So an element may differ from the twin's by the float32 summation error (bounded by
K * 2^-24 * sum |x_k w_k|, which matters where the sum cancels) plus one bf16 step where the two
sums fall on either side of a rounding boundary, never more. On machines without AMX the op does not apply (and the
packing says so), which the last test checks."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu_ops import cpu_ops
from kernels.linear import linear_packed, pack_linear_weight

needs_amx = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().amx_ready(), reason="no AMX on this machine")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _tolerance(x: torch.Tensor, weight: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each result's magnitude (8 significant bits), plus the float32 summation
    error bound of a length-K dot product."""
    exponent = torch.frexp(expected.float().abs().clamp_min(1e-30)).exponent
    step = torch.ldexp(torch.ones_like(expected, dtype=torch.float32), exponent - 8)
    summation = x.shape[1] * 2.0**-24 * (x.float().abs() @ weight.float().abs().T)
    return step + summation


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 32, 64, 100])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (64, 32), (1536, 576)])
def test_amx_linear_matches_reference(rows: int, in_features: int, out_features: int) -> None:
    x, weight = _randn(rows, in_features, seed=rows), _randn(out_features, in_features, seed=in_features)
    packed = pack_linear_weight(weight)
    assert packed is not None
    y = linear_packed(x, packed)
    expected = reference.linear(x, weight)
    assert y.shape == expected.shape and y.dtype == torch.bfloat16
    distance = (y.float() - expected.float()).abs()
    assert (distance <= _tolerance(x, weight, expected)).all()
    assert (y == expected).float().mean() > 0.99  # nearly all elements to the bit


@needs_amx
def test_amx_linear_reads_a_row_block_past_the_first() -> None:
    """64 rows are two row blocks: each must see its own rows, the second block from the cached weights."""
    x, weight = _randn(64, 64, seed=3), _randn(32, 64, seed=4)
    x[32:] = 0
    y = linear_packed(x, pack_linear_weight(weight))
    assert (y[32:] == 0).all() and (y[:32] != 0).any()


@needs_amx
def test_amx_linear_splits_column_blocks_over_threads() -> None:
    """Each thread configures its own tiles and takes a run of column blocks."""
    x, weight = _randn(64, 576, seed=5), _randn(3072, 576, seed=6)
    packed = pack_linear_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = linear_packed(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(linear_packed(x, packed), single)  # the same sums, whichever thread did them
    finally:
        torch.set_num_threads(threads)


def test_pack_declines_what_the_op_cannot_run() -> None:
    assert pack_linear_weight(_randn(48, 64, seed=0)) is None  # 48 output columns: not whole blocks
    assert pack_linear_weight(_randn(64, 64, seed=0).float()) is None  # float32
    if cpu_ops() is None or not cpu_ops().amx_ready():
        assert pack_linear_weight(_randn(64, 64, seed=0)) is None
