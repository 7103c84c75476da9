"""The compiled CPU attention op against dense causal attention (the oracle), over scattered block
tables, GQA, out-of-order decode rows mixed with prefill sequences, fp32 and bf16, and its split of
the work with the matmul path for long prefills."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import tuning
from kernels.cpu_ops import cpu_ops
from tests.kernels.factories import scattered_paged_batch
from tests.kernels.test_attention_torch import _dense_oracle

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain to build the extension here")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1), (14, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 and 128 take the AVX-512 form where the CPU has it
def test_decode_matches_dense_attention(
    dtype: torch.dtype, atol: float, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    seq_lens = torch.randint(1, 90, (13,), generator=gen).tolist()
    q_lens = [1] * 13
    q_lens[5] = seq_lens[5]  # a whole prefill among the decodes
    q_lens[9] = min(3, seq_lens[9])  # and a chunked one
    q, k_cache, v_cache, meta = scattered_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 8, dtype, gen)
    assert meta.compiled_seqs is not None and not meta.decode_buckets
    expected = _dense_oracle(q.double(), k_cache.double(), v_cache.double(), meta, 0.2)
    got = kernels.paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=atol)


def test_decode_rows_out_of_order() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, meta = scattered_paged_batch([1, 4, 1, 2, 1], [50, 4, 7, 12, 2], 6, 2, 8, 4, torch.float32, gen)
    expected = _dense_oracle(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(kernels.paged_attention(q, k_cache, v_cache, meta, 0.3).double(), expected, atol=1e-4, rtol=1e-4)


def test_long_prefills_take_the_matmul_path_beside_the_compiled_op(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "compiled_prefill_max_work", lambda has_avx512: 100)
    gen = torch.Generator().manual_seed(5)
    q_lens, seq_lens = [1, 30, 4, 1, 12], [40, 30, 9, 3, 70]
    q, k_cache, v_cache, meta = scattered_paged_batch(q_lens, seq_lens, 9, 3, 8, 4, torch.bfloat16, gen)
    # 30 x 30 and 12 x 70 exceed the work bound; 4 x 9 and the decodes stay compiled.
    assert meta.compiled_seqs.tolist() == [0, 2, 3]
    assert [plan.row_start for plan in meta.prefills] == [1, 36]
    expected = _dense_oracle(q.double(), k_cache.double(), v_cache.double(), meta, 0.125)
    got = kernels.paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)
