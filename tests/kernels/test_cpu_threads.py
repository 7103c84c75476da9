"""The compiled CPU ops split over PyTorch's threads (kernels/csrc/bindings.cpp) compute, to the bit,
what they compute on one thread: every split they make is over rows, columns, segments' rows and
columns, or (sequence, KV head) pairs, none over a sum, so each output element is the same float32
sum in the same order whichever thread does it. Checked at 2, 3 and 8 threads (more threads than
tasks for the small shapes, and for the matmuls' column groups, so that they split their rows too),
at odd sizes, twice at each count (the same result every run), in every instruction-set form.

The tests' oracle is the single-thread result, itself checked against the twins by the ops' own test
files (test_fused_cpu.py, test_linear_cpu.py, test_lora_cpu.py, test_attention_cpu.py)."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu_ops
from kernels.linear import Reads, available_kinds, linear_packed, pack_linear_weight
from kernels.lora.layouts import ModuleShape
from tests.kernels.factories import paged_lora, scattered_paged_batch

THREADS = (2, 3, 8)
DTYPES = [torch.float32, torch.bfloat16]

Result = torch.Tensor | tuple[torch.Tensor, ...]


def _at_threads(threads: int, compute: Callable[[], Result]) -> tuple[torch.Tensor, ...]:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        result = compute()
    finally:
        torch.set_num_threads(previous)
    return result if isinstance(result, tuple) else (result,)


def assert_same_at_every_thread_count(compute: Callable[[], Result]) -> None:
    single = _at_threads(1, compute)
    for threads in THREADS:
        for run in range(2):
            split = _at_threads(threads, compute)
            for got, expected in zip(split, single, strict=True):
                assert got.dtype == expected.dtype and got.shape == expected.shape
                assert torch.equal(got, expected), f"{threads} threads, run {run}: differs from one thread"


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def backend(compiled_form: str):
    return kernels.backend_for("cpu", "cpu")


_OPENMP_RUNTIMES = """
import kernels.cpu_ops as cpu_ops
module = cpu_ops.ops()
assert module is not None and cpu_ops.is_parallel(module)
with open("/proc/self/maps") as maps:
    print(sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}))
"""


def test_the_bindings_run_on_pytorchs_threads() -> None:
    """Built with OpenMP, and with the one OpenMP runtime PyTorch loaded (no second pool). In a fresh
    process: a test process may hold other libraries' own copies (sentencepiece ships a libgomp)."""
    run = subprocess.run([sys.executable, "-c", _OPENMP_RUNTIMES], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    runtimes = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1 and "/torch/lib/" in runtimes[0], runtimes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 67, 301])
@pytest.mark.parametrize("width", [576, 96])
def test_norms_split_over_rows(backend, dtype: torch.dtype, rows: int, width: int) -> None:
    x, weight = _randn(rows, width, dtype=dtype, seed=rows), _randn(width, dtype=dtype, seed=1)
    residual = _randn(rows, width, dtype=dtype, seed=2)

    def compute() -> Result:
        summed = residual.clone()
        return backend.rms_norm(x, weight, 1e-5), backend.rms_norm(x, weight, 1e-5, residual=summed), summed

    assert_same_at_every_thread_count(compute)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 67])
def test_silu_and_mul_splits_over_rows(backend, dtype: torch.dtype, rows: int) -> None:
    gate_up = _randn(rows, 2 * 1536, dtype=dtype, seed=rows) * 4
    assert_same_at_every_thread_count(lambda: backend.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [3, 37])
def test_rotary_store_kv_splits_over_tokens(backend, dtype: torch.dtype, tokens: int) -> None:
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 8
    gen = torch.Generator().manual_seed(tokens)
    qkv = _randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=5)
    positions = torch.randint(0, 90, (tokens,), generator=gen)
    angles = torch.rand(90, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]

    def compute() -> Result:
        rotated = qkv.clone()
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        backend.rotary_store_kv(rotated, positions, cos, sin, *caches, slots, num_heads, num_kv_heads)
        return rotated, *caches

    assert_same_at_every_thread_count(compute)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (5, 1001), (13, 49152)])
def test_max_logsumexp_splits_over_rows(backend, dtype: torch.dtype, rows: int, vocab: int) -> None:
    scores = _randn(rows, vocab, dtype=dtype, seed=vocab) * 8
    assert_same_at_every_thread_count(lambda: backend.max_logsumexp(scores))


@pytest.mark.parametrize("rows", [1, 7, 100, 301])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (64, 32), (96, 80)])
def test_matmuls_split_over_columns_and_rows(compiled_form: str, rows: int, in_features: int, out_features: int) -> None:
    """Every matmul of the form; the narrow ones have fewer column groups than threads and split
    their rows (in parts of whole tiles; AMX: of 32 rows)."""
    kinds = available_kinds()
    if not kinds:
        pytest.skip(f"the {compiled_form} form has no compiled matmul")
    for kind in kinds:
        dtype = torch.float32 if kind == "f32" else torch.bfloat16
        packed = pack_linear_weight(_randn(out_features, in_features, dtype=dtype, seed=3), kind)
        if packed is None:  # a shape this kernel does not tile
            continue
        x = _randn(rows, in_features, dtype=dtype, seed=rows)
        assert_same_at_every_thread_count(lambda: linear_packed(x, packed))


def test_matmul_reads_for_the_next_op_split_with_its_rows(compiled_form: str) -> None:
    """The memory the next op reads, requested during the matmul by its last row part only."""
    pool = torch.ones(64, 4096, dtype=torch.bfloat16)
    for kind in available_kinds():
        dtype = torch.float32 if kind == "f32" else torch.bfloat16
        packed = pack_linear_weight(_randn(32, 64, dtype=dtype, seed=4), kind)
        if packed is None:
            continue
        x = _randn(200, 64, dtype=dtype, seed=5)
        assert_same_at_every_thread_count(lambda: linear_packed(x, packed, Reads((pool,), (torch.arange(64),))))


def _lora_case(backend, dtype: torch.dtype, ranks: list[list[int]], entries: list[int], seed: int):
    widths, hidden = [576, 192, 192], 576
    gen = torch.Generator().manual_seed(seed)
    layout = backend.lora_layout(dtype, [ModuleShape(hidden, width) for width in widths])
    lora = paged_lora(layout, ranks, hidden, widths, gen)
    x = torch.randn(len(entries), hidden, generator=gen).to(dtype)
    y = torch.randn(len(entries), sum(widths), generator=gen).to(dtype)

    def compute() -> Result:
        out = y.clone()
        backend.add_lora(out, x, lora.slices, backend.plan_lora(layout, entries, lora.tables))
        return out

    return compute


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_splits_a_heavy_segment_over_rows_and_columns(backend, dtype: torch.dtype) -> None:
    """One rank-64 adapter's 3 decode tokens (split into column parts, each shrinking the rows
    again), and one long prefill segment (split into pieces of rows)."""
    assert_same_at_every_thread_count(_lora_case(backend, dtype, [[64, 64, 64]], [0, 0, 0], seed=1))
    assert_same_at_every_thread_count(_lora_case(backend, dtype, [[33, 17, 64]], [0] * 203, seed=2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_balances_adapters_of_different_ranks(backend, dtype: torch.dtype) -> None:
    """W's decode step: 8 adapters of ranks 8-64 (one without v), tokens without an adapter among
    them, segments of 1-9 tokens; and fewer segments than threads."""
    ranks = [[8, 8, 8], [16, 16, 0], [64, 64, 64], [32, 8, 16], [8, 64, 8], [64, 16, 32], [16, 16, 16], [8, 8, 64]]
    entries = [e for e in range(8) for _ in range(1 + 4 * e % 9)] + [-1, -1] + [2, 5]
    assert_same_at_every_thread_count(_lora_case(backend, dtype, ranks, entries, seed=3))
    assert_same_at_every_thread_count(_lora_case(backend, dtype, ranks[:2], [0, 1, 1], seed=4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_splits_over_sequences_and_heads(backend, dtype: torch.dtype) -> None:
    """(sequence, KV head) pairs: a decode batch with a prefill among it, and one sequence of fewer
    pairs than threads."""
    for q_lens, seq_lens in (([1, 1, 7, 1, 3], [30, 150, 20, 64, 3]), ([5], [5])):
        gen = torch.Generator().manual_seed(len(q_lens))
        q, k_cache, v_cache, step = scattered_paged_batch(q_lens, seq_lens, 9, 3, 64, 16, dtype, gen)
        plan = backend.plan_attention(step)
        assert_same_at_every_thread_count(lambda: backend.paged_attention(q, k_cache, v_cache, plan, 0.125))
