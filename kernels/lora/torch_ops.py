"""Fast CPU paths of `add_lora`.

On CPU the LoRA matmuls are tiny, so their cost is the number of calls, not their flops. With fp32
weights whose lora_b has its output dimension contiguous (the engine's pool layout), the compiled
op (`kernels/csrc/lora.cpp`) runs every segment in one call. Otherwise two PyTorch layouts, picked
per batch by `kernels.tuning`:
- segments: per run of tokens sharing a slot, one shrink `x[s:e] @ A^T` and one `addmm` per slice,
  with exact-rank views when the slot's rank is known (no work on the zero padding). Short runs
  are computed in fp32 whatever the inputs: tiny bf16 matmuls cost 2-5x more than fp32 ones on
  this CPU (AMX set-up), so 16-bit weights are cast per segment (keeping CPU LoRA weights in fp32
  is fastest); long runs of 16-bit inputs stay in their dtype, where AMX wins;
- gathered: with 16-bit weights and many short segments (decode over many adapters), the weights
  are gathered per token and the batch goes through batched matmuls in the weights' dtype."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels import tuning
from kernels.cpu_ops import available_for, cpu_ops
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
    if _compiled_applies(y, x, lora_a, lora_b):
        _add_compiled(y, x, lora_a, lora_b, meta, scales, offsets)
        return
    slot_scales = _as_floats(scales) if scales is not None else None
    if tuning.use_gathered_lora(lora_b.dtype, meta.num_active_tokens, meta.num_segments):
        _add_gathered(y, x.to(lora_a.dtype), lora_a, lora_b, meta, slot_scales, offsets)
        return
    segments = meta.segments
    if x.dtype == y.dtype == lora_a.dtype == lora_b.dtype:
        native = [seg for seg in segments if _is_native(x.dtype, seg[1] - seg[0])]
        _add_segments(y, x, lora_a, lora_b, meta, native, slot_scales, offsets)
        segments = [seg for seg in segments if not _is_native(x.dtype, seg[1] - seg[0])]
    if not segments:
        return
    target = torch.zeros(y.shape, dtype=torch.float32, device=y.device)  # [T, total_out]
    _add_segments(target, x.float(), lora_a, lora_b, meta, segments, slot_scales, offsets)
    y.add_(target)


def _compiled_applies(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    return (
        available_for(y)
        and x.dtype == y.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and lora_a.dtype == lora_b.dtype == torch.float32
        and x.is_contiguous()
        and y.is_contiguous()
        and lora_a.stride(2) == 1
        and lora_b.stride(1) == 1
    )


def _add_compiled(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    scales: torch.Tensor | Sequence[float] | None,
    offsets: list[int],
) -> None:
    known = meta.slice_ranks if meta.slice_ranks is not None else meta.slot_ranks
    ranks = list(known) if known is not None else []
    slot_scales = _as_floats(scales) if scales is not None else []
    cpu_ops().lora_segments(y, x, lora_a, lora_b, meta.segment_table, ranks, offsets, slot_scales)


def _is_native(dtype: torch.dtype, num_tokens: int) -> bool:
    """Whether a segment of `num_tokens` is computed in its own dtype rather than in fp32."""
    return dtype == torch.float32 or num_tokens >= tuning.NATIVE_16BIT_MIN_SEGMENT_TOKENS


def _add_segments(
    target: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    segments: Sequence[tuple[int, int, int]],
    scales: list[float] | None,
    offsets: list[int],
) -> None:
    """Per (start, end, slot) segment: one shrink for all slices (fewer calls beats skipping padded rows), then one
    addmm per slice. The view and cast calls are skipped when not needed: at ~1 us each they are
    a visible share of a ~20 us segment."""
    num_slices = len(offsets) - 1
    max_rank = lora_a.shape[1] // num_slices
    cast = lora_a.dtype != x.dtype
    for start, end, slot in segments:
        rank = meta.rank_of(slot, max_rank)
        if rank == 0:
            continue
        scale = 1.0 if scales is None else scales[slot]
        weight_a = lora_a[slot] if num_slices > 1 or rank == max_rank else lora_a[slot, :rank]
        weight_b = lora_b[slot] if rank == max_rank else lora_b[slot, :, :rank]  # [total_out, rank]
        if cast:
            weight_a, weight_b = weight_a.to(x.dtype), weight_b.to(x.dtype)
        shrunk = torch.mm(x[start:end], weight_a.t())  # [len, rank or num_slices * max_rank]
        rows = target[start:end]
        # The out= form measured ~1.5x faster than rows.addmm_ for these tiny shapes.
        if num_slices == 1:
            torch.addmm(rows, shrunk, weight_b.t(), alpha=scale, out=rows)
            continue
        for i in range(num_slices):
            dest = rows[:, offsets[i] : offsets[i + 1]]
            block = shrunk[:, i * max_rank : i * max_rank + rank]
            torch.addmm(dest, block, weight_b[offsets[i] : offsets[i + 1]].t(), alpha=scale, out=dest)


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
