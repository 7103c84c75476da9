"""Per-step plans of the multi-adapter LoRA op, one kind per backend, each built once per step from
the step's per-token adapter slots and reused by every layer.

All three describe the same facts: the segments, maximal runs of consecutive tokens that share a
slot (tokens with slot -1 get no LoRA); each holds them in the form its backend reads."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch


def active_runs(token_slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal slots as (start, end, slot), skipping runs of slot -1."""
    runs, start = [], 0
    for slot, group in groupby(token_slots):
        end = start + sum(1 for _ in group)
        if slot >= 0:
            runs.append((start, end, slot))
        start = end
    return runs


@dataclass(frozen=True, slots=True)
class TorchLoraPlan:
    """The segments as Python ints, for the PyTorch loop."""

    segments: tuple[tuple[int, int, int], ...]  # (start, end, slot)

    @classmethod
    def build(cls, token_slots: list[int]) -> TorchLoraPlan:
        return cls(tuple(active_runs(token_slots)))


@dataclass(frozen=True, slots=True)
class CompiledLoraPlan:
    """The segments as the compiled CPU op reads them."""

    segment_table: torch.Tensor  # [num_segments, 3] int64 on CPU: (start, length, slot)

    @property
    def num_segments(self) -> int:
        return self.segment_table.shape[0]

    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """The segments as (start, end, slot)."""
        return tuple((start, start + length, slot) for start, length, slot in self.segment_table.tolist())

    @classmethod
    def build(cls, token_slots: list[int]) -> CompiledLoraPlan:
        rows = [(start, end - start, slot) for start, end, slot in active_runs(token_slots)]
        return cls(torch.tensor(rows, dtype=torch.int64).view(-1, 3))


@dataclass(frozen=True, slots=True)
class TritonLoraPlan:
    """Device tensors for the SGMV (per segment) and BGMV (per token) kernels."""

    segment_starts: torch.Tensor  # [num_segments] int32, first token of each active run
    segment_lengths: torch.Tensor  # [num_segments] int32
    segment_slots: torch.Tensor  # [num_segments] int32
    active_token_idx: torch.Tensor  # [num_active_tokens] int64, tokens with a slot >= 0
    active_token_slots: torch.Tensor  # [num_active_tokens] int64
    num_segments: int
    num_active_tokens: int
    max_segment_len: int

    @classmethod
    def build(cls, token_slots: list[int], device: torch.device) -> TritonLoraPlan:
        runs = active_runs(token_slots)
        active = [(t, slot) for t, slot in enumerate(token_slots) if slot >= 0]

        def column(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            segment_starts=column([start for start, _, _ in runs], torch.int32),
            segment_lengths=column([end - start for start, end, _ in runs], torch.int32),
            segment_slots=column([slot for _, _, slot in runs], torch.int32),
            active_token_idx=column([t for t, _ in active], torch.int64),
            active_token_slots=column([slot for _, slot in active], torch.int64),
            num_segments=len(runs),
            num_active_tokens=len(active),
            max_segment_len=max((end - start for start, end, _ in runs), default=0),
        )
