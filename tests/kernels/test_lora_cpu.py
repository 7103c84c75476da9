"""add_lora on the CPU backends (PyTorch, and the compiled op in every instruction-set form) and its
twin, against a dense per-adapter computation in fp64. The weights are held as the engine's pool
holds them, in the backend's layout for the model's dtype (`Backend.lora_layout`: float32 dense rows
for PyTorch; the compiled op's tiles, bf16 for a bf16 model); the oracle reads the same values back
densely. x and y in fp32, bf16 and fp16."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.lora.layouts import LoraProjection, TiledLoraLayout
from kernels.lora.plans import CompiledLoraPlan, TorchLoraPlan, TritonLoraPlan, active_runs
from tests.kernels.factories import lora_weights, popularity_slots

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}
PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed"]


def dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets) -> torch.Tensor:
    """fp64, one masked dense product per slot and slice: no per-token or per-segment logic."""
    out = y.double().clone()
    max_rank = lora_a.shape[1] // (len(offsets) - 1)
    for slot in range(lora_a.shape[0]):
        mask = (torch.as_tensor(slots) == slot).double()[:, None]  # [T, 1]
        for i in range(len(offsets) - 1):
            shrunk = x.double() @ lora_a[slot, i * max_rank : (i + 1) * max_rank].double().T
            delta = shrunk @ lora_b[slot, offsets[i] : offsets[i + 1]].double().T
            out[:, offsets[i] : offsets[i + 1]] += mask * delta * scales[slot]
    return out


def lora_case(pattern, num_tokens, dtype, slice_widths, ranks, seed, no_adapter=0.2, sort=False, weight_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    num_slots, hidden = len(ranks), 24
    slots = popularity_slots(pattern, num_tokens, num_slots, gen)
    slots[torch.rand(num_tokens, generator=gen) < no_adapter] = -1
    if sort:
        slots = slots.sort().values
    lora_a, lora_b = lora_weights(num_slots, ranks, max(ranks), hidden, slice_widths, weight_dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(slice_widths), generator=gen).to(dtype)
    scales = (torch.rand(num_slots, generator=gen) + 0.5).tolist()
    offsets = [0, *torch.tensor(slice_widths).cumsum(0).tolist()]
    return y, x, lora_a, lora_b, slots.tolist(), scales, offsets


def _slice_ranks(ranks: list[int], num_slices: int) -> list[int]:
    return [rank for rank in ranks for _ in range(num_slices)]


def in_layout(backend, model_dtype, lora_a, lora_b, offsets, ranks):
    """The dense factors written into `backend`'s layout slot by slot, as the pool writes them; returns
    (lora_a, lora_b) in the layout and the same values read back densely (the oracle's weights)."""
    projection = LoraProjection(lora_a.shape[2], tuple(offsets))
    layout = backend.lora_layout(model_dtype, [projection])
    max_rank = lora_b.shape[2]
    tensors = layout.allocate(lora_a.shape[0], max_rank, projection, "cpu")
    for slot, rank in enumerate(ranks):
        for i in range(projection.num_slices):
            a = lora_a[slot, i * max_rank : i * max_rank + rank]
            b = lora_b[slot, offsets[i] : offsets[i + 1], :rank]
            layout.write(*tensors, slot, i, projection, a, b)
    return tensors, layout.dense(*tensors, projection)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_add_lora_matches_oracle(cpu_backend, dtype, pattern, num_tokens) -> None:
    ranks = [4, 8, 2, 8]
    y, x, lora_a, lora_b, slots, scales, offsets = lora_case(
        pattern, num_tokens, dtype, [16, 32, 16], ranks, seed=num_tokens, sort=num_tokens % 2 == 1
    )
    (held_a, held_b), (dense_a, dense_b) = in_layout(cpu_backend, dtype, lora_a, lora_b, offsets, ranks)
    plan = cpu_backend.plan_lora(slots)
    for slice_ranks in (None, _slice_ranks(ranks, 3)):
        for slot_scales in (scales, None):
            out = y.clone()
            cpu_backend.add_lora(out, x, held_a, held_b, plan, slot_scales, offsets, slice_ranks)
            expected = dense_oracle(y, x, dense_a, dense_b, slots, slot_scales or [1.0] * 4, offsets)
            torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("rank", [1, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranks_on_and_off_the_tiles_edges(cpu_backend, rank, dtype) -> None:
    """A rank fills its blocks of 16 rank rows partly or wholly (an odd one leaves a bf16 pair half
    padding); model-sized slices (576 + 192 + 192 wide, 576 in) span several tiles of columns; a
    segment of 19 tokens spans several row tiles."""
    gen = torch.Generator().manual_seed(rank)
    offsets, hidden = [0, 576, 768, 960], 576
    lora_a, lora_b = lora_weights(2, [rank, 3], 64, hidden, [576, 192, 192], torch.float32, gen)
    x = torch.randn(25, hidden, generator=gen).to(dtype)
    y = torch.randn(25, 960, generator=gen).to(dtype)
    slots = [0] * 19 + [-1] * 2 + [1] * 4
    (held_a, held_b), (dense_a, dense_b) = in_layout(cpu_backend, dtype, lora_a, lora_b, offsets, [rank, 3])
    out = y.clone()
    cpu_backend.add_lora(out, x, held_a, held_b, cpu_backend.plan_lora(slots), None, offsets, [rank] * 3 + [3] * 3)
    expected = dense_oracle(y, x, dense_a, dense_b, slots, [1.0, 1.0], offsets)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_reference_matches_oracle() -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = lora_case("zipf", 33, torch.bfloat16, [8, 8], [2, 4, 4], seed=2)
    out = y.clone()
    reference.add_lora(out, x, lora_a, lora_b, slots, scales, offsets)
    expected = dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_tokens_without_an_adapter_are_untouched(cpu_backend) -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = lora_case("uniform", 32, torch.float32, [16], [4, 4], seed=1, no_adapter=0.5)
    (held_a, held_b), _ = in_layout(cpu_backend, torch.float32, lora_a, lora_b, offsets, [4, 4])
    out = y.clone()
    cpu_backend.add_lora(out, x, held_a, held_b, cpu_backend.plan_lora(slots), scales, offsets)
    untouched = torch.tensor(slots) < 0
    assert untouched.any() and torch.equal(out[untouched], y[untouched])


def test_slice_ranks_limit_each_slice_of_a_fused_projection(cpu_backend) -> None:
    """slice_ranks [slot * num_slices + slice] bound each slice's rank: a slice given rank 0 is
    skipped (its columns untouched even though the weights there are not zero), the others are
    computed as with the slot's rank."""
    y, x, lora_a, lora_b, slots, scales, offsets = lora_case("uniform", 16, torch.float32, [16, 32, 16], [8, 8], seed=3, no_adapter=0)
    (lora_a, lora_b), _ = in_layout(cpu_backend, torch.float32, lora_a, lora_b, offsets, [8, 8])
    plan = cpu_backend.plan_lora(slots)
    full = y.clone()
    cpu_backend.add_lora(full, x, lora_a, lora_b, plan, scales, offsets, [8, 8, 8, 8, 8, 8])
    skipped = y.clone()
    cpu_backend.add_lora(skipped, x, lora_a, lora_b, plan, scales, offsets, [8, 0, 8, 8, 0, 8])
    middle = slice(offsets[1], offsets[2])
    assert torch.equal(skipped[:, middle], y[:, middle]) and not torch.equal(full[:, middle], y[:, middle])
    outer = torch.cat([torch.arange(offsets[1]), torch.arange(offsets[2], offsets[3])])
    torch.testing.assert_close(skipped[:, outer], full[:, outer], atol=0, rtol=0)


def test_segments_of_a_batch() -> None:
    slots = [2, 2, -1, 0, 0, 0, 2, -1, -1]
    assert active_runs(slots) == [(0, 2, 2), (3, 6, 0), (6, 7, 2)]
    plan = TritonLoraPlan.build(slots, torch.device("cpu"))
    assert plan.segment_starts.tolist() == [0, 3, 6] and plan.segment_lengths.tolist() == [2, 3, 1]
    assert plan.segment_slots.tolist() == [2, 0, 2] and plan.active_token_idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert plan.max_segment_len == 3 and plan.num_segments == 3 and plan.num_active_tokens == 6
    assert TorchLoraPlan.build(slots).segments == ((0, 2, 2), (3, 6, 0), (6, 7, 2))
    assert CompiledLoraPlan.build(slots).segment_table.tolist() == [[0, 2, 2], [3, 3, 0], [6, 1, 2]]
    assert CompiledLoraPlan.build([-1, -1]).num_segments == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_layout_reads_back_what_was_written(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    lora_a, lora_b = lora_weights(3, [5, 16, 1], 16, 32, [16, 48], torch.float32, gen)
    layout = TiledLoraLayout(dtype)
    projection = LoraProjection(32, (0, 16, 64))
    tensors = layout.allocate(3, 16, projection, "cpu")
    for slot, rank in enumerate([5, 16, 1]):
        for i in range(2):
            layout.write(*tensors, slot, i, projection, lora_a[slot, i * 16 : i * 16 + rank],
                         lora_b[slot, projection.slice_offsets[i] : projection.slice_offsets[i + 1], :rank])
    dense_a, dense_b = layout.dense(*tensors, projection)
    assert torch.equal(dense_a, lora_a.to(dtype)) and torch.equal(dense_b, lora_b.to(dtype))


def test_tiles_fit_only_whole_blocks_of_columns() -> None:
    assert TiledLoraLayout.fits(LoraProjection(576, (0, 576, 768, 960)), torch.bfloat16)
    assert not TiledLoraLayout.fits(LoraProjection(64, (0, 64, 72)), torch.float32)
    assert not TiledLoraLayout.fits(LoraProjection(63, (0, 64)), torch.bfloat16)
    assert TiledLoraLayout.fits(LoraProjection(63, (0, 64)), torch.float32)


def test_slices_off_the_tiles_take_the_dense_layout(cpu_backend) -> None:
    """A model whose slices are not whole blocks of 16 columns gets dense weights on every backend."""
    y, x, lora_a, lora_b, slots, scales, offsets = lora_case("zipf", 13, torch.float32, [12, 4], [4, 2], seed=4)
    (held_a, held_b), (dense_a, dense_b) = in_layout(cpu_backend, torch.float32, lora_a, lora_b, offsets, [4, 2])
    assert held_a is dense_a
    out = y.clone()
    cpu_backend.add_lora(out, x, held_a, held_b, cpu_backend.plan_lora(slots), scales, offsets)
    torch.testing.assert_close(out.double(), dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets), atol=1e-4, rtol=1e-4)
