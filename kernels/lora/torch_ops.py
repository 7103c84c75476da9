"""Fast PyTorch path of `add_lora`, used on CPU.

On CPU the LoRA matmuls are tiny, so their cost is the number of calls, not their flops. Two
layouts, picked per batch by `kernels.tuning`:
- segments: per run of tokens sharing a slot, one shrink `x[s:e] @ A^T` and one `addmm` per slice,
  with exact-rank views when the slot's rank is known (no work on the zero padding). Computed in
  fp32 whatever the inputs: tiny bf16 matmuls cost 3-5x more than fp32 ones on this CPU (AMX
  set-up), so 16-bit weights are cast per segment; keeping CPU LoRA weights in fp32 is fastest;
- gathered: with 16-bit weights and many short segments (decode over many adapters), the weights
  are gathered per token and the batch goes through batched matmuls in the weights' dtype."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels import tuning
from kernels.lora.meta import LoraBatchMeta


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    scales: torch.Tensor | Sequence[float] | None = None,
    slice_offsets: torch.Tensor | Sequence[int] | None = None,
) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T * scales[s] for s = token_slots[t] >= 0, in place.

    y [T, total_out], x [T, hidden_in], lora_a [S, max_rank * num_slices, hidden_in],
    lora_b [S, total_out, max_rank], scales [S] (None = 1), slice_offsets [num_slices + 1].
    """
    if meta.num_segments == 0:
        return
    offsets = _as_ints(slice_offsets) if slice_offsets is not None else [0, y.shape[1]]
    assert offsets[0] == 0 and offsets[-1] == y.shape[1], "slice_offsets must span y's columns"
    slot_scales = _as_floats(scales) if scales is not None else None
    if tuning.use_gathered_lora(lora_b.dtype, meta.num_active_tokens, meta.num_segments):
        _add_gathered(y, x.to(lora_a.dtype), lora_a, lora_b, meta, slot_scales, offsets)
        return
    direct = x.dtype == y.dtype == lora_a.dtype == lora_b.dtype == torch.float32
    target = y if direct else torch.zeros(y.shape, dtype=torch.float32, device=y.device)  # [T, total_out]
    _add_segments(target, x if direct else x.float(), lora_a, lora_b, meta, slot_scales, offsets)
    if not direct:
        y.add_(target)


def _add_segments(
    target: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    scales: list[float] | None,
    offsets: list[int],
) -> None:
    num_slices = len(offsets) - 1
    max_rank = lora_a.shape[1] // num_slices
    for start, end, slot in meta.segments:
        rank = meta.rank_of(slot, max_rank)
        if rank == 0:
            continue
        scale = 1.0 if scales is None else scales[slot]
        # One shrink for all slices (fewer calls beats skipping padded rows); exact rows if unfused.
        weight_a = lora_a[slot, :rank] if num_slices == 1 else lora_a[slot]
        shrunk = torch.mm(x[start:end], weight_a.t().to(x.dtype))  # [len, rank or num_slices * max_rank]
        for i in range(num_slices):
            weight_b = lora_b[slot, offsets[i] : offsets[i + 1], :rank].to(x.dtype)  # [width, rank]
            dest = target[start:end, offsets[i] : offsets[i + 1]]
            # The out= form measured ~1.7x faster than dest.addmm_ for these tiny shapes.
            torch.addmm(dest, shrunk[:, i * max_rank : i * max_rank + rank], weight_b.t(), alpha=scale, out=dest)


def _add_gathered(
    target: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    scales: list[float] | None,
    offsets: list[int],
) -> None:
    num_slices = len(offsets) - 1
    max_rank = lora_a.shape[1] // num_slices
    rows = meta.active_token_idx
    slots = meta.active_token_slots
    weight_a = lora_a.index_select(0, slots).to(x.dtype)  # [N, num_slices * max_rank, hidden_in]
    shrunk = torch.bmm(weight_a, x.index_select(0, rows).unsqueeze(-1))  # [N, num_slices * max_rank, 1]
    if scales is not None:
        shrunk.mul_(torch.tensor(scales, dtype=x.dtype, device=x.device).index_select(0, slots).view(-1, 1, 1))
    weight_b = lora_b.index_select(0, slots).to(x.dtype)  # [N, total_out, max_rank]
    delta = torch.empty(rows.numel(), offsets[-1], dtype=x.dtype, device=x.device)  # [N, total_out]
    for i in range(num_slices):
        cols = slice(offsets[i], offsets[i + 1])
        block = shrunk[:, i * max_rank : (i + 1) * max_rank]  # [N, max_rank, 1]
        delta[:, cols] = torch.bmm(weight_b[:, cols], block).squeeze(-1)
    target.index_add_(0, rows, delta.to(target.dtype))


def _as_ints(values: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (values.tolist() if torch.is_tensor(values) else values)]


def _as_floats(values: torch.Tensor | Sequence[float]) -> list[float]:
    return [float(v) for v in (values.tolist() if torch.is_tensor(values) else values)]
