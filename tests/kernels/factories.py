"""Small builders of random kernel inputs shared by the kernel tests."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels import StepSequences
from kernels.lora.layouts import LoraLayout, ModuleShape, pages_for_rank
from kernels.lora.plans import LoraSlice, PageTable


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


def reuse_blocks_before_window(step: StepSequences, window: int | None, num_blocks: int,
                   generator: torch.Generator) -> StepSequences:
    """`step` with each table's blocks before its first visible key replaced by random block ids."""
    if window is None:
        return step
    tables = []
    for table, q_len, seq_len in zip(step.block_tables, step.query_lens, step.seq_lens):
        first_key = max(0, seq_len - q_len + 1 - window)
        outside = first_key // step.block_size
        tables.append(torch.randint(0, num_blocks, (outside,), generator=generator).tolist() + table[outside:])
    return StepSequences(step.query_start, step.seq_lens, tables, step.block_size)


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


@dataclass(frozen=True)
class PagedLora:
    """One layer of a fused projection's adapter pages, filled as the adapter pool fills them, with
    the same factors for `kernels.reference.add_lora`."""

    slices: list[LoraSlice]  # for Backend.add_lora
    tables: dict[str, PageTable]  # for Backend.plan_lora
    reference_slices: list[tuple[int, int, list]]  # for reference.add_lora: (start, end, factors[e])

    def with_pages_on(self, device: str) -> PagedLora:
        """The page pools moved to `device`; the reference's factors stay on the CPU, where the oracle runs."""
        slices = [dataclasses.replace(piece, a=piece.a.to(device), b=piece.b.to(device)) for piece in self.slices]
        return dataclasses.replace(self, slices=slices)


def paged_lora(
    layout: LoraLayout,
    ranks: list[list[int]],
    hidden_in: int,
    slice_widths: list[int],
    generator: torch.Generator,
    spare_pages: int = 3,
) -> PagedLora:
    """ranks[e][i]: entry e's rank on slice i (0: it does not adapt it). Each entry's pages are
    scattered over a pool with `spare_pages` more pages than needed; every page no entry owns holds
    random values (so a kernel reading a page it does not own shows up), and the factors are rounded
    to the layout's dtype first, so the reference sees exactly what the pages hold."""
    modules = [f"slice{i}" for i in range(len(slice_widths))]
    needed = sum(pages_for_rank(rank) for entry in ranks for rank in entry)
    num_pages = needed + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    offsets = [0, *torch.tensor(slice_widths).cumsum(0).tolist()]
    slices, tables, reference_slices = [], {}, []
    for i, (module, width) in enumerate(zip(modules, slice_widths)):
        a, b = layout.allocate(1, num_pages, ModuleShape(hidden_in, width), "cpu")
        a.copy_(torch.randn(a.shape, generator=generator))
        b.copy_(torch.randn(b.shape, generator=generator))
        entry_pages, factors = [], []
        for entry in ranks:
            rank = entry[i]
            pages = [order.pop() for _ in range(pages_for_rank(rank))]
            entry_pages.append(tuple(pages))
            if rank == 0:
                factors.append(None)
                continue
            lora_a = (torch.randn(rank, hidden_in, generator=generator) / hidden_in**0.5).to(layout.dtype)
            lora_b = (torch.randn(width, rank, generator=generator) / rank**0.5).to(layout.dtype)
            layout.write(a, b, pages, lora_a[None], lora_b[None])
            factors.append((lora_a, lora_b))
        tables[module] = PageTable(tuple(entry[i] for entry in ranks), tuple(entry_pages))
        slices.append(LoraSlice(module, a[0], b[0], offsets[i], offsets[i + 1]))
        reference_slices.append((offsets[i], offsets[i + 1], factors))
    return PagedLora(slices, tables, reference_slices)


def popularity_slots(pattern: str, num_tokens: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """Per-token adapter entry for a popularity pattern (Punica's), with -1 = no adapter."""
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
