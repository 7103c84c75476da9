"""The compiled bf16 matmuls (kernels/csrc/amx_linear.cpp, bf16_linear.cpp) against their twin
`reference.linear`, each kernel this machine can run.

Both accumulate bf16 products in float32 and round once; only the order of the float32 sums
differs. So an element may differ from the twin's by the float32 summation error (bounded by
K * 2^-24 * sum |x_k w_k|, which matters where the sum cancels) plus one bf16 step where the two
sums fall on either side of a rounding boundary, never more. Where a kernel does not apply (no such
unit in this CPU, other dtypes, shapes it does not tile) the packing says so, which the last tests check."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.linear import KINDS, available_kinds, linear_packed, pack_linear_weight

HERE = available_kinds()
kinds_here = pytest.mark.parametrize(
    "kind", [pytest.param(kind, marks=pytest.mark.skipif(kind not in HERE, reason=f"no {kind} on this machine")) for kind in KINDS]
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _tolerance(x: torch.Tensor, weight: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each result's magnitude (8 significant bits), plus the float32 summation
    error bound of a length-K dot product."""
    exponent = torch.frexp(expected.float().abs().clamp_min(1e-30)).exponent
    step = torch.ldexp(torch.ones_like(expected, dtype=torch.float32), exponent - 8)
    summation = x.shape[1] * 2.0**-24 * (x.float().abs() @ weight.float().abs().T)
    return step + summation


@kinds_here
@pytest.mark.parametrize("rows", [1, 7, 17, 32, 64, 100])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (64, 32), (1536, 576), (64, 80)])
def test_compiled_linear_matches_reference(kind: str, rows: int, in_features: int, out_features: int) -> None:
    """Row counts that are and are not whole tiles; 80 output columns leave the AVX512-BF16 kernel
    a group of two column blocks (and are no whole AMX block: that kernel declines them)."""
    x, weight = _randn(rows, in_features, seed=rows), _randn(out_features, in_features, seed=in_features)
    packed = pack_linear_weight(weight, kind)
    if kind == "amx" and out_features % 32:
        assert packed is None
        return
    assert packed is not None and packed.kind == kind
    y = linear_packed(x, packed)
    expected = reference.linear(x, weight)
    assert y.shape == expected.shape and y.dtype == torch.bfloat16
    distance = (y.float() - expected.float()).abs()
    assert (distance <= _tolerance(x, weight, expected)).all()
    assert (y == expected).float().mean() > 0.99  # nearly all elements to the bit


@kinds_here
def test_compiled_linear_reads_a_row_tile_past_the_first(kind: str) -> None:
    """64 rows are several row tiles: each must see its own rows, the later ones from the cached weights."""
    x, weight = _randn(64, 64, seed=3), _randn(32, 64, seed=4)
    x[32:] = 0
    y = linear_packed(x, pack_linear_weight(weight, kind))
    assert (y[32:] == 0).all() and (y[:32] != 0).any()


@kinds_here
def test_compiled_linear_splits_column_blocks_over_threads(kind: str) -> None:
    """Each thread takes a run of column blocks (and, on AMX, configures its own tiles)."""
    x, weight = _randn(64, 576, seed=5), _randn(3072, 576, seed=6)
    packed = pack_linear_weight(weight, kind)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = linear_packed(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(linear_packed(x, packed), single)  # the same sums, whichever thread did them
    finally:
        torch.set_num_threads(threads)


@kinds_here
def test_pack_declines_what_the_kernel_cannot_run(kind: str) -> None:
    # 48 output columns: three whole 16-column blocks, but no whole 32-column AMX block.
    assert (pack_linear_weight(_randn(48, 64, seed=0), kind) is None) == (kind == "amx")
    assert pack_linear_weight(_randn(40, 64, seed=0), kind) is None  # 40 output columns: no whole 16-column block
    assert pack_linear_weight(_randn(64, 63, seed=0), kind) is None  # odd K: no whole pairs
    assert pack_linear_weight(_randn(64, 64, seed=0).float(), kind) is None  # float32


def test_pack_declines_kernels_this_cpu_lacks() -> None:
    for kind in KINDS:
        if kind not in HERE:
            assert pack_linear_weight(_randn(64, 64, seed=0), kind) is None
    default = pack_linear_weight(_randn(64, 64, seed=0))
    assert (default is None) == (not HERE) and (default is None or default.kind == HERE[0])
