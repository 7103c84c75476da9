"""BGMV: batched gather matrix-vector products, one adapter entry per token (decode-heavy batches),
over `RowPages` (one slice, one module's page pool, per launch).

One program owns one token and, in the shrink, one page of its entry (16 rank rows), in the expand
a tile of output columns, walking the entry's pages. The products are vector-matrix, done as
broadcast-multiply-sum rather than tl.dot (which would pad the single token to 16 rows). Grids are
sized by host-side counts; programs past their entry's rank return at once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.lora.layouts import PAGE_ROWS
from kernels.lora.plans import LoraSlice, TritonLoraPlan
from kernels.triton_utils import k_per_split, next_power_of_2, shrink_buffer


@triton.jit
def bgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, token_idx_ptr, token_entry_ptr, ranks_ptr, page_table_ptr, hidden_in, k_per_split,
    stride_xt, stride_xk, stride_ap, stride_ar, stride_ak, stride_vt, stride_vr, stride_pe,
    BLOCK_K: tl.constexpr, PAGE_ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """v[tok, j] (+)= sum_k x[tok, k] * a[page_table[e, p], j % 16, k] for the rank rows
    j = 16p .. 16p + 15 below rank[e] of this program's page p, over its share of k."""
    token = tl.load(token_idx_ptr + tl.program_id(0))
    entry = tl.load(token_entry_ptr + tl.program_id(0))
    rank = tl.load(ranks_ptr + entry)
    page = tl.program_id(1)
    if page * PAGE_ROWS >= rank:
        return
    page_id = tl.load(page_table_ptr + entry * stride_pe + page).to(tl.int64)
    page_rows = tl.arange(0, PAGE_ROWS)
    rank_mask = page * PAGE_ROWS + page_rows < rank
    k_begin = tl.program_id(2) * k_per_split
    acc = tl.zeros((PAGE_ROWS,), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, hidden_in), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_in
        x_row = tl.load(x_ptr + token * stride_xt + ks * stride_xk, mask=k_mask, other=0.0)
        a_tile = tl.load(a_ptr + page_id * stride_ap + page_rows[:, None] * stride_ar + ks[None, :] * stride_ak,
                         mask=rank_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(a_tile.to(tl.float32) * x_row.to(tl.float32)[None, :], axis=1)
    v_ptrs = v_ptr + token * stride_vt + (page * PAGE_ROWS + page_rows) * stride_vr
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=rank_mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=rank_mask)


@triton.jit
def bgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, token_idx_ptr, token_entry_ptr, ranks_ptr, page_table_ptr, out_features,
    stride_vt, stride_vr, stride_bp, stride_br, stride_bn, stride_yt, stride_yn, stride_pe,
    BLOCK_N: tl.constexpr, PAGE_ROWS: tl.constexpr,
):  # fmt: skip
    """y[tok, n] += sum_{j < rank[e]} v[tok, j] * b[page_table[e, j // 16], j % 16, n], summed in
    float32 and rounded into y once."""
    token = tl.load(token_idx_ptr + tl.program_id(0))
    entry = tl.load(token_entry_ptr + tl.program_id(0))
    rank = tl.load(ranks_ptr + entry)
    if rank == 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    page_rows = tl.arange(0, PAGE_ROWS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for page in range(tl.cdiv(rank, PAGE_ROWS)):
        page_id = tl.load(page_table_ptr + entry * stride_pe + page).to(tl.int64)
        rank_rows = page * PAGE_ROWS + page_rows
        rank_mask = rank_rows < rank
        v_part = tl.load(v_ptr + token * stride_vt + rank_rows * stride_vr, mask=rank_mask, other=0.0)
        b_tile = tl.load(b_ptr + page_id * stride_bp + page_rows[:, None] * stride_br + cols[None, :] * stride_bn,
                         mask=rank_mask[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(b_tile.to(tl.float32) * v_part[:, None], axis=0)  # [BLOCK_N]
    y_ptrs = y_ptr + token * stride_yt + cols * stride_yn
    y_row = tl.load(y_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_row + acc).to(y_ptr.dtype.element_ty), mask=col_mask)


def bgmv_shrink(x: torch.Tensor, piece: LoraSlice, plan: TritonLoraPlan, split_k: int | None = None) -> torch.Tensor:
    """v[t, :r] = x[t] @ A_e.T per token, A_e [r, hidden_in] the rank rows of the token's entry e in
    piece.a's pages. Shapes and the unwritten elements as `sgmv_shrink`."""
    num_tokens, hidden_in = x.shape
    max_pages = plan.max_pages[piece.module]
    split_k = split_k or tuning.split_k_for(hidden_in)
    v = shrink_buffer(num_tokens, max_pages * PAGE_ROWS, split_k, x.device)
    if plan.num_active_tokens == 0 or max_pages == 0:
        return v
    assert piece.a.shape[1:] == (PAGE_ROWS, hidden_in), "pages of RowPages for this x"
    page_table = plan.page_tables[piece.module]
    bgmv_shrink_kernel[(plan.num_active_tokens, max_pages, split_k)](
        x, piece.a, v, plan.active_token_idx, plan.active_token_entries, plan.ranks[piece.module], page_table,
        hidden_in, k_per_split(hidden_in, split_k, tuning.LORA_BLOCK_K),
        *x.stride(), *piece.a.stride(), *v.stride(), page_table.stride(0),
        BLOCK_K=tuning.LORA_BLOCK_K, PAGE_ROWS=PAGE_ROWS, SPLIT_K=split_k,
    )  # fmt: skip
    return v


def bgmv_expand(y: torch.Tensor, v: torch.Tensor, piece: LoraSlice, plan: TritonLoraPlan) -> None:
    """In place y[t, piece.start:piece.end] += v[t, :r] @ B_e.T per token; shapes as `sgmv_expand`."""
    max_pages = plan.max_pages[piece.module]
    if plan.num_active_tokens == 0 or max_pages == 0:
        return
    out_features = piece.end - piece.start
    assert piece.b.shape[1:] == (PAGE_ROWS, out_features), "pages of RowPages for this slice"
    y_slice = y[:, piece.start : piece.end]
    page_table = plan.page_tables[piece.module]
    block_n = min(tuning.LORA_BLOCK_N, next_power_of_2(out_features))
    bgmv_expand_kernel[(plan.num_active_tokens, triton.cdiv(out_features, block_n))](
        v, piece.b, y_slice, plan.active_token_idx, plan.active_token_entries, plan.ranks[piece.module], page_table,
        out_features, *v.stride(), *piece.b.stride(), *y_slice.stride(), page_table.stride(0),
        BLOCK_N=block_n, PAGE_ROWS=PAGE_ROWS,
    )  # fmt: skip
