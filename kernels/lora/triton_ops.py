"""add_lora on Triton: SGMV for prefill-sized segments, BGMV for decode-heavy batches."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels import tuning
from kernels.lora.bgmv import bgmv_expand, bgmv_shrink
from kernels.lora.meta import LoraBatchMeta
from kernels.lora.sgmv import sgmv_expand, sgmv_shrink


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoraBatchMeta,
    scales: torch.Tensor | Sequence[float] | None = None,
    slice_offsets: torch.Tensor | Sequence[int] | None = None,
) -> None:
    """Same contract as `kernels.add_lora`; the ranks' zero padding is multiplied through."""
    if meta.num_segments == 0:
        return
    scales_tensor = None
    if scales is not None:
        scales_tensor = torch.as_tensor(scales, dtype=torch.float32).to(y.device)
    if tuning.use_bgmv(meta.num_active_tokens, meta.num_segments):
        shrunk = bgmv_shrink(x, lora_a, meta)  # [T, num_slices * max_rank] fp32
        bgmv_expand(y, shrunk, lora_b, meta, scales_tensor, slice_offsets)
    else:
        shrunk = sgmv_shrink(x, lora_a, meta)
        sgmv_expand(y, shrunk, lora_b, meta, scales_tensor, slice_offsets)
