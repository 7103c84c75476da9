"""The compiled CPU decode-attention op against dense causal attention (the oracle), over scattered
block tables, GQA, out-of-order decode rows mixed with prefill sequences, fp32 and bf16."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.attention.cpu_extension import decode_extension
from tests.kernels.factories import scattered_paged_batch
from tests.kernels.test_attention_torch import _dense_oracle

pytestmark = pytest.mark.skipif(decode_extension() is None, reason="no C++ toolchain to build the extension here")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_decode_matches_dense_attention(dtype: torch.dtype, atol: float, num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    seq_lens = torch.randint(1, 90, (13,), generator=gen).tolist()
    q_lens = [1] * 13
    q_lens[5] = seq_lens[5]  # a whole prefill among the decodes
    q_lens[9] = min(3, seq_lens[9])  # and a chunked one
    q, k_cache, v_cache, meta = scattered_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, 16, 8, dtype, gen)
    assert meta.decode_set is not None and not meta.decode_buckets
    expected = _dense_oracle(q.double(), k_cache.double(), v_cache.double(), meta, 0.2)
    got = kernels.paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=atol)


def test_decode_rows_out_of_order() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, meta = scattered_paged_batch([1, 4, 1, 2, 1], [50, 4, 7, 12, 2], 6, 2, 8, 4, torch.float32, gen)
    expected = _dense_oracle(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(kernels.paged_attention(q, k_cache, v_cache, meta, 0.3).double(), expected, atol=1e-4, rtol=1e-4)
