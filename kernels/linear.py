"""Decode-sized bf16 matmuls on AMX tiles (kernels/csrc/amx_linear.cpp): the weight packed once into
the tiles' layout, then `linear_packed` per step. Where the compiled op does not apply (no AMX in
this build or process, other dtypes or devices, dimensions not multiples of 32), `pack_linear_weight`
returns None and callers keep their matmul library. Semantics: `x @ weight.T` accumulated in float32
and rounded to bf16 once (`kernels.reference.linear`)."""
from __future__ import annotations

import torch

from kernels.cpu_ops import available_for, cpu_ops

_BLOCK = 32  # output columns per packed block, and K per tile step


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 `weight` [N, K] -> packed[N/32][K/32][2][16][16][2]: per block of 32 output columns and
    step of 32 along K, two 16-column B tiles whose rows hold consecutive pairs of K; or None."""
    out_features, in_features = weight.shape
    if not (
        available_for(weight)
        and weight.dtype == torch.bfloat16
        and out_features % _BLOCK == 0
        and in_features % _BLOCK == 0
        and cpu_ops().amx_ready()
    ):
        return None
    # n = ((n_block * 2 + half) * 16 + column), k = (k_step * 16 + pair) * 2 + element
    tiles = weight.view(out_features // _BLOCK, 2, 16, in_features // _BLOCK, 16, 2)
    return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()


def linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [N, K] weight's transpose -> [M, N] bf16."""
    out = torch.empty(x.shape[0], packed.shape[0] * _BLOCK, dtype=torch.bfloat16)
    cpu_ops().amx_linear(out, x.contiguous(), packed)
    return out
