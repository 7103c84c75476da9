"""Paged attention and the KV-cache write on the CPU backends (PyTorch, and the compiled op in every
instruction-set form) and the twins, against dense causal attention in fp64, over scattered block
tables, GQA, decode rows out of order and mixed with prefills and chunked prefills."""
from __future__ import annotations

import pytest
import torch

from kernels import StepSequences, reference, tuning
from kernels.attention.plans import CompiledAttentionPlan, TorchAttentionPlan
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


def dense_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepSequences, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = step.query_start
    for b, seq_len in enumerate(step.seq_lens):
        positions = torch.arange(seq_len)
        blocks = torch.tensor(step.block_tables[b])[positions // step.block_size]
        keys = k_cache[blocks, positions % step.block_size]
        values = v_cache[blocks, positions % step.block_size]
        out[starts[b] : starts[b + 1]] = dense_causal_attention(q[starts[b] : starts[b + 1]], keys, values, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("q_lens,seq_lens", BATCHES)
def test_paged_attention_matches_dense(cpu_backend, dtype, heads, q_lens, seq_lens) -> None:
    gen = torch.Generator().manual_seed(len(q_lens) * 100 + heads[0])
    q, k_cache, v_cache, step = scattered_paged_batch(q_lens, seq_lens, *heads, 16, 8, dtype, gen)
    expected = dense_oracle(q, k_cache, v_cache, step, 0.25)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, cpu_backend.plan_attention(step), 0.25)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# bf16: the PyTorch path's matmuls round the scores to bf16 before the softmax (a step of 2^-8 of
# scores that reach ~10 at head_dim 128), hence 5e-2; the compiled op keeps them in float32.
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1), (14, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 and 128 take the vector form where the form has one
def test_decode_with_prefills_among_them(cpu_backend, dtype, atol, num_heads, num_kv_heads, head_dim) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    seq_lens = torch.randint(1, 90, (13,), generator=gen).tolist()
    q_lens = [1] * 13
    q_lens[5] = seq_lens[5]  # a whole prefill among the decodes
    q_lens[9] = min(3, seq_lens[9])  # and a chunked one
    q, k_cache, v_cache, step = scattered_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 8, dtype, gen)
    expected = dense_oracle(q.double(), k_cache.double(), v_cache.double(), step, 0.2)
    got = cpu_backend.paged_attention(q, k_cache, v_cache, cpu_backend.plan_attention(step), 0.2)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_softmax_of_scores_far_below_zero(cpu_backend, dtype, atol, head_dim) -> None:
    """Every score near -300 (keys opposite the queries): the softmax must subtract the true maximum,
    over exactly the keys there are (lengths that are and are not whole vectors of 16), or every
    exp(score - max) underflows to 0 in float32."""
    gen = torch.Generator().manual_seed(head_dim)
    q, k_cache, v_cache, step = scattered_paged_batch([1] * 4, [5, 17, 32, 40], 9, 3, head_dim, 16, torch.float32, gen)
    q = (2.0 + 0.1 * q).to(dtype)
    k_cache = (-2.0 + 0.1 * k_cache).to(dtype)
    v_cache = v_cache.to(dtype)
    scale = 300.0 / (4 * head_dim)
    expected = dense_oracle(q.double(), k_cache.double(), v_cache.double(), step, scale)
    got = cpu_backend.paged_attention(q, k_cache, v_cache, cpu_backend.plan_attention(step), scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=atol)


def test_reference_matches_dense() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, step = scattered_paged_batch([1, 4, 1, 2, 1], [50, 4, 7, 12, 2], 6, 2, 8, 4, torch.float32, gen)
    expected = dense_oracle(q, k_cache, v_cache, step, 0.3)
    torch.testing.assert_close(reference.paged_attention(q, k_cache, v_cache, step, 0.3).double(), expected, atol=1e-4, rtol=1e-4)


def test_torch_plan_buckets_decodes_by_length() -> None:
    gen = torch.Generator().manual_seed(4)
    seq_lens = torch.randint(1, 60, (30,), generator=gen).tolist()
    q_lens = [1] * 30
    q_lens[7] = seq_lens[7]  # one full prefill among them
    _, _, _, step = scattered_paged_batch(q_lens, seq_lens, 9, 3, 16, 4, torch.float32, gen)
    plan = TorchAttentionPlan.build(step)
    assert len(plan.decode_buckets) == -(-29 // tuning.DECODE_BUCKET_SEQS) and len(plan.prefills) == 1
    bucketed = sorted(row for bucket in plan.decode_buckets for row in bucket.token_rows.tolist())
    assert bucketed == [step.query_start[b] for b in range(30) if b != 7]


def test_compiled_plan_leaves_long_prefills_to_matmuls(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "compiled_prefill_max_work", lambda has_vector_attention: 100)
    gen = torch.Generator().manual_seed(5)
    _, _, _, step = scattered_paged_batch([1, 30, 4, 1, 12], [40, 30, 9, 3, 70], 9, 3, 8, 4, torch.bfloat16, gen)
    plan = CompiledAttentionPlan.build(step, has_vector_attention=False)
    # 30 x 30 and 12 x 70 exceed the work bound; 4 x 9 and the decodes stay compiled.
    assert plan.compiled_seqs.tolist() == [0, 2, 3]
    # The blocks the compiled op reads (the ones its projection requests), up to each context's end.
    used = [block for b in (0, 2, 3) for block in step.block_tables[b][: -(-step.seq_lens[b] // step.block_size)]]
    assert plan.blocks_read.tolist() == used and len(used) == 10 + 3 + 1
    assert [prefill.row_start for prefill in plan.prefills] == [1, 36]


def test_long_prefills_by_matmul_beside_the_compiled_op(compiled_form, monkeypatch) -> None:
    from kernels import backend_for

    monkeypatch.setattr(tuning, "compiled_prefill_max_work", lambda has_vector_attention: 100)
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, step = scattered_paged_batch([1, 30, 4, 1, 12], [40, 30, 9, 3, 70], 9, 3, 8, 4, torch.bfloat16, gen)
    backend = backend_for("cpu", "cpu")
    plan = backend.plan_attention(step)
    assert len(plan.prefills) == 2
    expected = dense_oracle(q.double(), k_cache.double(), v_cache.double(), step, 0.125)
    torch.testing.assert_close(backend.paged_attention(q, k_cache, v_cache, plan, 0.125).double(), expected, atol=3e-2, rtol=3e-2)


def test_store_kv_writes_slots_and_skips_padding(cpu_backend) -> None:
    num_blocks, block_size, heads, dim = 5, 4, 2, 8
    caches = [torch.zeros(num_blocks, block_size, heads, dim) for _ in range(4)]
    slot_mapping = torch.tensor([13, -1, 0, 7, 19, -1], dtype=torch.int64)
    k, v = torch.randn(6, heads, dim), torch.randn(6, heads, dim)
    cpu_backend.store_kv(k, v, caches[0], caches[1], slot_mapping)
    reference.store_kv(k, v, caches[2], caches[3], slot_mapping)
    expected_k = torch.zeros(num_blocks * block_size, heads, dim)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot] = k[t]
    for cache in (caches[0], caches[2]):
        assert torch.equal(cache.view(-1, heads, dim), expected_k)
    assert torch.equal(caches[1], caches[3])


def test_store_then_attend_round_trip(cpu_backend) -> None:
    """Write a sequence's keys through store_kv, then a decode step over it equals dense attention."""
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, dim, seq_len = 4, 4, 2, 8, 10
    keys = torch.randn(seq_len, kv_heads, dim, generator=gen)
    values = torch.randn(seq_len, kv_heads, dim, generator=gen)
    k_cache = torch.zeros(6, block_size, kv_heads, dim)
    v_cache = torch.zeros(6, block_size, kv_heads, dim)
    table = [4, 1, 3]
    positions = torch.arange(seq_len)
    slot_mapping = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    cpu_backend.store_kv(keys, values, k_cache, v_cache, slot_mapping)
    step = StepSequences([0, 1], [seq_len], [table], block_size)
    q = torch.randn(1, heads, dim, generator=gen)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, cpu_backend.plan_attention(step), 0.5)
    torch.testing.assert_close(out.double(), dense_causal_attention(q, keys, values, 0.5), atol=1e-5, rtol=1e-5)
