"""Fast PyTorch paths of the KV-cache write and paged attention, used on CPU.

Decode rows of all sequences go through one padded block gather and one attention call: the query
heads that share a KV head are laid along the query-length axis ([num_decode, kv_heads, group, D]),
so the KV heads are never repeated. Prefill sequences take one call each with a causal mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.meta import DecodePlan, PagedAttentionMeta, PrefillPlan


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache.view(-1, H, D)[slot_mapping[t]] = k[t] for slot_mapping[t] >= 0 (and likewise v)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMeta,
    scale: float,
) -> torch.Tensor:
    """q [T, num_heads, D], caches [num_blocks, block_size, num_kv_heads, D] -> out [T, num_heads, D]."""
    out = torch.empty_like(q)
    if meta.decode is not None:
        _decode(q, k_cache, v_cache, meta.decode, scale, out)
    for plan in meta.prefills:
        _prefill(q, k_cache, v_cache, plan, scale, out)
    return out


def _gather(cache: torch.Tensor, block_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Cache blocks -> [num_seqs, kv_heads, num_blocks * block_size, D] (a strided view of a copy)."""
    blocks = cache.index_select(0, block_idx)  # [num_seqs * num_blocks, block_size, kv_heads, D]
    return blocks.view(num_seqs, -1, *cache.shape[-2:]).transpose(1, 2)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_decode = plan.token_rows.numel()
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    rows = slice(*plan.row_range) if plan.row_range else plan.token_rows
    # [num_decode, kv_heads, group, D]: head h reads kv head h // group.
    q_rows = q[rows].view(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = _gather(k_cache, plan.block_idx, num_decode)
    values = _gather(v_cache, plan.block_idx, num_decode)
    attended = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=plan.valid_mask, scale=scale)
    out[rows] = attended.reshape(num_decode, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    keys = _gather(k_cache, plan.block_idx, 1)[0, :, : plan.seq_len]  # [kv_heads, seq_len, D]
    values = _gather(v_cache, plan.block_idx, 1)[0, :, : plan.seq_len]
    q_rows = q[plan.row_start : plan.row_end].transpose(0, 1)  # [num_heads, q_len, D]
    attended = F.scaled_dot_product_attention(
        q_rows,
        keys,
        values,
        attn_mask=plan.causal_mask,
        is_causal=plan.causal_mask is None,
        scale=scale,
        enable_gqa=True,
    )
    out[plan.row_start : plan.row_end] = attended.transpose(0, 1)
