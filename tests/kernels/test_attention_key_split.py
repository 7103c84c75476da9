"""The compiled paged attention on several threads: (sequence, KV head) tasks handed out in ranges of
about equal keys (bit for bit the one-thread result), and a long decode token's keys split into chunks
whose partial maxima and sums are merged after ("split-K"): a different order of sums, so within a
stated tolerance of the one-thread result and of the reference twin, and the same result every run at
a given thread count. Head sizes 64 and 128 (the AVX-512 forms' register-blocked kernel) and 80 (the
portable loops), sliding windows whose earlier blocks hold other sequences' keys, soft caps, more
threads than tasks. Figures at one thread: the ops' own tests (test_attention_cpu.py,
test_attention_windows.py)."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.factories import reuse_blocks_before_window, scattered_paged_batch
from tests.kernels.test_cpu_threads import THREADS, _at_threads, assert_same_at_every_thread_count

# The split changes the order of the softmax's sums (and its exponentials of the chunks' maxima): in
# float32 a few ulps of outputs of about 0.1; in bf16 the outputs are rounded after the merge, so one
# bf16 rounding step (2^-8 relative) either way.
SPLIT_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
REFERENCE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # as test_attention_windows.py
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def backend(compiled_form: str):
    import kernels

    return kernels.backend_for("cpu", "cpu")


def _attention(backend, q_lens: list[int], seq_lens: list[int], head_dim: int, dtype: torch.dtype,
               window: int | None = None, softcap: float | None = None):
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    q, k_cache, v_cache, step = scattered_paged_batch(q_lens, seq_lens, 9, 3, head_dim, 16, dtype, gen)
    read = reuse_blocks_before_window(step, window, k_cache.shape[0], gen)
    plan = backend.plan_attention(read)

    def compute() -> torch.Tensor:
        return backend.paged_attention(q, k_cache, v_cache, plan, 0.3, window=window, softcap=softcap)

    expected = reference.paged_attention(q, k_cache, v_cache, step, 0.3, window=window, softcap=softcap)
    return compute, expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequences_of_different_lengths_split_bit_for_bit(backend, dtype: torch.dtype) -> None:
    """Decodes of 5-300 keys and a prefill chunk: tasks balanced by keys, none split."""
    compute, _ = _attention(backend, [1, 1, 1, 1, 1, 1, 9], [40, 300, 17, 200, 5, 90, 60], 64, dtype)
    assert_same_at_every_thread_count(compute)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (700, None), (None, 2.0), (613, 2.0)])
def test_a_long_decode_splits_its_keys(backend, dtype: torch.dtype, head_dim: int, window: int | None,
                                       softcap: float | None) -> None:
    """One decode of 1500 keys (3 KV heads: fewer pairs than threads) and a short one beside it."""
    compute, expected = _attention(backend, [1, 1], [1500, 37], head_dim, dtype, window, softcap)
    single = _at_threads(1, compute)[0]
    tolerance = SPLIT_TOLERANCE[dtype]
    for threads in THREADS:
        split, again = _at_threads(threads, compute)[0], _at_threads(threads, compute)[0]
        assert torch.equal(split, again), f"{threads} threads: two runs differ"
        torch.testing.assert_close(split.float(), single.float(), atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(split.float(), expected.float(), atol=REFERENCE_TOLERANCE[dtype],
                                   rtol=REFERENCE_TOLERANCE[dtype])


def test_the_key_split_runs(backend) -> None:
    """The split path is taken (its sums differ in order from one thread's in some element of a
    1500-key float32 decode), and not on one thread or for short decodes (bit for bit above)."""
    compute, _ = _attention(backend, [1], [1500], 64, torch.float32)
    assert not torch.equal(_at_threads(8, compute)[0], _at_threads(1, compute)[0])
