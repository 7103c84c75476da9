"""The compiled CPU LoRA op (fp32 weights, lora_b in the pool's layout: output dimension contiguous)
against a dense per-adapter computation, with x and y in fp32 and in bf16."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels.cpu_ops import cpu_ops
from kernels.lora import torch_ops
from tests.kernels.test_lora_torch import PATTERNS, _case, _dense_oracle

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain to build the ops here")


def _pool_layout(lora_b: torch.Tensor) -> torch.Tensor:
    """The same values as lora_b [S, out, R], stored [S, R, out] as the engine's pool stores them."""
    return lora_b.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_compiled_lora_matches_oracle(activations: torch.dtype, pattern: str, num_tokens: int) -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = _case(
        pattern, num_tokens, torch.float32, [16, 8, 8], [4, 8, 2, 8], seed=num_tokens, sort=True
    )
    y, x, lora_b = y.to(activations), x.to(activations), _pool_layout(lora_b)
    assert torch_ops._compiled_applies(y, x, lora_a, lora_b)
    expected = _dense_oracle(y, x, lora_a, lora_b, slots, scales, offsets)
    tolerance = 1e-4 if activations == torch.float32 else 3e-2
    for slot_ranks in (None, [4, 8, 2, 8]):
        for slot_scales in (scales, None):
            out = y.clone()
            meta = kernels.LoraBatchMeta.from_token_slots(slots, slot_ranks)
            kernels.add_lora(out, x, lora_a, lora_b, meta, slot_scales, offsets)
            oracle = expected if slot_scales is not None else _dense_oracle(y, x, lora_a, lora_b, slots, [1.0] * 4, offsets)
            torch.testing.assert_close(out.double(), oracle, atol=tolerance, rtol=tolerance)


def test_tokens_without_an_adapter_are_untouched() -> None:
    y, x, lora_a, lora_b, slots, scales, offsets = _case("uniform", 32, torch.float32, [8], [4, 4], seed=1, no_adapter=0.5)
    out = y.clone()
    kernels.add_lora(out, x, lora_a, _pool_layout(lora_b), kernels.LoraBatchMeta.from_token_slots(slots), scales, offsets)
    untouched = slots < 0
    assert untouched.any() and torch.equal(out[untouched], y[untouched])


def test_slice_ranks_limit_each_slice_of_a_fused_projection() -> None:
    """slice_ranks [slot * num_slices + slice] bound each slice's rank: a slice given rank 0 is
    skipped (its columns untouched even though the weights there are not zero), the others are
    computed as with the slot's rank."""
    y, x, lora_a, lora_b, slots, scales, offsets = _case("uniform", 16, torch.float32, [16, 8, 8], [8, 8], seed=3, no_adapter=0)
    lora_b = _pool_layout(lora_b)
    meta = kernels.LoraBatchMeta.from_token_slots(slots, [8, 8])
    full = y.clone()
    kernels.add_lora(full, x, lora_a, lora_b, meta, scales, offsets)
    skipped = y.clone()
    kernels.add_lora(skipped, x, lora_a, lora_b, dataclasses.replace(meta, slice_ranks=(8, 0, 8, 8, 0, 8)), scales, offsets)
    middle = slice(offsets[1], offsets[2])
    assert torch.equal(skipped[:, middle], y[:, middle]) and not torch.equal(full[:, middle], y[:, middle])
    outer = torch.cat([torch.arange(offsets[1]), torch.arange(offsets[2], offsets[3])])
    torch.testing.assert_close(skipped[:, outer], full[:, outer], atol=0, rtol=0)
