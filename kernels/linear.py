"""Compiled bf16 matmuls for CPU projections: a weight packed once into the layout of this CPU's
kernel, then `linear_packed` per call. Two kernels (kernels/csrc/): `amx` on Intel AMX tiles
(decode-sized batches; oneDNN is faster above `tuning.AMX_LINEAR_MAX_ROWS`) and `avx512_bf16` on
`vdpbf16ps` for AVX512-BF16 CPUs without AMX (faster than oneDNN at every size measured).
Where neither applies (other CPUs or dtypes, devices, dimensions), `pack_linear_weight` returns None
and callers keep their matmul library. Semantics: `x @ weight.T` accumulated in float32 and rounded
to bf16 once (`kernels.reference.linear`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import tuning
from kernels.cpu_ops import available_for, cpu_ops

# Output columns per packed block, and the K multiple, of each kernel.
_AMX_BLOCK = 32
_AVX512_BF16_COLUMNS = 16
KINDS = ("amx", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A bf16 weight `[out_features, in_features]` in the layout of one kernel."""

    kind: str  # one of KINDS
    packed: torch.Tensor
    out_features: int
    max_rows: int | None  # larger batches are faster on oneDNN (None: this kernel serves any size)


def available_kinds() -> list[str]:
    """The compiled matmuls this process can run, fastest first."""
    ops = cpu_ops()
    if ops is None:
        return []
    return [kind for kind, ready in (("amx", ops.amx_ready), ("avx512_bf16", ops.avx512_bf16_ready)) if ready()]


def pack_linear_weight(weight: torch.Tensor, kind: str | None = None) -> PackedLinear | None:
    """`weight` in the layout of `kind` (default: the fastest kernel here), or None where that kernel
    does not apply to it."""
    out_features, in_features = weight.shape
    if not (available_for(weight) and weight.dtype == torch.bfloat16):
        return None
    kinds = available_kinds()
    kind = kind or (kinds[0] if kinds else None)
    if kind not in kinds:
        return None
    if kind == "amx":
        if out_features % _AMX_BLOCK or in_features % _AMX_BLOCK:
            return None
        # packed[N/32][K/32][2][16][16][2]: per block of 32 output columns and step of 32 along K, two
        # 16-column B tiles whose rows hold consecutive pairs of K:
        # n = ((n_block * 2 + half) * 16 + column), k = (k_step * 16 + pair) * 2 + element
        tiles = weight.view(out_features // _AMX_BLOCK, 2, 16, in_features // _AMX_BLOCK, 16, 2)
        return PackedLinear(kind, tiles.permute(0, 3, 1, 4, 2, 5).contiguous(), out_features, tuning.AMX_LINEAR_MAX_ROWS)
    if out_features % _AVX512_BF16_COLUMNS or in_features % 2:
        return None
    # packed[N/16][K/2][16][2]: per block of 16 output columns, each pair of K as one 64-byte vector.
    blocks = weight.view(out_features // _AVX512_BF16_COLUMNS, _AVX512_BF16_COLUMNS, in_features // 2, 2)
    return PackedLinear(kind, blocks.permute(0, 2, 1, 3).contiguous(), out_features, None)


def linear_packed(x: torch.Tensor, weight: PackedLinear) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [N, K] weight's transpose -> [M, N] bf16."""
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.bfloat16)
    run = cpu_ops().amx_linear if weight.kind == "amx" else cpu_ops().avx512_bf16_linear
    run(out, x.contiguous(), weight.packed)
    return out
