"""The PyTorch paths of the KV-cache write and paged attention (the PyTorch backend; the compiled CPU
backend takes `attend_prefill` for the prefills too long for its own op).

Decode rows go through one padded block gather and one attention call per length bucket (see
`kernels.attention.plans`): the query heads that share a KV head are laid along the query-length
axis ([num_seqs, kv_heads, group, D]), so KV heads are never repeated. Prefill sequences take one
call each (or a few, by query chunks) of plain matmuls with a causal mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import tuning
from kernels.attention.plans import DecodeBucket, PrefillPlan, TorchAttentionPlan


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
    plan: TorchAttentionPlan,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, num_heads, D], caches [num_blocks, block_size, num_kv_heads, D] -> out [T, num_heads, D];
    `window` and `softcap` as in `kernels.reference.paged_attention`."""
    out = torch.empty_like(q)
    for bucket in plan.decode_buckets:
        _decode(q, k_cache, v_cache, bucket, scale, out, window, softcap)
    for prefill in plan.prefills:
        attend_prefill(q, k_cache, v_cache, prefill, scale, out, window, softcap)
    return out


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap of attention scores, c * tanh(s / c), in place."""
    return scores if softcap is None else scores.div_(softcap).tanh_().mul_(softcap)


def _gather(cache: torch.Tensor, block_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Cache blocks -> [num_seqs, kv_heads, num_blocks * block_size, D] (a strided view of a copy)."""
    blocks = cache.index_select(0, block_idx)  # [num_seqs * num_blocks, block_size, kv_heads, D]
    return blocks.view(num_seqs, -1, *cache.shape[-2:]).transpose(1, 2)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
    out: torch.Tensor,
    window: int | None,
    softcap: float | None,
) -> None:
    num_seqs = bucket.token_rows.numel()
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    # [num_seqs, kv_heads, group, D]: head h reads kv head h // group.
    q_rows = q.index_select(0, bucket.token_rows).view(num_seqs, num_kv_heads, -1, head_dim)
    keys = _gather(k_cache, bucket.block_idx, num_seqs)
    values = _gather(v_cache, bucket.block_idx, num_seqs)
    mask = bucket.mask(window)
    if softcap is None:
        attended = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)
    else:  # SDPA has no soft cap: the same product, capped, by plain matmuls
        scores = _capped(torch.matmul(q_rows, keys.transpose(-1, -2)).mul_(scale), softcap)
        attended = torch.matmul(scores.masked_fill_(~mask, float("-inf")).softmax(-1), values)
    out.index_copy_(0, bucket.token_rows, attended.view(num_seqs, num_heads, head_dim))


def attend_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Plain grouped matmul-softmax-matmul, by chunks of queries so the scores stay small; each
    chunk only reads the keys up to its last position. Measured 3-4x faster than SDPA's causal CPU
    kernel here (256 new tokens, 9/3 heads: fp32 4.6 vs 17.8 ms, bf16 2.9 vs 6.7 ms)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    keys = _gather(k_cache, plan.block_idx, 1)[0]  # [kv_heads, num_blocks * block_size, D]
    values = _gather(v_cache, plan.block_idx, 1)[0]
    q_len = plan.row_end - plan.row_start
    hidden = plan.hidden_mask(window)
    for first in range(0, q_len, tuning.PREFILL_QUERY_CHUNK):
        last = min(first + tuning.PREFILL_QUERY_CHUNK, q_len)
        num_keys = plan.seq_len - q_len + last  # the chunk's last query sees keys [0, num_keys)
        rows = q[plan.row_start + first : plan.row_start + last]  # [chunk, heads, D]
        # [kv_heads, group * chunk, D]: the heads sharing a KV head share one matmul.
        grouped = rows.view(last - first, num_kv_heads, -1, head_dim).permute(1, 2, 0, 3)
        grouped = grouped.reshape(num_kv_heads, -1, head_dim)
        scores = _capped(torch.matmul(grouped, keys[:, :num_keys].transpose(1, 2)).mul_(scale), softcap)
        scores = scores.view(num_kv_heads, -1, last - first, num_keys)  # [kv_heads, group, chunk, keys]
        scores.masked_fill_(hidden[first:last, :num_keys], float("-inf"))
        probs = scores.softmax(-1).view(num_kv_heads, -1, num_keys)
        attended = torch.matmul(probs, values[:, :num_keys])  # [kv_heads, group * chunk, D]
        attended = attended.view(num_kv_heads, -1, last - first, head_dim).permute(2, 0, 1, 3)
        out[plan.row_start + first : plan.row_start + last] = attended.reshape(last - first, -1, head_dim)
