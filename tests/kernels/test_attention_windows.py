"""Sliding-window and soft-capped paged attention on every backend (PyTorch, the compiled CPU op in
each instruction-set form, Triton under its interpreter) against the reference twin, over scattered
block tables with windows shorter than the sequences. The blocks wholly before every new token's
window are pointed at other sequences' blocks, as after they are freed and reused: a kernel that
read them would attend to the wrong keys."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.attention.plans import TritonAttentionPlan
from kernels.attention.triton_ops import paged_attention_triton
from tests.kernels.factories import reuse_blocks_before_window, scattered_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# (q_lens, seq_lens): decodes, a whole prefill, chunked prefills, mixed, all longer than the windows.
BATCHES = [
    ([1, 1, 1], [3, 30, 47]),
    ([40], [40]),
    ([1, 9, 1, 20], [33, 25, 4, 52]),
]


def _check(backend, dtype, q_lens, seq_lens, head_dim, window, softcap) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    q, k_cache, v_cache, step = scattered_paged_batch(q_lens, seq_lens, 4, 2, head_dim, 16, dtype, gen)
    reused = reuse_blocks_before_window(step, window, k_cache.shape[0], gen)  # scores of about +-2 and more: a cap of 2 bites
    out = backend.paged_attention(q, k_cache, v_cache, backend.plan_attention(reused), 0.3, window=window,
                                  softcap=softcap)
    expected = reference.paged_attention(q, k_cache, v_cache, step, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("window,softcap", [(5, None), (17, 2.0), (None, 2.0)])
@pytest.mark.parametrize("q_lens,seq_lens", BATCHES)
def test_cpu_backends_window_and_softcap_match_twin(cpu_backend, dtype, head_dim, window, softcap, q_lens,
                                                    seq_lens) -> None:
    _check(cpu_backend, dtype, q_lens, seq_lens, head_dim, window, softcap)


@pytest.mark.parametrize("window,softcap", [(5, None), (17, 2.0)])
@pytest.mark.parametrize("q_lens,seq_lens", BATCHES)
def test_triton_window_and_softcap_match_twin(triton_backend, window, softcap, q_lens, seq_lens) -> None:
    _check(triton_backend, torch.float32, q_lens, seq_lens, 16, window, softcap)


def test_triton_split_decode_with_splits_wholly_before_the_window() -> None:
    """Split-KV decode where the first splits of a long context lie before its window (they hold no
    key, and the merge gives them no weight)."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, step = scattered_paged_batch([1, 1], [7, 61], 4, 2, 16, 8, torch.float32, gen)
    reused = reuse_blocks_before_window(step, 6, k_cache.shape[0], gen)
    out = paged_attention_triton(q, k_cache, v_cache, TritonAttentionPlan.build(reused, q.device), 0.3, window=6,
                                 softcap=2.0, num_splits=4)
    expected = reference.paged_attention(q, k_cache, v_cache, step, 0.3, window=6, softcap=2.0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_reference_window_is_hf_sliding_mask() -> None:
    """The twin's window against a dense oracle built from HF's rule: key j is seen by query i when
    i - window < j <= i."""
    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, step = scattered_paged_batch([12], [12], 2, 2, 8, 4, torch.float64, gen)
    blocks = torch.tensor(step.block_tables[0])[torch.arange(12) // 4]
    keys, values = k_cache[blocks, torch.arange(12) % 4], v_cache[blocks, torch.arange(12) % 4]
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.5
    scores = scores.masked_fill(~((j <= i) & (j > i - 3)), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    out = reference.paged_attention(q, k_cache, v_cache, step, 0.5, window=3)  # computed in float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
