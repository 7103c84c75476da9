"""The compiled matmuls (kernels/csrc/linear.cpp, amx_linear.cpp) against their twin `reference.linear`,
each kernel in each instruction-set form that has it (f32 in the AVX2 and AVX-512 forms, avx512_bf16
in the avx512_bf16 and amx forms, amx in the amx form), and the CPU backend's choice of projection.

They accumulate in float32 and round once; only the order of the float32 sums differs. So an element
may differ from the twin's by the float32 summation error (bounded by K * 2^-24 * sum |x_k w_k|,
which matters where the sum cancels) plus one step of the output dtype where the two sums fall on
either side of a rounding boundary, never more. Where a kernel does not apply (no such unit in this
CPU's form, other dtypes, shapes it does not tile) the packing says so, which the last tests check."""
from __future__ import annotations

import pytest
import torch

from kernels import reference, tuning
from kernels.linear import (
    KIND_DTYPES,
    KINDS,
    CompiledLinear,
    PlainLinear,
    Reads,
    available_kinds,
    linear_packed,
    pack_linear_weight,
)
from tests.kernels.conftest import use_form

# (form, kind): each compiled matmul in each form that has it.
FORM_KINDS = [("avx2", "f32"), ("avx2", "bf16"), ("avx512", "f32"), ("avx512", "bf16"),
              ("avx512_bf16", "f32"), ("avx512_bf16", "bf16"), ("amx", "f32"), ("amx", "bf16"), ("amx", "amx")]
kinds = pytest.mark.parametrize("form_kind", FORM_KINDS, ids=[f"{form}-{kind}" for form, kind in FORM_KINDS])


@pytest.fixture
def kind_in_form(request: pytest.FixtureRequest, form_kind: tuple[str, str]):
    form, kind = form_kind
    with use_form(request, form):
        assert kind in available_kinds()
        yield kind


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tolerance(x: torch.Tensor, weight: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """One step of the output dtype at each result's magnitude (8 significant bits for bf16, 24 for
    float32), plus the float32 summation error bound of a length-K dot product."""
    bits = 8 if expected.dtype == torch.bfloat16 else 24
    exponent = torch.frexp(expected.float().abs().clamp_min(1e-30)).exponent
    step = torch.ldexp(torch.ones_like(expected, dtype=torch.float32), exponent - bits)
    summation = x.shape[1] * 2.0**-24 * (x.float().abs() @ weight.float().abs().T)
    return step + summation


@kinds
@pytest.mark.parametrize("rows", [1, 7, 17, 32, 64, 100])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (64, 32), (1536, 576), (72, 80), (2112, 48)])
def test_compiled_linear_matches_reference(kind_in_form: str, rows: int, in_features: int, out_features: int) -> None:
    """Row counts that are and are not whole tiles; 80 output columns leave the AVX512-BF16 kernel
    a group of two column blocks (and are no whole AMX block: that kernel declines them); 72 inputs
    are no whole number of the 16 that x's packing widens at a time; 2112 inputs exceed the tall
    tile's bound (`bf16_fma_tall_tile_max_k_avx512`)."""
    kind = kind_in_form
    dtype = KIND_DTYPES[kind]
    x, weight = _randn(rows, in_features, seed=rows, dtype=dtype), _randn(out_features, in_features, seed=in_features, dtype=dtype)
    packed = pack_linear_weight(weight, kind)
    if kind == "amx" and out_features % 32:
        assert packed is None
        return
    assert packed is not None and packed.kind == kind
    y = linear_packed(x, packed)
    expected = reference.linear(x, weight)
    assert y.shape == expected.shape and y.dtype == dtype
    distance = (y.float() - expected.float()).abs()
    assert (distance <= _tolerance(x, weight, expected)).all()
    if dtype == torch.bfloat16:
        assert (y == expected).float().mean() > 0.99  # nearly all elements to the bit


@kinds
def test_compiled_linear_reads_a_row_tile_past_the_first(kind_in_form: str) -> None:
    """64 rows are several row tiles: each must see its own rows, the later ones from the cached weights."""
    dtype = KIND_DTYPES[kind_in_form]
    x, weight = _randn(64, 64, seed=3, dtype=dtype), _randn(32, 64, seed=4, dtype=dtype)
    x[32:] = 0
    y = linear_packed(x, pack_linear_weight(weight, kind_in_form))
    assert (y[32:] == 0).all() and (y[:32] != 0).any()


@kinds
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_linear_runs_row_blocks_in_turn(kind_in_form: str, threads: int) -> None:
    """A batch whose x outgrows `linear_row_block_bytes` (AMX: `amx_linear_row_block_bytes`, of x in
    bf16) several times over (each column group runs over one block of rows, then the next) computes
    every row as the rows alone do, to the bit (each element's sum runs over K in the same order), and
    as the twin does; with reads requested (in the last block only) and split over threads."""
    dtype = KIND_DTYPES[kind_in_form]
    in_features = 576
    if kind_in_form == "amx":
        rows = 3 * tuning.CPU_KERNEL_CONSTANTS["amx_linear_row_block_bytes"] // (in_features * 2) + 5
    else:
        rows = 3 * tuning.CPU_KERNEL_CONSTANTS["linear_row_block_bytes"] // (in_features * 4) + 5
    x, weight = _randn(rows, in_features, seed=11, dtype=dtype), _randn(960, in_features, seed=12, dtype=dtype)
    packed = pack_linear_weight(weight, kind_in_form)
    pool = torch.ones(64, 4096, dtype=torch.bfloat16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = linear_packed(x, packed, Reads((pool,), (torch.arange(64),)))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(y, torch.cat([linear_packed(x[first:first + 16], packed) for first in range(0, rows, 16)]))
    expected = reference.linear(x, weight)
    assert ((y.float() - expected.float()).abs() <= _tolerance(x, weight, expected)).all()


@kinds
def test_compiled_linear_of_no_rows(kind_in_form: str) -> None:
    """A step may hand a projection no rows: an empty result, whatever the row blocking makes of it;
    and no inputs: zeros."""
    dtype = KIND_DTYPES[kind_in_form]
    packed = pack_linear_weight(_randn(64, 576, seed=13, dtype=dtype), kind_in_form)
    y = linear_packed(torch.empty(0, 576, dtype=dtype), packed)
    assert y.shape == (0, 64) and y.dtype == dtype
    no_inputs = pack_linear_weight(torch.empty(64, 0, dtype=dtype), kind_in_form)
    if no_inputs is not None:  # a weight of no inputs, where the kernel takes one: sums of nothing
        assert torch.equal(linear_packed(torch.empty(3, 0, dtype=dtype), no_inputs), torch.zeros(3, 64, dtype=dtype))


@kinds
def test_compiled_linear_splits_column_blocks_over_threads(kind_in_form: str) -> None:
    """Each thread takes a run of column blocks (and, on AMX, configures its own tiles)."""
    dtype = KIND_DTYPES[kind_in_form]
    x, weight = _randn(64, 576, seed=5, dtype=dtype), _randn(3072, 576, seed=6, dtype=dtype)
    packed = pack_linear_weight(weight, kind_in_form)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = linear_packed(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(linear_packed(x, packed), single)  # the same sums, whichever thread did them
    finally:
        torch.set_num_threads(threads)


@kinds
@pytest.mark.parametrize("threads", [1, 2])
def test_reads_requested_during_a_matmul_change_nothing_it_computes(kind_in_form: str, threads: int) -> None:
    """The pages of the op after a projection are only requested into cache: the result is the same to
    the bit, for reads that do not divide evenly over the column groups (pages of 1, 3 and 100 lines,
    many more lines than the matmul has steps, page ids out of order and repeated), split over threads.
    The 1.6 MB stay within what a matmul of this size fetches (`fetch_min_flops_per_byte`), so the
    fetch runs."""
    dtype = KIND_DTYPES[kind_in_form]
    x, weight = _randn(17, 576, seed=7, dtype=dtype), _randn(960, 576, seed=8, dtype=dtype)
    packed = pack_linear_weight(weight, kind_in_form)
    pools = (torch.ones(40, 32, dtype=torch.bfloat16), torch.ones(9, 3, 16), torch.ones(500, 1600, dtype=torch.bfloat16))
    pages = (torch.tensor([3, 0, 39, 3]), torch.tensor([8]), torch.arange(499, -1, -1))
    fetched = sum(ids.numel() * -(-pool.stride(0) * pool.element_size() // 64) * 64 for pool, ids in zip(pools, pages))
    assert 2 * 17 * 576 * 960 >= tuning.CPU_KERNEL_CONSTANTS["fetch_min_flops_per_byte"] * fetched
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        plain = linear_packed(x, packed)
        assert torch.equal(linear_packed(x, packed, Reads(pools, pages)), plain)
        assert torch.equal(linear_packed(x, packed, Reads(pools[:1], (torch.tensor([], dtype=torch.int64),))), plain)
    finally:
        torch.set_num_threads(previous)


@kinds
def test_reads_outside_their_pool_are_refused(kind_in_form: str) -> None:
    dtype = KIND_DTYPES[kind_in_form]
    x, packed = _randn(4, 64, seed=9, dtype=dtype), pack_linear_weight(_randn(32, 64, seed=10, dtype=dtype), kind_in_form)
    pool = torch.ones(4, 64)
    for page in (4, -1):
        with pytest.raises(RuntimeError, match="outside its pool"):
            linear_packed(x, packed, Reads((pool,), (torch.tensor([page]),)))
    with pytest.raises(RuntimeError, match="one page-id tensor per fetched pool"):
        linear_packed(x, packed, Reads((pool, pool), (torch.tensor([0]),)))
    with pytest.raises(RuntimeError, match="1-D int64"):
        linear_packed(x, packed, Reads((pool,), (torch.tensor([0], dtype=torch.int32),)))


@kinds
def test_pack_declines_what_the_kernel_cannot_run(kind_in_form: str) -> None:
    kind, dtype = kind_in_form, KIND_DTYPES[kind_in_form]
    # 48 output columns: three whole 16-column blocks, but no whole 32-column AMX block.
    assert (pack_linear_weight(_randn(48, 64, seed=0, dtype=dtype), kind) is None) == (kind == "amx")
    assert pack_linear_weight(_randn(40, 64, seed=0, dtype=dtype), kind) is None  # 40 output columns: no whole 16-column block
    # Odd K: no whole pairs for the bf16 kernels; the float32 one takes any K.
    assert (pack_linear_weight(_randn(64, 63, seed=0, dtype=dtype), kind) is None) == (dtype == torch.bfloat16)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert pack_linear_weight(_randn(64, 64, seed=0, dtype=other), kind) is None  # another dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_declines_kernels_the_form_lacks(compiled_form: str, dtype: torch.dtype) -> None:
    here = [kind for kind in available_kinds() if KIND_DTYPES[kind] == dtype]
    for kind in KINDS:
        if kind not in here:
            assert pack_linear_weight(_randn(64, 64, seed=0, dtype=dtype), kind) is None
    default = pack_linear_weight(_randn(64, 64, seed=0, dtype=dtype))
    assert (default is None) == (not here) and (default is None or default.kind == here[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_projections_match_the_reference(cpu_backend, dtype: torch.dtype) -> None:
    """Whatever form the backend lays a weight out in, with or without a bias, it computes x @ W.T + b:
    bf16 to one bf16 step of the float32 sum, float32 to float rounding."""
    x, weight, bias = _randn(9, 64, seed=1).to(dtype), _randn(48, 64, seed=2).to(dtype), _randn(48, seed=3).to(dtype)
    for b in (None, bias):
        linear = cpu_backend.linear(weight, b)
        expected = (x.float() @ weight.float().T + (0 if b is None else b.float())).to(dtype)
        torch.testing.assert_close(linear(x), expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    compiled = cpu_backend.name == "cpu" and any(KIND_DTYPES[kind] == dtype for kind in available_kinds())
    assert isinstance(cpu_backend.linear(weight), CompiledLinear if compiled else PlainLinear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projection_is_held_once_and_serves_any_batch(cpu_backend, dtype: torch.dtype) -> None:
    """Whatever form the backend lays a weight out in, it holds the weight's bytes once (the AMX form
    once kept oneDNN's copy beside its own for batches past 96 rows: twice the projections' memory),
    and computes x @ W.T from them for decode-sized and prefill-sized batches alike."""
    weight = _randn(64, 64, seed=2).to(dtype)
    linear = cpu_backend.linear(weight)
    slots = {name for cls in type(linear).__mro__ for name in getattr(cls, "__slots__", ())}
    parts = [getattr(linear, name) for name in slots]
    tensors = [t for part in parts for t in ([part] if torch.is_tensor(part) else
                                             [getattr(part, f) for f in getattr(part, "__slots__", ())])]
    held = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    assert held == weight.numel() * weight.element_size()
    for rows in (5, 300):
        x = _randn(rows, 64, seed=1).to(dtype)
        expected = (x.float() @ weight.float().T).to(dtype)
        torch.testing.assert_close(linear(x), expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


@kinds
def test_rows_of_a_packed_weight_are_the_weights_rows(kind_in_form: str) -> None:
    """A tied embedding's lookup reads the head's packed copy: rows gathered from each kernel's layout
    are the weight's rows, bit for bit, in any order and repeated."""
    dtype = KIND_DTYPES[kind_in_form]
    weight = _randn(96, 64, seed=7, dtype=dtype)
    ids = torch.tensor([0, 95, 17, 31, 32, 17, 48])
    assert torch.equal(CompiledLinear(pack_linear_weight(weight, kind_in_form)).rows(ids), weight[ids])
