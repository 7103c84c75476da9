"""SGMV: segmented gather matrix-vector products for runs of tokens sharing an adapter slot.

One program owns a tile of SGMV_BLOCK_M tokens of one segment, so prefill-sized runs become real
matmuls against their slot's weights. The shrink can split its (wide) reduction across programs.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.lora.plans import TritonLoraPlan
from kernels.triton_utils import k_per_split, next_power_of_2, slice_offsets_tensor, upcast_dot_inputs


@triton.jit
def sgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    hidden_in, rank_total, k_per_split, num_n_tiles,
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_vt, stride_vn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """v[tok, n] (+)= sum_k x[tok, k] * a[slot, n, k] over this program's share of k."""
    seg = tl.program_id(0)
    m_tile = tl.program_id(1) // num_n_tiles
    n_tile = tl.program_id(1) % num_n_tiles
    seg_len = tl.load(seg_len_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(seg_start_ptr + seg) + rows
    row_mask = rows < seg_len
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < rank_total
    k_begin = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, hidden_in), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_in
        x_tile = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk,
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        a_tile = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_an + ks[:, None] * stride_ak,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        acc += tl.dot(x_tile, a_tile.to(x_tile.dtype))
    v_ptrs = v_ptr + tokens[:, None] * stride_vt + cols[None, :] * stride_vn
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=out_mask)


@triton.jit
def sgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, offsets_ptr, scales_ptr,
    max_rank, num_n_tiles,
    stride_vt, stride_vn, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_SCALES: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """y[tok, cols_i] += v[tok, i*R:(i+1)*R] @ b[slot, cols_i, :].T * scale[slot] for slice i."""
    seg = tl.program_id(0)
    m_tile = tl.program_id(1) // num_n_tiles
    n_tile = tl.program_id(1) % num_n_tiles
    part = tl.program_id(2)
    col_begin = tl.load(offsets_ptr + part)
    col_end = tl.load(offsets_ptr + part + 1)
    seg_len = tl.load(seg_len_ptr + seg)
    if m_tile * BLOCK_M >= seg_len or col_begin + n_tile * BLOCK_N >= col_end:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(seg_start_ptr + seg) + rows
    row_mask = rows < seg_len
    cols = col_begin + n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < col_end
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < max_rank
    v_tile = tl.load(v_ptr + tokens[:, None] * stride_vt + (part * max_rank + ranks[None, :]) * stride_vn,
                     mask=row_mask[:, None] & rank_mask[None, :], other=0.0)  # fmt: skip
    b_tile = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
                     mask=rank_mask[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        b_tile = b_tile.to(tl.float32)
    acc = tl.dot(v_tile.to(b_tile.dtype), b_tile)  # [BLOCK_M, BLOCK_N] fp32
    if HAS_SCALES:
        acc *= tl.load(scales_ptr + slot)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :] * stride_yn
    out_mask = row_mask[:, None] & col_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_tile + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def sgmv_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, plan: TritonLoraPlan, split_k: int | None = None
) -> torch.Tensor:
    """v = x @ lora_a[s].T per segment: x [T, hidden_in], lora_a [S, R_total, hidden_in] ->
    v [T, R_total] fp32, zero on tokens without an adapter. `split_k` None = by hidden_in."""
    num_tokens, hidden_in = x.shape
    rank_total = lora_a.shape[1]
    v = torch.zeros(num_tokens, rank_total, dtype=torch.float32, device=x.device)
    if plan.num_segments == 0:
        return v
    split_k = split_k or tuning.split_k_for(hidden_in)
    block_n = min(tuning.LORA_BLOCK_N, next_power_of_2(rank_total))
    num_n_tiles = triton.cdiv(rank_total, block_n)
    num_m_tiles = triton.cdiv(plan.max_segment_len, tuning.SGMV_BLOCK_M)
    grid = (plan.num_segments, num_m_tiles * num_n_tiles, split_k)
    sgmv_shrink_kernel[grid](
        x, lora_a, v, plan.segment_starts, plan.segment_lengths, plan.segment_slots,
        hidden_in, rank_total, k_per_split(hidden_in, split_k, tuning.LORA_BLOCK_K), num_n_tiles,
        *x.stride(), *lora_a.stride(), *v.stride(),
        BLOCK_M=tuning.SGMV_BLOCK_M, BLOCK_N=block_n, BLOCK_K=tuning.LORA_BLOCK_K,
        SPLIT_K=split_k, UPCAST=upcast_dot_inputs(),
    )  # fmt: skip
    return v


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    plan: TritonLoraPlan,
    scales: torch.Tensor | None = None,
    slice_offsets: torch.Tensor | Sequence[int] | None = None,
) -> None:
    """In place y[t, cols_i] += v[t, i*R:(i+1)*R] @ lora_b[s, cols_i].T * scales[s] per segment.

    y [T, total_out], v [T, R * num_slices] (from the shrink), lora_b [S, total_out, R],
    scales [S] fp32 on y's device or None, slice_offsets [num_slices + 1] ints or None."""
    if plan.num_segments == 0:
        return
    offsets, max_width = slice_offsets_tensor(slice_offsets, y)
    max_rank = lora_b.shape[2]
    num_n_tiles = triton.cdiv(max_width, tuning.LORA_BLOCK_N)
    num_m_tiles = triton.cdiv(plan.max_segment_len, tuning.SGMV_BLOCK_M)
    grid = (plan.num_segments, num_m_tiles * num_n_tiles, offsets.numel() - 1)
    sgmv_expand_kernel[grid](
        v, lora_b, y, plan.segment_starts, plan.segment_lengths, plan.segment_slots, offsets,
        scales if scales is not None else v, max_rank, num_n_tiles,
        *v.stride(), *lora_b.stride(), *y.stride(),
        BLOCK_M=tuning.SGMV_BLOCK_M, BLOCK_N=tuning.LORA_BLOCK_N, BLOCK_R=next_power_of_2(max_rank),
        HAS_SCALES=scales is not None, UPCAST=upcast_dot_inputs(),
    )  # fmt: skip


