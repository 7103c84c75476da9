"""add_lora's PyTorch path and its twin against a dense per-adapter computation."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference, tuning
from tests.kernels.factories import lora_weights, popularity_slots

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}
PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed"]


def _dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets) -> torch.Tensor:
    """fp64, one masked dense product per slot and slice: no per-token or per-segment logic."""
    out = y.double().clone()
    max_rank = lora_a.shape[1] // (len(offsets) - 1)
    for slot in range(lora_a.shape[0]):
        mask = (slots == slot).double()[:, None]  # [T, 1]
        for i in range(len(offsets) - 1):
            shrunk = x.double() @ lora_a[slot, i * max_rank : (i + 1) * max_rank].double().T
            delta = shrunk @ lora_b[slot, offsets[i] : offsets[i + 1]].double().T
            out[:, offsets[i] : offsets[i + 1]] += mask * delta * scales[slot]
    return out


def _case(pattern, num_tokens, dtype, slice_widths, ranks, seed, no_adapter=0.2, sort=False):
    gen = torch.Generator().manual_seed(seed)
    num_slots, hidden = len(ranks), 24
    slots = popularity_slots(pattern, num_tokens, num_slots, gen)
    slots[torch.rand(num_tokens, generator=gen) < no_adapter] = -1
    if sort:
        slots = slots.sort().values
    lora_a, lora_b = lora_weights(num_slots, ranks, max(ranks), hidden, slice_widths, dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(slice_widths), generator=gen).to(dtype)
    scales = torch.rand(num_slots, generator=gen) + 0.5
    offsets = [0, *torch.tensor(slice_widths).cumsum(0).tolist()]
    return y, x, lora_a, lora_b, slots, scales, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 3, 7, 64])
@pytest.mark.parametrize("sort", [False, True])
def test_add_lora_torch_matches_oracle(dtype, pattern, num_tokens, sort) -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = _case(
        pattern, num_tokens, dtype, [16, 8, 8], [4, 8, 2, 8], seed=num_tokens, sort=sort
    )
    expected = _dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets)
    for slot_ranks in (None, [4, 8, 2, 8]):
        meta = kernels.LoraBatchMeta.from_token_slots(slots, slot_ranks)
        for op in (kernels.add_lora, reference.add_lora):
            out = y.clone()
            op(out, x, lora_a, lora_b, meta, scales, offsets, backend="torch")
            torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_slots", [(40, 40), (64, 8), (5, 5)])
def test_both_cpu_layouts_agree(monkeypatch, dtype, num_tokens, num_slots) -> None:
    """The segment loop and the gathered form (forced by the tuning thresholds) give the same y."""
    y, x, lora_a, lora_b, slots, scales, offsets = _case(
        "distinct", num_tokens, dtype, [12, 4], [4] * num_slots, seed=7, no_adapter=0.1
    )
    meta = kernels.LoraBatchMeta.from_token_slots(slots)
    expected = _dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets)
    for gathered in (False, True):
        monkeypatch.setattr(tuning, "use_gathered_lora", lambda *_: gathered)
        out = y.clone()
        kernels.add_lora(out, x, lora_a, lora_b, meta, scales, offsets)
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_mixed_dtypes_bf16_activations_fp32_weights() -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = _case("zipf", 33, torch.bfloat16, [8, 8], [2, 4, 4], seed=2)
    lora_a, lora_b = lora_a.float(), lora_b.float()
    meta = kernels.LoraBatchMeta.from_token_slots(slots, [2, 4, 4])
    out = y.clone()
    kernels.add_lora(out, x, lora_a, lora_b, meta, scales, offsets)
    expected = _dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_no_scales_and_no_adapter_tokens() -> None:
    y, x, lora_a, lora_b, slots, _, offsets = _case("uniform", 9, torch.float32, [10], [3, 5], seed=1, no_adapter=0.5)
    meta = kernels.LoraBatchMeta.from_token_slots(slots)
    out = y.clone()
    kernels.add_lora(out, x, lora_a, lora_b, meta)
    expected = _dense_oracle(y, x, lora_a, lora_b, slots, [1.0, 1.0], offsets)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[slots < 0], y[slots < 0])


def test_meta_segments() -> None:
    meta = kernels.LoraBatchMeta.from_token_slots(torch.tensor([2, 2, -1, 0, 0, 0, 2, -1, -1]))
    assert meta.segments == ((0, 2, 2), (3, 6, 0), (6, 7, 2))
    assert meta.segment_starts.tolist() == [0, 3, 6]
    assert meta.segment_lengths.tolist() == [2, 3, 1]
    assert meta.segment_slots.tolist() == [2, 0, 2]
    assert meta.active_token_idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert meta.max_segment_len == 3


def test_forcing_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    meta = kernels.LoraBatchMeta.from_token_slots(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.add_lora(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 2, 4), torch.zeros(1, 4, 2), meta, backend="triton")
