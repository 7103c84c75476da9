"""Triton paged attention and KV write, on the test device (the interpreter on CPU tensors, or
compiled on CUDA: tests/device.py), against their twins run on CPU copies.

Sliding-window attention is not implemented by any backend yet (windowed architectures serve only
contexts their window covers whole: lora_runtime/models/architectures.py), so no case has a window."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.attention.plans import TritonAttentionPlan
from kernels.attention.triton_ops import paged_attention_triton
from tests.device import TEST_DEVICE
from tests.kernels.factories import scattered_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}


def _paged_batch(*args):
    """`scattered_paged_batch` with q and the caches on the test device."""
    q, k_cache, v_cache, step = scattered_paged_batch(*args)
    return q.to(TEST_DEVICE), k_cache.to(TEST_DEVICE), v_cache.to(TEST_DEVICE), step


def _on_cpu(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU, where the twins run."""
    return [t.cpu() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens,seq_lens,heads",
    [
        ([1, 1, 1], [1, 13, 30], (4, 2)),  # decode only, GQA
        ([6, 11], [6, 11], (2, 2)),  # full prefills, plain multi-head
        ([1, 5, 1, 3], [25, 5, 9, 20], (6, 2)),  # mixed decode, prefill and chunked prefill
    ],
)
def test_paged_attention_matches_twin(triton_backend, dtype, q_lens, seq_lens, heads) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    q, k_cache, v_cache, step = _paged_batch(q_lens, seq_lens, *heads, 16, 8, dtype, gen)
    out = triton_backend.paged_attention(q, k_cache, v_cache, triton_backend.plan_attention(step), 0.25)
    expected = reference.paged_attention(*_on_cpu(q, k_cache, v_cache), step, 0.25)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [2, 4])
def test_decode_split_kv_merges_partials(num_splits) -> None:
    """Contexts of very different lengths, so some splits of the short ones are empty."""
    gen = torch.Generator().manual_seed(9)
    q, k_cache, v_cache, step = _paged_batch([1, 1], [3, 45], 4, 1, 16, 8, torch.float32, gen)
    plan = TritonAttentionPlan.build(step, q.device)
    out = paged_attention_triton(q, k_cache, v_cache, plan, 0.5, num_splits=num_splits)
    expected = reference.paged_attention(*_on_cpu(q, k_cache, v_cache), step, 0.5)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_triton_matches_twin(triton_backend, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(4, 8, 3, 16, dtype=dtype)
    v_cache = torch.zeros(4, 8, 3, 16, dtype=dtype)
    k = torch.randn(5, 3, 16, generator=gen).to(dtype)
    v = torch.randn(5, 3, 16, generator=gen).to(dtype)
    slot_mapping = torch.tensor([9, -1, 31, 0, 17])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, expected_k, expected_v, slot_mapping)
    k_cache, v_cache = k_cache.to(TEST_DEVICE), v_cache.to(TEST_DEVICE)
    triton_backend.store_kv(k.to(TEST_DEVICE), v.to(TEST_DEVICE), k_cache, v_cache, slot_mapping.to(TEST_DEVICE))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


@pytest.mark.slow
def test_model_sized_decode_and_chunked_prefill(triton_backend) -> None:
    """SmolLM2-135M's attention shape (9 query / 3 KV heads, head_dim 64, block 16), bf16."""
    gen = torch.Generator().manual_seed(2)
    q, k_cache, v_cache, step = _paged_batch([1, 1, 20], [70, 150, 60], 9, 3, 64, 16, torch.bfloat16, gen)
    out = triton_backend.paged_attention(q, k_cache, v_cache, triton_backend.plan_attention(step), 0.125)
    expected = reference.paged_attention(*_on_cpu(q, k_cache, v_cache), step, 0.125)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=3e-2, rtol=3e-2)
