"""Per-step batch metadata for multi-adapter LoRA: which slot each token uses, and the runs
("segments") of consecutive tokens that share a slot. Built once per step, reused by every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class LoraBatchMeta:
    """Adapter layout of one batch.

    Segments are maximal runs of consecutive tokens with the same slot; only runs with a slot >= 0
    are kept (tokens with slot -1 get no LoRA). Tensor fields live on the tokens' device (the
    Triton kernels read them); the tuple fields are the same facts as Python ints for the CPU path.
    """

    token_slots: torch.Tensor  # [num_tokens] int64, -1 = no adapter
    num_tokens: int
    segment_starts: torch.Tensor  # [num_segments] int32, first token of each active run
    segment_lengths: torch.Tensor  # [num_segments] int32
    segment_slots: torch.Tensor  # [num_segments] int32
    segments: tuple[tuple[int, int, int], ...]  # (start, end, slot) per active run
    segment_table: torch.Tensor  # [num_segments, 3] int64 on CPU: (start, length, slot), for the compiled op
    active_token_idx: torch.Tensor  # [num_active_tokens] int64, tokens with a slot >= 0
    active_token_slots: torch.Tensor  # [num_active_tokens] int64
    max_segment_len: int
    slot_ranks: tuple[int, ...] | None  # true rank per slot; None = use the padded max rank
    # Optional finer ranks for a fused projection, slot-major [num_slots * num_slices] (each <= the
    # slot's rank): the compiled CPU op skips the slices an adapter does not target.
    slice_ranks: tuple[int, ...] | None = None

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_active_tokens(self) -> int:
        return int(self.active_token_idx.numel())

    @classmethod
    def from_token_slots(
        cls,
        token_slots: torch.Tensor,
        slot_ranks: Sequence[int] | torch.Tensor | None = None,
    ) -> LoraBatchMeta:
        """Build the metadata from `token_slots` ([num_tokens] int, -1 = no adapter).

        `slot_ranks` ([num_slots] ints) gives each slot's true rank, so the CPU path multiplies by
        exact-rank views instead of the zero-padded max rank; the result is the same either way.
        """
        assert token_slots.dim() == 1, "token_slots must be [num_tokens]"
        device = token_slots.device
        slots_cpu = token_slots.detach().to("cpu", torch.int64)
        segments = _active_runs(slots_cpu)
        starts, ends, seg_slots = (list(column) for column in zip(*segments)) if segments else ([], [], [])
        active_idx = torch.nonzero(slots_cpu >= 0).flatten()
        ranks = None
        if slot_ranks is not None:
            ranks = tuple(int(r) for r in (slot_ranks.tolist() if torch.is_tensor(slot_ranks) else slot_ranks))
        return cls(
            token_slots=token_slots.to(torch.int64),
            num_tokens=int(slots_cpu.numel()),
            segment_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            segment_lengths=torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int32, device=device),
            segment_slots=torch.tensor(seg_slots, dtype=torch.int32, device=device),
            segments=tuple(segments),
            segment_table=torch.tensor([(s, e - s, slot) for s, e, slot in segments], dtype=torch.int64).view(-1, 3),
            active_token_idx=active_idx.to(device),
            active_token_slots=slots_cpu[active_idx].to(device),
            max_segment_len=max((e - s for s, e in zip(starts, ends)), default=0),
            slot_ranks=ranks,
        )

    def rank_of(self, slot: int, max_rank: int) -> int:
        """The rank to multiply by for `slot`: its true rank when known, else the padded max."""
        if self.slot_ranks is None:
            return max_rank
        rank = self.slot_ranks[slot]
        assert 0 <= rank <= max_rank, f"slot {slot} has rank {rank} > padded max rank {max_rank}"
        return rank


def _active_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values in `slots` ([num_tokens] int64, CPU) as (start, end, slot),
    skipping runs of slot -1."""
    values, counts = torch.unique_consecutive(slots, return_counts=True)
    ends = torch.cumsum(counts, 0)
    runs = zip((ends - counts).tolist(), ends.tolist(), values.tolist())
    return [(start, end, slot) for start, end, slot in runs if slot >= 0]
