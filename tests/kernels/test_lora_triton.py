"""Triton SGMV/BGMV kernels over paged adapter weights (`RowPages`), on the test device (the
interpreter on CPU tensors, or compiled on CUDA: tests/device.py), against `reference.add_lora` on CPU.

Every row of a page pool that no entry owns (spare pages, rows of a last page past the rank) is NaN,
so a kernel that reads past an entry's rank or pages shows NaNs; some columns of y are -0.0, so a
kernel that writes y where it should add nothing (entry -1, rank 0 on a slice) shows +0.0."""
from __future__ import annotations

import pytest
import torch

from kernels import reference, tuning
from kernels.lora.layouts import PAGE_ROWS, RowPages
from kernels.lora.plans import TritonLoraPlan
from kernels.lora.triton_ops import add_lora_triton
from tests.device import ON_GPU, TEST_DEVICE
from tests.kernels.factories import PagedLora, paged_lora, popularity_slots

PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed"]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}
# Every pattern and rank mix in each dtype on a GPU; in float32 alone under the (slow) interpreter.
PATTERN_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32]
# ranks[e][i]: entry e's rank on slice i. Ranks 1, 15, 16, 17, 33, 64 on every slice, one rank of 0
# on each slice, and an entry that adapts nothing.
MIXED_RANKS = [[1, 16, 0], [15, 0, 17], [16, 33, 1], [17, 1, 64], [33, 64, 15], [64, 17, 16], [0, 0, 0]]


def _case(num_tokens, pattern, dtype, ranks=MIXED_RANKS, hidden_in=40, slice_widths=(48, 16, 16), seed=0,
          sort=False):  # fmt: skip
    """(pages, token entries with about 20% -1, x, y) of one step, on the test device."""
    gen = torch.Generator().manual_seed(seed)
    lora = paged_lora(RowPages(dtype), ranks, hidden_in, list(slice_widths), gen)
    _poison_unowned_rows(lora)
    entries = popularity_slots(pattern, num_tokens, len(ranks), gen)
    entries[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    if sort:
        entries = entries.sort().values
    x = torch.randn(num_tokens, hidden_in, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(slice_widths), generator=gen).to(dtype)
    y[:, ::3] = -0.0
    return lora.with_pages_on(TEST_DEVICE), entries.tolist(), x.to(TEST_DEVICE), y.to(TEST_DEVICE)


def _poison_unowned_rows(lora: PagedLora) -> None:
    """NaN into every page row of each pool that no entry's rank covers."""
    for piece in lora.slices:
        table = lora.tables[piece.module]
        owned = torch.zeros(piece.a.shape[:2], dtype=torch.bool)  # [num_pages, PAGE_ROWS]
        for rank, pages in zip(table.ranks, table.pages):
            for i, page in enumerate(pages):
                owned[page, : rank - i * PAGE_ROWS] = True
        piece.a[~owned] = float("nan")
        piece.b[~owned] = float("nan")


def _check(lora: PagedLora, entries: list[int], x, y, run) -> None:
    """`run(out, plan)` adds the LoRA delta into out; compared with the oracle (on CPU copies), and
    bitwise on every (token, slice) that must stay untouched."""
    plan = TritonLoraPlan.build(entries, lora.tables, x.device)
    out, expected = y.clone(), y.to("cpu", copy=True)
    run(out, plan)
    out, y = out.cpu(), y.cpu()
    reference.add_lora(expected, x.cpu(), entries, lora.reference_slices)
    tolerance = TOLERANCE[y.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    for t, entry in enumerate(entries):
        for piece, (start, end, factors) in zip(lora.slices, lora.reference_slices):
            if entry < 0 or factors[entry] is None:
                assert torch.equal(_bits(out[t, start:end]), _bits(y[t, start:end])), (t, piece.module)


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.uint8)


def _kernels(lora: PagedLora, x, kind: str | None = None, split_k: int | None = None):
    return lambda out, plan: add_lora_triton(out, x, lora.slices, plan, kind, split_k)


@pytest.mark.parametrize("dtype", PATTERN_DTYPES)
@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 3, 7, 33])
def test_mixed_ranks_match_reference(kind, pattern, num_tokens, dtype) -> None:
    """Either kernel pair on any batch shape: ranks 1-64 and 0 mixed in one step, three slices."""
    lora, entries, x, y = _case(num_tokens, pattern, dtype, seed=num_tokens)
    _check(lora, entries, x, y, _kernels(lora, x, kind))


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(kind, dtype) -> None:
    lora, entries, x, y = _case(9, "uniform", dtype, seed=2)
    _check(lora, entries, x, y, _kernels(lora, x, kind))


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_split_k_on_and_off(kind, split_k) -> None:
    """hidden_in 200 spans several BLOCK_K tiles, so each split program loops and the last is partial."""
    lora, entries, x, y = _case(6, "zipf", torch.float32, hidden_in=200, seed=11, sort=True)
    _check(lora, entries, x, y, _kernels(lora, x, kind, split_k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern,num_tokens,sort,bgmv", [("skewed", 20, True, False), ("distinct", 6, False, True)])
def test_backend_picks_the_kernels(triton_backend, dtype, pattern, num_tokens, sort, bgmv) -> None:
    """Long runs (a sorted skewed batch) take SGMV, one token per run (distinct) BGMV."""
    lora, entries, x, y = _case(num_tokens, pattern, dtype, seed=3, sort=sort)
    plan = TritonLoraPlan.build(entries, lora.tables, x.device)
    assert tuning.use_bgmv(plan.num_active_tokens, plan.num_segments) == bgmv
    backend_plan = triton_backend.plan_lora(RowPages(dtype), entries, lora.tables)
    _check(lora, entries, x, y, lambda out, _: triton_backend.add_lora(out, x, lora.slices, backend_plan))


def test_sgmv_tiles_long_segments() -> None:
    """Segments longer than SGMV_BLOCK_M span several row tiles; rank 17 ends in a partial page."""
    lora, entries, x, y = _case(37, "skewed", torch.float32, ranks=[[17], [33]], slice_widths=(40,), seed=4, sort=True)
    _check(lora, entries, x, y, _kernels(lora, x, "sgmv"))


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_slices_no_entry_adapts_are_skipped(kind) -> None:
    """No entry of the step adapts the middle slice: its columns stay bitwise untouched."""
    lora, entries, x, y = _case(8, "uniform", torch.float32, ranks=[[4, 0, 16], [0, 0, 3], [20, 0, 0]], seed=5)
    _check(lora, entries, x, y, _kernels(lora, x, kind))


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_tokens_without_entries_are_untouched(kind) -> None:
    lora, _, x, y = _case(5, "uniform", torch.bfloat16, seed=6)
    _check(lora, [-1] * 5, x, y, _kernels(lora, x, kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_model_sized_fused_qkv(kind) -> None:
    """SmolLM2-135M's fused q/k/v (576 -> 576 + 192 + 192), 24 tokens over 4 entries, bf16."""
    ranks = [[16, 8, 16], [64, 64, 64], [8, 0, 8], [33, 17, 1]]
    lora, entries, x, y = _case(24, "zipf", torch.bfloat16, ranks=ranks, hidden_in=576,
                                slice_widths=(576, 192, 192), seed=7, sort=True)  # fmt: skip
    _check(lora, entries, x, y, _kernels(lora, x, kind))
