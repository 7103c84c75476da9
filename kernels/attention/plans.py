"""Per-step plans of paged attention, one kind per backend, each built once per step from the step's
sequences (query starts, context lengths, block tables) and reused by every layer.

- Triton: the step's tensors on the device, and which sequences decode (one new token) or prefill.
- Compiled CPU op: the sequences it attends in place (every decode, and the prefills small enough,
  `tuning.compiled_prefill_max_work`); the larger prefills take the matmul path of the PyTorch plan.
- PyTorch: the decode sequences sorted by context length and cut into a few buckets, each bucket one
  padded block gather with a length mask; each prefill (or prefill chunk) with its own block gather
  and causal-offset mask.

Why buckets (measured, 64 decode sequences of 20-150 tokens, 1 thread): one padded batch gathers
~1.9x the needed keys into buffers so large that allocating them dominates; buckets of ~12
sequences cut the step 3-5x against one batch and ~2x against one call per sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import tuning


@dataclass(frozen=True, slots=True)
class StepSequences:
    """The step's sequences as the model runner knows them (host ints)."""

    query_start: list[int]  # [B + 1] cumulative new-token counts in the flat batch
    seq_lens: list[int]  # [B] context length including the new tokens
    block_tables: list[list[int]]  # [B][blocks of the sequence]
    block_size: int

    def __post_init__(self) -> None:
        assert all(0 < q <= n for q, n in zip(self.query_lens, self.seq_lens)), "need 0 < q_len <= seq_len"

    @property
    def query_lens(self) -> list[int]:
        return [end - start for start, end in zip(self.query_start[:-1], self.query_start[1:])]

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def padded_tables(self) -> torch.Tensor:
        """[B, max_blocks] int32 on CPU; entries past a sequence's last block are 0 (never read)."""
        width = max((len(table) for table in self.block_tables), default=0)
        return torch.tensor([_padded(table, width) for table in self.block_tables], dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Sequences with exactly one new token and similar context lengths, attended in one call."""

    token_rows: torch.Tensor  # [num_seqs] int64, row of each decode token in q
    block_idx: torch.Tensor  # [num_seqs * num_blocks] int64, cache blocks to gather, padding -> 0
    valid_mask: torch.Tensor  # [num_seqs, 1, 1, num_blocks * block_size] bool, key position < seq_len
    seq_lens: torch.Tensor  # [num_seqs, 1, 1, 1] int64, for the masks of sliding windows

    def mask(self, window: int | None) -> torch.Tensor:
        """The keys each sequence's token sees: its context, or only its last `window` positions."""
        if window is None:
            return self.valid_mask
        positions = torch.arange(self.valid_mask.shape[-1])
        return self.valid_mask & (positions >= self.seq_lens - window)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One sequence with several new tokens: the last q_len positions of its context."""

    row_start: int
    row_end: int
    seq_len: int  # context length including the new tokens
    block_idx: torch.Tensor  # [ceil(seq_len / block_size)] int64
    future_mask: torch.Tensor  # [q_len, seq_len] bool, True where the key lies after the query

    def hidden_mask(self, window: int | None) -> torch.Tensor:
        """[q_len, seq_len] bool, True where the query does not see the key: the future, and with a
        sliding `window`, keys `window` or more positions before the query."""
        if window is None:
            return self.future_mask
        q_len = self.row_end - self.row_start
        query_pos = torch.arange(self.seq_len - q_len, self.seq_len)[:, None]
        return self.future_mask | (torch.arange(self.seq_len)[None, :] <= query_pos - window)


@dataclass(frozen=True, slots=True)
class TorchAttentionPlan:
    decode_buckets: tuple[DecodeBucket, ...]
    prefills: tuple[PrefillPlan, ...]

    @classmethod
    def build(cls, step: StepSequences) -> TorchAttentionPlan:
        q_lens = step.query_lens
        decodes = [b for b, q in enumerate(q_lens) if q == 1]
        prefills = [b for b, q in enumerate(q_lens) if q > 1]
        return cls(_decode_buckets(step, decodes), _prefill_plans(step, prefills))


@dataclass(frozen=True, slots=True)
class CompiledAttentionPlan:
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start: torch.Tensor  # [B + 1] int32
    compiled_seqs: torch.Tensor | None  # [n] int64, the sequences the compiled op attends
    prefills: tuple[PrefillPlan, ...]  # the longer prefills, by matmuls
    blocks_read: torch.Tensor  # [m] int64, the cache blocks the compiled op reads, sequence by sequence

    @classmethod
    def build(cls, step: StepSequences, has_vector_attention: bool) -> CompiledAttentionPlan:
        max_work = tuning.compiled_prefill_max_work(has_vector_attention)
        by_matmul = [b for b, (q, n) in enumerate(zip(step.query_lens, step.seq_lens)) if q > 1 and q * n > max_work]
        compiled = sorted(set(range(len(step.seq_lens))) - set(by_matmul))
        return cls(
            block_tables=step.padded_tables(),
            seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32),
            query_start=torch.tensor(step.query_start, dtype=torch.int32),
            compiled_seqs=torch.tensor(compiled, dtype=torch.int64) if compiled else None,
            prefills=_prefill_plans(step, by_matmul),
            blocks_read=torch.tensor([block for b in compiled
                                      for block in step.block_tables[b][: -(-step.seq_lens[b] // step.block_size)]],
                                     dtype=torch.int64),
        )


@dataclass(frozen=True, slots=True)
class TritonAttentionPlan:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    max_seq_len: int
    decode_seq_idx: torch.Tensor  # [num_decode] int32, sequences with one new token
    prefill_seq_idx: torch.Tensor  # [num_prefill] int32, sequences with several
    max_prefill_query_len: int

    @classmethod
    def build(cls, step: StepSequences, device: torch.device) -> TritonAttentionPlan:
        q_lens = step.query_lens
        prefills = [b for b, q in enumerate(q_lens) if q > 1]

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            query_start_loc=column(step.query_start),
            seq_lens=column(step.seq_lens),
            block_tables=step.padded_tables().to(device),
            block_size=step.block_size,
            max_seq_len=max(step.seq_lens, default=0),
            decode_seq_idx=column([b for b, q in enumerate(q_lens) if q == 1]),
            prefill_seq_idx=column(prefills),
            max_prefill_query_len=max((q_lens[b] for b in prefills), default=0),
        )


def _decode_buckets(step: StepSequences, seqs: list[int]) -> tuple[DecodeBucket, ...]:
    by_length = sorted(seqs, key=lambda b: step.seq_lens[b])
    size = tuning.DECODE_BUCKET_SEQS
    return tuple(_decode_bucket(step, by_length[i : i + size]) for i in range(0, len(by_length), size))


def _decode_bucket(step: StepSequences, seqs: list[int]) -> DecodeBucket:
    ctx = torch.tensor([step.seq_lens[b] for b in seqs], dtype=torch.int64)  # [num_seqs]
    num_blocks = -(-int(ctx.max()) // step.block_size)
    # Blocks past a sequence's last one point at block 0 (masked anyway).
    blocks = torch.tensor([_padded(step.block_tables[b][: -(-step.seq_lens[b] // step.block_size)], num_blocks)
                           for b in seqs], dtype=torch.int64)  # [num_seqs, num_blocks]
    positions = torch.arange(num_blocks * step.block_size)
    return DecodeBucket(
        token_rows=torch.tensor([step.query_start[b] for b in seqs], dtype=torch.int64),
        block_idx=blocks.flatten(),
        valid_mask=(positions[None, :] < ctx[:, None])[:, None, None, :],
        seq_lens=ctx.view(-1, 1, 1, 1),
    )


def _prefill_plans(step: StepSequences, seqs: list[int]) -> tuple[PrefillPlan, ...]:
    return tuple(_prefill_plan(step, b) for b in seqs)


def _prefill_plan(step: StepSequences, b: int) -> PrefillPlan:
    start, end, seq_len = step.query_start[b], step.query_start[b + 1], step.seq_lens[b]
    q_len = end - start
    num_blocks = -(-seq_len // step.block_size)
    # New token i sits at position seq_len - q_len + i and sees keys up to that position.
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    future = torch.arange(seq_len)[None, :] > query_pos
    return PrefillPlan(start, end, seq_len, torch.tensor(step.block_tables[b][:num_blocks], dtype=torch.int64), future)


def _padded(table: list[int], width: int) -> list[int]:
    return table + [0] * (width - len(table))
