"""Launchers of the Triton paged-attention and KV-write kernels."""
from __future__ import annotations

import torch
import triton

from kernels import tuning
from kernels.attention.plans import TritonAttentionPlan
from kernels.attention.paged import (
    paged_decode_kernel,
    paged_decode_merge_kernel,
    paged_prefill_kernel,
    store_kv_kernel,
)
from kernels.triton_utils import next_power_of_2, upcast_dot_inputs


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Contract of `Backend.store_kv`."""
    num_heads, head_dim = k.shape[1:]
    _assert_dim_contiguous(k, v, k_cache, v_cache)
    store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_HEADS=num_heads, BLOCK_H=next_power_of_2(num_heads, 1), HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Contract of `Backend.paged_attention`; `num_splits` (a power of two) overrides the
    decode split-KV choice of `tuning.decode_splits`."""
    _assert_dim_contiguous(q, k_cache, v_cache)
    assert plan.block_size & (plan.block_size - 1) == 0, "Triton paged attention needs a power-of-two block_size"
    out = torch.empty_like(q)
    if plan.decode_seq_idx.numel():
        _decode(q, k_cache, v_cache, plan, scale, window or 0, softcap, out, num_splits)
    if plan.prefill_seq_idx.numel():
        _prefill(q, k_cache, v_cache, plan, scale, window or 0, softcap, out)
    return out


def _decode(q, k_cache, v_cache, plan: TritonAttentionPlan, scale: float, window: int, softcap: float | None, out,
            num_splits: int | None) -> None:
    num_decode = plan.decode_seq_idx.numel()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    splits = num_splits or tuning.decode_splits(num_decode * num_kv_heads, plan.max_seq_len)
    assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    tokens_per_split = triton.cdiv(triton.cdiv(plan.max_seq_len, splits), plan.block_size) * plan.block_size
    # Partials are indexed by token row; only decode rows are written or read.
    part_out = torch.empty(num_tokens if splits > 1 else 0, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(part_out.shape[:3], dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    group = num_heads // num_kv_heads
    paged_decode_kernel[(num_decode, num_kv_heads, splits)](
        q, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc, plan.decode_seq_idx,
        out, part_out, part_max, part_sum, scale, softcap or 0.0, window, tokens_per_split,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], plan.block_tables.stride(0),
        out.stride(0), out.stride(1), *_strides3(part_out), part_max.stride(0), part_max.stride(1),
        GROUP=group, BLOCK_G=next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=plan.block_size, NUM_SPLITS=splits, UPCAST=upcast_dot_inputs(), HAS_SOFTCAP=softcap is not None,
    )  # fmt: skip
    if splits > 1:
        paged_decode_merge_kernel[(num_decode, num_heads)](
            out, part_out, part_max, part_sum, plan.query_start_loc, plan.decode_seq_idx,
            out.stride(0), out.stride(1), *_strides3(part_out), part_max.stride(0), part_max.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), NUM_SPLITS=splits,
        )  # fmt: skip


def _prefill(q, k_cache, v_cache, plan: TritonAttentionPlan, scale: float, window: int, softcap: float | None,
             out) -> None:
    num_heads, head_dim = q.shape[1:]
    num_m_tiles = triton.cdiv(plan.max_prefill_query_len, tuning.PREFILL_BLOCK_M)
    paged_prefill_kernel[(plan.prefill_seq_idx.numel(), num_m_tiles, num_heads)](
        q, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc, plan.prefill_seq_idx,
        out, scale, softcap or 0.0, window,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], plan.block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=tuning.PREFILL_BLOCK_M, BLOCK_SIZE=plan.block_size, UPCAST=upcast_dot_inputs(),
        HAS_SOFTCAP=softcap is not None,
    )  # fmt: skip


def _strides3(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _assert_dim_contiguous(*tensors: torch.Tensor) -> None:
    """The kernels index head_dim with unit stride."""
    assert all(t.stride(-1) == 1 for t in tensors), "the last (head_dim) dimension must be contiguous"
