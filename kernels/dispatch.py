"""The public entry points: pick the Triton kernels for CUDA tensors and, on CPU, the compiled ops
(`kernels.cpu_ops`) where they are built, else the PyTorch paths.

Triton is never launched on CPU outside the interpreter (`TRITON_INTERPRET=1`): there it fails
with "0 active drivers", so forcing it raises a clear error instead."""
from __future__ import annotations

import functools
import os
from typing import Sequence

import torch

from kernels import reference
from kernels.attention.meta import PagedAttentionMeta
from kernels.attention.torch_ops import paged_attention_torch, store_kv_torch
from kernels.cpu_ops import available_for, cpu_ops
from kernels.lora.meta import LoraBatchMeta
from kernels.lora.torch_ops import add_lora_torch

BACKENDS = ("torch", "triton")


def resolve_backend(device: torch.device, backend: str | None) -> str:
    """`None` -> "triton" on CUDA, "torch" elsewhere; a forced "triton" on CPU needs the interpreter."""
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before kernels is imported, or use backend='torch'"
        )
    return backend


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    scales: torch.Tensor | Sequence[float] | None = None,
    slice_offsets: torch.Tensor | Sequence[int] | None = None,
    backend: str | None = None,
) -> None:
    """In place: y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T * scales[s] for s = meta.token_slots[t] >= 0.

    Args:
        y: [T, total_out] output of the base projection, updated in place.
        x: [T, hidden_in] input of the projection.
        lora_a: [S, max_rank * num_slices, hidden_in], ranks zero-padded to max_rank.
        lora_b: [S, total_out, max_rank].
        meta: built once per step by `LoraBatchMeta.from_token_slots`.
        scales: [S] per-slot scale (None = 1, i.e. folded into the weights).
        slice_offsets: [num_slices + 1] column offsets of a fused projection: slice i's rank block
            lora_a[:, i*max_rank:(i+1)*max_rank] feeds y[:, slice_offsets[i]:slice_offsets[i+1]].
        backend: None (by device), "torch" or "triton".
    """
    if resolve_backend(y.device, backend) == "triton":
        # Imported on first use: triton is an optional dependency of CPU-only installs.
        from kernels.lora.triton_ops import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, meta, scales, slice_offsets)
    else:
        add_lora_torch(y, x, lora_a, lora_b, meta, scales, slice_offsets)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Write new keys/values into the paged cache.

    k, v: [T, num_kv_heads, D]; caches: [num_blocks, block_size, num_kv_heads, D];
    slot_mapping: [T] int64 = block_id * block_size + offset, negative entries skipped (padding).
    Semantics: k_cache.view(-1, H, D)[slot_mapping[t]] = k[t] for slot_mapping[t] >= 0.
    """
    if resolve_backend(k.device, backend) == "triton":
        from kernels.attention.triton_ops import store_kv_triton

        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMeta,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (decode and prefill).

    q: [T, num_heads, D]; caches: [num_blocks, block_size, num_kv_heads, D] with num_heads a
    multiple of num_kv_heads (head h reads KV head h // group); meta: `PagedAttentionMeta.build`.
    Returns [T, num_heads, D]. Semantics per sequence: softmax(q @ K^T * scale + causal) @ V where
    the new tokens are the last q_len positions of the context.
    The CPU path gathers whole cache blocks and masks the positions past each context, so every
    cache entry must hold a finite value (allocate caches with torch.zeros, not torch.empty):
    a masked NaN still turns the output into NaN through 0 * NaN.
    """
    if resolve_backend(q.device, backend) == "triton":
        from kernels.attention.triton_ops import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMS norm of x [rows, hidden]; with `residual`, `residual += x` first (in place) and the norm
    reads the sum. Semantics: `kernels.reference.rms_norm`. Returns a new tensor."""
    compiled = available_for(x) and x.is_contiguous() and weight.dtype == x.dtype
    if compiled and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)):
        out = torch.empty_like(x)
        if residual is None:
            cpu_ops().rms_norm(out, x, weight, eps)
        else:
            cpu_ops().add_rms_norm(out, x, residual, weight, eps)
        return out
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] -> silu(gate) * up [rows, width]."""
    if available_for(gate_up) and gate_up.is_contiguous():
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        cpu_ops().silu_and_mul(out, gate_up)
        return out
    return reference.silu_and_mul(gate_up)


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    backend: str | None = None,
) -> None:
    """Rotary embedding of the q and k heads of a fused projection's output, in place, then the
    KV-cache write of the rotated keys and the values.

    qkv: [T, (num_heads + 2 * num_kv_heads) * D] (q heads, k heads, v heads); positions: [T] int64;
    cos, sin: [max_positions, D] tables in qkv's dtype; caches and slot_mapping as in `store_kv`.
    Semantics: `kernels.reference.rotary_store_kv`.
    """
    same_dtype = cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == qkv.dtype
    if available_for(qkv) and backend != "triton" and same_dtype:
        cpu_ops().rotary_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        return
    store = functools.partial(store_kv, backend=backend)
    reference.rotate_then_store(store, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def max_logsumexp(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [rows, vocab], any float dtype -> (row maxima [rows], their first indices [rows] int64,
    logsumexp of each row [rows]), all computed in float32: greedy tokens and log-softmax
    normalisers in one pass, with no float32 copy of bf16 logits. Semantics: `kernels.reference.max_logsumexp`."""
    rows = scores.shape[0]
    if available_for(scores) and scores.is_contiguous() and scores.shape[1] > 0:
        values, log_normaliser = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
        indices = torch.empty(rows, dtype=torch.int64)
        cpu_ops().max_logsumexp(scores, values, indices, log_normaliser)
        return values, indices, log_normaliser
    scores = scores.float()
    values, indices = scores.max(dim=-1)
    # Reusing the maxima: one exp-sum pass, about half the cost of a separate logsumexp.
    return values, indices, values + (scores - values[:, None]).exp_().sum(dim=-1).log_()
