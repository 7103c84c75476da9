"""Per-step metadata for paged attention, built once per step and reused by every layer.

It keeps the raw step tensors (for the Triton kernels and the compiled CPU op) and a CPU plan:
- with the compiled op (`kernels.cpu_ops`): the sequences it attends in place (every decode, and the
  prefills small enough, `tuning.compiled_prefill_max_work`); the larger prefills take the matmul path;
- without it: the decode sequences sorted by context length and cut into a few buckets, each bucket
  one padded block gather with a length mask; each prefill or chunked-prefill sequence with its own
  block gather and causal-offset mask.

Why buckets (measured, 64 decode sequences of 20-150 tokens, 1 thread): one padded batch gathers
~1.9x the needed keys into buffers so large that allocating them dominates; buckets of ~12
sequences cut the step 3-5x against one batch and ~2x against one call per sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import tuning
from kernels import cpu_ops


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Sequences with exactly one new token and similar context lengths, attended in one call."""

    token_rows: torch.Tensor  # [num_seqs] int64, row of each decode token in q
    block_idx: torch.Tensor  # [num_seqs * num_blocks] int64, cache blocks to gather, padding -> 0
    valid_mask: torch.Tensor  # [num_seqs, 1, 1, num_blocks * block_size] bool, key position < seq_len


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One sequence with several new tokens: the last q_len positions of its context."""

    row_start: int
    row_end: int
    seq_len: int  # context length including the new tokens
    block_idx: torch.Tensor  # [ceil(seq_len / block_size)] int64
    future_mask: torch.Tensor  # [q_len, seq_len] bool, True where the key lies after the query


@dataclass(frozen=True, slots=True)
class PagedAttentionMeta:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    block_size: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    decode_seq_idx: torch.Tensor  # [num_decode] int32, sequences with one new token (Triton decode)
    prefill_seq_idx: torch.Tensor  # [num_prefill] int32, sequences with several (Triton prefill)
    max_prefill_query_len: int
    compiled_seqs: torch.Tensor | None  # [n] int64, sequences the compiled CPU op attends, if any
    decode_buckets: tuple[DecodeBucket, ...]  # decodes on CPU without the compiled op
    prefills: tuple[PrefillPlan, ...]  # prefills on CPU not taken by the compiled op

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
    ) -> PagedAttentionMeta:
        """Args: query_start_loc [B+1] (cumulative new tokens per sequence in the flat batch),
        seq_lens [B] (context length including the new tokens), block_tables [B, max_blocks]
        (entries past a sequence's last block are arbitrary), block_size (tokens per block)."""
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
        assert all(0 < q <= n for q, n in zip(q_lens, lens)), "need 0 < q_len <= seq_len per sequence"
        tables_cpu = block_tables.to("cpu", torch.int64)
        decode_seqs = [b for b, q in enumerate(q_lens) if q == 1]
        prefill_seqs = [b for b, q in enumerate(q_lens) if q > 1]
        device = block_tables.device
        compiled = cpu_ops.available_for(block_tables)
        matmul_prefills = prefill_seqs
        compiled_seqs = None
        if compiled:
            max_work = tuning.compiled_prefill_max_work(cpu_ops.cpu_ops().has_avx512())
            matmul_prefills = [b for b in prefill_seqs if q_lens[b] * lens[b] > max_work]
            taken = sorted(set(decode_seqs + prefill_seqs) - set(matmul_prefills))
            compiled_seqs = torch.tensor(taken, dtype=torch.int64) if taken else None
        return cls(
            query_start_loc=query_start_loc.to(device, torch.int32),
            seq_lens=seq_lens.to(device, torch.int32),
            block_tables=block_tables.to(torch.int32).contiguous(),
            block_size=block_size,
            num_tokens=starts[-1],
            max_query_len=max(q_lens, default=0),
            max_seq_len=max(lens, default=0),
            decode_seq_idx=torch.tensor(decode_seqs, dtype=torch.int32, device=device),
            prefill_seq_idx=torch.tensor(prefill_seqs, dtype=torch.int32, device=device),
            max_prefill_query_len=max((q_lens[b] for b in prefill_seqs), default=0),
            compiled_seqs=compiled_seqs,
            decode_buckets=() if compiled else _decode_buckets(decode_seqs, starts, lens, tables_cpu, block_size, device),
            prefills=tuple(
                _prefill_plan(starts[b], starts[b + 1], lens[b], tables_cpu[b], block_size, device)
                for b in matmul_prefills
            ),
        )


def _decode_buckets(
    seqs: list[int],
    starts: list[int],
    lens: list[int],
    tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> tuple[DecodeBucket, ...]:
    by_length = sorted(seqs, key=lambda b: lens[b])
    size = tuning.DECODE_BUCKET_SEQS
    return tuple(
        _decode_bucket(by_length[i : i + size], starts, lens, tables, block_size, device)
        for i in range(0, len(by_length), size)
    )


def _decode_bucket(
    seqs: list[int],
    starts: list[int],
    lens: list[int],
    tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> DecodeBucket:
    ctx = torch.tensor([lens[b] for b in seqs], dtype=torch.int64)  # [num_seqs]
    num_blocks = -(-int(ctx.max()) // block_size)
    blocks = tables[seqs, :num_blocks]  # [num_seqs, num_blocks]
    # Entries past a sequence's last block are arbitrary: point them at block 0 (masked anyway).
    needed = torch.arange(num_blocks) * block_size < ctx[:, None]
    blocks = torch.where(needed, blocks, torch.zeros_like(blocks))
    positions = torch.arange(num_blocks * block_size)
    return DecodeBucket(
        token_rows=torch.tensor([starts[b] for b in seqs], dtype=torch.int64, device=device),
        block_idx=blocks.flatten().to(device),
        valid_mask=(positions[None, :] < ctx[:, None])[:, None, None, :].to(device),
    )


def _prefill_plan(
    start: int, end: int, seq_len: int, table: torch.Tensor, block_size: int, device: torch.device
) -> PrefillPlan:
    q_len = end - start
    num_blocks = -(-seq_len // block_size)
    # New token i sits at position seq_len - q_len + i and sees keys up to that position.
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    future = torch.arange(seq_len)[None, :] > query_pos
    return PrefillPlan(start, end, seq_len, table[:num_blocks].to(device), future.to(device))
