"""Paged attention and the KV-cache write, PyTorch paths and twins, against dense causal attention."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference, tuning
from tests.kernels.factories import dense_causal_attention, scattered_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}

# (q_lens, seq_lens): pure decode, full prefills, chunked prefill, and a mix in arbitrary order.
BATCHES = [
    ([1, 1, 1], [1, 17, 40]),
    ([5, 16], [5, 16]),
    ([300], [300]),
    ([1, 270], [5, 600]),
    ([7, 1, 1, 3, 1], [30, 150, 20, 3, 64]),
    ([1, 9, 1], [33, 9, 1]),
]


def _dense_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        blocks = meta.block_tables[b].long()[positions // meta.block_size]
        keys = k_cache[blocks, positions % meta.block_size]
        values = v_cache[blocks, positions % meta.block_size]
        out[starts[b] : starts[b + 1]] = dense_causal_attention(q[starts[b] : starts[b + 1]], keys, values, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("q_lens,seq_lens", BATCHES)
def test_paged_attention_matches_dense(dtype, heads, q_lens, seq_lens) -> None:
    gen = torch.Generator().manual_seed(len(q_lens) * 100 + heads[0])
    q, k_cache, v_cache, meta = scattered_paged_batch(q_lens, seq_lens, *heads, 16, 8, dtype, gen)
    expected = _dense_oracle(q, k_cache, v_cache, meta, 0.25)
    for op in (kernels.paged_attention, reference.paged_attention):
        out = op(q, k_cache, v_cache, meta, 0.25)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_rows_out_of_order_and_interleaved(monkeypatch) -> None:
    """Decode tokens need not be contiguous in the flat batch (bucketed PyTorch decode path)."""
    monkeypatch.setattr(tuning, "CPU_COMPILED_OPS", False)
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, meta = scattered_paged_batch([1, 4, 1, 2, 1], [50, 4, 7, 12, 2], 6, 2, 8, 4, torch.float32, gen)
    assert len(meta.decode_buckets) == 1
    expected = _dense_oracle(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(kernels.paged_attention(q, k_cache, v_cache, meta, 0.3).double(), expected, atol=1e-4, rtol=1e-4)


def test_many_decode_sequences_span_several_buckets(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "CPU_COMPILED_OPS", False)
    gen = torch.Generator().manual_seed(4)
    seq_lens = torch.randint(1, 60, (30,), generator=gen).tolist()
    q_lens = [1] * 30
    q_lens[7] = seq_lens[7]  # one full prefill among them
    q, k_cache, v_cache, meta = scattered_paged_batch(q_lens, seq_lens, 9, 3, 16, 4, torch.float32, gen)
    assert len(meta.decode_buckets) > 1 and len(meta.prefills) == 1
    expected = _dense_oracle(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(kernels.paged_attention(q, k_cache, v_cache, meta, 0.25).double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", [kernels.store_kv, reference.store_kv])
def test_store_kv_writes_slots_and_skips_padding(op) -> None:
    num_blocks, block_size, heads, dim = 5, 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, heads, dim)
    v_cache = torch.zeros(num_blocks, block_size, heads, dim)
    slot_mapping = torch.tensor([13, -1, 0, 7, 19, -1], dtype=torch.int64)
    k = torch.randn(6, heads, dim)
    v = torch.randn(6, heads, dim)
    op(k, v, k_cache, v_cache, slot_mapping)
    expected_k = torch.zeros(num_blocks * block_size, heads, dim)
    expected_v = torch.zeros(num_blocks * block_size, heads, dim)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot], expected_v[slot] = k[t], v[t]
    assert torch.equal(k_cache.view(-1, heads, dim), expected_k)
    assert torch.equal(v_cache.view(-1, heads, dim), expected_v)


def test_store_then_attend_round_trip() -> None:
    """Write a sequence's keys through store_kv, then a decode step over it equals dense attention."""
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, dim, seq_len = 4, 4, 2, 8, 10
    keys = torch.randn(seq_len, kv_heads, dim, generator=gen)
    values = torch.randn(seq_len, kv_heads, dim, generator=gen)
    k_cache = torch.zeros(6, block_size, kv_heads, dim)
    v_cache = torch.zeros(6, block_size, kv_heads, dim)
    table = torch.tensor([[4, 1, 3, 0]], dtype=torch.int32)
    positions = torch.arange(seq_len)
    slot_mapping = table[0].long()[positions // block_size] * block_size + positions % block_size
    kernels.store_kv(keys, values, k_cache, v_cache, slot_mapping)
    meta = kernels.PagedAttentionMeta.build(torch.tensor([0, 1]), torch.tensor([seq_len]), table, block_size)
    q = torch.randn(1, heads, dim, generator=gen)
    out = kernels.paged_attention(q, k_cache, v_cache, meta, 0.5)
    torch.testing.assert_close(out.double(), dense_causal_attention(q, keys, values, 0.5), atol=1e-5, rtol=1e-5)
