"""add_lora on Triton over `RowPages`: SGMV for prefill-sized segments, BGMV for decode-heavy
batches; one shrink and one expand launch per slice that some entry of the step adapts."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import tuning
from kernels.lora.bgmv import bgmv_expand, bgmv_shrink
from kernels.lora.plans import LoraSlice, TritonLoraPlan
from kernels.lora.sgmv import sgmv_expand, sgmv_shrink

KERNELS = {"sgmv": (sgmv_shrink, sgmv_expand), "bgmv": (bgmv_shrink, bgmv_expand)}


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    slices: Sequence[LoraSlice],
    plan: TritonLoraPlan,
    kind: str | None = None,
    split_k: int | None = None,
) -> None:
    """Contract of `Backend.add_lora`. `kind` ("sgmv" or "bgmv") overrides the choice of
    `tuning.use_bgmv`, `split_k` that of `tuning.split_k_for`."""
    if plan.num_segments == 0:
        return
    if kind is None:
        kind = "bgmv" if tuning.use_bgmv(plan.num_active_tokens, plan.num_segments) else "sgmv"
    shrink, expand = KERNELS[kind]
    for piece in slices:
        if plan.max_pages[piece.module] == 0:
            continue  # no entry of the step adapts this slice: rank 0 everywhere
        expand(y, shrink(x, piece, plan, split_k), piece, plan)
