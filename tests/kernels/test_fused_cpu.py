"""The fused per-token ops (norms, SiLU-and-multiply, rotary + KV write, max/logsumexp) on the CPU
backends (PyTorch, and the compiled ops in every instruction-set form) against their twins.

fp32 agrees to float rounding; the 16-bit dtypes reproduce the twin's roundings, so they agree to one
step of the dtype (the exponential and the reciprocal square root differ from PyTorch's in the last
float bit)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
             torch.float16: dict(atol=2e-3, rtol=1e-3)}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm(cpu_backend, dtype: torch.dtype, rows: int) -> None:
    x, weight = _randn(rows, 576, dtype=dtype, seed=rows), _randn(576, dtype=dtype, seed=1)
    torch.testing.assert_close(cpu_backend.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place_first(cpu_backend, dtype: torch.dtype) -> None:
    x, weight = _randn(9, 96, dtype=dtype, seed=2), _randn(96, dtype=dtype, seed=3)
    residual = _randn(9, 96, dtype=dtype, seed=4)
    expected_residual = residual.clone()
    expected = reference.rms_norm(x, weight, 1e-6, residual=expected_residual)
    got = cpu_backend.rms_norm(x, weight, 1e-6, residual=residual)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # one rounded add, as the twin
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul(cpu_backend, dtype: torch.dtype, rows: int) -> None:
    gate_up = _randn(rows, 2 * 1536, dtype=dtype, seed=rows) * 4  # spans the sigmoid's tails
    torch.testing.assert_close(cpu_backend.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **TOLERANCE[dtype])


def test_silu_of_extreme_inputs_stays_finite(cpu_backend) -> None:
    gate_up = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(cpu_backend.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
def test_rotary_store_kv(cpu_backend, dtype: torch.dtype, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    head_dim, tokens, block_size, num_blocks = 32, 11, 4, 8
    gen = torch.Generator().manual_seed(num_heads)
    qkv = _randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=5)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    angles = torch.rand(50, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1  # padding: rotated, never stored
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    expected_qkv = qkv.clone()
    reference.rotary_store_kv(expected_qkv, positions, cos, sin, caches[0], caches[1], slots, num_heads, num_kv_heads)
    cpu_backend.rotary_store_kv(qkv, positions, cos, sin, caches[2], caches[3], slots, num_heads, num_kv_heads)
    torch.testing.assert_close(qkv, expected_qkv, **TOLERANCE[dtype])
    torch.testing.assert_close(caches[2], caches[0], **TOLERANCE[dtype])
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0)  # values are copied, not computed
    assert int((caches[2] != 0).any(-1).any(-1).sum()) == tokens - 1  # every slot but the padding one


def test_compiled_ops_refuse_mismatched_tensors(compiled_form) -> None:
    ops = cpu_ops.ops()
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.silu_and_mul(torch.empty(2, 3), torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rms_norm(torch.empty(2, 4), torch.empty(2, 4, dtype=torch.bfloat16), torch.empty(4), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.empty(2, 2, dtype=torch.float64), torch.empty(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 49152])
def test_max_logsumexp(cpu_backend, vocab: int, dtype: torch.dtype) -> None:
    """bf16 scores are the model's own logits: widened exactly, so the results are the float ones."""
    scores = (_randn(5, vocab, dtype=torch.float32, seed=vocab) * 8).to(dtype)
    if vocab > 1:
        scores[1, :: max(2, vocab // 3)] = -float("inf")  # masked tokens, as a schema leaves them
    scores[2, vocab // 2] = scores[2, -1] = scores[2].max() + 1  # a tie: the first index wins
    values, indices, log_normaliser = cpu_backend.max_logsumexp(scores)
    expected_values, expected_indices, expected_norm = reference.max_logsumexp(scores)
    torch.testing.assert_close(values, expected_values, atol=0, rtol=0)
    assert indices.tolist() == expected_indices.tolist()
    torch.testing.assert_close(log_normaliser, expected_norm, atol=1e-5, rtol=1e-6)
