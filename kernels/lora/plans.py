"""Per-step plans of the multi-adapter LoRA op, one kind per backend, each built once per step and
reused by every layer.

A step's input is the token of each adapter entry (`token_entries`, -1 = base model) and, per
adapted module, where each entry's pages lie (`PageTable`). All three plans describe the same facts:
the segments, maximal runs of consecutive tokens that share an entry, and the page tables; each
holds them in the form its backend reads."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from kernels.lora.layouts import pages_for_rank


@dataclass(frozen=True, slots=True)
class PageTable:
    """Where a step's adapter entries lie in one module's page pool: entry e has rank ranks[e] there
    (0: it does not adapt the module) in pages[e], ceil(rank / 16) page ids in rank order."""

    ranks: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        assert len(self.ranks) == len(self.pages)
        assert all(len(p) == pages_for_rank(r) for r, p in zip(self.ranks, self.pages)), "one page per 16 rank rows"

    @property
    def max_pages(self) -> int:
        return max((len(p) for p in self.pages), default=0)

    def padded(self) -> list[list[int]]:
        """[E, max(1, max_pages)] page ids, 0 past each entry's pages (never read: the rank bounds them)."""
        width = max(1, self.max_pages)
        return [list(p) + [0] * (width - len(p)) for p in self.pages]


@dataclass(frozen=True, slots=True)
class LoraSlice:
    """One adapted module of a (fused) projection at one layer: its page tensors in the backend's
    layout (a[layer], b[layer]) and the output columns [start, end) it adds to."""

    module: str
    a: torch.Tensor
    b: torch.Tensor
    start: int
    end: int


def active_runs(token_entries: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal entries as (start, end, entry), skipping runs of -1."""
    runs, start = [], 0
    for entry, group in groupby(token_entries):
        end = start + sum(1 for _ in group)
        if entry >= 0:
            runs.append((start, end, entry))
        start = end
    return runs


@dataclass(frozen=True, slots=True)
class TorchLoraPlan:
    """The segments as Python ints and each entry's pages as index tensors, for the PyTorch loop."""

    segments: tuple[tuple[int, int, int], ...]  # (start, end, entry)
    ranks: Mapping[str, tuple[int, ...]]  # module -> [E]
    page_index: Mapping[str, tuple[torch.Tensor, ...]]  # module -> [E] int64 page ids

    @classmethod
    def build(cls, token_entries: Sequence[int], tables: Mapping[str, PageTable], device) -> TorchLoraPlan:
        index = {module: tuple(torch.tensor(pages, dtype=torch.int64, device=device) for pages in table.pages)
                 for module, table in tables.items()}
        return cls(tuple(active_runs(token_entries)), {m: t.ranks for m, t in tables.items()}, index)


@dataclass(frozen=True, slots=True)
class CompiledLoraPlan:
    """The segments and page tables as the compiled CPU op reads them."""

    segment_table: torch.Tensor  # [num_segments, 3] int64: (start, length, entry)
    ranks: Mapping[str, torch.Tensor]  # module -> [E] int64
    page_tables: Mapping[str, torch.Tensor]  # module -> [E, max_pages] int64

    @property
    def num_segments(self) -> int:
        return self.segment_table.shape[0]

    @classmethod
    def build(cls, token_entries: Sequence[int], tables: Mapping[str, PageTable]) -> CompiledLoraPlan:
        rows = [(start, end - start, entry) for start, end, entry in active_runs(token_entries)]
        return cls(
            segment_table=torch.tensor(rows, dtype=torch.int64).view(-1, 3),
            ranks={module: torch.tensor(table.ranks, dtype=torch.int64) for module, table in tables.items()},
            page_tables={module: torch.tensor(table.padded(), dtype=torch.int64) for module, table in tables.items()},
        )


@dataclass(frozen=True, slots=True)
class TritonLoraPlan:
    """Device tensors for the SGMV (per segment) and BGMV (per token) kernels."""

    segment_starts: torch.Tensor  # [num_segments] int32, first token of each active run
    segment_lengths: torch.Tensor  # [num_segments] int32
    segment_entries: torch.Tensor  # [num_segments] int32
    active_token_idx: torch.Tensor  # [num_active_tokens] int64, tokens with an entry >= 0
    active_token_entries: torch.Tensor  # [num_active_tokens] int64
    ranks: Mapping[str, torch.Tensor]  # module -> [E] int32
    page_tables: Mapping[str, torch.Tensor]  # module -> [E, max_pages] int32
    max_pages: Mapping[str, int]  # module -> the most pages of any entry
    num_segments: int
    num_active_tokens: int
    max_segment_len: int

    @classmethod
    def build(cls, token_entries: Sequence[int], tables: Mapping[str, PageTable], device: torch.device) -> TritonLoraPlan:
        runs = active_runs(token_entries)
        active = [(t, entry) for t, entry in enumerate(token_entries) if entry >= 0]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            segment_starts=column([start for start, _, _ in runs], torch.int32),
            segment_lengths=column([end - start for start, end, _ in runs], torch.int32),
            segment_entries=column([entry for _, _, entry in runs], torch.int32),
            active_token_idx=column([t for t, _ in active], torch.int64),
            active_token_entries=column([entry for _, entry in active], torch.int64),
            ranks={module: column(list(table.ranks), torch.int32) for module, table in tables.items()},
            page_tables={module: column(table.padded(), torch.int32) for module, table in tables.items()},
            max_pages={module: table.max_pages for module, table in tables.items()},
            num_segments=len(runs),
            num_active_tokens=len(active),
            max_segment_len=max((end - start for start, end, _ in runs), default=0),
        )
