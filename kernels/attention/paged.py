"""Triton paged attention over block tables, with grouped-query heads.

- decode (one new token): one program per (sequence, KV head, context split) handles all the query
  heads of the group at once, so each cached key is read once per group; long contexts are split
  across programs (flash-decoding) and a second kernel merges the partial softmaxes.
- prefill / chunked prefill: one program per (sequence, tile of new tokens, query head) walks the
  cached blocks up to its causal limit with an online softmax.
- a sliding window (`window` > 0) starts each walk at the block of the first key any of the program's
  tokens sees, and masks the older keys of that block; a soft cap (HAS_SOFTCAP) turns each score s
  into softcap * tanh(s / softcap) before the softmax (Gemma 2).
Keys are tiled one cache block at a time, so block_size must be a power of two (>= 16 on GPU)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_block(
    q, k_cache_ptr, v_cache_ptr, block, k_head_offset, v_head_offset, stride_kb, stride_ko, stride_vb, stride_vo,
    key_mask, visible, row_max, row_sum, acc, scale, softcap,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of queries q [rows, BLOCK_D] over one cache block: `key_mask`
    [BLOCK_SIZE] says which slots of the block hold keys, `visible` [rows, BLOCK_SIZE] which keys
    each query may see. Returns the updated (row_max, row_sum, acc)."""
    offsets = tl.arange(0, BLOCK_SIZE)
    dims = tl.arange(0, BLOCK_D)
    tile_mask = key_mask[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + block * stride_kb + offsets[:, None] * stride_ko + k_head_offset + dims[None, :],
                mask=tile_mask, other=0.0)  # fmt: skip
    v = tl.load(v_cache_ptr + block * stride_vb + offsets[:, None] * stride_vo + v_head_offset + dims[None, :],
                mask=tile_mask, other=0.0)  # fmt: skip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # "ieee": exact float32 products for a float32 cache (tf32, Triton's default on GPU, keeps 10
    # mantissa bits); 16-bit tiles take the tensor cores either way.
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale  # [rows, BLOCK_SIZE]
    if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates to +-1 without overflow trouble
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    probs = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
    return new_max, row_sum, acc


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, decode_seq_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, scale, softcap, window, tokens_per_split,
    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.load(decode_seq_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    group_idx = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group_idx
    head_mask = group_idx < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    first_key = 0  # the window's first key; the blocks before its block are not read
    if window > 0:
        first_key = tl.maximum(seq_len - window, 0)
        start = tl.maximum(start, first_key // BLOCK_SIZE * BLOCK_SIZE)
    offsets = tl.arange(0, BLOCK_SIZE)
    row_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for pos0 in range(start, end, BLOCK_SIZE):
        block = tl.load(block_tables_ptr + seq * stride_bt + pos0 // BLOCK_SIZE).to(tl.int64)
        key_mask = (pos0 + offsets < end) & (pos0 + offsets >= first_key)
        row_max, row_sum, acc = _attend_block(
            q, k_cache_ptr, v_cache_ptr, block, kv_head * stride_kh, kv_head * stride_vh,
            stride_kb, stride_ko, stride_vb, stride_vo,
            key_mask, key_mask[None, :], row_max, row_sum, acc, scale, softcap, BLOCK_SIZE, BLOCK_D, HEAD_DIM, UPCAST,
            HAS_SOFTCAP,
        )  # fmt: skip
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / row_sum[:, None]
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip
    else:
        # Unnormalised partial: the merge rescales each split by exp(its max - global max).
        tl.store(part_out_ptr + token * stride_pt + heads[:, None] * stride_ph + split * stride_ps + dims[None, :],
                 acc, mask=out_mask)  # fmt: skip
        stats = token * stride_mt + heads * stride_mh + split
        tl.store(part_max_ptr + stats, row_max, mask=head_mask)
        tl.store(part_sum_ptr + stats, row_sum, mask=head_mask)


@triton.jit
def paged_decode_merge_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_ptr, decode_seq_ptr,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """out = sum_s exp(m_s - M) * acc_s / sum_s exp(m_s - M) * l_s over the splits of one head."""
    token = tl.load(query_start_ptr + tl.load(decode_seq_ptr + tl.program_id(0))).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    stats = token * stride_mt + head * stride_mh + splits
    split_max = tl.load(part_max_ptr + stats)
    weights = tl.exp(split_max - tl.max(split_max, axis=0))  # empty splits: exp(-inf) = 0
    total = tl.sum(weights * tl.load(part_sum_ptr + stats), axis=0)
    parts = tl.load(part_out_ptr + token * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
                    mask=dim_mask[None, :], other=0.0)  # fmt: skip
    out = tl.sum(parts * weights[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, prefill_seq_ptr,
    out_ptr, scale, softcap, window,
    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.load(prefill_seq_ptr + tl.program_id(0))
    first_token = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - first_token
    if tl.program_id(1) * BLOCK_M >= q_len:
        return
    head = tl.program_id(2)
    kv_head = head // GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    tokens = (first_token + rows).to(tl.int64)
    query_pos = seq_len - q_len + rows  # causal limit of each new token
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    # A finite start, not -inf: with a window, a row may meet whole blocks it does not see before its
    # first key, and exp(-inf - -inf) would be NaN; exp(-inf - -1e30) is 0.
    row_max = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_end = tl.minimum(seq_len, seq_len - q_len + (tl.program_id(1) + 1) * BLOCK_M)
    key_start = 0
    if window > 0:  # the tile's first token sees the oldest key of any of its tokens
        key_start = tl.maximum(seq_len - q_len + tl.program_id(1) * BLOCK_M - window + 1, 0) // BLOCK_SIZE * BLOCK_SIZE
    for pos0 in range(key_start, key_end, BLOCK_SIZE):
        block = tl.load(block_tables_ptr + seq * stride_bt + pos0 // BLOCK_SIZE).to(tl.int64)
        key_pos = pos0 + offsets
        visible = key_pos[None, :] <= query_pos[:, None]
        if window > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        row_max, row_sum, acc = _attend_block(
            q, k_cache_ptr, v_cache_ptr, block, kv_head * stride_kh, kv_head * stride_vh,
            stride_kb, stride_ko, stride_vb, stride_vo,
            key_pos < seq_len, visible, row_max, row_sum, acc, scale, softcap,
            BLOCK_SIZE, BLOCK_D, HEAD_DIM, UPCAST, HAS_SOFTCAP,
        )  # fmt: skip
    out = acc / row_sum[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])  # fmt: skip


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t] (and v) for slot = slot_mapping[t] >= 0."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads[:, None] * stride_kch + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads[:, None] * stride_vch + dims[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
