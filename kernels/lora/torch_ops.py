"""The PyTorch path of the multi-adapter LoRA op, for the PyTorch backend (CPU without the compiled
ops, and devices that are neither CUDA nor CPU).

On CPU the LoRA matmuls are tiny, so their cost is the number of calls, not their flops: per segment
(a run of tokens sharing a slot), one shrink for all slices of a fused projection and one `addmm`
per slice, with exact-rank views where the slices' ranks are known (no work on the zero padding).
The segment's delta is formed in float32 (the CPU pool's dtype: tiny 16-bit matmuls cost more than
fp32 ones there) and added to y once, rounding as `kernels.reference.add_lora` does."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.lora.plans import TorchLoraPlan


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    plan: TorchLoraPlan,
    scales: Sequence[float] | None,
    slice_offsets: Sequence[int],
    slice_ranks: Sequence[int] | None,
) -> None:
    """Contract of `Backend.add_lora`; `slice_offsets` already resolved to [num_slices + 1] ints."""
    if not plan.segments:
        return
    num_slices = len(slice_offsets) - 1
    max_rank = lora_a.shape[1] // num_slices
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)  # [T, total_out]
    for start, end, slot in plan.segments:
        ranks = _slice_ranks(slice_ranks, slot, num_slices, max_rank)
        if not any(ranks):
            continue
        scale = 1.0 if scales is None else float(scales[slot])
        weight_a = lora_a[slot].to(torch.float32)  # [num_slices * max_rank, hidden_in]
        shrunk = torch.mm(x[start:end].to(torch.float32), weight_a.t())  # [len, num_slices * max_rank]
        rows = delta[start:end]
        for i, rank in enumerate(ranks):
            if rank == 0:
                continue
            dest = rows[:, slice_offsets[i] : slice_offsets[i + 1]]
            block = shrunk[:, i * max_rank : i * max_rank + rank]
            weight_b = lora_b[slot, slice_offsets[i] : slice_offsets[i + 1], :rank].to(torch.float32)
            # The out= form measured ~1.5x faster than dest.addmm_ for these tiny shapes.
            torch.addmm(dest, block, weight_b.t(), alpha=scale, out=dest)
    y.add_(delta)  # computed in float32, rounded to y's dtype once


def _slice_ranks(slice_ranks: Sequence[int] | None, slot: int, num_slices: int, max_rank: int) -> list[int]:
    if slice_ranks is None:
        return [max_rank] * num_slices
    ranks = list(slice_ranks[slot * num_slices : (slot + 1) * num_slices])
    assert all(0 <= rank <= max_rank for rank in ranks), f"slot {slot}: ranks {ranks} exceed the padded {max_rank}"
    return ranks
