"""SGMV: segmented gather matrix-vector products for runs of tokens sharing an adapter entry, over
`RowPages` (one slice, one module's page pool, per launch).

One program owns a tile of SGMV_BLOCK_M tokens of one segment, so prefill-sized runs become real
matmuls against their entry's pages. The shrink gives each page of the entry (16 rank rows) its own
program and can split its wide reduction across programs; the expand walks the entry's pages. Both
grids are sized by host-side maxima (longest segment, most pages of any entry); programs past their
segment or past their entry's rank return after reading it, so an entry of rank 0 costs no page loads.
tl.dot runs with input_precision="ieee": exact float32 products for float32 pages (tf32 would round
them to 10 mantissa bits); 16-bit tiles take the tensor cores either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.lora.layouts import PAGE_ROWS
from kernels.lora.plans import LoraSlice, TritonLoraPlan
from kernels.triton_utils import k_per_split, next_power_of_2, shrink_buffer, upcast_dot_inputs


@triton.jit
def sgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, seg_start_ptr, seg_len_ptr, seg_entry_ptr, ranks_ptr, page_table_ptr,
    hidden_in, k_per_split, max_pages,
    stride_xt, stride_xk, stride_ap, stride_ar, stride_ak, stride_vt, stride_vr, stride_pe,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PAGE_ROWS: tl.constexpr,
    SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """v[tok, j] (+)= sum_k x[tok, k] * a[page_table[e, p], j % 16, k] for the rank rows
    j = 16p .. 16p + 15 below rank[e] of this program's page p, over its share of k."""
    seg = tl.program_id(0)
    m_tile = tl.program_id(1) // max_pages
    page = tl.program_id(1) % max_pages
    seg_len = tl.load(seg_len_ptr + seg)
    entry = tl.load(seg_entry_ptr + seg)
    rank = tl.load(ranks_ptr + entry)
    if m_tile * BLOCK_M >= seg_len or page * PAGE_ROWS >= rank:
        return
    page_id = tl.load(page_table_ptr + entry * stride_pe + page).to(tl.int64)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(seg_start_ptr + seg) + rows
    row_mask = rows < seg_len
    page_rows = tl.arange(0, PAGE_ROWS)
    rank_mask = page * PAGE_ROWS + page_rows < rank
    k_begin = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_M, PAGE_ROWS), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, hidden_in), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_in
        x_tile = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk,
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        a_tile = tl.load(a_ptr + page_id * stride_ap + page_rows[None, :] * stride_ar + ks[:, None] * stride_ak,
                         mask=k_mask[:, None] & rank_mask[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        acc = tl.dot(x_tile, a_tile, acc=acc, input_precision="ieee")  # [BLOCK_M, PAGE_ROWS]
    v_ptrs = v_ptr + tokens[:, None] * stride_vt + (page * PAGE_ROWS + page_rows)[None, :] * stride_vr
    out_mask = row_mask[:, None] & rank_mask[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=out_mask)


@triton.jit
def sgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_entry_ptr, ranks_ptr, page_table_ptr, out_features,
    stride_vt, stride_vr, stride_bp, stride_br, stride_bn, stride_yt, stride_yn, stride_pe,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_ROWS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """y[tok, n] += sum_{j < rank[e]} v[tok, j] * b[page_table[e, j // 16], j % 16, n], summed in
    float32 and rounded into y once."""
    seg = tl.program_id(0)
    m_tile = tl.program_id(1)
    seg_len = tl.load(seg_len_ptr + seg)
    entry = tl.load(seg_entry_ptr + seg)
    rank = tl.load(ranks_ptr + entry)
    if m_tile * BLOCK_M >= seg_len or rank == 0:
        return
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(seg_start_ptr + seg) + rows
    row_mask = rows < seg_len
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    page_rows = tl.arange(0, PAGE_ROWS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for page in range(tl.cdiv(rank, PAGE_ROWS)):
        page_id = tl.load(page_table_ptr + entry * stride_pe + page).to(tl.int64)
        rank_rows = page * PAGE_ROWS + page_rows
        rank_mask = rank_rows < rank
        v_tile = tl.load(v_ptr + tokens[:, None] * stride_vt + rank_rows[None, :] * stride_vr,
                         mask=row_mask[:, None] & rank_mask[None, :], other=0.0)  # fmt: skip
        b_tile = tl.load(b_ptr + page_id * stride_bp + page_rows[:, None] * stride_br + cols[None, :] * stride_bn,
                         mask=rank_mask[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            b_tile = b_tile.to(tl.float32)
        acc = tl.dot(v_tile.to(b_tile.dtype), b_tile, acc=acc, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :] * stride_yn
    out_mask = row_mask[:, None] & col_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_tile + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def sgmv_shrink(x: torch.Tensor, piece: LoraSlice, plan: TritonLoraPlan, split_k: int | None = None) -> torch.Tensor:
    """v[t, :r] = x[t] @ A_e.T per segment, A_e [r, hidden_in] the rank rows of the segment's entry e
    in piece.a's pages. x [T, hidden_in] -> v [T, 16 * max_pages] float32; elements past each
    token's rank, and rows of tokens without an entry, are never read by the expand and left
    unwritten. `split_k` None = by hidden_in."""
    num_tokens, hidden_in = x.shape
    max_pages = plan.max_pages[piece.module]
    split_k = split_k or tuning.split_k_for(hidden_in)
    v = shrink_buffer(num_tokens, max_pages * PAGE_ROWS, split_k, x.device)
    if plan.num_segments == 0 or max_pages == 0:
        return v
    assert piece.a.shape[1:] == (PAGE_ROWS, hidden_in), "pages of RowPages for this x"
    page_table = plan.page_tables[piece.module]
    num_m_tiles = triton.cdiv(plan.max_segment_len, tuning.SGMV_BLOCK_M)
    grid = (plan.num_segments, num_m_tiles * max_pages, split_k)
    sgmv_shrink_kernel[grid](
        x, piece.a, v, plan.segment_starts, plan.segment_lengths, plan.segment_entries,
        plan.ranks[piece.module], page_table,
        hidden_in, k_per_split(hidden_in, split_k, tuning.LORA_BLOCK_K), max_pages,
        *x.stride(), *piece.a.stride(), *v.stride(), page_table.stride(0),
        BLOCK_M=tuning.SGMV_BLOCK_M, BLOCK_K=tuning.LORA_BLOCK_K, PAGE_ROWS=PAGE_ROWS,
        SPLIT_K=split_k, UPCAST=upcast_dot_inputs() or x.dtype != piece.a.dtype,
    )  # fmt: skip
    return v


def sgmv_expand(y: torch.Tensor, v: torch.Tensor, piece: LoraSlice, plan: TritonLoraPlan) -> None:
    """In place y[t, piece.start:piece.end] += v[t, :r] @ B_e.T per segment, B_e [end - start, r] of
    the segment's entry e in piece.b's pages. y [T, total_out], v [T, 16 * max_pages] from the shrink."""
    max_pages = plan.max_pages[piece.module]
    if plan.num_segments == 0 or max_pages == 0:
        return
    out_features = piece.end - piece.start
    assert piece.b.shape[1:] == (PAGE_ROWS, out_features), "pages of RowPages for this slice"
    y_slice = y[:, piece.start : piece.end]
    page_table = plan.page_tables[piece.module]
    block_n = min(tuning.LORA_BLOCK_N, next_power_of_2(out_features))
    num_m_tiles = triton.cdiv(plan.max_segment_len, tuning.SGMV_BLOCK_M)
    grid = (plan.num_segments, num_m_tiles, triton.cdiv(out_features, block_n))
    sgmv_expand_kernel[grid](
        v, piece.b, y_slice, plan.segment_starts, plan.segment_lengths, plan.segment_entries,
        plan.ranks[piece.module], page_table, out_features,
        *v.stride(), *piece.b.stride(), *y_slice.stride(), page_table.stride(0),
        BLOCK_M=tuning.SGMV_BLOCK_M, BLOCK_N=block_n, PAGE_ROWS=PAGE_ROWS, UPCAST=upcast_dot_inputs(),
    )  # fmt: skip
