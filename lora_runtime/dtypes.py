"""The model's dtype: an explicit one, or "auto", bf16 where the device multiplies it at least as fast
as float32 and float32 elsewhere.

On CPU that is where the compiled ops have an AVX-512 form (`kernels.cpu_ops.bf16_matmul`): with
`vdpbf16ps` (AVX512-BF16, AMX) bf16 does twice FMA's multiply-adds per instruction, and without it the
AVX-512 form widens bf16 weights to float32 in registers (the same arithmetic on half the bytes).
Elsewhere bf16 ran slower than float32 (docs/benchmarks.md)."""
from __future__ import annotations

import torch

from kernels import cpu_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """(the dtype to load the model in, why), for `requested` "auto" or a name of `DTYPES`."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {requested!r}")
        return requested, "as configured"
    kind = torch.device(device).type
    if kind == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: this GPU multiplies bf16 natively"
        return "float16", "auto: this GPU has no bf16 arithmetic"
    if kind == "cpu":
        how = cpu_ops.bf16_matmul()
        if how is not None:
            return "bfloat16", (f"auto: the compiled matmuls multiply bf16 at float32's rate or better here ({how}; "
                                f"compiled CPU ops: {cpu_ops.active_form()})")
        return "float32", "auto: no AVX-512 form of the compiled CPU ops here: bf16 would be slower than float32"
    return "float32", f"auto: float32 on {kind}"
