"""add_lora on Triton: SGMV for prefill-sized segments, BGMV for decode-heavy batches."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels import tuning
from kernels.lora.bgmv import bgmv_expand, bgmv_shrink
from kernels.lora.plans import TritonLoraPlan
from kernels.lora.sgmv import sgmv_expand, sgmv_shrink


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    plan: TritonLoraPlan,
    scales: Sequence[float] | None,
    slice_offsets: Sequence[int],
) -> None:
    """Contract of `Backend.add_lora`; the ranks' zero padding is multiplied through."""
    if plan.num_segments == 0:
        return
    scales_tensor = None
    if scales is not None:
        scales_tensor = torch.as_tensor(scales, dtype=torch.float32).to(y.device)
    if tuning.use_bgmv(plan.num_active_tokens, plan.num_segments):
        shrunk = bgmv_shrink(x, lora_a, plan)  # [T, num_slices * max_rank] fp32
        bgmv_expand(y, shrunk, lora_b, plan, scales_tensor, slice_offsets)
    else:
        shrunk = sgmv_shrink(x, lora_a, plan)
        sgmv_expand(y, shrunk, lora_b, plan, scales_tensor, slice_offsets)
