"""add_lora on the CPU backends (PyTorch, and the compiled op in every instruction-set form) against
its twin `kernels.reference.add_lora`, run in float64 on the same factors. The weights are held as
the engine's adapter pool holds them: pages scattered over a pool whose other pages hold garbage, in
the backend's layout for the model's dtype (`Backend.lora_layout`: float32 row pages for PyTorch; the
compiled op's tiled pages, bf16 for a bf16 model). x and y in fp32, bf16 and fp16."""
from __future__ import annotations

import pytest
import torch

from kernels import reference, tuning
from kernels.lora.layouts import ModuleShape, RowPages, TiledPages
from kernels.lora.plans import (
    CompiledLoraPlan,
    LoraSlice,
    PageTable,
    TorchLoraPlan,
    TritonLoraPlan,
    active_runs,
)
from tests.kernels.factories import PagedLora, paged_lora, popularity_slots

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}
PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed"]


def layout_of(backend, dtype, hidden_in, slice_widths):
    return backend.lora_layout(dtype, [ModuleShape(hidden_in, width) for width in slice_widths])


def run_both(backend, layout, lora: PagedLora, entries, y, x) -> tuple[torch.Tensor, torch.Tensor]:
    """(the backend's result, the twin's in float64 on the same factors)."""
    out = y.clone()
    backend.add_lora(out, x, lora.slices, backend.plan_lora(layout, entries, lora.tables))
    expected = y.double()
    reference.add_lora(expected, x.double(), entries, lora.reference_slices)
    return out, expected


def token_entries(pattern: str, num_tokens: int, num_entries: int, gen: torch.Generator, no_adapter: float = 0.2,
                  sort: bool = False) -> list[int]:
    entries = popularity_slots(pattern, num_tokens, num_entries, gen)
    entries[torch.rand(num_tokens, generator=gen) < no_adapter] = -1
    return (entries.sort().values if sort else entries).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_add_lora_matches_reference(cpu_backend, dtype, pattern, num_tokens) -> None:
    """Entries of different ranks per slice (0: the entry does not adapt that slice)."""
    gen = torch.Generator().manual_seed(num_tokens)
    widths, hidden = [16, 32, 16], 24
    ranks = [[4, 4, 4], [8, 0, 8], [2, 17, 0], [8, 8, 33]]
    layout = layout_of(cpu_backend, dtype, hidden, widths)
    lora = paged_lora(layout, ranks, hidden, widths, gen)
    entries = token_entries(pattern, num_tokens, len(ranks), gen, sort=num_tokens % 2 == 1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype)
    out, expected = run_both(cpu_backend, layout, lora, entries, y, x)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("rank", [1, 15, 16, 17, 33, 64, 65, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranks_on_and_off_the_pages_edges(cpu_backend, rank, dtype) -> None:
    """A rank fills its last page partly or wholly (an odd one leaves a bf16 pair half padding); past
    64 ranks, the widened tiles read their rows in more than one chunk (gemm_tiles.h); model-sized
    slices (576 + 192 + 192 wide, 576 in) span several tiles of columns; a long segment spans two
    whole chunks of rows and part of a third, its last row tile partial."""
    gen = torch.Generator().manual_seed(rank)
    widths, hidden = [576, 192, 192], 576
    layout = layout_of(cpu_backend, dtype, hidden, widths)
    lora = paged_lora(layout, [[rank] * 3, [3, 3, 3]], hidden, widths, gen)
    long_segment = 2 * tuning.CPU_KERNEL_CONSTANTS["lora_chunk_rows"] + 11
    entries = [0] * long_segment + [-1] * 2 + [1] * 4
    x = torch.randn(len(entries), hidden, generator=gen).to(dtype)
    y = torch.randn(len(entries), 960, generator=gen).to(dtype)
    out, expected = run_both(cpu_backend, layout, lora, entries, y, x)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_many_entries_of_one_token_each(cpu_backend) -> None:
    """The many-adapter decode step: 300 entries of ranks 8-64, one token each, in bf16."""
    gen = torch.Generator().manual_seed(300)
    widths, hidden = [64, 32], 48
    ranks = [[(8, 16, 32, 64)[e % 4], (64, 8, 0, 16)[e % 4]] for e in range(300)]
    layout = layout_of(cpu_backend, torch.bfloat16, hidden, widths)
    lora = paged_lora(layout, ranks, hidden, widths, gen)
    x = torch.randn(300, hidden, generator=gen).to(torch.bfloat16)
    y = torch.randn(300, sum(widths), generator=gen).to(torch.bfloat16)
    out, expected = run_both(cpu_backend, layout, lora, list(range(300)), y, x)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_tokens_and_slices_without_an_adapter_are_untouched(cpu_backend) -> None:
    gen = torch.Generator().manual_seed(1)
    widths = [16, 32]
    layout = layout_of(cpu_backend, torch.float32, 24, widths)
    lora = paged_lora(layout, [[4, 0], [4, 4]], 24, widths, gen)
    entries = token_entries("uniform", 32, 2, gen, no_adapter=0.5)
    y, x = torch.randn(32, 48, generator=gen), torch.randn(32, 24, generator=gen)
    out, _ = run_both(cpu_backend, layout, lora, entries, y, x)
    untouched = torch.tensor(entries) < 0
    assert untouched.any() and torch.equal(out[untouched], y[untouched])
    only_first = torch.tensor(entries) == 0
    assert only_first.any() and torch.equal(out[only_first][:, 16:], y[only_first][:, 16:])
    assert not torch.equal(out[only_first][:, :16], y[only_first][:, :16])


def test_segments_and_page_tables_of_a_step() -> None:
    entries = [2, 2, -1, 0, 0, 0, 2, -1, -1]
    assert active_runs(entries) == [(0, 2, 2), (3, 6, 0), (6, 7, 2)]
    tables = {"q_proj": PageTable((16, 0, 33), ((4,), (), (7, 1, 9)))}
    triton = TritonLoraPlan.build(entries, tables, torch.device("cpu"))
    assert triton.segment_starts.tolist() == [0, 3, 6] and triton.segment_lengths.tolist() == [2, 3, 1]
    assert triton.segment_entries.tolist() == [2, 0, 2] and triton.active_token_idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert triton.max_segment_len == 3 and triton.num_segments == 3 and triton.num_active_tokens == 6
    assert triton.page_tables["q_proj"].tolist() == [[4, 0, 0], [0, 0, 0], [7, 1, 9]]
    assert triton.max_pages == {"q_proj": 3} and triton.ranks["q_proj"].tolist() == [16, 0, 33]
    torch_plan = TorchLoraPlan.build(entries, tables, "cpu")
    assert torch_plan.segments == ((0, 2, 2), (3, 6, 0), (6, 7, 2))
    assert [index.tolist() for index in torch_plan.page_index["q_proj"]] == [[4], [], [7, 1, 9]]
    compiled = CompiledLoraPlan.build(entries, tables)
    assert compiled.segment_table.tolist() == [[0, 2, 2], [3, 3, 0], [6, 1, 2]]
    assert compiled.page_tables["q_proj"].tolist() == [[4, 0, 0], [0, 0, 0], [7, 1, 9]]
    assert CompiledLoraPlan.build([-1, 1, -1], tables).segment_table.tolist() == [[1, 1, 1]]
    assert CompiledLoraPlan.build([-1, -1], {}).num_segments == 0
    with pytest.raises(AssertionError):
        PageTable((17,), ((3,),))  # rank 17 needs two pages


@pytest.mark.parametrize("layout", [TiledPages(torch.float32), TiledPages(torch.bfloat16), RowPages(torch.float32)])
def test_pages_read_back_what_was_written(layout) -> None:
    """Every layer's factors written into scattered pages of a pool and read back: exactly; the rows
    of the last page past the rank are zero, whatever the page held before; a layer written with
    zero factors (one the adapter does not adapt) holds zeros."""
    gen = torch.Generator().manual_seed(0)
    a, b = layout.allocate(2, 6, ModuleShape(32, 48), "cpu")
    a.copy_(torch.randn(a.shape, generator=gen))
    b.copy_(torch.randn(b.shape, generator=gen))
    lora_a = torch.randn(2, 21, 32, generator=gen).to(layout.dtype)
    lora_b = torch.randn(2, 48, 21, generator=gen).to(layout.dtype)
    lora_a[0], lora_b[0] = 0, 0
    before_a, before_b = a.clone(), b.clone()
    layout.write(a, b, [5, 2], lora_a, lora_b)
    read_a, read_b = layout.read(a, b, [5, 2], 32)
    assert torch.equal(read_a[:, :21], lora_a) and torch.equal(read_b[:, :, :21], lora_b)
    assert not read_a[:, 21:].any() and not read_b[:, :, 21:].any()
    untouched = [0, 1, 3, 4]
    assert torch.equal(a[:, untouched], before_a[:, untouched]) and torch.equal(b[:, untouched], before_b[:, untouched])


def test_tiles_fit_only_whole_blocks_of_columns(cpu_backend) -> None:
    """A model whose outputs are not whole blocks of 16 columns gets row pages on every backend."""
    assert TiledPages.fits(ModuleShape(576, 192), torch.bfloat16)
    assert not TiledPages.fits(ModuleShape(64, 72), torch.float32)
    assert not TiledPages.fits(ModuleShape(63, 64), torch.bfloat16)
    assert TiledPages.fits(ModuleShape(63, 64), torch.float32)
    gen = torch.Generator().manual_seed(4)
    layout = layout_of(cpu_backend, torch.float32, 24, [12, 4])
    assert isinstance(layout, RowPages)
    lora = paged_lora(layout, [[4, 4], [2, 0]], 24, [12, 4], gen)
    entries = token_entries("zipf", 13, 2, gen)
    y, x = torch.randn(13, 16, generator=gen), torch.randn(13, 24, generator=gen)
    out, expected = run_both(cpu_backend, layout, lora, entries, y, x)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_delta_is_rounded_into_y_once_to_nearest_even(cpu_backend, dtype) -> None:
    """With factors whose delta is exact (x's first feature times one column of B, small dyadics),
    y + delta lands on ties of the output dtype often: y must equal the sum rounded once, to nearest
    even, bit for bit; a NaN or infinite y stays so, and a subnormal y plus a zero delta stays that
    subnormal."""
    gen = torch.Generator().manual_seed(5)
    num_tokens, hidden, width, rank = 24, 32, 96, 8
    layout = layout_of(cpu_backend, dtype, hidden, [width])
    a, b = layout.allocate(1, 2, ModuleShape(hidden, width), "cpu")
    lora_a, lora_b = torch.zeros(1, rank, hidden), torch.zeros(1, width, rank)
    lora_a[0, 0, 0] = 1.0
    lora_b[0, :, 0] = torch.randint(-64, 65, (width,), generator=gen) / 256
    lora_b[0, 3, 0] = 0.0
    layout.write(a, b, [1], lora_a.to(layout.dtype), lora_b.to(layout.dtype))
    slices = [LoraSlice("m", a[0], b[0], 0, width)]
    x = torch.zeros(num_tokens, hidden, dtype=dtype)
    x[:, 0] = torch.randint(1, 4, (num_tokens,), generator=gen).to(dtype)
    y = torch.randn(num_tokens, width, generator=gen).to(dtype)
    y[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    y[:, 3] = torch.tensor(1e-39 if dtype == torch.bfloat16 else 1e-5).to(dtype)  # subnormal in either
    out = y.clone()
    cpu_backend.add_lora(out, x, slices, cpu_backend.plan_lora(layout, [0] * num_tokens, {"m": PageTable((rank,), ((1,),))}))
    expected = (y.float() + x[:, :1].float() * lora_b[0, :, 0]).to(dtype)
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])
    assert (expected[:, 3] != 0).all()
