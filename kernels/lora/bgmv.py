"""BGMV: batched gather matrix-vector products, one adapter slot per token (decode-heavy batches).

One program owns one token and a tile of output columns; the products are vector-matrix, done as
broadcast-multiply-sum rather than tl.dot (which would pad the single token to 16 rows)."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.lora.plans import TritonLoraPlan
from kernels.triton_utils import k_per_split, next_power_of_2, slice_offsets_tensor


@triton.jit
def bgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, token_idx_ptr, token_slot_ptr,
    hidden_in, rank_total, k_per_split,
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_vt, stride_vn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """v[tok, n] (+)= sum_k x[tok, k] * a[slot, n, k] over this program's share of k."""
    token = tl.load(token_idx_ptr + tl.program_id(0))
    slot = tl.load(token_slot_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < rank_total
    k_begin = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, hidden_in), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_in
        x_row = tl.load(x_ptr + token * stride_xt + ks * stride_xk, mask=k_mask, other=0.0)
        a_tile = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_an + ks[None, :] * stride_ak,
                         mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(a_tile.to(tl.float32) * x_row.to(tl.float32)[None, :], axis=1)
    v_ptrs = v_ptr + token * stride_vt + cols * stride_vn
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=col_mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=col_mask)


@triton.jit
def bgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, token_idx_ptr, token_slot_ptr, offsets_ptr, scales_ptr, max_rank,
    stride_vt, stride_vn, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SCALES: tl.constexpr,
):  # fmt: skip
    """y[tok, cols_i] += b[slot, cols_i, :] @ v[tok, i*R:(i+1)*R] * scale[slot] for slice i."""
    token = tl.load(token_idx_ptr + tl.program_id(0))
    slot = tl.load(token_slot_ptr + tl.program_id(0))
    part = tl.program_id(2)
    col_begin = tl.load(offsets_ptr + part)
    col_end = tl.load(offsets_ptr + part + 1)
    if col_begin + tl.program_id(1) * BLOCK_N >= col_end:
        return
    cols = col_begin + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < col_end
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < max_rank
    v_row = tl.load(v_ptr + token * stride_vt + (part * max_rank + ranks) * stride_vn, mask=rank_mask, other=0.0)
    b_tile = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :] * stride_br,
                     mask=col_mask[:, None] & rank_mask[None, :], other=0.0)  # fmt: skip
    acc = tl.sum(b_tile.to(tl.float32) * v_row.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
    if HAS_SCALES:
        acc *= tl.load(scales_ptr + slot)
    y_ptrs = y_ptr + token * stride_yt + cols * stride_yn
    y_row = tl.load(y_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_row + acc).to(y_ptr.dtype.element_ty), mask=col_mask)


def bgmv_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, plan: TritonLoraPlan, split_k: int | None = None
) -> torch.Tensor:
    """v[t] = x[t] @ lora_a[s].T per token: x [T, hidden_in], lora_a [S, R_total, hidden_in] ->
    v [T, R_total] fp32, zero on tokens without an adapter. `split_k` None = by hidden_in."""
    num_tokens, hidden_in = x.shape
    rank_total = lora_a.shape[1]
    v = torch.zeros(num_tokens, rank_total, dtype=torch.float32, device=x.device)
    if plan.num_active_tokens == 0:
        return v
    split_k = split_k or tuning.split_k_for(hidden_in)
    block_n = min(tuning.LORA_BLOCK_N, next_power_of_2(rank_total))
    grid = (plan.num_active_tokens, triton.cdiv(rank_total, block_n), split_k)
    bgmv_shrink_kernel[grid](
        x, lora_a, v, plan.active_token_idx, plan.active_token_slots,
        hidden_in, rank_total, k_per_split(hidden_in, split_k, tuning.LORA_BLOCK_K),
        *x.stride(), *lora_a.stride(), *v.stride(),
        BLOCK_N=block_n, BLOCK_K=tuning.LORA_BLOCK_K, SPLIT_K=split_k,
    )  # fmt: skip
    return v


def bgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    lora_b: torch.Tensor,
    plan: TritonLoraPlan,
    scales: torch.Tensor | None = None,
    slice_offsets: torch.Tensor | Sequence[int] | None = None,
) -> None:
    """In place y[t, cols_i] += v[t, i*R:(i+1)*R] @ lora_b[s, cols_i].T * scales[s] per token.

    Shapes as `sgmv_expand`."""
    if plan.num_active_tokens == 0:
        return
    offsets, max_width = slice_offsets_tensor(slice_offsets, y)
    max_rank = lora_b.shape[2]
    grid = (plan.num_active_tokens, triton.cdiv(max_width, tuning.LORA_BLOCK_N), offsets.numel() - 1)
    bgmv_expand_kernel[grid](
        v, lora_b, y, plan.active_token_idx, plan.active_token_slots, offsets,
        scales if scales is not None else v, max_rank,
        *v.stride(), *lora_b.stride(), *y.stride(),
        BLOCK_N=tuning.LORA_BLOCK_N, BLOCK_R=next_power_of_2(max_rank), HAS_SCALES=scales is not None,
    )  # fmt: skip
