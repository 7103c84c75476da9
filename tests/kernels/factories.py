"""Small builders of random kernel inputs shared by the kernel tests."""
from __future__ import annotations

import torch

from kernels import StepSequences


def scattered_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepSequences]:
    """Random q and caches whose sequences own randomly scattered blocks; the block tables of some
    sequences run past their last block with garbage ids (never to be read).
    Returns (q [T, H, D], k_cache, v_cache, the step's sequences)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables, used = [], 0
    for b, count in enumerate(blocks_per_seq):
        garbage = torch.randint(0, 10**6, (b % 3,), generator=generator).tolist()
        tables.append(order[used : used + count].tolist() + garbage)
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    query_start = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    return q, k_cache, v_cache, StepSequences(query_start, list(seq_lens), tables, block_size)


def dense_causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Independent oracle: torch SDPA in fp64 with repeated KV heads. q [q_len, H, D] are the last
    q_len positions of keys/values [seq_len, H_kv, D]."""
    q_len, seq_len = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), keys, values, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def lora_weights(
    num_slots: int,
    ranks: list[int],
    max_rank: int,
    hidden_in: int,
    slice_widths: list[int],
    dtype: torch.dtype,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked lora_a [S, max_rank * num_slices, hidden_in], lora_b [S, total_out, max_rank] with slot
    s's rank ranks[s] and the padding beyond it zero (as the adapter pool stores them; lora_b is
    stored [S, max_rank, total_out] and returned as that storage's [S, total_out, max_rank] view, the
    pool's layout, which every backend takes)."""
    num_slices = len(slice_widths)
    lora_a = torch.zeros(num_slots, max_rank * num_slices, hidden_in)
    lora_b = torch.zeros(num_slots, sum(slice_widths), max_rank)
    for slot, rank in enumerate(ranks):
        for i in range(num_slices):
            rows = slice(i * max_rank, i * max_rank + rank)
            lora_a[slot, rows] = torch.randn(rank, hidden_in, generator=generator) / hidden_in**0.5
        lora_b[slot, :, :rank] = torch.randn(sum(slice_widths), rank, generator=generator) / rank**0.5
    return lora_a.to(dtype), lora_b.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)


def popularity_slots(pattern: str, num_tokens: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """Per-token slot for an adapter popularity pattern (Punica's), with -1 = no adapter."""
    if pattern == "distinct":
        slots = torch.arange(num_tokens) % num_slots
    elif pattern == "identical":
        slots = torch.zeros(num_tokens, dtype=torch.int64)
    elif pattern == "uniform":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=generator)
    elif pattern == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64)
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=generator)
    elif pattern == "skewed":
        slots = torch.where(torch.rand(num_tokens, generator=generator) < 0.8, 0, num_slots - 1)
    else:
        raise ValueError(pattern)
    return slots.to(torch.int64)
