"""Triton SGMV/BGMV kernels, run in the interpreter on CPU tensors, against their twins."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.lora import bgmv, sgmv
from kernels.lora.plans import TritonLoraPlan
from tests.kernels.factories import lora_weights, popularity_slots

PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed"]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}
OPS = {"sgmv": (sgmv.sgmv_shrink, sgmv.sgmv_expand), "bgmv": (bgmv.bgmv_shrink, bgmv.bgmv_expand)}


def _case(pattern, num_tokens, dtype, hidden=40, slice_widths=(16, 8, 8), ranks=(4, 8, 2), seed=0, sort=False):
    gen = torch.Generator().manual_seed(seed)
    slots = popularity_slots(pattern, num_tokens, len(ranks), gen)
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    if sort:
        slots = slots.sort().values
    lora_a, lora_b = lora_weights(len(ranks), list(ranks), max(ranks), hidden, list(slice_widths), dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(slice_widths), generator=gen).to(dtype)
    scales = torch.rand(len(ranks), generator=gen) + 0.5
    offsets = [0, *torch.tensor(slice_widths).cumsum(0).tolist()]
    return y, x, lora_a, lora_b, slots.tolist(), scales, offsets


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 3, 7])
def test_shrink_and_expand_match_twins(kind, pattern, num_tokens) -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = _case(pattern, num_tokens, torch.float32, seed=num_tokens)
    plan = TritonLoraPlan.build(slots, x.device)
    shrink, expand = OPS[kind]
    shrunk = shrink(x, lora_a, plan)
    torch.testing.assert_close(shrunk, reference.sgmv_shrink(x, lora_a, slots), atol=1e-4, rtol=1e-4)
    out, expected = y.clone(), y.clone()
    expand(out, shrunk, lora_b, plan, scales, offsets)
    reference.sgmv_expand(expected, shrunk, lora_b, slots, scales, offsets)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_split_k_on_and_off(kind, split_k) -> None:
    """hidden 200 spans several BLOCK_K tiles, so each split program loops and the last is partial."""
    y, x, lora_a, lora_b, slots, scales, offsets = _case("zipf", 5, torch.float32, hidden=200, seed=11)
    shrunk = OPS[kind][0](x, lora_a, TritonLoraPlan.build(slots, x.device), split_k=split_k)
    torch.testing.assert_close(shrunk, reference.sgmv_shrink(x, lora_a, slots), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern,num_tokens", [("skewed", 20), ("distinct", 6), ("uniform", 9)])
def test_add_lora_triton_backend_matches_twin(triton_backend, dtype, pattern, num_tokens) -> None:
    """The backend picks SGMV (long runs, sorted skewed batch) or BGMV (distinct) by batch shape;
    unsorted tokens and tokens without an adapter included."""
    y, x, lora_a, lora_b, slots, scales, offsets = _case(
        pattern, num_tokens, dtype, slice_widths=(24, 8), ranks=(8, 2, 4), seed=3, sort=pattern == "skewed"
    )
    out, expected = y.clone(), y.clone()
    triton_backend.add_lora(out, x, lora_a, lora_b, triton_backend.plan_lora(slots), scales.tolist(), offsets)
    reference.add_lora(expected, x, lora_a, lora_b, slots, scales, offsets)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_sgmv_tiles_long_segments() -> None:
    """A segment longer than SGMV_BLOCK_M spans several row tiles; no scales given."""
    y, x, lora_a, lora_b, slots, _, offsets = _case("identical", 37, torch.float32, slice_widths=(40,), ranks=(16,))
    plan = TritonLoraPlan.build(slots, x.device)
    out, expected = y.clone(), y.clone()
    sgmv.sgmv_expand(out, sgmv.sgmv_shrink(x, lora_a, plan), lora_b, plan)
    reference.add_lora(expected, x, lora_a, lora_b, slots)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_model_sized_fused_qkv(triton_backend) -> None:
    """SmolLM2-135M's fused q/k/v (576 -> 576 + 192 + 192), 24 tokens over 4 adapters, bf16."""
    y, x, lora_a, lora_b, slots, scales, offsets = _case(
        "zipf", 24, torch.bfloat16, hidden=576, slice_widths=(576, 192, 192), ranks=(16, 8, 16, 4), seed=5, sort=True
    )
    out, expected = y.clone(), y.clone()
    triton_backend.add_lora(out, x, lora_a, lora_b, triton_backend.plan_lora(slots), scales.tolist(), offsets)
    reference.add_lora(expected, x, lora_a, lora_b, slots, scales, offsets)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
